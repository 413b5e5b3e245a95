"""Where nanojax keeps files between runs: `NANOJAX_CACHE` (default ~/.cache/nanojax) holds the converted default
model, the persistent compilation cache (`xla/`), the compiled programs (`executables/`) and small answers of
transformers kept so that a start need not import it with torch (`answers/`)."""
import hashlib
import json
import os
import tempfile
import uuid
from importlib.metadata import version
from pathlib import Path
from typing import Any, Callable


def cache_dir() -> Path:
    return Path(os.environ.get("NANOJAX_CACHE", "~/.cache/nanojax")).expanduser()


def use_compilation_cache() -> None:
    """Keeps compiled programs on disk, so that a second start loads them instead of compiling: XLA executables
    with their Triton kernels (compiled into the executable) and XLA's autotuning results. A user's own
    JAX_COMPILATION_CACHE_DIR wins. XLA's kernel cache file is left off (`jax_persistent_cache_enable_xla_caches`
    "all"): shared by processes that compile different programs, it made later runs fail on the H100 with
    CUDA_ERROR_ILLEGAL_INSTRUCTION (docs/perf_notes.md, "Start-up")."""
    import jax

    if jax.config.jax_compilation_cache_dir is None:
        jax.config.update("jax_compilation_cache_dir", str(cache_dir() / "xla"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # the few programs there are, all kept
    _write_cache_entries_whole()


def _write_cache_entries_whole() -> None:
    """JAX's file cache writes an entry in place (`LRUCache.put`), so a process reading it meanwhile (a second
    nanojax process, another test worker) or one after a writer was killed half-way reads a truncated executable,
    and deserializing one aborts the process (a CI run on the CPU, two pytest workers sharing the cache). Entries
    are written to a temporary file and renamed into place, as nanojax's own executable files are. With eviction on
    (`jax_compilation_cache_max_size`) or a cache that is not a local folder, JAX's own write stays."""
    from jax._src import lru_cache

    put = lru_cache.LRUCache.put
    if getattr(put, "whole", False):
        return

    def put_whole(cache, key: str, value: bytes) -> None:
        if cache.eviction_enabled or not key or not lru_cache._is_local_filesystem(str(cache.path)):
            return put(cache, key, value)
        path = cache.path / f"{key}{lru_cache._CACHE_SUFFIX}"
        if path.exists():
            return
        tmp = cache.path / f".{key}.{uuid.uuid4().hex}.tmp"
        tmp.write_bytes(value)
        os.replace(str(tmp), str(path))

    put_whole.whole = True
    lru_cache.LRUCache.put = put_whole


def remembered(kind: str, key: bytes, compute: Callable[[], Any]) -> Any:
    """compute()'s JSON value, kept under `answers/` per kind, key and installed transformers version.

    For answers that cost an import of transformers' auto classes (which import torch: 3-6 s of a start) but depend
    only on file contents and that version. An unwritable cache is no error: the answer is computed each time."""
    digest = hashlib.sha256(key + version("transformers").encode()).hexdigest()
    path = cache_dir() / "answers" / kind / f"{digest}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    value = json.loads(json.dumps(compute()))  # as a later start reads it back (tuples become lists)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            json.dump(value, f)
        os.replace(f.name, path)  # whole or absent: a reader never sees half a file
    except OSError:
        pass
    return value
