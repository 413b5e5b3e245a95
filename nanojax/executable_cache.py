"""Compiled programs kept on disk as serialized executables, keyed before tracing, so that a warm start neither traces
nor lowers them (docs/perf_notes.md, "Keeping compiled programs"). Files are unpickled: keep the folder private."""
import functools
import hashlib
import logging
import os
import pickle
import platform
import re
from collections.abc import Callable
from pathlib import Path

import jax
import jaxlib
import numpy as np
from jax.experimental import serialize_executable

import pallas_kernels
from convert.cache import cache_dir, write_whole

_log = logging.getLogger(__name__)
# Bumped when the file layout below changes: older files then sit under another environment hash.
FORMAT = 1
SUFFIX = ".jaxexe"


def default_directory() -> Path:
    return cache_dir() / "executables"


def use_compilation_cache() -> None:
    """JAX's persistent compilation cache (executables, Triton kernels, autotuning) in the nanojax cache's `xla/`
    unless JAX_COMPILATION_CACHE_DIR is set. Only on a GPU: docs/perf_notes.md, "Keeping compiled programs"."""
    if jax.config.jax_compilation_cache_dir is None:
        jax.config.update("jax_compilation_cache_dir", str(cache_dir() / "xla"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # the few programs there are, all kept


def signature(args) -> str:
    """What jit specializes a pytree's call on, read without tracing, as text."""
    leaves, tree = jax.tree.flatten(args)
    shapes = [(np.shape(x), str(getattr(x, "dtype", type(x).__name__)), bool(getattr(x, "weak_type", False)),
               _placement(x)) for x in leaves]  # a Python scalar: its type (jit traces it weakly typed)
    return f"{tree}|{shapes}"


def _placement(x) -> tuple | None:
    """A leaf's sharding and its devices' ids in mesh order: a Mesh's repr names only its axes, and an executable
    loads onto the devices it was compiled for."""
    sharding = getattr(x, "sharding", None)
    if sharding is None:
        return None
    mesh = getattr(sharding, "mesh", None)
    devices = mesh.devices.flat if mesh is not None else sorted(sharding.device_set, key=lambda d: d.id)
    return sharding, tuple(d.id for d in devices)


def program_key(*parts) -> str:
    """Hex key of a program from parts with a stable repr; ValueError for one naming a memory address."""
    text = repr(parts)
    if re.search(r" at 0x[0-9a-fA-F]+", text):
        raise ValueError(f"a key part has no stable repr (it names a memory address): {text[:300]}")
    return hashlib.blake2b(text.encode(), digest_size=20).hexdigest()


@functools.cache
def environment() -> str:
    """Hex hash of what makes a stored executable stale: versions, device, flags, nanojax's source."""
    source = hashlib.blake2b(digest_size=20)
    for root in (Path(__file__).parent, Path(pallas_kernels.__file__).parent):
        for path in sorted(root.rglob("*.py")):
            source.update(f"{root.name}/{path.relative_to(root)}\0".encode())
            source.update(path.read_bytes())
    device = jax.devices()[0]
    parts = [FORMAT, jax.__version__, jaxlib.__version__, device.platform, device.client.platform_version,
             device.device_kind, jax.device_count(), os.environ.get("XLA_FLAGS", ""),
             jax.config.jax_enable_x64, jax.config.jax_default_matmul_precision, source.hexdigest()]
    if device.platform == "cpu":  # XLA:CPU code targets this host's instruction set; a shared home may move hosts
        parts.append(_cpu_flags())
    return hashlib.blake2b(repr(parts).encode(), digest_size=10).hexdigest()


def _cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return f"{platform.machine()} {platform.processor()}"
    return next((line for line in text.splitlines() if line.startswith("flags")), "")


def path_of(directory: Path, key: str) -> Path:
    return Path(directory) / environment() / f"{key}{SUFFIX}"


def holds_none(directory: Path) -> bool:
    """Whether `directory` holds no executable of this environment (a new cache or build)."""
    return not any((Path(directory) / environment()).glob(f"*{SUFFIX}"))


def load(directory: Path | None, key: str) -> jax.stages.Compiled | None:
    if directory is None:
        return None
    path = path_of(directory, key)
    try:
        device_ids, blob, in_tree, out_tree = pickle.loads(path.read_bytes())
        by_id = {d.id: d for d in jax.devices()}
        # The executable's own devices, in its order: any other list fails XLA's checks (a crash, not an error).
        devices = [by_id[i] for i in device_ids]
        return serialize_executable.deserialize_and_load(blob, in_tree, out_tree, execution_devices=devices)
    except FileNotFoundError:
        return None
    except Exception as e:  # noqa: BLE001 - any unreadable file is a miss: the caller compiles and overwrites it
        _log.debug("executable cache: %s unreadable (%s: %s), compiling again", path, type(e).__name__, e)
        return None


def store(directory: Path | None, key: str, compiled: jax.stages.Compiled) -> bool:
    """-> whether `compiled` was written; a program that cannot be serialized or written is not an error."""
    if directory is None:
        return False
    try:
        blob, in_tree, out_tree = serialize_executable.serialize(compiled)
        device_ids = [d.id for d in compiled._executable._unloaded_executable.device_list]
        data = pickle.dumps((device_ids, blob, in_tree, out_tree), protocol=pickle.HIGHEST_PROTOCOL)
        write_whole(path_of(directory, key), data)  # what a killed writer left is removed by the next store
    except (OSError, ValueError, NotImplementedError, AttributeError, pickle.PicklingError, TypeError) as e:
        _log.debug("executable cache: %s not stored (%s: %s)", key, type(e).__name__, e)
        return False
    return True


def compile_and_store(directory: Path | None, key: str, lowered: jax.stages.Lowered,
                      compiler_options: dict | None = None) -> jax.stages.Compiled:
    """Compiles `lowered` and stores it; thread-safe. On the CPU only while JAX's persistent compilation cache is off:
    an XLA:CPU executable that came from that cache serializes incompletely, and which did cannot be told
    (docs/perf_notes.md, "Keeping compiled programs")."""
    compiled = lowered.compile(compiler_options=compiler_options)
    persistent_cache_on = jax.config.jax_enable_compilation_cache and jax.config.jax_compilation_cache_dir
    if jax.default_backend() == "gpu" or not persistent_cache_on:
        store(directory, key, compiled)
    return compiled


def load_or_compile(key_parts: tuple, lower: Callable[[], jax.stages.Lowered],
                    directory: Path | None) -> tuple[jax.stages.Compiled, bool]:
    """-> (the program, whether it came from `directory`); directory None compiles every time."""
    key = program_key(*key_parts)
    compiled = load(directory, key)
    if compiled is not None:
        return compiled, True
    return compile_and_store(directory, key, lower()), False
