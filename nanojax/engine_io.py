"""What the engine hands back: `RequestOutput` events, delivered on a `RequestStream` (from the engine loop's
thread to a consumer thread or an asyncio task)."""
import asyncio
import dataclasses
import queue


@dataclasses.dataclass
class RequestOutput:
    index: int  # position of the prompt in the call (`add_request(index=...)`)
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated tokens (a stop token included)
    text: str  # generated text, special tokens skipped, a stop string cut off (streamed: the deltas so far)
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None while running
    delta: str = ""  # text added since the previous streamed event
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    time_to_first_token: float | None = None
    request_id: str = ""
    choice: int = 0  # which of the request's n choices
    # SamplingParams(logprobs=N): per generated token, (its logprob, {token id: logprob} of the N most likely)
    logprobs: list[tuple[float, dict[int, float]]] | None = None


class RequestStream:
    """The events of one or more requests, in the order the engine makes them. Iterate it in a thread (blocks), or
    `async for` over it in the asyncio loop given at construction. It ends once every choice of every request
    added to it has finished; a request that failed raises its error there."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None):
        self._loop = loop
        self._queue = asyncio.Queue() if loop else queue.SimpleQueue()
        self._open = 0  # choices added and not finished (counted by the consumer's side only)
        self.finished = False

    def expect(self, choices: int) -> None:
        self._open += choices

    def put(self, event: RequestOutput, error: BaseException | None = None) -> None:
        """Called by the engine loop."""
        if self._loop is None:
            self._queue.put((event, error))
        else:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, (event, error))

    def _take(self, item) -> RequestOutput:
        event, error = item
        if event.finish_reason is not None:
            self._open -= 1
            self.finished = self._open == 0 or error is not None
        if error is not None:
            raise error
        return event

    def __iter__(self):
        while not self.finished:
            yield self._take(self._queue.get())

    async def __aiter__(self):
        while not self.finished:
            yield self._take(await self._queue.get())


def find_stop(text: str, stop: tuple[str, ...], start: int = 0) -> int:
    """Where the first stop string found in text[start:] starts (an index into text), or -1."""
    return min((i for i in (text.find(s, start) for s in stop) if i >= 0), default=-1)
