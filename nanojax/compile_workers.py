"""Worker processes beside the engine's, each running one job: nanojax.compilation's compile of a share of the
programs on an empty executable cache (`Job.work`; see nanojax.compilation for why and how the programs are dealt).

A worker is spawned (`python -m nanojax.compile_workers`), or, on a build's first start, forked by `LLM` from its own
process before JAX starts a backend there (`fork_ahead`), so that it skips importing JAX and nanojax
(docs/perf_notes.md, "Compile workers"). It starts its backend, then waits for its job (`send`: a pickled `Job` on its
stdin), runs it and writes its times to its stdout (`wait` reads them). This module imports neither the runner nor
nanojax.compilation: the job names the function it runs, which unpickling finds.
"""
import json
import logging
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import jax
from jax._src import xla_bridge

_log = logging.getLogger(__name__)
# Workers on a GPU: more processes compile each kernel again, and eight did not end sooner than four
# (docs/perf_notes.md, "Compile workers").
WORKERS = 4


@dataclass(frozen=True)
class Job:
    """What one worker compiles: the runner's constructor arguments with params as ShapeDtypeStructs, and the
    programs with the keys to store them under; `work` compiles them (picklable: a module's function)."""
    work: Callable  # work(config, params, runner_kwargs, {program: key}) -> the seconds it spent lowering
    config: object
    params: object  # the params' pytree of jax.ShapeDtypeStruct
    runner_kwargs: dict
    programs: tuple  # ((program, executable-cache key), ...)
    jax_config: dict  # the engine's values of JAX_CONFIG, applied in the worker


# What a worker takes over from the engine's jax.config: its platform, what tracing depends on, and the persistent
# cache.
JAX_CONFIG = ("jax_platforms", "jax_enable_x64", "jax_default_matmul_precision", "jax_enable_compilation_cache",
              "jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")


class Forked:
    """A forked worker's process, with what this module uses of subprocess.Popen's."""

    def __init__(self, pid: int, stdin):
        self.pid, self.stdin, self.returncode = pid, stdin, None

    def wait(self) -> int:
        if self.returncode is None:
            self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            os.kill(self.pid, signal.SIGKILL)


@dataclass
class Running:
    """A started worker."""
    process: "subprocess.Popen | Forked"
    log: object  # the worker's stderr, a temporary file read if it fails
    out: object  # its stdout, a temporary file: at its end a line of its `life`'s wall-clock times
    spawned: float  # time.time() at its start
    job: Job | None = None  # None until `send`


def spawn() -> Running:
    """Starts a worker that imports JAX and nanojax and starts its backend (on this process's platforms), then waits
    for its job (`send`), or for its stdin to close, when it exits. Its imports find nanojax where this process found
    it; it allocates device memory only as it needs it (the engine holds most of the device)."""
    root = str(Path(__file__).resolve().parents[1])  # nanojax/, pallas_kernels/ and convert/ live here
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
           "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    if jax.config.jax_platforms:
        env["JAX_PLATFORMS"] = jax.config.jax_platforms
    log, out = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    process = subprocess.Popen([sys.executable, "-m", "nanojax.compile_workers"], stdin=subprocess.PIPE,
                               stdout=out, stderr=log, env=env)
    return Running(process, log, out, time.time())


def fork_ahead(n: int) -> list[Running]:
    """n workers forked from this process, each waiting (without a backend) for `start`; [] where forking is not
    safe: a JAX backend started here already (its CUDA state and threads do not survive a fork), other Python threads
    running (a lock one of them holds would stay held in the child), or no os.fork. They share this process's
    imports and jax.config; `stop` ends those not started."""
    if not hasattr(os, "fork") or xla_bridge.backends_are_initialized() or threading.active_count() > 1:
        return []
    pipes = [os.pipe() for _ in range(n)]
    files = [(tempfile.TemporaryFile(), tempfile.TemporaryFile()) for _ in range(n)]
    sys.stdout.flush()
    sys.stderr.flush()
    pids = []
    for i, (read, _) in enumerate(pipes):
        try:
            with warnings.catch_warnings():  # Python 3.12 warns of native threads: numpy's BLAS pool, which
                warnings.simplefilter("ignore", DeprecationWarning)  # stops and restarts itself around a fork
                pid = os.fork()
        except OSError:  # no memory or process left for one: none is kept (the engine spawns them if it needs them)
            break
        if pid == 0:
            _forked_life(read, *files[i])
        pids.append(pid)
    spawned = time.time()
    for read, _ in pipes:
        os.close(read)
    for (_, write), (log, out) in zip(pipes[len(pids):], files[len(pids):]):
        os.close(write)
        log.close()
        out.close()
    workers = [Running(Forked(pid, os.fdopen(write, "wb")), log, out, spawned)
               for pid, (_, write), (log, out) in zip(pids, pipes, files)]
    if len(workers) < n:
        stop_all(workers)
    return workers


