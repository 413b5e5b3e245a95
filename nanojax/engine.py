"""The engine core: one loop thread owns scheduler, pages and runner; other threads post functions to its inbox. Step
N+1 is dispatched before step N is read back (its decode rows take their last tokens on the device): the host streams
step N while the GPU runs N+1, and a sequence that stops in step N wastes its row of N+1."""
import atexit
import concurrent.futures
import dataclasses
import queue
import threading
import time
import weakref
from typing import Callable, NamedTuple

import jax

from nanojax.front import EngineStats
from nanojax.output import OutputProcessor, Request, prompt_targets
from nanojax.page_manager import PageManager
from nanojax.runner import ModelRunner
from nanojax.scheduler import CapacityError, Scheduler
from nanojax.sequence import Sequence, SequenceStatus

_EXITING = threading.Event()  # set at exit: engine loops stop after their current step
LOOP_THREAD = "nanojax-engine"
LINGER_S = 2.0  # how long an idle engine loop waits for the next request before its thread ends


@atexit.register
def _stop_loops() -> None:
    """Loops stop after their step and are joined: a daemon thread in a JAX call at finalization aborts the process."""
    _EXITING.set()
    for thread in threading.enumerate():
        if thread.name == LOOP_THREAD:
            thread.join(timeout=30)


class _Step(NamedTuple):
    chunks: list
    pending: dict  # {seq_id: (runner.Pending, row)} of the chunks that sample
    prompt: dict  # {seq_id: (runner.Pending, last row)} of those whose prompt logprobs are wanted
    chainable: bool  # the next step may be dispatched before this one is read back
    first_tokens_only: bool  # it samples prompts' last tokens only (new requests' first tokens)
    constrained: bool  # a row's token mask came from the host


