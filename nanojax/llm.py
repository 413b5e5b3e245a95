"""The public engine: `LLM(model)` builds runner, scheduler, page pool and engine core, then serves any thread."""
import dataclasses
import itertools
import time
import weakref
from typing import Iterable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from convert.keys import param_shapes
from convert.quantize import is_quantized, quantize_params
from nanojax import compilation, compile_workers, executable_cache
from nanojax.executable_cache import use_compilation_cache
from nanojax.config import EngineConfig
from nanojax.distributed import DistributedRunner, min_over_processes
from nanojax.engine import EngineCore
from nanojax.engine_io import RequestOutput, RequestStream
from nanojax.front import EngineLimits, EngineStats, RequestFront
from nanojax.loader import LoadedModel, load_model
from nanojax.page_manager import PageManager
from nanojax.runner import PREFILL_ROW, ModelRunner, buffer_addresses
from nanojax.sampling_params import SamplingParams
from nanojax.scheduler import Scheduler, SchedulerConfig
from nanojax.sharding import TensorParallel
from nanojax.structured import MaskFeed


class LLM(RequestFront):
    """model: a nanojax checkpoint or HF folder, a Hub 'org/name', a .gguf file, None for the embedded default
    (SmolLM2-135M-Instruct), or a `LoadedModel` (host arrays give their memory to the KV pool). config, knobs: an
    EngineConfig and its fields as keywords (which win). On a GPU every program is compiled (kept on disk) before this
    returns. In a multi-process job (nanojax.distributed) process 0 runs the engine, the others `follow()` it."""

    def __init__(self, model: "str | LoadedModel | None" = None, config: EngineConfig | None = None, **knobs):
        start, start_wall = time.perf_counter(), time.time()
        engine = dataclasses.replace(config, **knobs) if config else EngineConfig(**knobs)
        # Forked before this process starts a backend, in case this is a build's first start on a GPU (known once
        # the backend is up): forked workers skip importing JAX and nanojax. They end with this LLM.
        workers = compile_workers.fork_ahead(compile_workers.WORKERS) if (
            engine.warmup is not False and engine.tensor_parallel_size is None) else []
        self._stop_workers = weakref.finalize(self, compile_workers.stop_all, workers)
        on_gpu = jax.default_backend() == "gpu"
        if on_gpu:  # XLA:CPU executables do not reliably survive the persistent cache
            use_compilation_cache()
        engine = engine.resolved(on_gpu)
        several = jax.process_count() > 1  # a jax.distributed job: one model over every process's devices
        sharded = engine.tensor_parallel_size is not None or several
        # Off for several processes (each holds other devices' executables, under keys not made per process) and on
        # the CPU (an XLA:CPU executable is not reliably loaded by another process).
        executable_dir = executable_cache.default_directory() if on_gpu and not several else None
        first_start = engine.warmup and executable_dir and not sharded and executable_cache.holds_none(executable_dir)
        _start_workers(workers, first_start)
        spawned_at = workers[0].spawned - start_wall if workers else None  # (compile_all empties the list)
        in_use = _bytes_in_use()  # before the weights: what every start of this build finds
        if isinstance(model, LoadedModel):  # weights handed over on the device are the weights, not memory in use
            in_use = max(0, in_use - _bytes([x for x in jax.tree.leaves(model.params) if isinstance(x, jax.Array)]))
        drafted = engine.speculative_config is not None and engine.speculative_config.model is not None
        hand_out = (_HandOut(engine, workers, executable_dir, in_use) if workers and not engine.quantization
                    and not drafted else None)
        loaded = load_model(model, engine.dtype, place=None if sharded or engine.quantization else jax.device_put,
                            on_config=hand_out)
        loaded_at = time.perf_counter()
        self.config = loaded.config
        self.engine_config = engine = engine.for_model(self.config)
        # Device buffers the caller handed over (a LoadedModel of device arrays): close() leaves them alone.
        callers_buffers = buffer_addresses(model.params) if isinstance(model, LoadedModel) else frozenset()
        params, tp = _placed(loaded.params, self.config, engine, several)
        draft_config = None
        if drafted:
            draft = _draft(engine, self.config, tp)
            params, draft_config = {**params, "draft": draft.params}, draft.config
        kv_heads = self.config.num_kv_heads if tp is None else tp.local_config.num_kv_heads
        num_pages = hand_out.num_pages if hand_out and hand_out.config == self.config else _num_pages(
            engine, self.config, _bytes(params), kv_heads, in_use, draft_config)
        self.page_manager = PageManager(num_pages, engine.page_size)
        self.limits = EngineLimits(engine.max_model_len, engine.page_size, num_pages, engine.max_num_seqs)
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=engine.max_num_seqs, max_num_batched_tokens=engine.max_num_batched_tokens,
            max_model_len=engine.max_model_len, chunk_size=engine.chunk_size or engine.max_num_batched_tokens,
            page_size=engine.page_size, prefill_row=PREFILL_ROW), self.page_manager)
        self.runner = (DistributedRunner if several else ModelRunner)(
            self.config, engine, params, num_pages=num_pages, tensor_parallel=tp, vocab_limit=loaded.vocab_limit(),
            executable_dir=executable_dir, draft=draft_config)
        built_at = time.perf_counter()
        if engine.warmup:
            compilation.compile_all(self.runner, engine.progress, workers=workers or None)
        compiled_at = time.perf_counter()
        self.tokenizer = loaded.resolved().tokenizer  # its load overlapped the steps above
        self.core = EngineCore(self.runner, self.scheduler, self.page_manager, self.tokenizer)
        self.runner.feed = MaskFeed(self.core.output.grammars, self.runner.tables.allowed.shape[1]) if (
            engine.hosted_masks) else None
        self._ids = itertools.count()
        # close(), or this LLM collected: the device memory is free when `del llm` (+ gc.collect) returns, before
        # another LLM sizes its pool. Not at exit: the loops stop on their own then (nanojax.engine).
        self._release = weakref.finalize(self, _release, self.core, self.runner, callers_buffers, self._stop_workers)
        self._release.atexit = False
        # Where start-up went (scripts/bench_startup.py); the workers' own times are runner.worker_seconds.
        self.startup_seconds = {"load": loaded_at - start, "build": built_at - loaded_at,
                                "compile": compiled_at - built_at, "tokenizer_wait": time.perf_counter() - compiled_at,
                                **({"workers_spawned": spawned_at} if spawned_at is not None else {}),
                                **({"handed_out": hand_out.at - start} if hand_out and hand_out.at else {})}

    @property
    def decode_steps(self) -> int:
        return self.engine_config.decode_steps

    def stats(self) -> EngineStats:
        """The engine's load now (read from any thread: a snapshot for metrics, not a consistent one)."""
        return self.core.stats()

    def speculation_stats(self) -> np.ndarray:
        """Speculative decoding so far: [forwards, row-forwards that verified proposals, the tokens those gave]."""
        return self.core.in_loop(self.runner.speculation_stats)

    @property
    def dead(self) -> BaseException | None:
        """The error that lost the device state, once a step failed that way."""
        return self.core.dead

    @property
    def closed(self) -> bool:
        return self.core.closed

    def warmup(self, progress: bool = True) -> None:
        """Compiles every program the engine runs, so that no request compiles anything."""
        compilation.compile_all(self.runner, progress)

    def prepare_structured_outputs(self) -> None:
        """Builds what the first constrained request would otherwise wait for (the server calls it as it starts)."""
        self.core.output.grammars.prepare()
        self.runner.hosted_ready(wait=True)

    def follow(self) -> None:
        """On a process other than 0: runs the steps process 0 sends, until process 0 closes (or exits)."""
        if not isinstance(self.runner, DistributedRunner):
            raise RuntimeError("follow() is for the processes other than 0 of a jax.distributed job")
        self.runner.follow()

    def close(self) -> None:
        """Aborts unfinished requests, stops loop and workers, frees the device (not a caller's `LoadedModel`'s weights)
        and the other processes' `follow`; idempotent, also on leaving `with LLM(...) as llm:`."""
        self._release()

    def _submit(self, ids, params, request_id, index, stream, stream_text) -> None:
        request_id = str(next(self._ids)) if request_id is None else request_id
        self.core.submit([self.core.new_request(ids, params, request_id, index, stream, stream_text)])

    def abort(self, request_id: str) -> None:
        """Ends a request (all its choices) with finish_reason "abort"; its KV pages are freed in the next step."""
        self.core.abort(request_id)

    def pin_prefix(self, prompt: str | list[int]) -> int:
        """Computes the prompt's KV once and pins its full pages: later requests that start with it (and are longer)
        reuse them, however much else is evicted. -> a handle for `unpin`."""
        ids = self.encode(prompt)
        page_size = self.page_manager.page_size
        if len(ids) < page_size:
            raise ValueError(f"the prefix has {len(ids)} tokens, less than one KV page ({page_size} tokens): "
                             "nothing to pin")
        once = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        self.check(0, ids, once)
        stream = RequestStream()
        first = self.core.new_request(ids, once, str(next(self._ids)), 0, stream, stream_text=False)
        first.request.pin = True
        self.core.submit([first])
        for _ in stream:
            pass
        return first.request.pin_handle

    def unpin(self, handle: int) -> None:
        """Releases a pinned prefix: its pages become ordinary cached pages, evicted under memory pressure."""
        self.core.in_loop(lambda: self.page_manager.unpin(handle))

    def stream(self, prompts: Iterable[str | list[int]],
               sampling_params: SamplingParams | list[SamplingParams] | None = None) -> Iterator[RequestOutput]:
        """Runs the prompts together; yields a RequestOutput each time a request gains text or finishes."""
        return self._run_requests(prompts, sampling_params, stream_text=True)

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Outputs in prompt order, each prompt's n choices in order; a single prompt may be passed as is."""
        prompts = [prompts] if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)) else list(prompts)
        done: dict[tuple[int, int], RequestOutput] = {}
        with tqdm(total=len(prompts), desc="generating", disable=not use_tqdm) as bar:
            for out in self._run_requests(prompts, sampling_params, stream_text=False):
                if out.finish_reason is not None:
                    done[out.index, out.choice] = out
                    bar.update(out.choice == 0)
        return [done[k] for k in sorted(done)]

    def _run_requests(self, prompts, sampling_params, stream_text: bool) -> Iterator[RequestOutput]:
        """The requests' events as they happen; those still running when the caller stops early are aborted."""
        prompts = list(prompts)
        params = sampling_params or SamplingParams()
        params = [sp or SamplingParams() for sp in (params if isinstance(params, list) else [params] * len(prompts))]
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        ids = [self.encode(p) for p in prompts]
        for i, (p, sp) in enumerate(zip(ids, params)):  # all of them before any runs
            self.check(i, p, sp)
        stream, request_ids = RequestStream(), [str(next(self._ids)) for _ in ids]
        try:
            self.core.submit([self.core.new_request(p, sp, request_id, i, stream, stream_text)
                              for i, (p, sp, request_id) in enumerate(zip(ids, params, request_ids))])
            yield from stream
        finally:
            if not stream.finished:
                self.core.end(request_ids)


