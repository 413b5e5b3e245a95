"""Several processes, one model: process 0 runs the engine and broadcasts each runner call to the others, since JAX's
multi-controller runtime needs every process to issue the same jitted calls in the same order."""
import atexit
import functools
import os
import pickle
import sys
import threading
import traceback

import jax
import numpy as np
from jax.experimental import multihost_utils

from nanojax.runner import ModelRunner

_HEAD = 4096  # bytes of the first broadcast of a call

ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID = ("NANOJAX_COORDINATOR", "NANOJAX_NUM_PROCESSES",
                                                     "NANOJAX_PROCESS_ID")


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> bool:
    """Joins this process to a multi-process job, before anything else uses JAX; -> whether it did (not when no
    argument is given, here or in the environment)."""
    coordinator = coordinator or os.environ.get(ENV_COORDINATOR) or None
    num_processes = _int_from("num_processes", num_processes, ENV_NUM_PROCESSES)
    process_id = _int_from("process_id", process_id, ENV_PROCESS_ID)
    given = (coordinator, num_processes, process_id)
    if all(v is None for v in given):
        return False
    if any(v is None for v in given):
        raise ValueError(f"coordinator, num_processes and process_id go together (or {ENV_COORDINATOR}, "
                         f"{ENV_NUM_PROCESSES}, {ENV_PROCESS_ID}); got {given}")
    host, _, port = coordinator.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"coordinator must be 'host:port', got {coordinator!r}")
    if num_processes < 1 or not 0 <= process_id < num_processes:
        raise ValueError(f"process_id must be in [0, num_processes), got process_id={process_id}, "
                         f"num_processes={num_processes}")
    # Cross-process collectives between CPU devices (tests, CPU clusters); GPUs use NCCL whatever this says.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes, process_id)
    return True


def _int_from(name: str, value: int | None, env: str) -> int | None:
    if value is not None or not os.environ.get(env):
        return value
    try:
        return int(os.environ[env])
    except ValueError:
        raise ValueError(f"{env} ({name}) must be an integer, got {os.environ[env]!r}") from None


def min_over_processes(value: int) -> int:
    """The smallest of every process's `value` (a quantity all processes must agree on, e.g. the KV pages)."""
    if jax.process_count() == 1:
        return value
    return int(np.min(multihost_utils.process_allgather(np.int32(value))))


def _broadcast_bytes(payload: bytes | None) -> bytes:
    """Process 0's payload on every process (the others pass None): a fixed block, mostly a whole step, then the rest
    padded to a power of two bytes, so that a handful of broadcast programs serve every call."""
    source = jax.process_index() == 0
    data = np.frombuffer(payload or b"", np.uint8)
    head = np.zeros(_HEAD, np.uint8)
    if source:
        head[:4] = np.frombuffer(np.uint32(len(data)).tobytes(), np.uint8)
        head[4:4 + len(data)] = data[:_HEAD - 4]
    head = multihost_utils.broadcast_one_to_all(head)
    length = int(head[:4].view(np.uint32)[0])
    rest = length - (_HEAD - 4)
    if rest <= 0:
        return head[4:4 + length].tobytes()
    tail = np.zeros(1 << (rest - 1).bit_length(), np.uint8)
    if source:
        tail[:rest] = data[_HEAD - 4:]
    return head[4:].tobytes() + multihost_utils.broadcast_one_to_all(tail)[:rest].tobytes()


def _broadcast_call(name: str):
    """A ModelRunner method that process 0 broadcasts to the other processes before running it."""
    method = getattr(ModelRunner, name)

    @functools.wraps(method)
    def lead(self, *args, **kwargs):
        if jax.process_index() != 0:
            raise RuntimeError(f"process {jax.process_index()} runs the steps process 0 sends: call follow()")
        with self._lock:
            if not self.stop.alive:
                raise RuntimeError("this runner has stopped (LLM.close): the other processes have left")
            _broadcast_bytes(pickle.dumps((name, args, kwargs)))
            return method(self, *args, **kwargs)

    return lead


class DistributedRunner(ModelRunner):
    """A ModelRunner over a mesh spanning processes (`tensor_parallel` required): process 0 drives it, others follow."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._lock = threading.Lock()  # a broadcast and its call, one at a time (engine loop, close, exit)
        # On process 0, stop() tells the other processes to stop following (their `follow` returns), once; also at
        # exit: registered after jax's exit hook, so it runs first. A no-op elsewhere.
        self.stop = _Stop(self._lock)
        atexit.register(self.stop)

    decode = _broadcast_call("decode")
    prefill = _broadcast_call("prefill")
    set_slot = _broadcast_call("set_slot")
    set_masks = _broadcast_call("set_masks")

    def follow(self) -> None:
        """On a process other than 0: runs each call process 0 broadcasts, until it sends stop."""
        if jax.process_index() == 0:
            raise RuntimeError("process 0 drives the engine; follow() is for the other processes")
        while payload := _broadcast_bytes(None):
            name, args, kwargs = pickle.loads(payload)
            try:
                getattr(ModelRunner, name)(self, *args, **kwargs)
            except Exception:  # noqa: BLE001 -- the same step failed on process 0; its engine goes on
                traceback.print_exc(file=sys.stderr)


class _Stop:
    """Sends stop (an empty payload) from process 0, once; apart from the runner, which atexit then does not keep."""

    def __init__(self, lock: threading.Lock):
        self.lock, self.alive = lock, True

    def __call__(self) -> None:
        with self.lock:
            if self.alive and jax.process_index() == 0:
                _broadcast_bytes(b"")
            self.alive = False

