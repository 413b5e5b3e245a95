"""What the engine hands back: `RequestOutput` events on a `RequestStream`, to a thread or an asyncio task."""
import asyncio
import collections
import dataclasses
import queue
import weakref


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
    # SamplingParams(prompt_logprobs=N): the same per prompt token, None for the first (nothing precedes it)
    prompt_logprobs: list[tuple[float, dict[int, float]] | None] | None = None


class RequestStream:
    """The events of one or more requests, in order: iterated in a thread, or with `async for` (over it or over
    `batches()`) in the asyncio loop given. It ends once every choice has finished; a failed request raises there."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None):
        self._queue = None if loop else queue.SimpleQueue()
        # asyncio: the engine appends here, and the loop's mailbox wakes the consumer once for all the events put
        # meanwhile (a step's events for every stream of the loop: one wakeup, not one each)
        self._items: collections.deque = collections.deque()
        self._mailbox = _mailboxes.get(loop) or _mailboxes.setdefault(loop, _Mailbox(loop)) if loop else None
        self._posted = False  # on the mailbox and not yet delivered
        self._waiter: asyncio.Future | None = None
        self._open = 0  # choices added and not finished (counted by the consumer's side only)
        self.finished = False

    def expect(self, choices: int) -> None:
        self._open += choices

    @property
    def all_finished(self) -> bool:
        """Every choice added has delivered its final event (`finished` is also set by an error)."""
        return self._open == 0

    def put(self, event: RequestOutput, error: BaseException | None = None) -> None:
        if self._mailbox is None:
            self._queue.put((event, error))
            return
        self._items.append((event, error))
        if not self._posted:  # (cleared by the loop before it hands over the items: none is left behind)
            self._posted = True
            self._mailbox.post(self)

    def _wake(self) -> None:
        self._posted = False
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

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

    async def batches(self):
        """Lists of the events that came since the consumer last looked (one list per wakeup, in order)."""
        while not self.finished:
            while not self._items:
                self._waiter = asyncio.get_running_loop().create_future()
                await self._waiter
            batch = []
            try:
                while self._items and not self.finished:
                    batch.append(self._take(self._items.popleft()))
            except BaseException:
                if batch:  # the events before the error go out first
                    yield batch
                raise
            yield batch

    async def __aiter__(self):
        async for batch in self.batches():
            for event in batch:
                yield event


class _Mailbox:
    """An event loop's streams with events waiting; the loop is woken (a self-pipe write) only if no wakeup is due."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.streams: collections.deque = collections.deque()
        self.scheduled = False

    def post(self, stream: RequestStream) -> None:
        self.streams.append(stream)
        if not self.scheduled:
            self.scheduled = True
            self.loop.call_soon_threadsafe(self.deliver)

    def deliver(self) -> None:
        self.scheduled = False  # before taking the streams: one posted from here on schedules another delivery
        while self.streams:
            self.streams.popleft()._wake()


_mailboxes: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Mailbox]" = weakref.WeakKeyDictionary()


def find_stop(text: str, stop: tuple[str, ...], start: int = 0) -> int:
    """Where the first stop string found in text[start:] starts (an index into text), or -1."""
    return min((i for i in (text.find(s, start) for s in stop) if i >= 0), default=-1)