def _release(core: EngineCore, runner: ModelRunner, keep: frozenset[int], stop_workers) -> None:
    """What close() does (a finalizer: it holds no LLM)."""
    core.close()
    stop_workers()
    if isinstance(runner, DistributedRunner):
        runner.stop()
    runner.release(keep=keep)


def _start_workers(workers: list, first_start: bool) -> None:
    """On a build's first start the workers start (spawned if none were forked) as the weights load; else they stop."""
    if not first_start:
        compile_workers.stop_all(workers)
    elif workers:
        compile_workers.start(workers)
    else:
        workers.extend(compile_workers.spawn() for _ in range(compile_workers.WORKERS))


class _HandOut:
    """load_model's on_config: the workers get their programs (shapes only) while the weights convert; the runner takes
    them only under its own keys (compilation.compile_all), and this pool size only for the same config."""

    def __init__(self, engine: EngineConfig, workers: list, executable_dir, in_use: int):
        self.engine, self.workers, self.executable_dir, self.in_use = engine, workers, executable_dir, in_use
        self.config = self.num_pages = self.at = None

    def __call__(self, known: LoadedModel) -> None:
        engine = self.engine.for_model(known.config)
        shapes = _placed_shapes(known.config, jnp.dtype(engine.dtype))
        num_pages = _num_pages(engine, known.config, _bytes(shapes), known.config.num_kv_heads, self.in_use)
        runner = ModelRunner(known.config, engine, shapes, num_pages=num_pages, executable_dir=self.executable_dir)
        compilation.hand_out(runner, self.workers)
        self.config, self.num_pages, self.at = known.config, num_pages, time.perf_counter()