class EngineCore:
    """The loop over one runner (its model and engine configs), scheduler and page pool."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, page_manager: PageManager, tokenizer):
        self.runner, self.scheduler, self.page_manager = runner, scheduler, page_manager
        engine = runner.engine
        self.output = OutputProcessor(tokenizer, engine.max_model_len, runner.config.eos_token_ids, engine.seed)
        self._free_slots = list(range(engine.max_num_seqs))
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # functions the loop's thread runs
        self._lock = threading.Lock()  # orders the loop's decision to stop against a new request's start
        self._running, self.closed = False, False
        # The loop's thread while it runs; _closing, set by close(): the loop ends as soon as it is idle.
        self._thread, self._closing = None, threading.Event()
        self._turned_at = time.monotonic()  # when the loop last began a turn (stats' stalled_s)
        self._requests: dict[str, list[Sequence[Request]]] = {}  # request id -> its unfinished choices
        self.dead: BaseException | None = None  # set when a step failed in a way that lost the device state
        # Called on the loop thread once a step's events are in their streams (and at each turn of the loop, for
        # the events of aborts and failures): the engine process sends them to the server's process from there.
        self.events_out: Callable[[], None] = lambda: None

    def stats(self) -> EngineStats:
        pages, busy = self.page_manager, self.scheduler.has_unfinished() or not self._inbox.empty()
        return EngineStats(len(self.scheduler.running), len(self.scheduler.waiting), pages.num_pages,
                           pages.num_pages - pages.num_free_pages, time.monotonic() - self._turned_at if busy else 0.0)

    def close(self) -> None:
        """Ends every unfinished request (finish_reason "abort") and stops the loop's thread; idempotent."""
        if self.closed:
            return
        self.closed = True  # requests are refused from here on
        self.end(list(self._requests))
        self._closing.set()  # the loop, idle once the aborts are read back, ends at once instead of lingering
        if self._thread not in (None, threading.current_thread()):  # (an event callback: it ends after this turn)
            self._thread.join()

    def end(self, request_ids: list[str]) -> None:
        """Aborts the requests; returns once their pages are free."""
        self.in_loop(lambda: [self._abort(request_id) for request_id in request_ids])

    def abort(self, request_id: str) -> None:
        self._post(lambda: self._abort(request_id))

    def new_request(self, ids, params, request_id, index, stream, stream_text) -> Sequence[Request]:
        """A validated request's first choice (OutputProcessor.sequences)."""
        if self.closed:
            raise RuntimeError("this LLM is closed")
        if self.dead is not None:
            raise RuntimeError(f"the engine has stopped after an error: {self.dead!r}")
        return self.output.sequences(ids, params, request_id, index, stream, stream_text)

    def submit(self, firsts: list[Sequence]) -> None:
        """Requests' first choices as one inbox item: the next step sees them all, however fast the loop runs."""
        self._post(lambda: self._add(firsts))

    def in_loop(self, fn):
        """Runs fn on the loop's thread (the one that touches scheduler and pages); returns or raises its result."""
        if threading.current_thread() is self._thread:  # (an event callback)
            return fn()
        future = concurrent.futures.Future()

        def settle() -> None:
            try:
                future.set_result(fn())
            except Exception as e:  # noqa: BLE001 -- handed to the caller's thread
                future.set_exception(e)

        self._post(settle)
        return future.result()

    def _post(self, item: Callable[[], None]) -> None:
        """Queues item, starting the loop's thread unless it runs (`_engine_loop`: it holds the engine only weakly)."""
        self._inbox.put(item)
        with self._lock:
            if not self._running:
                self._running, self._turned_at = True, time.monotonic()
                self._thread = threading.Thread(target=_engine_loop, name=LOOP_THREAD, daemon=True,
                                                args=(weakref.ref(self), self._inbox, self._closing))
                self._thread.start()

    def _loop(self, first: Callable[[], None] | None = None) -> bool:
        """Steps until nothing is left to do (-> True) or the process exits (-> False); first: an inbox item taken."""
        inflight, idle = None, False  # inflight: the step dispatched last, not read back yet
        try:
            if first is not None:
                first()
            while not _EXITING.is_set():
                self._turned_at = time.monotonic()
                while not self._inbox.empty():  # (the loop alone takes from it)
                    self._inbox.get_nowait()()
                self.events_out()
                # A step still in flight holds only finished rows: not read back, so that the loop lets go of this
                # LLM (a caller's del) without waiting for the device.
                if idle := not self.scheduler.has_unfinished():
                    return True
                inflight = self._step(inflight)
            return False
        finally:
            if not idle:  # stopped at exit, or failed
                with self._lock:
                    self._running = False

    def _end_if_idle(self) -> bool:
        """-> whether the loop's thread ends: unless work came in meanwhile (work queued later starts a new one)."""
        with self._lock:
            self._running = not self._inbox.empty() and not _EXITING.is_set()
            return not self._running

    def _step(self, inflight: _Step | None) -> _Step | None:
        """Dispatches the next step, then reads back inflight (before, unless `chainable`). A constrained step's tokens
        are read before (the next masks need them), their texts and events after. -> the step dispatched."""
        after_first_tokens, held = False, []  # held: sequences whose texts and events wait for the dispatch
        if inflight is not None and not inflight.chainable:
            held = self._complete(inflight)
            if not inflight.constrained or inflight.first_tokens_only:  # (first tokens: their streams wait)
                self._publish(held)
                held = []
            after_first_tokens, inflight = inflight.first_tokens_only, None
        step = None
        try:
            step = self._dispatch(inflight, after_first_tokens)
        except CapacityError as e:  # this request can never fit: it ends, the others go on
            self._fail([e.seq], e)
        except Exception as e:  # noqa: BLE001 -- a failed step ends its requests, not the engine
            self._step_failed(e)
        if inflight is not None:
            held = self._complete(inflight)
        if held or inflight is not None:
            self._publish(held)
        return step

    def _complete(self, step: _Step) -> list[Sequence]:
        """The step's tokens in place of its placeholders, under the stop conditions; the requests they end, ended.
        -> the sequences that gained."""
        seqs = []
        try:
            for c in step.chunks:
                if c.seq.seq_id in step.prompt:
                    self.output.accept_prompt_logprobs(c, *step.prompt[c.seq.seq_id])
                if c.sample and c.seq.status is not SequenceStatus.FINISHED:
                    out, row = step.pending[c.seq.seq_id]
                    self.scheduler.fill(c.seq, self.output.accept(c.seq, out, row, c.num_steps), c.num_steps)
                    seqs.append(c.seq)
                    for sibling in c.seq.request.siblings:  # n > 1: the prompt's pages are committed, others hit them
                        if sibling.status is not SequenceStatus.FINISHED:
                            self.scheduler.add(sibling)
                    c.seq.request.siblings = []
        except Exception as e:  # noqa: BLE001
            self._step_failed(e)
            return []
        finally:  # its results' buffers back to the pool before the next dispatch: a program given the addresses of
            # its last run reuses its CUDA graph as recorded (docs/perf_notes.md, "Dispatch and host overhead")
            step.pending.clear()
            step.prompt.clear()
        for seq in seqs:
            self._finish_ended(seq)
        return seqs

    def _publish(self, seqs: list[Sequence]) -> None:
        """Brings the sequences' texts up to their tokens (a stop string may end one) and streams their events."""
        for seq in seqs:
            self.output.update_text(seq.request)
            self._finish_ended(seq)
            if (event := self.output.event(seq)) is not None:
                seq.request.stream.put(event)
        self.events_out()

    def _add(self, firsts: list[Sequence[Request]]) -> None:
        for seq in firsts:
            self._requests[seq.request.output.request_id] = [seq, *seq.request.siblings]
            try:
                self.scheduler.add(seq)
            except ValueError as e:
                self._fail([seq], e)

    def _dispatch(self, inflight: _Step | None = None, after_first_tokens: bool = False) -> _Step | None:
        """One forward: the decode program for decodes alone, else prefill with decode rows (None: inflight first)."""
        if not self.scheduler.has_unfinished():
            return None
        chunks = self.scheduler.schedule(decode_steps=self.runner.decode_steps)
        if not chunks:
            if inflight is None:
                raise RuntimeError("the scheduler found nothing to run although requests are unfinished")
            return None
        chunks, fields = self._prepare(chunks)
        if not chunks:
            return None
        chunks, masks, masks_in_step = self._constrain(chunks)
        decodes = [c for c in chunks if c.num_tokens == 1 and c.sample]
        prefills = [c for c in chunks if not (c.num_tokens == 1 and c.sample)]
        sampling = [fields[c.seq.seq_id] for c in decodes]  # -> {name: [value per row]}
        rows = ([max(c.seq.token_ids[c.start], 0) for c in decodes], [c.seq.page_table for c in decodes],
                [c.end for c in decodes], {k: [row[k] for row in sampling] for k in sampling[0]}) if decodes else None
        sources = [inflight.pending[c.seq.seq_id][1] if c.seq.num_pending else -1 for c in decodes]
        if masks is not None and not masks_in_step:
            self.runner.set_masks(*masks)
        if not prefills:  # one dispatch of the decode program, 1..decode_steps a row (constrained alone: 1, or hosted)
            out = self.runner.decode(*rows, masks_in_step or self.runner.decode_steps,
                                     [c.num_steps for c in decodes], sources, masks if masks_in_step else None)
            pending, prompt = {c.seq.seq_id: (out, i) for i, c in enumerate(decodes)}, {}
        else:
            targets = [prompt_targets(c) for c in prefills]
            outs = self.runner.prefill([(c.seq.token_ids[c.start:c.end], c.seq.page_table, c.end,
                                         fields.get(c.seq.seq_id), t)
                                        for c, t in zip(prefills, targets)], decodes=rows, sources=sources)
            pending = {c.seq.seq_id: out for c, out in zip(prefills + decodes, outs) if c.sample}
            prompt = {c.seq.seq_id: out for c, out, t in zip(prefills, outs, targets) if t}
        self.scheduler.advance(chunks)
        # The next step may go before this one is read back when its decode rows can take their tokens from this
        # one's (one dispatch), unless this one samples first tokens only, or follows such a step (their streams would
        # wait: docs/perf_notes.md), or a constrained row's next mask needs this step's tokens on the host.
        one_dispatch = len({id(out) for out, _ in pending.values()}) <= 1
        first_tokens_only = bool(pending) and not decodes
        return _Step(chunks, pending, prompt, one_dispatch and not first_tokens_only and not after_first_tokens
                     and masks is None, first_tokens_only, masks is not None)

    def _prepare(self, chunks) -> tuple[list, dict]:
        """Slots, masks and sampling rows (a request whose row fails ends alone) -> (chunks kept, {seq_id: row})."""
        for seq in self.scheduler.waiting:
            self._release_slot(seq.request)
        fields = {}
        for c in chunks:
            req: Request = c.seq.request
            p = req.params
            try:
                # bias, penalties, min_tokens or a constraint: a token-table slot, written from the tokens so far
                if (p.logit_bias or p.penalized or p.min_tokens > 0 or req.matcher) and req.slot is None:
                    req.slot = self._free_slots.pop()
                    self.runner.set_slot(req.slot, *req.table_rows(self.runner.config.vocab_size))
                if c.sample:
                    fields[c.seq.seq_id] = req.sampling_row(c.seq.num_generated, self.runner.tables.neutral)
            except Exception as e:  # noqa: BLE001 -- this request's error, the step goes on
                self._fail([c.seq], e)
        return [c for c in chunks if c.seq.status is not SequenceStatus.FINISHED], fields

    def _constrain(self, chunks) -> tuple[list, tuple | None, int]:
        """-> (chunks, constrained rows' masks (set_masks's arguments) or None, the steps of the decode carrying them if
        they are the step's only rows, else 0). A constrained row takes one step, unless beside plain rows it may keep
        the later draws its grammar allows (Request.speculative_constraint), or alone its model keeps to its grammar
        (Request.run_ahead) or, one row, a hosted decode runs it (ModelRunner.hosted)."""
        reqs = [c.seq.request for c in chunks if c.sample and c.seq.request.matcher is not None]
        if not reqs:
            return chunks, None, 0
        masks = [r.slot for r in reqs], self.output.grammars.masks([r.matcher for r in reqs])
        decodes = [c for c in chunks if c.num_tokens == 1 and c.sample]
        one_step = all(c.seq.request.matcher is not None for c in decodes) and not all(r.run_ahead for r in reqs)
        alone = one_step and len(decodes) == len(chunks)
        if alone and len(chunks) == 1 and (steps := self.runner.hosted(reqs[0].matcher, chunks[0].num_steps)):
            return chunks, masks, steps
        return [dataclasses.replace(c, num_steps=1) if c.sample and c.seq.request.matcher is not None and (
            one_step or not c.seq.request.speculative_constraint) else c for c in chunks], masks, int(alone)

    def _release_slot(self, req: Request) -> None:
        if req.slot is not None:
            self._free_slots.append(req.slot)
            req.slot = None

    def _finish_ended(self, seq: Sequence) -> None:
        """Frees a sequence whose request has a finish reason (its prompt's pages pinned if asked), once."""
        req: Request = seq.request
        if req.output.finish_reason is not None and seq.status is not SequenceStatus.FINISHED:
            if req.pin:
                req.pin_handle = self.page_manager.pin_pages(seq, len(req.output.prompt_token_ids))
            self._finish(seq)

    def _finish(self, seq: Sequence) -> None:
        """Frees a sequence's pages and slot (a sibling never admitted has none)."""
        if seq.status is SequenceStatus.RUNNING or seq in self.scheduler.waiting:
            self.scheduler.finish(seq)
        seq.status = SequenceStatus.FINISHED
        self._release_slot(seq.request)
        self.output.grammars.release(seq.request.matcher)
        choices = self._requests.get(seq.request.output.request_id, [])
        if seq in choices:
            choices.remove(seq)
            if not choices:
                del self._requests[seq.request.output.request_id]

    def _end(self, seq: Sequence, reason: str, error: BaseException | None = None) -> None:
        """Ends a request's choice that did not finish by itself (aborted, or failed with `error`)."""
        if seq.status is SequenceStatus.FINISHED:
            return
        self._finish(seq)
        out = seq.request.output
        out.finish_reason = reason
        seq.request.stream.put(dataclasses.replace(out, token_ids=list(out.token_ids), delta=""), error=error)

    def _abort(self, request_id: str) -> None:
        for seq in list(self._requests.get(request_id, ())):
            self._end(seq, "abort")

    def _fail(self, seqs: list[Sequence], error: BaseException) -> None:
        for seq in seqs:
            for s in list(self._requests.get(seq.request.output.request_id, [seq])):
                self._end(s, "error", error)

    def _step_failed(self, error: BaseException) -> None:
        """Ends the requests of a step that raised; if the step lost the device state, the engine is dead."""
        self._fail([*self.scheduler.running, *self.scheduler.waiting], error)
        if any(x.is_deleted() for x in jax.tree.leaves((self.runner.cache, self.runner.tables))):
            self.dead = error


def _engine_loop(ref: "weakref.ref[EngineCore]", inbox: queue.SimpleQueue, closing: threading.Event) -> None:
    """Runs the loop; idle, it waits LINGER_S for work holding only the inbox (a new thread delays a first token)."""
    item = None
    while (core := ref()) is not None and core._loop(item):
        del core, item  # (an item may hold the engine)
        item = _next_item(ref, inbox, closing)
        if item is None and ((core := ref()) is None or core._end_if_idle()):
            return


def _next_item(ref: "weakref.ref[EngineCore]", inbox: queue.SimpleQueue, closing: threading.Event):
    """The inbox's next item within LINGER_S; None if none came, at exit, or once the engine is closed or freed."""
    deadline = time.monotonic() + LINGER_S
    while time.monotonic() < deadline and not _EXITING.is_set() and not closing.is_set() and ref() is not None:
        try:
            return inbox.get(timeout=0.05)  # (returns at once when something is put)
        except queue.Empty:
            pass
    return None
