"""Where nanojax keeps files between runs: `NANOJAX_CACHE` (default ~/.cache/nanojax) holds the converted default
model, the persistent compilation cache (`xla/`), the compiled programs (`executables/`) and small answers of
transformers kept so that a start need not import it with torch (`answers/`)."""
import hashlib
import json
import os
import tempfile
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
    CUDA_ERROR_ILLEGAL_INSTRUCTION (docs/perf_notes.md, "Start-up"). `LLM` turns it on only on a GPU: an XLA:CPU
    executable that one process stored can abort another that loads it (jaxlib 0.10.2: CI workers sharing the
    cache lost a test process that way)."""
    import jax

    if jax.config.jax_compilation_cache_dir is None:
        jax.config.update("jax_compilation_cache_dir", str(cache_dir() / "xla"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # the few programs there are, all kept


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