def _placed(params, config, engine: EngineConfig, several: bool):
    """The weights quantized as asked and placed on the device(s) -> (params, the TensorParallel or None)."""
    if engine.quantization == "fp8" and not is_quantized(params["layers"][0]["qkv"]):
        # The LM head stays in dtype: in FP8 it changed SmolLM2's answers (docs/benchmarks.md, "FP8 weights").
        params = quantize_params(params, config, lm_head=False)
    if engine.tensor_parallel_size is None and not several:
        return jax.device_put(params), None  # a checkpoint's weights arrive as numpy arrays
    tp = TensorParallel.create(config, engine.tensor_parallel_size or jax.device_count())
    return tp.place(params, engine.progress), tp


def _draft(engine: EngineConfig, config, tp: TensorParallel | None) -> LoadedModel:
    """Speculative decoding's draft model, on the device (whole on each of tp's: a small model runs its steps
    faster than their all-reduces), checked against the model's vocabulary."""
    name = engine.speculative_config.model
    draft = load_model(name, engine.dtype, place=jax.device_put if tp is None else (
        lambda params: jax.device_put(params, tp.replicated)))
    if draft.config.vocab_size != config.vocab_size:
        raise ValueError(f"speculative_config model {name!r} has a vocabulary of {draft.config.vocab_size} tokens and "
                         f"the model one of {config.vocab_size}: a draft model must share the model's vocabulary")
    return draft


