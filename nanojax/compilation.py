"""Compiling a runner's programs ahead: their executable-cache keys, loading and storing them
(nanojax.executable_cache), a thread pool, and shares of them compiled in worker processes (nanojax.compile_workers).

It sees the runner (nanojax.runner.ModelRunner) through a small interface: `programs()`, `key_parts(p)` (what p's
executable depends on, read without tracing), `lower(p)`, `compiler_options(p)`, `twin(p)`, `missing(programs)` and
`install(p, executable)`, with `executable_dir`, `sharded` and `rebuild_kwargs`. The runner imports nothing from here:
a program not compiled ahead compiles on first use there (CPU tests).

`compile_all` loads what the executable cache holds, then lowers the other programs one by one and compiles them on a
thread pool (XLA compiles outside the GIL). Lowering is Python under the GIL, so on a GPU the programs are dealt into
shares for a few worker processes (docs/perf_notes.md, "Compile workers"). A worker rebuilds the runner from the
params' ShapeDtypeStructs (`compile_share`), lowers and compiles its share and stores each program in the executable
cache under the key the engine computed; the engine loads them, and compiles what a worker did not store: a worker
costs time, never correctness. For an HF folder `LLM` hands out every program as soon as config.json is read
(`hand_out`) and converts the weights meanwhile; `compile_all` then waits for the workers, or stops those handed
programs of a config other than transformers' normalized one and compiles anew. The engine lowers nothing itself
beside busy workers (the same subject).
"""
import concurrent.futures
import os
import time

import jax
from tqdm import tqdm

from nanojax import compile_workers, executable_cache
from nanojax.runner import ModelRunner


def compile_all(runner, progress: bool = True, threads: int | None = None,
                workers: "int | list[compile_workers.Running] | None" = None) -> None:
    """Compiles every program of `runner` now. Those the executable cache holds (`runner.executable_dir`) are loaded
    without tracing; the others are traced and lowered one by one, compiled on a thread pool and stored. workers:
    processes that each take a share of them meanwhile (they need the executable cache and an unsharded runner), or a
    list of workers already spawned: those handed this runner's programs (`hand_out`) are waited for, those handed
    another's (keys it does not compute) are stopped and spawned anew, the others take shares of the rest, or are
    stopped; None: compile_workers.WORKERS where they can run on a GPU, else none. Seconds spent lowering here and in
    all go to `runner.compile_seconds`, each worker's times to `runner.worker_seconds`."""
    spawned = workers if isinstance(workers, list) else []
    try:
        _compile_all(runner, progress, threads, None if spawned else workers, spawned)
    finally:
        compile_workers.stop_all(spawned)


def hand_out(runner, workers: list) -> None:
    """Deals every program over the workers (`shares`) and sends each its share: a runner built from the params'
    shapes does it while the engine reads and places the weights; the runner built on them then waits for the
    workers and loads the programs in `compile_all(runner, workers=workers)`."""
    programs = runner.programs()
    keys = program_keys(runner, programs)
    for worker, share in zip(workers, shares(runner, programs, len(workers))):
        if share:
            compile_workers.send(worker, _job(runner, share, keys))


def _compile_all(runner, progress: bool, threads: int | None, workers: int | None, spawned: list) -> None:
    start = time.perf_counter()
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
        dealt = shares(runner, [p for p in runner.missing(todo) if p not in in_flight], workers + 1)
        running = busy + _send(runner, dealt[1:], keys, idle)
        try:
            lowering = compile_programs(runner, dealt[0], keys, threads, bar)
        except BaseException:  # an error here, or Ctrl-C: the workers stop too
            compile_workers.stop_all(running)
            raise
        runner.worker_seconds = [t for t in map(compile_workers.wait, running) if t is not None]
        _load(runner, runner.missing(todo), keys, bar, cached=False)  # the workers'
        # What a worker did not store (it failed, or could not start) is compiled here.
        lowering += compile_programs(runner, runner.missing(todo), keys, threads, bar)
    runner.compile_seconds = {"lowering": lowering, "total": time.perf_counter() - start}


def program_keys(runner, programs) -> dict:
    """{program: its executable-cache key} (executable_cache.program_key of the runner's `key_parts`)."""
    return {p: executable_cache.program_key(*runner.key_parts(p)) for p in programs}


def _send(runner, dealt, keys: dict, idle: list) -> list:
    """Each non-empty share sent to a worker of `idle` (spawned when none is left); the others in `idle` are
    stopped. Returns the workers sent a share."""
    running = [compile_workers.send(idle.pop() if idle else compile_workers.spawn(), _job(runner, share, keys))
               for share in dealt if share]
    compile_workers.stop_all(idle)  # spawned ahead for programs that were in the cache after all
    return running


def _job(runner, share, keys: dict) -> compile_workers.Job:
    return compile_workers.make_job(compile_share, runner.config, runner.params,
                                    {**runner.rebuild_kwargs, "executable_dir": runner.executable_dir},
                                    [(p, keys[p]) for p in share])


def _load(runner, programs, keys: dict, bar, cached: bool) -> None:
    """Installs what the executable cache holds of `programs` in the runner (cached: stored by an earlier start, else
    by this start's workers)."""
    with concurrent.futures.ThreadPoolExecutor(min(len(programs), os.cpu_count() or 1) or 1) as pool:
        found = list(pool.map(lambda p: executable_cache.load(runner.executable_dir, keys[p]), programs))
    for p, compiled in zip(programs, found):
        if compiled is not None:
            runner.install(p, compiled, cached=cached)
            bar.update(1)


def shares(runner, programs, n: int) -> list[list]:
    """`programs` dealt round-robin into n lists, a cascade decode in its twin's, right after it (where XLA tunes
    their GEMMs, FP8 weights' decodes, it then finds the twin's in the process's autotuning cache instead of tuning
    them again)."""
    chains = {}
    for p in programs:
        twin = runner.twin(p)
        chains.setdefault(twin if twin in programs else p, []).append(p)
    chains = list(chains.values())
    return [[p for chain in chains[i::n] for p in chain] for i in range(n)]


def compile_programs(runner, programs, keys: dict, threads: int | None = None, bar=None) -> float:
    """Traces and lowers `programs` one by one and compiles them on a pool of `threads` (default: a thread per core),
    storing each under keys[p] in the executable cache and installing it in the runner; a cascade decode's compile
    waits for its twin's, when both are here (`shares`). Returns the seconds spent lowering."""
    lowering = 0.0
    threads = threads or min(len(programs), os.cpu_count() or 1) or 1

    def compile_after(twin, p, lowered):
        if twin is not None:  # submitted earlier to this first-in first-out pool: running or done
            concurrent.futures.wait([twin])
        return executable_cache.compile_and_store(runner.executable_dir, keys[p], lowered,
                                                  runner.compiler_options(p))

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        of = {}
        for p in programs:
            t = time.perf_counter()
            lowered = runner.lower(p)
            lowering += time.perf_counter() - t
            of[p] = pool.submit(compile_after, of.get(runner.twin(p)), p, lowered)
        futures = {f: p for p, f in of.items()}
        for f in concurrent.futures.as_completed(futures):
            runner.install(futures[f], f.result())
            if bar is not None:
                bar.update(1)
    return lowering


def compile_share(config, shapes, runner_kwargs: dict, keys: dict) -> float:
    """A worker's work (compile_workers.Job.work): the runner built from the params' shapes, each program of `keys`
    lowered, compiled and stored under its key. Returns the seconds spent lowering."""
    return compile_programs(ModelRunner(config, params=shapes, **runner_kwargs), list(keys), keys)
