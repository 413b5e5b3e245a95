"""Compiling a runner's programs ahead: loaded from the executable cache, else lowered here (Python, under the GIL) and
compiled on a thread pool, with shares lowered in worker processes on a GPU (docs/perf_notes.md, "Compile workers")."""
import concurrent.futures
import dataclasses
import os
import time

import jax
from tqdm import tqdm

from nanojax import compile_workers, executable_cache
from nanojax.runner import ModelRunner, Program


def compile_all(runner, progress: bool = True, threads: int | None = None,
                workers: "int | list[compile_workers.Running] | None" = None) -> None:
    """Compiles or loads every program of `runner` now, timed in runner.compile_seconds and worker_seconds. workers:
    how many to spawn (None: compile_workers.WORKERS on a GPU, else none), or those spawned already (`hand_out`)."""
    start = time.perf_counter()
    spawned, running = (workers if isinstance(workers, list) else []), []
    try:
        todo = runner.missing(runner.programs())
        keys = program_keys(runner, todo)
        # Workers handed programs under keys other than this runner's (a runner of another config: LLM's hand-out
        # from config.json as written, where transformers' defaults differ) are stopped, and as many spawned anew.
        stale = [w for w in spawned if w.job is not None and any(keys.get(p) != key for p, key in w.job.programs)]
        for worker in stale:
            spawned.remove(worker)
            compile_workers.stop(worker)
        busy, idle = [w for w in spawned if w.job is not None], [w for w in spawned if w.job is None]
        if spawned or stale:
            workers = len(idle) + len(stale)
        elif workers is None:
            on_gpu = jax.default_backend() == "gpu"
            workers = compile_workers.WORKERS if on_gpu and runner.executable_dir and not runner.sharded else 0
        if (workers or spawned) and not runner.executable_dir:
            raise ValueError("compile workers store programs in the executable cache: executable_dir is None")
        if (workers or spawned) and runner.sharded:  # a worker builds the runner again from the params' shapes
            raise ValueError("compile workers build unsharded runners: not for a tensor-parallel one")
        in_flight = {p for w in busy for p, _ in w.job.programs}
        with tqdm(total=len(todo), desc=f"compiling {len(todo)} programs", disable=not progress) as bar:
            _load(runner, [p for p in todo if p not in in_flight], keys, bar, cached=True)
            dealt = shares([p for p in runner.missing(todo) if p not in in_flight], workers + 1)
            running = busy + [compile_workers.send(idle.pop() if idle else compile_workers.spawn(),
                                                   _job(runner, share, keys)) for share in dealt[1:] if share]
            compile_workers.stop_all(idle)  # spawned ahead for programs that were in the cache after all
            lowering = compile_programs(runner, dealt[0], keys, threads, bar)
            runner.worker_seconds = [t for t in map(compile_workers.wait, running) if t is not None]
            _load(runner, runner.missing(todo), keys, bar, cached=False)  # the workers'
            # What a worker did not store (it failed, or could not start) is compiled here.
            lowering += compile_programs(runner, runner.missing(todo), keys, threads, bar)
        runner.compile_seconds = {"lowering": lowering, "total": time.perf_counter() - start}
    finally:  # after an error, or Ctrl-C, the workers stop too
        compile_workers.stop_all(running)
        compile_workers.stop_all(spawned)


def hand_out(runner, workers: list) -> None:
    """Sends each worker its share of every program, from a runner of the params' shapes while the engine converts
    the weights; `compile_all(runner, workers=workers)` then waits for them."""
    programs = runner.programs()
    keys = program_keys(runner, programs)
    for worker, share in zip(workers, shares(programs, len(workers))):
        if share:
            compile_workers.send(worker, _job(runner, share, keys))


def program_keys(runner, programs) -> dict:
    return {p: executable_cache.program_key(*runner.key_parts(p)) for p in programs}


def _job(runner, share, keys: dict) -> compile_workers.Job:
    """A worker traces with the params' shapes."""
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), runner.params)
    return compile_workers.Job(compile_share, runner.config, shapes,
                               {**runner.rebuild_kwargs, "executable_dir": runner.executable_dir},
                               tuple((p, keys[p]) for p in share),
                               {k: getattr(jax.config, k) for k in compile_workers.JAX_CONFIG})


def _load(runner, programs, keys: dict, bar, cached: bool) -> None:
    """Installs what the executable cache holds of `programs` (cached: stored by an earlier start, not a worker)."""
    with concurrent.futures.ThreadPoolExecutor(min(len(programs), os.cpu_count() or 1) or 1) as pool:
        found = list(pool.map(lambda p: executable_cache.load(runner.executable_dir, keys[p]), programs))
    for p, compiled in zip(programs, found):
        if compiled is not None:
            runner.install(p, compiled, cached=cached)
            bar.update(1)


def twin(p):
    """The program whose GEMMs a cascade decode shares (the plain decode of its rows), else None."""
    return dataclasses.replace(p, cascade=False) if isinstance(p, Program) and p.cascade else None


def shares(programs, n: int) -> list[list]:
    """`programs` dealt round-robin into n lists, a cascade decode right after its twin: where XLA tunes their GEMMs
    (FP8 weights), it then finds the twin's in the process's autotuning cache."""
    chains = {}
    for p in programs:
        shared = twin(p)
        chains.setdefault(shared if shared in programs else p, []).append(p)
    chains = list(chains.values())
    return [[p for chain in chains[i::n] for p in chain] for i in range(n)]


def compile_programs(runner, programs, keys: dict, threads: int | None = None, bar=None) -> float:
    """Lowers `programs` one by one, compiles, stores and installs them on a thread pool (a cascade decode after its
    twin, as `shares`); -> the seconds spent lowering."""
    lowering = 0.0
    threads = threads or min(len(programs), os.cpu_count() or 1) or 1

    def compile_after(shared, p, lowered):
        if shared is not None:  # its twin's, submitted earlier to this first-in first-out pool: running or done
            concurrent.futures.wait([shared])
        return executable_cache.compile_and_store(runner.executable_dir, keys[p], lowered,
                                                  runner.compiler_options(p))

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        of = {}
        for p in programs:
            t = time.perf_counter()
            lowered = runner.lower(p)
            lowering += time.perf_counter() - t
            of[p] = pool.submit(compile_after, of.get(twin(p)), p, lowered)
        futures = {f: p for p, f in of.items()}
        for f in concurrent.futures.as_completed(futures):
            runner.install(futures[f], f.result())
            if bar is not None:
                bar.update(1)
    return lowering


def compile_share(config, shapes, runner_kwargs: dict, keys: dict) -> float:
    """A worker's compile_workers.Job.work: a runner from the params' shapes compiles and stores its share."""
    return compile_programs(ModelRunner(config, params=shapes, **runner_kwargs), list(keys), keys)