def _num_pages(engine: EngineConfig, config, param_bytes: int, kv_heads: int, in_use: int, draft=None) -> int:
    """num_pages, or what fits in memory_fraction of one device less in_use and param_bytes (the same before and after
    placing: every start finds its executables' keys); kv_heads: one device's; a draft's KV shares the pages."""
    if engine.num_pages is not None:
        return engine.num_pages
    values = config.num_layers * kv_heads * config.head_dim  # a token's K (or V) values over the layers
    values += draft.num_layers * draft.num_kv_heads * draft.head_dim if draft else 0
    page_bytes = 2 * values * engine.page_size * jnp.dtype(engine.dtype).itemsize
    limit = _device_limit()
    # CPU: no allocator limit to read, keep the pool modest
    budget = limit * engine.memory_fraction - in_use - param_bytes if limit is not None else 2 << 30
    num_pages = min_over_processes(int(max(0, min(engine.max_num_seqs * engine.pages_per_seq, budget // page_bytes))))
    if num_pages < engine.pages_per_seq:
        raise ValueError(
            f"the KV pool fits only {num_pages} pages of {engine.page_size} tokens, and one sequence of "
            f"max_model_len={engine.max_model_len} needs {engine.pages_per_seq}: {_gib(in_use)} were in use on the "
            f"device before this LLM, its weights take {_gib(param_bytes)}, the pool gets memory_fraction="
            f"{engine.memory_fraction} of {_gib(limit or 0)} less those. Free device memory (close other LLMs: "
            "LLM.close()), raise memory_fraction, lower max_model_len, or set num_pages")
    return num_pages


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
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(*s, sharding=device), param_shapes(config, dtype),
                        is_leaf=lambda x: isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], np.dtype))


def _bytes(params) -> int:
    """The bytes params (arrays or jax.ShapeDtypeStructs) take on the first local device."""
    device = jax.local_devices()[0]

    def on_device(x):
        if isinstance(x, jax.Array):
            return sum(shard.data.nbytes for shard in x.addressable_shards if shard.device == device)
        return int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize

    return sum(on_device(x) for x in jax.tree.leaves(params))
