"""The one place for jax-version differences in the Pallas Triton API (supported: jax 0.10.x and 0.11.x), for how
the kernels' dots lower, and for the GPU size the kernels' automatic tilings aim at.

Both versions export `CompilerParams`, `load` and `store` from `jax.experimental.pallas.triton`. Passing Triton
compiler params is what selects the Triton lowering: without them jax >= 0.11 lowers GPU kernels with Mosaic GPU,
which does not support the pointer-gather loads these kernels use.
"""
import functools
import sys

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as plgpu

load = plgpu.load
store = plgpu.store


def _name_the_triton_dialect_module() -> None:
    """MLIR's Python bindings import a dialect's module (under each of their search prefixes) whenever they wrap a
    value or an op of that dialect, until one import succeeds. jaxlib ships the Triton dialect's module as
    `jaxlib.triton.dialect`, a name they do not search, so every wrap in JAX's Triton lowering walked sys.path in
    vain (docs/perf_notes.md, "Where the compile goes"). Under the name they search, the first lookup succeeds and is
    remembered; the ops' classes were registered when the module was imported, so the lowering is unchanged."""
    try:
        from jaxlib.triton import dialect
    except ImportError:
        return
    sys.modules.setdefault("jaxlib.mlir.dialects.tt", dialect)


_name_the_triton_dialect_module()

# SMs of the GPU the tilings were tuned on.
H100_SMS = 132


@functools.cache
def num_sms() -> int:
    """Streaming multiprocessors of the GPU the kernels run on: the automatic tilings size memory-bound grids to
    about one program per SM, at trace time. Without a GPU (interpret mode on CPU) H100_SMS stands in, so that CPU
    runs trace the tilings that GPU gets."""
    if jax.default_backend() != "gpu":
        return H100_SMS
    return jax.devices()[0].core_count


def is_power_of_2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def dot(a, b, *, trans_b=False):
    """a [M, K] @ b [K, N] (b [N, K] with trans_b) accumulated in f32. HIGHEST keeps f32 inputs in IEEE f32 on GPU:
    the Triton lowering takes DEFAULT and HIGH as tf32."""
    dims = (((1,), (1 if trans_b else 0,)), ((), ()))
    return lax.dot_general(a, b, dims, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def triton_params(num_warps: int, num_stages: int):
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def can_lower_for_cuda() -> bool:
    """Whether Triton kernels can be lowered for 'cuda' here (e.g. on a CPU-only machine, to check the lowering):
    jaxlib <= 0.10.2 lowers them without a GPU; later versions need one (0.11.2 asks a GPU device for its compute
    capability; some 0.11 development versions compiled the module while lowering, through the CUDA plugin). Uses
    jaxlib internals, so anything unexpected means "no"."""
    try:
        from jax._src.lib import triton, version
        return version <= (0, 10, 2) or triton.has_compilation_handler("cuda")
    except (ImportError, AttributeError):
        return False
