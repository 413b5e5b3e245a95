"""What the kernels share: the Pallas Triton API of jax 0.10.x and 0.11.x, their dots, GPU size and input check.
Triton compiler params select the Triton lowering: jax >= 0.11 would take Mosaic GPU, which lacks pointer gathers."""
import contextlib
import functools
import sys

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as plgpu

load, store = plgpu.load, plgpu.store


# jaxlib's Triton dialect where MLIR's bindings look on every wrap, instead of walking sys.path in vain
# (docs/perf_notes.md, "Where the compile goes").
with contextlib.suppress(ImportError):
    from jaxlib.triton import dialect
    sys.modules.setdefault("jaxlib.mlir.dialects.tt", dialect)


@functools.cache
def num_sms() -> int:
    """The GPU's SMs, which memory-bound grids fill; without one an H100's 132, so interpret mode traces its tilings."""
    return jax.devices()[0].core_count if jax.default_backend() == "gpu" else 132


def is_power_of_2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two up to cap that divides n."""
    return min(n & -n, cap)


def dot(a, b, *, trans_b=False):
    """a [M, K] @ b [K, N] (b [N, K] with trans_b) in f32; HIGHEST, as Triton takes DEFAULT and HIGH as tf32."""
    dims = (((1,), (1 if trans_b else 0,)), ((), ()))
    return lax.dot_general(a, b, dims, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def triton_params(num_warps: int, num_stages: int):
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def can_lower_for_cuda() -> bool:
    """Whether Triton kernels lower for 'cuda' without a GPU (jaxlib <= 0.10.2); anything unexpected means "no"."""
    try:
        from jax._src.lib import triton, version
        return version <= (0, 10, 2) or triton.has_compilation_handler("cuda")
    except (ImportError, AttributeError):
        return False


def check_vector(name, x, length, dtype=jnp.int32):
    if x is None or x.shape != (length,) or x.dtype != dtype:
        got = None if x is None else f"{x.dtype}{x.shape}"
        raise ValueError(f"{name} must be {jnp.dtype(dtype).name} [{length}], got {got}")


def check_pow2(config, names, minimum=1):
    if not all(is_power_of_2(getattr(config, name)) and getattr(config, name) >= minimum for name in names):
        raise ValueError(f"{', '.join(names)} must be powers of two >= {minimum}, got {config}")
