"""Each row through its own expert's weights, out[m] = x[m] @ w[ids[m]]: a mixture-of-experts decode's choices, reading
only the chosen experts. XLA lowers the gathered one-row products to reductions that stream the weights at a fraction
of the bandwidth (docs/perf_notes.md, "Mixture of experts")."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._compat import check_vector, is_power_of_2, load, pow2_divisor, store, triton_params


@dataclasses.dataclass(frozen=True)
class ExpertMatmulConfig:
    """A program computes block_n columns of one row over a split_k-th of K, streaming it in block_k slices; XLA sums
    the split_k f32 partials (few rows: more programs to fill the GPU)."""
    block_n: int = 64
    block_k: int = 64
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        if not all(is_power_of_2(v) for v in (self.block_n, self.block_k, self.split_k)):
            raise ValueError(f"block sizes and split_k must be powers of two, got {self}")


def expert_matmul_reference(x, w, ids):
    """x: [M, K]; w: [E, K, N]; ids: [M] int32 in [0, E) -> [M, N] f32."""
    return jnp.einsum("mk,mkn->mn", x, w[ids].astype(x.dtype), precision=lax.Precision.HIGHEST,
                      preferred_element_type=jnp.float32)


def _kernel(ids_ref, x_ref, w_ref, o_ref, *, block_k: int):
    # ids_ref: [] the row's expert; x_ref: [K / split_k] the row's share of K; w_ref: [E, K / split_k, block_n] every
    # expert's column block; o_ref: [block_n] f32
    expert = load(ids_ref)

    def body(i, acc):  # elementwise: one reduction over K at the end, not one a slice
        ks = pl.ds(i * block_k, block_k)
        return acc + load(x_ref.at[ks]).astype(jnp.float32)[:, None] * load(w_ref.at[expert, ks, :]).astype(jnp.float32)

    acc = lax.fori_loop(0, x_ref.shape[0] // block_k, body, jnp.zeros((block_k,) + o_ref.shape, jnp.float32))
    store(o_ref, jnp.sum(acc, axis=0))


def _default_config(k: int, n: int) -> ExpertMatmulConfig:
    """64 x 64 tiles, K split in 4 where it divides: more programs in flight, at 1 to 64 rows alike."""
    config = ExpertMatmulConfig(block_n=pow2_divisor(n, 64), block_k=pow2_divisor(k, 64))
    return dataclasses.replace(config, split_k=next(s for s in (4, 2, 1) if k % (s * config.block_k) == 0))


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def expert_matmul(x, w, ids, *, config: ExpertMatmulConfig | None = None, interpret: bool = False):
    """expert_matmul_reference's contract, one program per (row, block of columns, share of K)."""
    m, k = x.shape
    num_experts, k_w, n = w.shape
    config = config or _default_config(k, n)
    k_split = k // config.split_k
    if k_w != k or k_split % config.block_k or n % config.block_n:
        raise ValueError(f"x [M, {k}] and w [E, {k_w}, {n}] must share K, divisible by split_k * block_k, and N by "
                         f"block_n: {config}")
    check_vector("ids", ids, m)
    out = pl.pallas_call(
        functools.partial(_kernel, block_k=config.block_k),
        grid=(m, n // config.block_n, config.split_k),
        in_specs=[pl.BlockSpec((None,), lambda r, c, s: (r,)), pl.BlockSpec((None, k_split), lambda r, c, s: (r, s)),
                  pl.BlockSpec((num_experts, k_split, config.block_n), lambda r, c, s: (0, s, c))],
        out_specs=pl.BlockSpec((None, None, config.block_n), lambda r, c, s: (s, r, c)),
        out_shape=jax.ShapeDtypeStruct((config.split_k, m, n), jnp.float32),
        compiler_params=triton_params(config.num_warps, config.num_stages),
        interpret=interpret,
    )(ids, x, w)
    return out.sum(axis=0)
