"""The XLA flags nanojax sets unless the user's XLA_FLAGS names them. XLA reads XLA_FLAGS once, when JAX starts a
backend, so `import nanojax` sets them (before any array exists, as a script's first imports do); a process whose
GPU backend started earlier keeps XLA's defaults. XLA's own behaviour back:
`XLA_FLAGS=--xla_gpu_experimental_cost_model_gemm_tiling_options=` (an empty map)."""
import importlib.metadata
import os

# XLA's GEMM autotuner compiles and profiles ~20 Triton tilings and 6-8 cuBLASLt algorithms for every GEMM fusion,
# most of an empty-cache start's compile work. Its cost model's 4 best tilings of the default list are enough: the
# 33 programs of Qwen3-0.6B in 332-343 CPU seconds instead of 423-541 (compile_all 46 s instead of 55-57 on an
# H100), the steps within two calls' spread of XLA's own (docs/perf_notes.md, "Start-up"). A GPU-only flag, but
# every backend parses XLA_FLAGS.
DEFAULTS = {"xla_gpu_experimental_cost_model_gemm_tiling_options": "top=4,top_from_default=1"}
# The jaxlib versions these flags were run with: XLA aborts the process on a flag it does not know.
TRIED_JAXLIB = ((0, 10, 2), (0, 11, 2))


def jaxlib_version() -> tuple[int, ...]:
    """(major, minor, patch) of the installed jaxlib; () where that cannot be read (then no flag is set)."""
    try:
        return tuple(int(part) for part in importlib.metadata.version("jaxlib").split(".")[:3])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return ()


def set_defaults(environ=os.environ, version: tuple[int, ...] | None = None) -> None:
    """Appends each of DEFAULTS to environ["XLA_FLAGS"] that it does not name, where jaxlib is a version they were
    tried with."""
    if (version or jaxlib_version()) not in TRIED_JAXLIB:
        return
    flags = environ.get("XLA_FLAGS", "")
    added = [f"--{name}={value}" for name, value in DEFAULTS.items() if f"--{name}=" not in flags]
    if added:
        environ["XLA_FLAGS"] = " ".join([flags, *added]).strip()
