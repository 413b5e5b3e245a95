"""Grouped GEMMs for a mixture of experts: rows laid out in blocks of block_m, each block's rows through one expert's
weights, out[b] = x[b] @ w[block_experts[b]]^T. A step's choices are sorted by expert and each expert's run padded to
whole blocks (vLLM's fused_moe layout), so a block reads one expert's weights and an unused expert none. XLA's
ragged_dot and its gathered products stream the weights at a fraction of the bandwidth (docs/perf_notes.md,
"Mixture of experts"). Experts are [E, N, K] as HF holds them; FP8 ones (w_t [E, N, K]) are read as stored, their
scales applied after the products."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._compat import check_pow2, check_vector, dot, load, pow2_divisor, store, triton_params


@dataclasses.dataclass(frozen=True)
class GroupedMatmulConfig:
    """A program computes block_n columns of one block of rows, streaming K in block_k slices."""
    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        check_pow2(self, ("block_n", "block_k"))


def block_rows(num_choices: int, num_experts: int) -> int:
    """Rows a block holds for num_choices spread over num_experts: tl.dot's minimum 16, up to 64 when experts get
    many rows each (prefill), so that each expert's weights are read by fewer blocks."""
    return min(max(16, pl.next_power_of_2(-(-num_choices // num_experts))), 64)


def grouped_matmul_reference(x, w, scale, block_experts):
    """x: [B * block_m, K]; w: experts [E, N, K] (FP8 with scale [E, N], else None);
    block_experts: [B] int32, each block's expert (-1: unused, after every used block; the used ones ascending) ->
    [B * block_m, N] f32 (unused blocks' rows: any value)."""
    num_experts, block_m = w.shape[0], x.shape[0] // block_experts.shape[0]
    group_sizes = jnp.zeros(num_experts, jnp.int32).at[block_experts].add(block_m, mode="drop")
    out = lax.ragged_dot(x, jnp.swapaxes(w, 1, 2).astype(x.dtype), group_sizes, precision=lax.Precision.HIGHEST,
                         preferred_element_type=jnp.float32)
    return out if scale is None else out * scale[jnp.repeat(jnp.maximum(block_experts, 0), block_m)]


def _kernel(expert_ref, x_ref, w_ref, *refs, block_k: int):
    # expert_ref: [] the block's expert (-1: unused); x_ref: [block_m, K] its rows; w_ref: [E, block_n, K] every
    # expert's column block, followed in refs by FP8's scale_ref [E, block_n];
    # o_ref: [block_m, block_n] f32
    *scale_ref, o_ref = refs
    expert = load(expert_ref)

    @pl.when(expert >= 0)
    def _():
        def body(i, acc):
            ks = pl.ds(i * block_k, block_k)
            x = load(x_ref.at[:, ks])
            return acc + dot(x, load(w_ref.at[expert, :, ks]).astype(x.dtype), trans_b=True)

        acc = lax.fori_loop(0, x_ref.shape[1] // block_k, body, jnp.zeros(o_ref.shape, jnp.float32))
        store(o_ref, acc * load(scale_ref[0].at[expert, :])[None, :] if scale_ref else acc)


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def grouped_matmul(x, w, scale, block_experts, *, config: GroupedMatmulConfig | None = None, interpret: bool = False):
    """grouped_matmul_reference's contract (unused blocks are skipped). Grid: column blocks outermost, so that the
    blocks of one expert, adjacent, read its weights while they are in L2."""
    rows, k = x.shape
    num_experts, n, k_w = w.shape
    num_blocks = block_experts.shape[0]
    block_m = rows // max(num_blocks, 1)
    # Blocks of 16 rows (decode) read weights in longer K slices; more rows in wider column blocks.
    wide = block_m > 16
    config = config or GroupedMatmulConfig(block_n=pow2_divisor(n, 128 if wide else 64),
                                           block_k=pow2_divisor(k, 64 if wide else 128))
    if k_w != k or k % config.block_k or n % config.block_n or min(config.block_k, config.block_n) < 16:
        raise ValueError(f"x [M, {k}] and experts [E, {n}, {k_w}] must share K, divisible by block_k, N by block_n, "
                         f"both blocks >= 16: {config}")
    if block_m < 16 or block_m * num_blocks != rows:
        raise ValueError(f"x's {rows} rows must be whole blocks of >= 16 for {num_blocks} block_experts")
    check_vector("block_experts", block_experts, num_blocks)
    bn = config.block_n
    scales = [] if scale is None else [scale]
    return pl.pallas_call(
        functools.partial(_kernel, block_k=config.block_k),
        grid=(n // bn, num_blocks),
        in_specs=[pl.BlockSpec((None,), lambda c, b: (b,)), pl.BlockSpec((block_m, k), lambda c, b: (b, 0)),
                  pl.BlockSpec((num_experts, bn, k), lambda c, b: (0, c, 0))]
        + [pl.BlockSpec((num_experts, bn), lambda c, b: (0, c))] * len(scales),
        out_specs=pl.BlockSpec((block_m, bn), lambda c, b: (b, c)),
        out_shape=jax.ShapeDtypeStruct((rows, n), jnp.float32),
        compiler_params=triton_params(config.num_warps, config.num_stages),
        interpret=interpret,
    )(block_experts, x, w, *scales)