def start(forked: list[Running]) -> list[Running]:
    """Lets forked workers start their backends (then they wait for their jobs, `send`); returns them."""
    for worker in forked:
        try:
            worker.process.stdin.write(b"g")
            worker.process.stdin.flush()
        except OSError:  # it died: wait() reports it
            pass
    return forked


def _forked_life(job_fd: int, log, out) -> None:
    """A forked worker: waits for `start`, then lives as a spawned one (`life`); never returns. Its output goes to
    its files, not to the engine's streams."""
    code = 1
    try:
        for fd in (1, 2):  # a library's prints and XLA's messages
            os.dup2(log.fileno(), fd)
        # Every other descriptor inherited closed, as a spawned worker has them: the other workers' pipes (each sees
        # the end of its job only when the engine closes its end) and whatever the engine's process holds open (a
        # server's connection must end with the engine, not with its workers).
        low = 3
        for fd in sorted({job_fd, log.fileno(), out.fileno()}):
            os.closerange(low, fd)
            low = fd + 1
        os.closerange(low, os.sysconf("SC_OPEN_MAX"))
        sys.stdout, sys.stderr = open(1, "w", closefd=False), open(2, "w", closefd=False)
        with os.fdopen(job_fd, "rb") as jobs:
            if jobs.read(1) == b"g":  # else stopped before start: nothing to do
                os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # read when the backend starts
                life(jobs, out)
        code = 0
    except BaseException:  # noqa: BLE001 - reported through the exit status and the log
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # not the engine's exit handlers


def send(worker: Running, job: Job) -> Running:
    """Hands a worker (spawned, or forked and started) its job."""
    worker.job = job
    try:
        worker.process.stdin.write(pickle.dumps(job, protocol=pickle.HIGHEST_PROTOCOL))
        worker.process.stdin.close()
    except OSError:  # it died at once: wait() reports it
        pass
    return worker


def wait(running: Running) -> dict | None:
    """Waits for the worker; if it failed, logs a warning with its stderr's tail and returns None. Else returns where
    its time went: seconds from its spawn to its backend being ready, its job, its end ("ready", "job", "done"), and
    the seconds it spent lowering ("lowering")."""
    code = running.process.wait()
    running.out.seek(0)
    lines = running.out.read().decode(errors="replace").splitlines()
    running.out.close()
    if code != 0:
        running.log.seek(0)
        tail = running.log.read()[-2000:].decode(errors="replace")
        _log.warning("a compile worker exited with %s; what it did not store of its %d programs compiles here:\n%s",
                     code, len(running.job.programs), tail)
    running.log.close()
    return _times(lines, running.spawned) if code == 0 else None


def _times(lines: list[str], spawned: float) -> dict | None:
    """A worker's stdout lines -> its times from `spawned`, from its last line (a library may have written to stdout
    before it); None if that line holds none."""
    try:
        times = json.loads(lines[-1])
        return {**{k: times[k] - spawned for k in ("ready", "job", "done")}, "lowering": times["lowering"]}
    except (ValueError, IndexError, KeyError):
        return None


def stop(running: Running) -> None:
    """Ends the worker (the engine's compile failed or was interrupted, or it has no job for it)."""
    running.process.kill()
    running.process.wait()
    running.out.close()
    running.log.close()


def stop_all(workers: list[Running]) -> None:
    """Stops and removes every worker left in `workers`."""
    while workers:
        stop(workers.pop())


def make_job(work, config, params, runner_kwargs: dict, programs) -> Job:
    """A worker's job: params as the same pytree of jax.ShapeDtypeStruct (what a worker traces with)."""
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    return Job(work, config, shapes, runner_kwargs, tuple(programs), {k: getattr(jax.config, k) for k in JAX_CONFIG})


def run(job: Job) -> float:
    """A worker's work: the engine's jax.config, then the job's programs compiled and stored under their keys.
    Returns the seconds spent lowering."""
    for name, value in job.jax_config.items():
        jax.config.update(name, value)
    return job.work(job.config, job.params, job.runner_kwargs, dict(job.programs))


def life(jobs, out) -> None:
    """A worker's life: its backend, then its job if one comes on `jobs` (a binary file); its times to `out` (a
    binary file, `wait` reads them). The runner's imports come before the job: nanojax/__init__ imports the engine,
    which `python -m` runs before this module, and a forked worker has them from the engine's process."""
    jax.devices()
    times = {"ready": time.time()}
    job = jobs.read()
    if job:  # else the engine had nothing for it
        times["job"] = time.time()
        times["lowering"] = run(pickle.loads(job))
        times["done"] = time.time()
        out.write(f"{json.dumps(times)}\n".encode())
        out.flush()


if __name__ == "__main__":
    life(sys.stdin.buffer, sys.stdout.buffer)
