"""An `LLM` in a child process (vLLM's layout): in one process the server's HTTP work and the engine loop take turns on
one GIL, the GPU waiting whenever the loop waits (docs/perf_notes.md, "Serving"). Requests go down a pipe, each step's
events come back in one message; they are checked on this side too (`RequestFront`): a bad one fails in the caller."""
import contextlib
import dataclasses
import gc
import itertools
import multiprocessing
import threading
from concurrent.futures import Future

from nanojax.engine_io import RequestOutput
from nanojax.front import EngineStats, RequestFront
from nanojax.llm import LLM


class EngineProcess(RequestFront):
    def __init__(self, model=None, **llm_kwargs):
        """model: what LLM takes, or a picklable function returning it, called in the child (e.g. random weights
        drawn on its device). Returns once the child's LLM is built (and compiled); its errors are raised here."""
        context = multiprocessing.get_context("spawn")  # the parent may run threads (uvicorn's, JAX's)
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(target=_child, args=(child_conn, model, llm_kwargs), daemon=True,
                                        name="nanojax-engine")
        self._process.start()
        child_conn.close()
        try:
            kind, info = self._conn.recv()
        except EOFError:  # it died without a word
            kind, info = "exited", None
        if kind != "ready":
            self._process.join()
            raise info or RuntimeError(f"the engine process exited while starting (code {self._process.exitcode})")
        self.config, self.limits, self.tokenizer, self.decode_steps = info
        self.dead: str | None = None  # why the engine stopped, once it has
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()  # guards the tables below (the caller's threads and the reader)
        self._streams: dict[str, list] = {}  # request id -> [stream, prompt ids, choices not finished]
        self._replies: dict[int, Future] = {}
        self._ids = itertools.count()
        threading.Thread(target=self._read, name="nanojax-engine-reader", daemon=True).start()

    # ----- requests (LLM's surface) -----
    def _submit(self, ids, params, request_id, index, stream, stream_text) -> None:
        if self.dead is not None:
            raise RuntimeError(f"the engine has stopped: {self.dead}")
        request_id = f"p{next(self._ids)}" if request_id is None else request_id
        stream.expect(params.n)
        with self._lock:
            self._streams[request_id] = [stream, ids, params.n]
        self._send(("add", ids, params, request_id, index, stream_text))

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def stats(self) -> EngineStats:
        return self.call(LLM.stats, timeout=10.0)

    def prepare_structured_outputs(self) -> None:
        self.call(LLM.prepare_structured_outputs)

    def call(self, fn, *args, timeout: float | None = None):
        """fn(llm, *args) run in the child's command thread -> its result, or its exception raised here (picklable)."""
        token, reply = next(self._ids), Future()
        with self._lock:
            self._replies[token] = reply
        self._send(("call", token, fn, args))
        return reply.result(timeout)

    def close(self) -> None:
        """Stops the child (its requests end); idempotent."""
        if self._process.is_alive():
            with contextlib.suppress(RuntimeError):  # (it has gone already)
                self._send(("stop",))
            self._process.join(30)
        if self._process.is_alive():
            self._process.kill()

    # ----- the pipe -----
    def _send(self, message) -> None:
        try:
            with self._send_lock:
                self._conn.send(message)
        except (OSError, ValueError) as e:  # the child has gone
            raise RuntimeError(f"the engine has stopped: {self.dead or e}") from None

    def _read(self) -> None:
        """The reader thread: each message from the child is a list of items, in the order the child made them."""
        while True:
            try:
                items = self._conn.recv()
            except (EOFError, OSError):
                self._stopped(self.dead or f"the engine process exited (code {self._process.exitcode})")
                return
            try:
                for item in items:
                    getattr(self, f"_on_{item[0]}")(*item[1:])
            except Exception as e:  # a bug here would otherwise leave every open request waiting forever
                self._stopped(f"the server's side of the engine failed: {e!r}")
                self.close()
                raise

    def _on_event(self, request_id: str, values: tuple, error: BaseException | None) -> None:
        with self._lock:
            entry = self._streams.get(request_id)
            if entry is None:
                return
            stream, ids, _ = entry
            event = RequestOutput(prompt_token_ids=ids, **dict(zip(_SENT_FIELDS, values)))
            if event.finish_reason is not None:
                entry[2] -= 1
                if entry[2] == 0 or error is not None:
                    del self._streams[request_id]
        stream.put(event, error)

    def _on_reply(self, token: int, result, error: BaseException | None) -> None:
        with self._lock:
            reply = self._replies.pop(token)
        reply.set_exception(error) if error is not None else reply.set_result(result)

    def _on_dead(self, reason: str) -> None:
        self.dead = reason

    def _stopped(self, reason: str) -> None:
        """The child is gone: every open request and call ends with an error."""
        self.dead = reason
        with self._lock:
            streams, self._streams = self._streams, {}
            replies, self._replies = self._replies, {}
        error = RuntimeError(f"the engine has stopped: {reason}")
        for request_id, (stream, ids, _) in streams.items():
            stream.put(_error_event(request_id, 0, ids), error)
        for reply in replies.values():
            reply.set_exception(error)


