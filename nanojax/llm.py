"""The public engine: `LLM(model)`, requests added from any thread while one loop owns the device.

`add_request` validates a request and hands it to the engine loop, a thread that runs while requests are unfinished:
each step the scheduler picks what to compute (decodes first, then prefill chunks under the token budget), the
runner dispatches it, and the sampled tokens are checked against the stop conditions. A step is dispatched before
the previous one is read back (its decode rows take their last tokens on the device), so the host reads, checks,
detokenizes and streams step N while the GPU runs step N+1; a sequence that stops in step N wastes its row of N+1.
`generate` and `stream` are built on `add_request`, and several may run at once from different threads.
"""
import atexit
import concurrent.futures
import dataclasses
import itertools
import queue
import threading
import time
import weakref
from typing import Callable, Iterable, Iterator, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from nanojax import compile_workers, executable_cache
from nanojax.cascade import CascadeRules
from nanojax.detokenizer import Detokenizer
from nanojax.distributed import DistributedRunner, min_over_processes
from nanojax.engine_io import RequestOutput, RequestStream, find_stop
from nanojax.front import EngineLimits, EngineStats, RequestFront
from nanojax.loader import LoadedModel, load_model
from nanojax.ops import get_ops
from nanojax.page_manager import PageManager
from nanojax.quantize import is_quantized, quantize_params
from nanojax.runner import PREFILL_ROW, ModelRunner, checked_row
from nanojax.sampling import BANNED, PROMPT
from nanojax.sampling_params import SamplingParams
from nanojax.scheduler import CapacityError, Scheduler, SchedulerConfig
from nanojax.sequence import Sequence, SequenceStatus


_EXITING = threading.Event()  # set at exit: engine loops stop after their current step
_LOOP_THREAD = "nanojax-engine"
_LINGER_S = 2.0  # how long an idle engine loop waits for the next request before its thread ends


@atexit.register
def _stop_loops() -> None:
    """At exit, each engine loop stops after its current step and is waited for: a daemon thread inside a JAX call
    while the interpreter finalizes aborts the process (a step is still in flight when the last request ends)."""
    _EXITING.set()
    for thread in threading.enumerate():
        if thread.name == _LOOP_THREAD:
            thread.join(timeout=30)


class _Step(NamedTuple):
    """A dispatched step: its chunks, {seq_id: (runner.Pending, row)} of the chunks that sample, {seq_id:
    (runner.Pending, last row)} of those whose prompt logprobs are wanted; whether the next step may be dispatched
    before it is read back; whether it samples prompts' last tokens only (new requests' first tokens)."""
    chunks: list
    pending: dict
    prompt: dict
    chainable: bool
    first_tokens_only: bool


@dataclasses.dataclass
class _Request:
    output: RequestOutput
    params: SamplingParams
    stop_ids: frozenset[int]
    stream: RequestStream
    start: float
    detok: Detokenizer | None = None
    emitted_text: str = ""
    pin: bool = False  # pin the prompt's full pages when the request finishes (`LLM.pin_prefix`) ...
    pin_handle: int | None = None  # ... under this page-manager handle
    cut: bool = False  # a stop string ended it: its text is cut there
    stream_tokens: bool = False  # streamed without a tokenizer: an event for every step's new tokens
    slot: int | None = None  # its row of the runner's token tables, while it runs (bias, penalties, min_tokens)
    siblings: list["Sequence"] = dataclasses.field(default_factory=list)  # n > 1: admitted once the prompt is cached

    @property
    def needs_tables(self) -> bool:
        p = self.params
        return bool(p.logit_bias) or p.penalized or p.min_tokens > 0


