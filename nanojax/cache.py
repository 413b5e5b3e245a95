"""Where nanojax keeps files between runs: `NANOJAX_CACHE` (default ~/.cache/nanojax) holds the converted default
model and the persistent compilation cache (`xla/`)."""
import os
from pathlib import Path


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
