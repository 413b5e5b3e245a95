"""Each row through its own expert's weights, out[m] = x[m] @ w[ids[m]]: a mixture-of-experts decode's choices, reading
only the chosen experts. XLA lowers the gathered one-row products to reductions that stream the weights at a fraction
of the bandwidth (docs/perf_notes.md, "Mixture of experts")."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._compat import check_vector, is_power_of_2, load, store, triton_params


@dataclasses.dataclass(frozen=True)
class ExpertMatmulConfig:
    """A program computes block_n columns of one row, streaming K in block_k slices."""
    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        if not (is_power_of_2(self.block_n) and is_power_of_2(self.block_k)):
            raise ValueError(f"block sizes must be powers of two, got {self}")


def expert_matmul_reference(x, w, ids):
    """x: [M, K]; w: [E, K, N]; ids: [M] int32 in [0, E) -> [M, N] f32."""
    return jnp.einsum("mk,mkn->mn", x, w[ids].astype(x.dtype), precision=lax.Precision.HIGHEST,
                      preferred_element_type=jnp.float32)


def _kernel(ids_ref, x_ref, w_ref, o_ref, *, block_k: int):
    # ids_ref: [] the row's expert; x_ref: [K] the row; w_ref: [E, K, block_n] every expert's column block;
    # o_ref: [block_n] f32
    expert = load(ids_ref)

    def body(i, acc):
        ks = pl.ds(i * block_k, block_k)
        xk = load(x_ref.at[ks]).astype(jnp.float32)
        wk = load(w_ref.at[expert, ks, :]).astype(jnp.float32)
        return acc + jnp.sum(xk[:, None] * wk, axis=0)

    acc = lax.fori_loop(0, x_ref.shape[0] // block_k, body, jnp.zeros(o_ref.shape, jnp.float32))
    store(o_ref, acc)


def _pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two up to cap that divides n."""
    return min(n & -n, cap)


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def expert_matmul(x, w, ids, *, config: ExpertMatmulConfig | None = None, interpret: bool = False):
    """expert_matmul_reference's contract, one program per (row, block of columns)."""
    m, k = x.shape
    num_experts, k_w, n = w.shape
    config = config or ExpertMatmulConfig(block_n=_pow2_divisor(n, 64), block_k=_pow2_divisor(k, 128))
    if k_w != k or k % config.block_k or n % config.block_n:
        raise ValueError(f"x [M, {k}] and w [E, {k_w}, {n}] must share K, divisible by block_k and block_n of {config}")
    check_vector("ids", ids, m)
    return pl.pallas_call(
        functools.partial(_kernel, block_k=config.block_k),
        grid=(m, n // config.block_n),
        in_specs=[pl.BlockSpec((None,), lambda r, c: (r,)), pl.BlockSpec((None, k), lambda r, c: (r, 0)),
                  pl.BlockSpec((num_experts, k, config.block_n), lambda r, c: (0, 0, c))],
        out_specs=pl.BlockSpec((None, config.block_n), lambda r, c: (r, c)),
        out_shape=jax.ShapeDtypeStruct((m, n), jnp.float32),
        compiler_params=triton_params(config.num_warps, config.num_stages),
        interpret=interpret,
    )(ids, x, w)