class LLM(RequestFront):
    """An inference engine over one model.

    model: a nanojax checkpoint folder, an HF folder, an 'org/name' on the Hugging Face Hub, a .gguf file, None for
    the embedded default (SmolLM2-135M-Instruct), or a `LoadedModel` already in memory.
    dtype: "bfloat16" (default on GPU) or "float32" (default on CPU).
    num_pages: KV pages in the pool; None sizes it from free device memory (`memory_fraction`).
    max_num_seqs, max_num_batched_tokens: requests running at once and tokens per step; prompts are prefilled in
    chunks that share the step's token budget. Defaults on GPU: 256 and 8192 (docs/benchmarks.md, "Defaults").
    decode_steps: decode steps run on device per dispatch when a step is decode-only. None: 32 on GPU (on the H100,
    batch 1 ran at 1.43 / 1.33 / 1.28 ms per step with 16 / 32 / 64; docs/benchmarks.md), 8 on CPU, where text
    streams in bursts of decode_steps tokens.
    kernels: "reference" (jnp), "pallas", "interpret" (the Pallas kernels interpreted, for CPU tests), or "auto"
    (the Pallas kernels on a GPU where the model's shapes allow them).
    warmup: compile every program before returning, behind one progress bar (None: on a GPU; on a CPU programs
    compile on first use). On a GPU compiled programs are kept on disk as executables (nanojax.executable_cache),
    which the next start loads without tracing, and in the persistent compilation cache (`nanojax.cache`); what is
    not there yet is compiled by this process and compile workers beside it (nanojax.compile_workers).
    quantization: None, or "fp8": every projection's weights in FP8 (E4M3) with per-output-channel scales, quantized
    at load (nanojax.quantize); embeddings, norms and the LM head stay in `dtype`. A `LoadedModel` whose weights are
    device arrays keeps its bf16 copy in use while the KV pool is sized (the caller holds it); to give that memory to
    the pool, hand over host arrays (quantized first with nanojax.quantize.quantize_params and `jax.device_get`, as
    scripts/bench_throughput.py does: weights freed on the device leave holes the pool cannot use).
    tensor_parallel_size: run the model split over this many local devices (nanojax.sharding; 1 runs the sharded
    code on one device); None: one device, unsharded, or in a multi-process job (nanojax.distributed) every device
    of every process, process 0 running the engine and the others `follow()`ing it.
    cascade: decode reads a prefix that running requests share (a cached system prompt, a document) once per step
    for all of them, when nanojax.cascade's default rules find it worth it (or the `CascadeRules` given); False:
    each request reads its own pages (to compare the two).
    """

    def __init__(self, model: "str | LoadedModel | None" = None, *, dtype: str | None = None,
                 max_model_len: int | None = None, page_size: int = 16, num_pages: int | None = None,
                 memory_fraction: float = 0.85, max_num_seqs: int | None = None,
                 max_num_batched_tokens: int | None = None, chunk_size: int | None = None,
                 decode_steps: int | None = None, kernels: str = "auto", seed: int = 0, warmup: bool | None = None,
                 progress: bool = True, tensor_parallel_size: int | None = None, quantization: str | None = None,
                 cascade: "bool | CascadeRules" = True):
        from nanojax.cache import use_compilation_cache

        start, start_wall = time.perf_counter(), time.time()
        # Compile workers forked before this process starts a backend, in case this is a build's first start on a
        # GPU (decided below, once the backend is up): forked, they skip importing JAX and nanojax. They end with
        # this LLM, if __init__ fails before warmup takes them.
        spawned = compile_workers.fork_ahead(compile_workers.WORKERS) if (
            warmup is not False and tensor_parallel_size is None) else []
        self._stop_workers = weakref.finalize(self, compile_workers.stop_all, spawned)
        on_gpu = jax.default_backend() == "gpu"
        if on_gpu:  # XLA:CPU executables do not reliably survive the persistent cache (nanojax.cache)
            use_compilation_cache()
        self.dtype = dtype or ("bfloat16" if on_gpu else "float32")
        if quantization not in (None, "fp8"):
            raise ValueError(f"quantization must be None or 'fp8', got {quantization!r}")
        if not isinstance(cascade, (bool, CascadeRules)):
            raise ValueError(f"cascade must be True, False or a nanojax.cascade.CascadeRules, got {cascade!r}")
        several = jax.process_count() > 1  # a jax.distributed job: one model over every process's devices
        sharded = tensor_parallel_size is not None or several
        warmup = warmup if warmup is not None else on_gpu
        # Off for several processes: each holds other devices' executables, under keys not yet made per process.
        # Off on the CPU: an XLA:CPU executable is not reliably loaded by another process (nanojax.cache).
        executable_dir = executable_cache.default_directory() if on_gpu and not several else None
        # A build's first start (none of its executables stored yet): compile workers start now (spawned where none
        # was forked), starting their backends while the weights load, and take shares of the programs in warmup
        # (nanojax.compile_workers).
        if not (warmup and executable_dir and not sharded and executable_cache.holds_none(executable_dir)):
            compile_workers.stop_all(spawned)
        elif spawned:
            compile_workers.start(spawned)
        else:
            spawned.extend(compile_workers.spawn() for _ in range(compile_workers.WORKERS))
        spawned_at = spawned[0].spawned - start_wall if spawned else None  # workers' times count from their start
        self.decode_steps = _positive("decode_steps", decode_steps, 32 if on_gpu else 8)
        max_num_seqs = _positive("max_num_seqs", max_num_seqs, 256 if on_gpu else 64)
        budget = _positive("max_num_batched_tokens", max_num_batched_tokens, 8192 if on_gpu else 2048)
        sizes = _RunnerSizes(self.dtype, max_model_len, page_size, num_pages, memory_fraction, max_num_seqs, budget,
                             self.decode_steps, kernels, CascadeRules() if cascade is True else cascade or None,
                             executable_dir, in_use=_bytes_in_use())
        hand_out, handed = None, {}  # handed: the config, runner arguments and time of the hand-out
        if spawned and not quantization:
            def hand_out(known: LoadedModel) -> None:
                """The workers get their programs as soon as the config is read, while the weights convert: the
                programs need the params' shapes, which follow from the config, not the weights nor the tokenizer.
                That config may be config.json as written (load_model's on_config), checked below: the runner built
                on the weights takes the workers' programs only under its own keys (ModelRunner.compile_all)."""
                shapes = _placed_shapes(known.config, jnp.dtype(self.dtype))
                kwargs = sizes.runner_kwargs(known, _bytes(shapes), known.config.num_kv_heads)
                ModelRunner(known.config, shapes, **kwargs).hand_out(spawned)
                handed.update(config=known.config, kwargs=kwargs, at=time.perf_counter())

        # One device: a converted checkpoint's parts go to it while the next ones convert (the first large copies
        # to a GPU are slow, docs/perf_notes.md "Start-up"). Sharded weights are placed by TensorParallel; weights
        # quantized at load go as FP8 only (below).
        loaded = load_model(model, self.dtype, place=None if sharded or quantization else jax.device_put,
                            on_config=hand_out)
        loaded_at = time.perf_counter()
        self.config, params = loaded.config, loaded.params
        # Device buffers the caller handed over (a LoadedModel of device arrays): close() leaves them alone.
        self._callers_buffers = _buffers(model.params) if isinstance(model, LoadedModel) else frozenset()
        if quantization == "fp8" and not is_quantized(params["layers"][0]["qkv"]):
            # The LM head stays in dtype: in FP8 it changed SmolLM2's answers (docs/benchmarks.md, "FP8 weights").
            params = quantize_params(params, self.config, lm_head=False)
        tp = None
        if sharded:
            from nanojax.sharding import TensorParallel

            size = jax.device_count() if tensor_parallel_size is None else tensor_parallel_size
            tp = TensorParallel.create(self.config, size)
            params = tp.place(params, progress)
        else:  # a checkpoint's weights arrive as numpy arrays
            params = jax.device_put(params)
        kwargs = handed["kwargs"] if handed.get("config") == self.config else sizes.runner_kwargs(
            loaded, _bytes(params), self.config.num_kv_heads if tp is None else tp.local_config.num_kv_heads)
        model_len = _model_len(max_model_len, self.config)
        self.page_manager = PageManager(kwargs["num_pages"], page_size)
        self.limits = EngineLimits(model_len, page_size, kwargs["num_pages"], max_num_seqs)
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=model_len,
            chunk_size=chunk_size or budget, page_size=page_size, prefill_row=PREFILL_ROW), self.page_manager)
        self.runner = (DistributedRunner if several else ModelRunner)(self.config, params, tensor_parallel=tp,
                                                                      vocab_limit=loaded.vocab_limit(), **kwargs)
        self.eos_ids = frozenset(self.config.eos_token_ids)
        self._rng = np.random.default_rng(seed)
        self._free_slots = list(range(max_num_seqs))
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # ("add", [Sequence]) | ("abort", id) | ("call", fn)
        self._lock = threading.Lock()  # orders the loop's decision to stop against a new request's start
        self._running, self.closed = False, False
        self._thread: threading.Thread | None = None  # the loop's thread, while it runs
        self._closing = threading.Event()  # set by close(): the loop ends as soon as it is idle
        self._turned_at = time.monotonic()  # when the loop last began a turn (stats' stalled_s)
        self._requests: dict[str, list[Sequence]] = {}  # request id -> its unfinished choices
        self._ids = itertools.count()
        self.dead: BaseException | None = None  # set when a step failed in a way that lost the device state
        # Called on the loop thread once a step's events are in their streams (and at each turn of the loop, for
        # the events of aborts and failures): the engine process sends them to the server's process from there.
        self.events_out: Callable[[], None] = lambda: None
        built_at = time.perf_counter()
        if warmup:
            self.runner.compile_all(progress, workers=spawned or None)
        compiled_at = time.perf_counter()
        self.tokenizer = loaded.resolved().tokenizer  # its load overlapped the steps above
        # Where start-up went (scripts/bench_startup.py prints it): reading / converting the weights, placing them
        # and the KV pool on the device, compiling or loading the programs, then waiting for the tokenizer; and on a
        # first start when compile workers were spawned and handed their programs (runner.worker_seconds: the rest
        # of their times, from their spawn).
        self.startup_seconds = {"load": loaded_at - start, "build": built_at - loaded_at,
                                "compile": compiled_at - built_at, "tokenizer_wait": time.perf_counter() - compiled_at,
                                **({"workers_spawned": spawned_at} if spawned_at is not None else {}),
                                **({"handed_out": handed["at"] - start} if handed else {})}

    def stats(self) -> EngineStats:
        """The engine's load now (read from any thread: a snapshot for metrics, not a consistent one)."""
        pages = self.page_manager
        busy = self.scheduler.has_unfinished() or not self._inbox.empty()
        return EngineStats(len(self.scheduler.running), len(self.scheduler.waiting), pages.num_pages,
                           pages.num_pages - pages.num_free_pages,
                           time.monotonic() - self._turned_at if busy else 0.0)

    def warmup(self, progress: bool = True) -> None:
        """Compiles every program the engine runs (any sampling mix, any batch up to max_num_seqs, any prompt up
        to max_model_len), so that no request compiles anything."""
        self.runner.compile_all(progress)

    # ----- several processes (nanojax.distributed) -----
    def follow(self) -> None:
        """On a process other than 0 of a multi-process job: runs the steps process 0's engine sends; returns when
        process 0 calls `close` (or exits)."""
        if not isinstance(self.runner, DistributedRunner):
            raise RuntimeError("follow() is for the processes other than 0 of a jax.distributed job")
        self.runner.follow()

    def close(self) -> None:
        """Gives back what this LLM holds: unfinished requests end (finish_reason "abort"), the loop thread and
        compile workers stop, and the KV pool, token tables, compiled programs and the weights it placed leave the
        device (a caller's `LoadedModel` keeps its own arrays). On process 0 of a multi-process job it also releases
        the other processes' `follow`. Idempotent; the LLM takes no requests after. `with LLM(...) as llm:` closes
        on leaving the block."""
        if self.closed:
            return
        if threading.current_thread() is self._thread:
            raise RuntimeError("close() was called from the engine loop's thread (an event callback)")
        self.closed = True  # add_request refuses from here on
        self._in_loop(lambda: [self._abort(request_id) for request_id in list(self._requests)])
        self._closing.set()  # the loop, idle once the aborts are read back, ends at once instead of lingering
        if self._thread is not None:
            self._thread.join()
        self._stop_workers()
        if isinstance(self.runner, DistributedRunner):
            self.runner.stop()
        self.runner.release(keep=self._callers_buffers)

    # ----- requests -----
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, *,
                    request_id: str | None = None, index: int = 0, stream: RequestStream | None = None,
                    stream_text: bool = True) -> RequestStream:
        """Queues a request (from any thread); its events arrive on the returned stream: a RequestOutput each time
        one of its n choices gains text or finishes. Bad requests raise ValueError here, naming what is wrong.

        request_id: for `abort` (default: a fresh one); index: RequestOutput.index; stream: deliver to this stream
        (shared by several requests); stream_text=False detokenizes a request only when it finishes (or to find its
        stop strings)."""
        params = params or SamplingParams()
        ids = self.encode(prompt)
        self.check(index, ids, params)
        request_id = str(next(self._ids)) if request_id is None else request_id
        stream = stream or RequestStream()
        self._enqueue(ids, params, request_id, index, stream, stream_text)
        return stream

    def _enqueue(self, ids: list[int], params: SamplingParams, request_id: str, index: int, stream: RequestStream,
                 stream_text: bool, pin: bool = False) -> _Request:
        """Hands a validated request to the engine loop; -> its first choice's state."""
        first = self._first_choice(ids, params, request_id, index, stream, stream_text, pin)
        self._submit([first])
        return first.params

    def _first_choice(self, ids, params, request_id, index, stream, stream_text, pin=False) -> Sequence:
        """A validated request's sequences; -> the first choice's (the others are its siblings, added once its
        prompt's pages are committed)."""
        if self.closed:
            raise RuntimeError("this LLM is closed")
        if self.dead is not None:
            raise RuntimeError(f"the engine has stopped after an error: {self.dead!r}")
        stream.expect(params.n)
        seqs = [self._sequence(request_id, index, choice, ids, params, stream, stream_text)
                for choice in range(params.n)]
        seqs[0].params.siblings, seqs[0].params.pin = seqs[1:], pin
        for sibling in seqs[1:]:  # one list of prompt logprobs, filled by the first choice's prefill
            sibling.params.output.prompt_logprobs = seqs[0].params.output.prompt_logprobs
        return seqs[0]

    def _submit(self, firsts: list[Sequence]) -> None:
        """Requests' first choices to the engine loop as one inbox item, so that its next step sees them all
        (a generate call's batch does not depend on how fast the loop thread runs)."""
        self._inbox.put(("add", firsts))
        self._start()

    def abort(self, request_id: str) -> None:
        """Ends a request (all its choices) with finish_reason "abort"; its KV pages are freed in the next step."""
        self._inbox.put(("abort", request_id))
        self._start()

    def _sequence(self, request_id, index, choice, ids, params, stream, stream_text) -> Sequence:
        seed = params.seed + choice if params.seed is not None else int(self._rng.integers(2**32))
        params = dataclasses.replace(params, seed=seed % 2**32)
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_ids)
        detok = Detokenizer(self.tokenizer) if self.tokenizer and (stream_text or params.stop) else None
        out = RequestOutput(index, list(ids), [], "", None, request_id=request_id, choice=choice,
                            logprobs=[] if params.logprobs is not None else None,
                            prompt_logprobs=None if params.prompt_logprobs is None else [None] * len(ids))
        req = _Request(out, params, stop_ids, stream, time.perf_counter(), detok,
                       stream_tokens=stream_text and self.tokenizer is None)
        # The first choice computes the prompt's logprobs over the whole prompt; the others, admitted once its pages
        # are committed, find it cached and share its list.
        # It ends at max_tokens or max_model_len tokens, and samples one token whatever the prompt's length.
        limit = max(len(ids) + 1, min(len(ids) + params.max_tokens, self.max_model_len))
        return Sequence(ids, params=req, reads_prefix_cache=params.prompt_logprobs is None or choice > 0,
                        max_num_tokens=limit)

    # ----- pinned prefixes -----
    def pin_prefix(self, prompt: str | list[int]) -> int:
        """Computes the prompt's KV once and pins its full pages (len(prompt) // page_size of them): every later
        request that starts with this prompt, and is longer than the pinned pages, reuses them
        (RequestOutput.num_cached_tokens), however much else is evicted meanwhile. Returns a handle for `unpin`.
        """
        ids = self.encode(prompt)
        page_size = self.page_manager.page_size
        if len(ids) < page_size:
            raise ValueError(f"the prefix has {len(ids)} tokens, less than one KV page ({page_size} tokens): "
                             "nothing to pin")
        once = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        self.check(0, ids, once)
        stream = RequestStream()
        req = self._enqueue(ids, once, str(next(self._ids)), 0, stream, stream_text=False, pin=True)
        for _ in stream:
            pass
        return req.pin_handle

    def unpin(self, handle: int) -> None:
        """Releases a pinned prefix: its pages become ordinary cached pages, evicted under memory pressure."""
        self._in_loop(lambda: self.page_manager.unpin(handle))

    def _in_loop(self, fn):
        """Runs fn in the engine loop (the one thread that touches scheduler and pages); returns or raises its
        result here."""
        future = concurrent.futures.Future()
        self._inbox.put(("call", lambda: _settle(future, fn)))
        self._start()
        return future.result()

    # ----- offline use -----
    def stream(self, prompts: Iterable[str | list[int]],
               sampling_params: SamplingParams | list[SamplingParams] | None = None) -> Iterator[RequestOutput]:
        """Runs the prompts together; yields a RequestOutput each time a request gains text or finishes."""
        return self._run_requests(prompts, sampling_params, stream_text=True)

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Outputs in prompt order (n > 1: each prompt's choices in order). A single prompt (str or token-id list)
        may be passed as is."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        done: dict[tuple[int, int], RequestOutput] = {}
        with tqdm(total=len(prompts), desc="generating", disable=not use_tqdm) as bar:
            for out in self._run_requests(prompts, sampling_params, stream_text=False):
                if out.finish_reason is not None:
                    done[out.index, out.choice] = out
                    bar.update(out.choice == 0)
        return [done[k] for k in sorted(done)]

    def _run_requests(self, prompts, sampling_params, stream_text: bool) -> Iterator[RequestOutput]:
        """The requests' events in the order they happen; requests still running when the caller stops early (a
        stream closed, an error) are aborted."""
        prompts = list(prompts)
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        params = [sp or SamplingParams() for sp in params]
        ids = [self.encode(p) for p in prompts]
        for i, (p, sp) in enumerate(zip(ids, params)):  # all of them before any runs
            self.check(i, p, sp)
        stream, request_ids = RequestStream(), []
        try:
            firsts = []
            for i, (p, sp) in enumerate(zip(ids, params)):
                request_ids.append(str(next(self._ids)))
                firsts.append(self._first_choice(p, sp, request_ids[-1], i, stream, stream_text))
            self._submit(firsts)
            yield from stream
        finally:
            if not stream.finished:  # their pages are free when this returns
                self._in_loop(lambda: [self._abort(request_id) for request_id in request_ids])

    # ----- the engine loop (its own thread; the only code that touches scheduler, pages and runner) -----
    def _start(self) -> None:
        """Runs the loop if it is not running (`_engine_loop`: an idle loop waits a while for more work, holding
        the LLM only weakly, so an unused LLM is freed with its KV pool like any object)."""
        with self._lock:
            if not self._running:
                self._running, self._turned_at = True, time.monotonic()
                self._thread = threading.Thread(target=_engine_loop, name=_LOOP_THREAD, daemon=True,
                                                args=(weakref.ref(self), self._inbox, self._closing))
                self._thread.start()

    def _loop(self, first: tuple | None = None) -> bool:
        """Steps until nothing is left to do (-> True) or the process exits (-> False). first: an inbox item
        already taken out."""
        inflight = None  # the step dispatched last, not read back yet
        try:
            if first is not None:
                self._take(*first)
            while not _EXITING.is_set():
                self._turned_at = time.monotonic()
                self._take_inbox()
                self.events_out()
                if not self.scheduler.has_unfinished():
                    # A step still in flight holds only finished rows: not read back, so that the loop lets go of
                    # this LLM (a caller's del) without waiting for the device.
                    return True
                inflight = self._step(inflight)
        except BaseException:
            with self._lock:
                self._running = False
            raise
        with self._lock:  # stopped at exit
            self._running = False
        return False

    def _end_if_idle(self) -> bool:
        """The loop's thread ends unless work came in meanwhile (a request queued after this starts a new one).
        -> whether it ends."""
        with self._lock:
            self._running = not self._inbox.empty() and not _EXITING.is_set()
            return not self._running

    def _step(self, inflight: _Step | None) -> _Step | None:
        """Dispatches the next step, then reads back, checks and streams the one before it (inflight), so the
        host's work on a step overlaps the GPU's on the next: a multi-step decode's dispatch returns once the host
        has launched every step of its loop, well before they have run. -> the step dispatched (None: none).
        A step that is not `chainable` is read back before the next dispatch."""
        after_first_tokens = False
        if inflight is not None and not inflight.chainable:
            self._read_back(inflight)
            after_first_tokens, inflight = inflight.first_tokens_only, None
        step = None
        try:
            step = self._dispatch(inflight, after_first_tokens)
        except CapacityError as e:  # this request can never fit: it ends, the others go on
            self._fail([e.seq], e)
        except Exception as e:  # noqa: BLE001 -- a failed step ends its requests, not the engine
            self._step_failed(e)
        if inflight is not None:
            self._read_back(inflight)
        return step

    def _read_back(self, step: _Step) -> None:
        try:
            seqs = self._complete(step.chunks, step.pending, step.prompt)
        except Exception as e:  # noqa: BLE001
            self._step_failed(e)
            return
        self._emit(seqs)
        self.events_out()

    def _take_inbox(self) -> None:
        while True:
            try:
                self._take(*self._inbox.get_nowait())
            except queue.Empty:
                return

    def _take(self, kind: str, item) -> None:
        if kind == "add":
            for seq in item:
                self._requests[seq.params.output.request_id] = [seq, *seq.params.siblings]
                try:
                    self.scheduler.add(seq)
                except ValueError as e:
                    self._fail([seq], e)
        elif kind == "abort":
            self._abort(item)
        else:
            item()

    def _dispatch(self, inflight: _Step | None = None, after_first_tokens: bool = False) -> _Step | None:
        """Schedules a step and dispatches it: a decode-only step in one call of the decode program; the prefill
        chunks packed into the prefill program, with the step's decodes (one step each) in the same forward.
        inflight: the step before, not read back yet: rows whose last token it samples take it on the device.
        after_first_tokens: the step before sampled prompts only and was read back just now. -> None when nothing
        can run until inflight is read back."""
        if not self.scheduler.has_unfinished():
            return None
        chunks = self.scheduler.schedule(decode_steps=self.decode_steps)
        if not chunks:
            if inflight is None:
                raise RuntimeError("the scheduler found nothing to run although requests are unfinished")
            return None
        chunks, fields = self._prepare(chunks)
        if not chunks:
            return None
        decodes = [c for c in chunks if c.num_tokens == 1 and c.sample]
        prefills = [c for c in chunks if not (c.num_tokens == 1 and c.sample)]
        rows = ([max(c.seq.token_ids[c.start], 0) for c in decodes], [c.seq.page_table for c in decodes],
                [c.end for c in decodes], _columns([fields[c.seq.seq_id] for c in decodes])) if decodes else None
        sources = [inflight.pending[c.seq.seq_id][1] if c.seq.num_pending else -1 for c in decodes]
        if not prefills:  # each row's steps (1..decode_steps) in one dispatch of the decode program
            out = self.runner.decode(*rows, self.decode_steps, [c.num_steps for c in decodes], sources)
            pending, prompt = {c.seq.seq_id: (out, i) for i, c in enumerate(decodes)}, {}
        else:
            targets = [self._prompt_targets(c) for c in prefills]
            outs = self.runner.prefill([(c.seq.token_ids[c.start:c.end], c.seq.page_table, c.end,
                                         fields.get(c.seq.seq_id), t)
                                        for c, t in zip(prefills, targets)], decodes=rows, sources=sources)
            pending = {c.seq.seq_id: out for c, out in zip(prefills + decodes, outs) if c.sample}
            prompt = {c.seq.seq_id: out for c, out, t in zip(prefills, outs, targets) if t}
        self.scheduler.advance(chunks)
        # The next step may go before this one is read back when its decode rows can take their tokens from this
        # one's last tokens (one dispatch) and this one is not a prefill-only step that samples (its first tokens
        # would wait for the next dispatch's launch), nor the step right after one: its read back leaves the GIL
        # to the threads that stream those first tokens (in-process consumers; measured with the engine process's
        # former sender thread: time to first token, docs/perf_notes.md).
        one_dispatch = len({id(out) for out, _ in pending.values()}) <= 1
        first_tokens_only = bool(pending) and not decodes
        return _Step(chunks, pending, prompt, one_dispatch and not first_tokens_only and not after_first_tokens,
                     first_tokens_only)

    @staticmethod
    def _prompt_targets(c) -> list[int] | None:
        """The prompt token after each of the chunk's positions, -1 past the prompt; None unless its request wants
        prompt logprobs (and computes its prompt: not a second choice, which finds it cached)."""
        seq = c.seq
        if seq.params.params.prompt_logprobs is None or seq.reads_prefix_cache:
            return None
        last = seq.num_prompt_tokens - 1
        return [seq.token_ids[pos + 1] if pos < last else -1 for pos in range(c.start, c.end)]

    def _prepare(self, chunks) -> tuple[list, dict]:
        """Each scheduled request's token-table slot and its sampling row in the step's dtypes; a request whose row
        cannot be prepared fails alone, its chunks left out of the step. A request preempted since its last step
        gives its slot back. -> (the chunks kept, {seq_id: sampling row} of those that sample)."""
        for seq in self.scheduler.waiting:
            self._release_slot(seq.params)
        fields = {}
        for c in chunks:
            try:
                self._assign_slot(c.seq.params)
                if c.sample:
                    fields[c.seq.seq_id] = checked_row(self._sampling_row(c.seq))
            except Exception as e:  # noqa: BLE001 -- this request's error, the step goes on
                self._fail([c.seq], e)
        return [c for c in chunks if c.seq.status is not SequenceStatus.FINISHED], fields

    def _assign_slot(self, req: _Request) -> None:
        """A request that uses bias, penalties or min_tokens gets a token-table slot, written from its prompt and
        output so far."""
        if req.needs_tables and req.slot is None:
            req.slot = self._free_slots.pop()
            self.runner.set_slot(req.slot, *self._table_rows(req))

    def _table_rows(self, req: _Request) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        vocab = self.config.vocab_size
        counts = np.bincount(np.asarray(req.output.token_ids, np.int64), minlength=vocab).astype(np.int32)
        flags = np.zeros(vocab, np.int8)
        flags[req.output.prompt_token_ids] |= PROMPT
        flags[[t for t in req.stop_ids if t < vocab]] |= BANNED
        bias = np.zeros(vocab, np.float32)
        for t, b in (req.params.logit_bias or {}).items():
            bias[t] = b
        return counts, flags, bias

    def _release_slot(self, req: _Request) -> None:
        if req.slot is not None:
            self._free_slots.append(req.slot)
            req.slot = None

    def _sampling_row(self, seq: Sequence) -> dict:
        """A row's sampling fields; its counters count the tokens of a step still in flight."""
        req: _Request = seq.params
        p, generated = req.params, seq.num_generated
        return dict(p.device_values(), seeds=p.seed, counters=generated,
                    slots=self.runner.neutral_slot if req.slot is None else req.slot,
                    ban_steps=max(0, p.min_tokens - generated))

    def _complete(self, chunks, pending, prompt) -> list[Sequence]:
        """Waits for the step's tokens, puts them in place of its placeholders, applies the stop conditions and frees
        finished requests. -> the sequences that gained tokens."""
        for c in chunks:
            if c.seq.seq_id in prompt:
                self._accept_prompt_logprobs(c, *prompt[c.seq.seq_id])
        seqs = []
        for c in chunks:
            if c.sample and c.seq.status is not SequenceStatus.FINISHED:
                out, row = pending[c.seq.seq_id]
                self.scheduler.fill(c.seq, self._accept(c.seq, out, row, c.num_steps), c.num_steps)
                seqs.append(c.seq)
        for seq in seqs:
            req: _Request = seq.params
            for sibling in req.siblings:  # n > 1: the prompt's pages are committed now, the other choices hit them
                if sibling.status is not SequenceStatus.FINISHED:
                    self.scheduler.add(sibling)
            req.siblings = []
            self._update_text(seq)
            if req.output.finish_reason is not None:
                if req.pin:
                    req.pin_handle = self.page_manager.pin_pages(seq, len(req.output.prompt_token_ids))
                self._finish(seq)
        return seqs

    def _accept(self, seq: Sequence, pending, row: int, num_steps: int) -> list[int]:
        """The prefix of the row's first num_steps new tokens the request keeps; marks it finished when a stop
        condition is met."""
        req: _Request = seq.params
        out, known = req.output, seq.num_known
        kept = []
        for tok in pending.tokens()[:num_steps, row].tolist():
            kept.append(tok)
            out.token_ids.append(tok)
            if out.time_to_first_token is None:
                out.time_to_first_token = time.perf_counter() - req.start
            if tok in req.stop_ids and len(out.token_ids) > req.params.min_tokens:
                out.finish_reason = "stop"
            elif len(out.token_ids) >= req.params.max_tokens or known + len(kept) >= self.max_model_len:
                out.finish_reason = "length"
            if out.finish_reason:
                break
        if req.params.logprobs is not None:
            logprobs, top_ids, top_logprobs = pending.logprobs()
            n = req.params.logprobs
            for step in range(len(kept)):
                out.logprobs.append(_logprob_entry(logprobs[step, row], top_ids[step, row], top_logprobs[step, row], n))
        return kept

    @staticmethod
    def _accept_prompt_logprobs(c, pending, last_row: int) -> None:
        """Fills the request's prompt_logprobs for the positions after the chunk's (a recomputed chunk, after a
        preemption, fills the same values again)."""
        req: _Request = c.seq.params
        p = pending.prompt_logprobs(last_row, c.end - c.start)
        for i, pos in enumerate(range(c.start, min(c.end, c.seq.num_prompt_tokens - 1))):
            req.output.prompt_logprobs[pos + 1] = _logprob_entry(p.logprobs[i], p.top_ids[i], p.top_logprobs[i],
                                                                 req.params.prompt_logprobs)

    def _update_text(self, seq: Sequence) -> None:
        """Brings the request's text up to its tokens, and ends it at a stop string."""
        req: _Request = seq.params
        out, stop = req.output, req.params.stop
        if req.detok is None:
            return
        before = len(out.text)
        out.text = req.detok.update(out.token_ids)
        i = find_stop(out.text, stop, max(0, before - max(map(len, stop), default=0)))
        if i >= 0:
            # A multi-step decode samples past the token that completed the stop string: drop what follows it,
            # so the output is the same whatever decode_steps is.
            while len(out.token_ids) > 1 and find_stop(self._text(out.token_ids[:-1]), stop) >= 0:
                out.token_ids.pop()
                if out.logprobs:
                    out.logprobs.pop()
            text = self._text(out.token_ids)
            out.text, out.finish_reason, req.cut = text[:find_stop(text, stop)], "stop", True

    def _emit(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            event = self._event(seq)
            if event is not None:
                seq.params.stream.put(event)

    def _event(self, seq: Sequence) -> RequestOutput | None:
        """The request's event for the tokens it gained in its last step (None if its visible text did not
        change); built before the request's next step is accepted."""
        req: _Request = seq.params
        out, stop = req.output, req.params.stop
        if out.finish_reason and self.tokenizer is not None and not req.cut:
            out.text = self._text(out.token_ids)  # the whole text decoded once, as a fresh decode gives it
        out.num_cached_tokens = seq.num_cached_tokens
        stable = out.text if out.finish_reason else out.text.rstrip("\ufffd")
        if stop and not out.finish_reason:  # hold back what may be the start of a stop string
            stable = stable[:max(0, len(stable) - max(map(len, stop)) + 1)]
        out.delta, req.emitted_text = stable[len(req.emitted_text):], stable
        if not out.delta and out.finish_reason is None and req.params.logprobs is None and not req.stream_tokens:
            return None
        return dataclasses.replace(out, token_ids=list(out.token_ids), text=stable,
                                   logprobs=None if out.logprobs is None else list(out.logprobs))

    def _text(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    # ----- ending requests -----
    def _finish(self, seq: Sequence) -> None:
        """Frees a sequence's pages and slot (a sibling never admitted has none)."""
        if seq.status is SequenceStatus.RUNNING or seq in self.scheduler.waiting:
            self.scheduler.finish(seq)
        seq.status = SequenceStatus.FINISHED
        self._release_slot(seq.params)
        choices = self._requests.get(seq.params.output.request_id, [])
        if seq in choices:
            choices.remove(seq)
            if not choices:
                del self._requests[seq.params.output.request_id]

    def _end(self, seq: Sequence, reason: str, error: BaseException | None = None) -> None:
        """Ends a request's choice that did not finish by itself (aborted, or failed with `error`)."""
        if seq.status is SequenceStatus.FINISHED:
            return
        self._finish(seq)
        out = seq.params.output
        out.finish_reason = reason
        seq.params.stream.put(dataclasses.replace(out, token_ids=list(out.token_ids), delta=""), error=error)

    def _abort(self, request_id: str) -> None:
        for seq in list(self._requests.get(request_id, ())):
            self._end(seq, "abort")

    def _fail(self, seqs: list[Sequence], error: BaseException) -> None:
        for seq in seqs:
            for s in list(self._requests.get(seq.params.output.request_id, [seq])):
                self._end(s, "error", error)

    def _step_failed(self, error: BaseException) -> None:
        """Ends the requests of a step that raised; if the step lost the device state, the engine is dead."""
        self._fail([*self.scheduler.running, *self.scheduler.waiting], error)
        if any(x.is_deleted() for x in jax.tree.leaves((self.runner.cache, self.runner.tables))):
            self.dead = error


def _engine_loop(ref: "weakref.ref[LLM]", inbox: queue.SimpleQueue, closing: threading.Event) -> None:
    """An LLM's loop thread: runs its loop until it is idle, then waits up to _LINGER_S for more work, holding the
    inbox but not the LLM (a thread's start is paid by the next first token: docs/perf_notes.md, "Serving"). It
    ends when the wait runs out with nothing queued, at exit, once the LLM is closed or freed."""
    item = None
    while (llm := ref()) is not None and llm._loop(item):
        del llm
        item = _next_item(ref, inbox, closing)
        if item is None and ((llm := ref()) is None or llm._end_if_idle()):
            return


def _next_item(ref: "weakref.ref[LLM]", inbox: queue.SimpleQueue, closing: threading.Event) -> tuple | None:
    """The inbox's next item within _LINGER_S; None if none came, at exit, or once the LLM is closed or freed."""
    deadline = time.monotonic() + _LINGER_S
    while time.monotonic() < deadline and not _EXITING.is_set() and not closing.is_set() and ref() is not None:
        try:
            return inbox.get(timeout=0.05)  # (returns at once when something is put)
        except queue.Empty:
            pass
    return None


@dataclasses.dataclass(frozen=True)
class _RunnerSizes:
    """LLM's size knobs, checked; `runner_kwargs` makes the runner's arguments of them."""
    dtype: str
    max_model_len: int | None
    page_size: int
    num_pages: int | None
    memory_fraction: float
    max_num_seqs: int
    max_num_batched_tokens: int
    decode_steps: int
    kernels: str
    cascade_rules: CascadeRules | None
    executable_dir: object
    in_use: int  # the bytes the device held when LLM started, before the weights

    def runner_kwargs(self, known: LoadedModel, param_bytes: int, kv_heads: int) -> dict:
        """The runner's arguments but params, tensor_parallel and vocab_limit (the tokenizer's length, which no
        program depends on: the hand-out does not wait for the tokenizer), from what is known before the weights are
        read and their bytes on one device (param_bytes: the same before and after they are placed, so that every
        start sizes the same KV pool and finds the executables stored under the same keys); kv_heads: one device's."""
        model_len = _model_len(self.max_model_len, known.config)
        pages_per_seq = -(-model_len // self.page_size)
        num_pages = self.num_pages if self.num_pages is not None else min_over_processes(self.pages_that_fit(
            known.config, self.max_num_seqs * pages_per_seq, kv_heads, self.in_use + param_bytes))
        if num_pages < pages_per_seq and self.num_pages is None:
            raise ValueError(
                f"the KV pool fits only {num_pages} pages of {self.page_size} tokens, and one sequence of "
                f"max_model_len={model_len} needs {pages_per_seq}: {_gib(self.in_use)} were in use on the device "
                f"before this LLM, its weights take {_gib(param_bytes)}, the pool gets memory_fraction="
                f"{self.memory_fraction} of {_gib(_device_limit() or 0)} less those. Free device memory (close other "
                "LLMs: LLM.close()), raise memory_fraction, lower max_model_len, or set num_pages")
        return dict(num_pages=num_pages, page_size=self.page_size, pages_per_seq=pages_per_seq,
                    dtype=jnp.dtype(self.dtype), ops=get_ops(self.kernels, known.config),
                    max_num_seqs=self.max_num_seqs,
                    max_prefill_tokens=self.max_num_batched_tokens, decode_steps=self.decode_steps,
                    cascade_rules=self.cascade_rules, executable_dir=self.executable_dir)

    def pages_that_fit(self, config, wanted: int, kv_heads: int, in_use: int) -> int:
        """KV pages in memory_fraction of the first device, less in_use bytes; at most `wanted`."""
        itemsize = jnp.dtype(self.dtype).itemsize
        page_bytes = 2 * config.num_layers * kv_heads * self.page_size * config.head_dim * itemsize
        limit = _device_limit()
        # CPU: no allocator limit to read, keep the pool modest
        budget = limit * self.memory_fraction - in_use if limit is not None else 2 << 30
        return int(max(0, min(wanted, budget // page_bytes)))


def _device_limit() -> int | None:
    """The first local device's allocator limit in bytes (None where the device does not say: the CPU)."""
    return (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit")


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def _bytes_in_use() -> int:
    """The bytes this process holds on its first local device (0 where the device does not say: the CPU)."""
    return (jax.local_devices()[0].memory_stats() or {}).get("bytes_in_use", 0)


def _placed_shapes(config, dtype) -> dict:
    """The params' jax.ShapeDtypeStructs as jax.device_put places them, from the config alone."""
    from convert.keys import param_shapes  # convert/ builds on nanojax.config: imported when needed

    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(*s, sharding=device), param_shapes(config, dtype),
                        is_leaf=lambda x: isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], np.dtype))


def _buffers(params) -> frozenset[int]:
    """The addresses of the device buffers under params' jax.Arrays."""
    return frozenset(shard.data.unsafe_buffer_pointer() for x in jax.tree.leaves(params) if isinstance(x, jax.Array)
                     for shard in x.addressable_shards)


def _bytes(params) -> int:
    """The bytes params (arrays or jax.ShapeDtypeStructs) take on the first local device."""
    device = jax.local_devices()[0]

    def on_device(x):
        if isinstance(x, jax.Array):
            return sum(shard.data.nbytes for shard in x.addressable_shards if shard.device == device)
        return int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize

    return sum(on_device(x) for x in jax.tree.leaves(params))


def _model_len(max_model_len: int | None, config) -> int:
    """max_model_len checked against the model's positions; None: 4096, or the model's positions if fewer."""
    if max_model_len and max_model_len > config.max_position_embeddings:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's max_position_embeddings="
                         f"{config.max_position_embeddings}")
    return min(max_model_len or 4096, config.max_position_embeddings)


def _positive(name: str, value: int | None, default: int) -> int:
    value = default if value is None else value
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be >= 1, got {value!r}")
    return value


def _columns(rows: list[dict]) -> dict[str, list]:
    """Rows of sampling fields -> {name: [value per row]}."""
    return {name: [row[name] for row in rows] for name in rows[0]}


def _logprob_entry(logprob, top_ids, top_logprobs, n: int) -> tuple[float, dict[int, float]]:
    """A token's (logprob, {token id: logprob} of the n most likely) from the step's arrays (top_ids, top_logprobs:
    [MAX_LOGPROBS])."""
    return float(logprob), {int(i): float(v) for i, v in zip(top_ids[:n], top_logprobs[:n])}


def _settle(future: concurrent.futures.Future, fn) -> None:
    try:
        future.set_result(fn())
    except Exception as e:  # noqa: BLE001 -- handed to the caller's thread
        future.set_exception(e)