def _error_event(request_id: str, index: int, prompt_ids: list[int]) -> RequestOutput:
    """The last event of a request that ended with an error on this side of the pipe."""
    return RequestOutput(index, prompt_ids, [], "", "error", request_id=request_id)


# A RequestOutput crosses the pipe as a tuple of these fields (plain values pickle for a fraction of a dataclass's
# cost; docs/perf_notes.md, "Serving"); the prompt's ids stay behind, the parent has them.
_SENT_FIELDS = tuple(f.name for f in dataclasses.fields(RequestOutput) if f.name != "prompt_token_ids")


class _Outbox:
    """The child's messages to the parent, and the stream its LLM puts every request's events in (they name their
    request). A step's events go as one message from the engine loop's own thread (`EngineCore.events_out`), so a first
    token does not wait on another thread for the GIL; others go at once."""

    def __init__(self, conn, llm):
        self.conn, self.llm = conn, llm
        self.items: list[tuple] = []
        self.lock = threading.Lock()  # one writer at a time on the connection
        self.dead_sent = False

    def expect(self, choices: int) -> None:
        pass

    def put(self, event: RequestOutput, error: BaseException | None = None) -> None:
        with self.lock:
            self.items.append(("event", event.request_id, tuple(getattr(event, f) for f in _SENT_FIELDS), error))

    def flush(self, *more: tuple) -> None:
        with self.lock:
            items, self.items = [*self.items, *more], []
            if self.llm.dead is not None and not self.dead_sent:
                items.append(("dead", repr(self.llm.dead)))
                self.dead_sent = True
            if items:
                with contextlib.suppress(OSError, ValueError):  # the parent has gone: the command loop ends on its own
                    self.conn.send(items)


def freeze_startup_heap() -> None:
    """Puts every object alive now beyond the garbage collector's reach (as vLLM does once started): its full
    collections, which pause the process, then walk only what serving allocates (docs/perf_notes.md, "Serving")."""
    gc.collect()
    gc.freeze()


def _child(conn, model, llm_kwargs) -> None:
    """Builds the LLM, then runs the parent's commands until told to stop or the parent goes away."""
    try:
        llm = LLM(model() if callable(model) else model, **llm_kwargs)
    except BaseException as e:  # noqa: BLE001 -- raised in the parent
        conn.send(("failed", e))
        return
    freeze_startup_heap()
    conn.send(("ready", (llm.config, llm.limits, llm.tokenizer, llm.decode_steps)))
    out = _Outbox(conn, llm)
    llm.core.events_out = out.flush
    while True:
        try:
            kind, *args = conn.recv()
        except (EOFError, OSError):
            break
        if kind == "add":
            ids, params, request_id, index, stream_text = args
            try:
                llm.add_request(ids, params, request_id=request_id, index=index, stream=out, stream_text=stream_text)
            except Exception as e:  # noqa: BLE001 -- the request ends with it, the engine goes on
                out.put(_error_event(request_id, index, ids), e)
                out.flush()
        elif kind == "abort":
            llm.abort(*args)
        elif kind == "call":
            token, fn, fn_args = args
            try:
                out.flush(("reply", token, fn(llm, *fn_args), None))
            except Exception as e:  # noqa: BLE001
                out.flush(("reply", token, None, e))
        elif kind == "stop":
            break
    out.flush()
