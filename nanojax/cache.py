"""JAX's persistent compilation cache, in the nanojax cache's `xla/` folder (convert/cache.py: the cache's layout
and how files are written there)."""
import jax

from convert.cache import cache_dir


def use_compilation_cache() -> None:
    """Keeps compiled programs on disk, so that a second start loads them instead of compiling: XLA executables
    with their Triton kernels (compiled into the executable) and XLA's autotuning results. A user's own
    JAX_COMPILATION_CACHE_DIR wins. XLA's kernel cache file is left off (`jax_persistent_cache_enable_xla_caches`
    "all"): shared by processes that compile different programs, it made later runs fail with
    CUDA_ERROR_ILLEGAL_INSTRUCTION. `LLM` turns it on only on a GPU: an XLA:CPU executable that one process stored can
    abort another that loads it (jaxlib 0.10.2). Both: docs/perf_notes.md, "Keeping compiled programs"."""
    if jax.config.jax_compilation_cache_dir is None:
        jax.config.update("jax_compilation_cache_dir", str(cache_dir() / "xla"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # the few programs there are, all kept
