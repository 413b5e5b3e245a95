"""JAX's persistent compilation cache, in the nanojax cache's `xla/` folder (convert/cache.py: the cache's layout)."""
import jax

from convert.cache import cache_dir


def use_compilation_cache() -> None:
    """Keeps compiled programs (XLA executables, their Triton kernels, autotuning results) on disk for the next start;
    a user's JAX_COMPILATION_CACHE_DIR wins. Only on a GPU: docs/perf_notes.md, "Keeping compiled programs"."""
    if jax.config.jax_compilation_cache_dir is None:
        jax.config.update("jax_compilation_cache_dir", str(cache_dir() / "xla"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # the few programs there are, all kept
