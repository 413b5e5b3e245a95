"""Each row through its own expert's weights, out[m] = x[m] @ w[ids[m]]: a mixture-of-experts decode's choices, reading
only the chosen experts. XLA lowers the gathered one-row products to reductions that stream the weights at a fraction
of the bandwidth (docs/perf_notes.md, "Mixture of experts"). FP8 experts (convert/quantize.py: w_t [E, N, K] and
scale [E, N]) are read as they are stored, their scales applied after the products."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._compat import check_pow2, check_vector, load, pow2_divisor, store, triton_params


@dataclasses.dataclass(frozen=True)
class ExpertMatmulConfig:
    """A program computes block_n columns of one row over a split_k-th of K, streaming it in block_k slices; XLA sums
    the split_k f32 partials (few rows: more programs to fill the GPU)."""
    block_n: int = 64
    block_k: int = 64
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    unroll: bool = False  # the K slices unrolled: every slice's loads in flight at once, not a load's latency a slice

    def __post_init__(self):
        check_pow2(self, ("block_n", "block_k", "split_k"))


def expert_shape(w, scale) -> tuple[int, int, int]:
    """(E, K, N) of experts w [E, K, N] (scale None) or FP8 w_t [E, N, K] with scale [E, N]."""
    return (w.shape[0], w.shape[2], w.shape[1]) if scale is not None else w.shape


def expert_matmul_reference(x, w, scale, ids):
    """x: [M, K]; w, scale: experts w [E, K, N] and None, or FP8 w_t [E, N, K] and scale [E, N]; ids: [M] int32 ->
    [M, N] f32. An id outside [0, E) (an expert another device holds) reads the nearest one: the caller drops its row."""
    kw = {"precision": lax.Precision.HIGHEST, "preferred_element_type": jnp.float32}
    ids = jnp.clip(ids, 0, w.shape[0] - 1)
    if scale is None:
        return jnp.einsum("mk,mkn->mn", x, w[ids].astype(x.dtype), **kw)
    return jnp.einsum("mk,mnk->mn", x, w[ids].astype(x.dtype), **kw) * scale[ids]


def _kernel(ids_ref, x_ref, w_ref, *refs, block_k: int, unroll: bool):
    # ids_ref: [] the row's expert; x_ref: [K / split_k] the row's share of K; w_ref: [E, K / split_k, block_n] every
    # expert's column block, or FP8 [E, block_n, K / split_k] followed in refs by its scale_ref [E, block_n];
    # o_ref: [block_n] f32
    *scale_ref, o_ref = refs
    expert, fp8 = jnp.clip(load(ids_ref), 0, w_ref.shape[0] - 1), bool(scale_ref)  # (in the kernel: no launch)

    def body(i, acc):  # elementwise: one reduction over K at the end, not one a slice
        ks = pl.ds(i * block_k, block_k)
        x = load(x_ref.at[ks]).astype(jnp.float32)
        if fp8:
            return acc + load(w_ref.at[expert, :, ks]).astype(jnp.float32) * x[None, :]
        return acc + x[:, None] * load(w_ref.at[expert, ks, :]).astype(jnp.float32)

    shape = (o_ref.shape[0], block_k) if fp8 else (block_k, o_ref.shape[0])
    acc, slices = jnp.zeros(shape, jnp.float32), x_ref.shape[0] // block_k
    if unroll:
        for i in range(slices):
            acc = body(i, acc)
    else:
        acc = lax.fori_loop(0, slices, body, acc)
    store(o_ref, jnp.sum(acc, axis=1) * load(scale_ref[0].at[expert, :]) if fp8 else jnp.sum(acc, axis=0))


MAX_UNROLLED = 16  # K slices a program unrolls at most (more: a longer compile for a loop's last few loads)


def _default_config(k: int, n: int, fp8: bool) -> ExpertMatmulConfig:
    """bf16: 64 x 64 tiles, K split in 4 where it divides (more programs in flight). FP8 (w_t [N, K]): 256 contiguous
    bytes a column, K whole: 32 columns, its slices unrolled, up to MAX_UNROLLED slices, else 16 in a loop
    (scripts/tune_experts.py)."""
    if fp8:
        block_k = pow2_divisor(k, 256)
        if k // block_k > MAX_UNROLLED:
            return ExpertMatmulConfig(block_n=pow2_divisor(n, 16), block_k=block_k)
        return ExpertMatmulConfig(block_n=pow2_divisor(n, 32), block_k=block_k, num_warps=8, unroll=True)
    config = ExpertMatmulConfig(block_n=pow2_divisor(n, 64), block_k=pow2_divisor(k, 64))
    return dataclasses.replace(config, split_k=next(s for s in (4, 2, 1) if k % (s * config.block_k) == 0))


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def expert_matmul(x, w, scale, ids, *, config: ExpertMatmulConfig | None = None, interpret: bool = False):
    """expert_matmul_reference's contract, one program per (row, block of columns, share of K)."""
    m, k = x.shape
    num_experts, k_w, n = expert_shape(w, scale)
    config = config or _default_config(k, n, scale is not None)
    k_split, bn = k // config.split_k, config.block_n
    if k_w != k or k_split % config.block_k or n % bn:
        raise ValueError(f"x [M, {k}] and experts of [{k_w}, {n}] must share K, divisible by split_k * block_k, and "
                         f"N by block_n: {config}")
    check_vector("ids", ids, m)
    scales = [] if scale is None else [scale]
    w_spec = (pl.BlockSpec((num_experts, bn, k_split), lambda r, c, s: (0, c, s)) if scales else
              pl.BlockSpec((num_experts, k_split, bn), lambda r, c, s: (0, s, c)))
    return pl.pallas_call(
        functools.partial(_kernel, block_k=config.block_k, unroll=config.unroll),
        grid=(m, n // bn, config.split_k),
        in_specs=[pl.BlockSpec((None,), lambda r, c, s: (r,)), pl.BlockSpec((None, k_split), lambda r, c, s: (r, s)),
                  w_spec] + [pl.BlockSpec((num_experts, bn), lambda r, c, s: (0, c))] * len(scales),
        out_specs=pl.BlockSpec((None, None, bn), lambda r, c, s: (s, r, c)),
        out_shape=jax.ShapeDtypeStruct((config.split_k, m, n), jnp.float32),
        compiler_params=triton_params(config.num_warps, config.num_stages),
        interpret=interpret,
    )(ids, x, w, *scales).sum(axis=0)
