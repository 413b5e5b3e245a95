"""Worker processes that compile shares of the programs into the executable cache (nanojax.compilation), spawned, or
forked before JAX starts a backend here so that they skip importing it (docs/perf_notes.md, "Compile workers")."""
import contextlib
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
WORKERS = 4  # on a GPU; more processes compile each kernel again (docs/perf_notes.md, "Compile workers")


@dataclass(frozen=True)
class Job:
    """What one worker compiles; `work` does it, so this module imports neither the runner nor nanojax.compilation."""
    work: Callable  # work(config, params, runner_kwargs, {program: key}) -> the seconds it spent lowering
    config: object
    params: object  # the params' pytree of jax.ShapeDtypeStruct
    runner_kwargs: dict
    programs: tuple  # ((program, executable-cache key), ...)
    jax_config: dict  # the engine's values of JAX_CONFIG, applied in the worker


# The engine's jax.config a worker takes over: its platform, what tracing depends on, and the persistent cache.
JAX_CONFIG = ("jax_platforms", "jax_enable_x64", "jax_default_matmul_precision", "jax_enable_compilation_cache",
              "jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")


class Forked:
    """A forked worker's process, with the part of subprocess.Popen's interface used here."""

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
    process: "subprocess.Popen | Forked"
    log: object  # the worker's stderr, a temporary file read if it fails
    out: object  # its stdout, a temporary file: at its end a line of its `life`'s wall-clock times
    spawned: float  # time.time() at its start
    job: Job | None = None  # None until `send`


def spawn() -> Running:
    """A worker that allocates device memory only as it needs it: the engine holds most of the device."""
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
    """n workers forked from this process, each waiting without a backend for `start`; [] where forking is not safe:
    a backend started here (CUDA state does not survive a fork), or other threads (their locks would stay held)."""
    if not hasattr(os, "fork") or xla_bridge.backends_are_initialized() or threading.active_count() > 1:
        return []
    sys.stdout.flush()
    sys.stderr.flush()
    workers = []
    for _ in range(n):
        (read, write), log, out = os.pipe(), tempfile.TemporaryFile(), tempfile.TemporaryFile()
        try:
            with warnings.catch_warnings():  # Python 3.12 warns of native threads: numpy's BLAS pool, which
                warnings.simplefilter("ignore", DeprecationWarning)  # stops and restarts itself around a fork
                pid = os.fork()
        except OSError:  # no memory or process left for one: none is kept (the engine spawns them if it needs them)
            os.close(read)
            os.close(write)
            log.close()
            out.close()
            stop_all(workers)
            return []
        if pid == 0:
            _forked_life(read, log, out)
        os.close(read)
        workers.append(Running(Forked(pid, os.fdopen(write, "wb")), log, out, time.time()))
    return workers


def start(forked: list[Running]) -> None:
    """Lets forked workers start their backends."""
    for worker in forked:
        with contextlib.suppress(OSError):  # it died: wait() reports it
            worker.process.stdin.write(b"g")
            worker.process.stdin.flush()


def _forked_life(job_fd: int, log, out) -> None:
    """A forked worker: waits for `start`, then lives as a spawned one; never returns."""
    code = 1
    try:
        for fd in (1, 2):  # a library's prints and XLA's messages
            os.dup2(log.fileno(), fd)
        # Every other inherited descriptor closed, as a spawned worker has them: another worker's pipe held open
        # would hide its end, and a server's connection must end with the engine, not with its workers.
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
    worker.job = job
    with contextlib.suppress(OSError):  # it died at once: wait() reports it
        worker.process.stdin.write(pickle.dumps(job, protocol=pickle.HIGHEST_PROTOCOL))
        worker.process.stdin.close()
    return worker


def wait(running: Running) -> dict | None:
    """Seconds from the worker's spawn to "ready", "job" and "done", and its "lowering"; None if it failed (logged
    with its stderr's tail) or its last stdout line (a library may print before it) holds no times."""
    code = running.process.wait()
    with running.out, running.log:
        running.out.seek(0)
        lines = running.out.read().decode(errors="replace").splitlines()
        if code != 0:
            running.log.seek(0)
            _log.warning("a compile worker exited with %s; what it did not store of its %d programs compiles here:\n%s",
                         code, len(running.job.programs), running.log.read()[-2000:].decode(errors="replace"))
            return None
    try:
        times = json.loads(lines[-1])
        return {**{k: times[k] - running.spawned for k in ("ready", "job", "done")}, "lowering": times["lowering"]}
    except (ValueError, IndexError, KeyError):
        return None


def stop(running: Running) -> None:
    running.process.kill()
    running.process.wait()
    running.out.close()
    running.log.close()


def stop_all(workers: list[Running]) -> None:
    while workers:
        stop(workers.pop())


def life(jobs, out) -> None:
    """A worker's life: its backend, then its job if one comes on `jobs`, its times to `out` (binary files). The
    runner is imported already: by nanojax/__init__ under `python -m`, or in the engine's process before a fork."""
    jax.devices()
    times = {"ready": time.time()}
    data = jobs.read()
    if data:  # else the engine had nothing for it
        times["job"] = time.time()
        job = pickle.loads(data)
        for name, value in job.jax_config.items():
            jax.config.update(name, value)
        times["lowering"] = job.work(job.config, job.params, job.runner_kwargs, dict(job.programs))
        times["done"] = time.time()
        out.write(f"{json.dumps(times)}\n".encode())
        out.flush()


if __name__ == "__main__":
    life(sys.stdin.buffer, sys.stdout.buffer)
