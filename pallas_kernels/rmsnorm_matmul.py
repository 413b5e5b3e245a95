"""One fused kernel per projection of a decoder layer: [RMSNorm] -> matmul [+ bias] [-> SiLU-and-mul] [+ residual].

    qkv:      rmsnorm_matmul(x, attn_norm, w_qkv, b_qkv, eps=eps)
    o_proj:   rmsnorm_matmul(attn, None, w_o, b_o, residual=x)                       # x + attn @ w_o
    gate/up:  rmsnorm_matmul(x, mlp_norm, w_gate_up, b_gate_up, eps=eps, activation="silu_mul")
    down:     rmsnorm_matmul(h, None, w_down, b_down, residual=x)                    # x + h @ w_down
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._compat import load, store, triton_params

ACTIVATIONS = (None, "silu_mul")


def rms_norm(x, scale, eps):
    """HF's RMSNorm rounding: statistics and the product in f32, rounded to x.dtype, then times the weight in
    x.dtype. The one definition: the model's norms and every kernel reference use it."""
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return scale.astype(x.dtype) * normed.astype(x.dtype)


def rmsnorm_matmul_reference(x, norm_scale, w, bias=None, *, eps=None, residual=None, activation=None):
    """The semantics of rmsnorm_matmul, in plain jnp with the decoder's rounding (rms_norm, linear, SwiGLU and
    residual add), so that the fused kernel is a drop-in for those steps:

        h = x                                               if norm_scale is None
          = norm_scale * (x * rsqrt(mean(x^2) + eps))      else: normalized in f32, cast to x.dtype, then scaled
        p = (h @ w [+ bias]).astype(x.dtype)                dot accumulated in f32, bias added in f32 (`linear`)
        p = silu(p[:, :N/2]) * p[:, N/2:]                   if activation == "silu_mul", in x.dtype (gate | up)
        out = residual + p                                  if residual is not None, in x.dtype

    x: [..., K]; norm_scale: [K] or None; w: [K, N]; bias: [N] or None; residual: [..., N] ([..., N/2] with silu_mul)
    -> x.dtype. The kernel keeps the activation and the residual add in f32 and rounds once at the end, so it can
    differ from this by about one rounding of x.dtype (nothing for f32).
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    h = x if norm_scale is None else rms_norm(x, norm_scale, eps)
    out = jnp.dot(h, w.astype(x.dtype), preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST)
    if bias is not None:
        out = out + bias.astype(jnp.float32)
    out = out.astype(x.dtype)
    if activation == "silu_mul":
        gate, up = jnp.split(out, 2, axis=-1)
        out = jax.nn.silu(gate) * up
    if residual is not None:
        out = residual + out
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Pallas (Triton) kernel. A program owns a block_m x block_n output tile. With a norm it first takes the sum of squares
# of its x rows over all of K (x rows are small and stay in L1/L2); then it streams K in block_k slices, normalizing
# each x slice on the fly, and accumulates in f32 one dot per weight column group: [w[:, j:j+bn]], or with silu_mul
# [w[:, j:j+bn] (gate), w[:, I+j:I+j+bn] (up)] of the same [K, 2I] array. The epilogue (bias, SiLU * up, residual)
# runs on the f32 accumulators and the tile is rounded to x.dtype once. At decode sizes (M <= 64) the cost is
# streaming w once, and num_stages keeps several w slices in flight per program. With k_splits > 1 (split K),
# k_splits programs share an output tile's K range and store f32 partial sums; XLA adds them up and runs the same
# epilogue in one fusion after the kernel. That costs a launch and a few KiB of traffic, and pays where N is too
# narrow for the tiles alone to cover the SMs (o_proj / down_proj with N = hidden).


@dataclasses.dataclass(frozen=True)
class RmsNormMatmulConfig:
    """Tiling of the fused kernel. block_m is an upper bound: the kernel uses next_pow2(M), at least 16 (tl.dot's
    minimum), when that is smaller. All blocks are powers of two >= 16; K and N need not be multiples of them."""
    block_m: int = 16
    block_n: int = 32
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 4
    k_splits: int = 1  # programs sharing one output tile's K range; their f32 partials are summed by XLA

    def __post_init__(self):
        if any(b < 16 or b & (b - 1) for b in (self.block_m, self.block_n, self.block_k)):
            raise ValueError(f"block sizes must be powers of two >= 16, got {self}")
        if self.k_splits < 1:
            raise ValueError(f"k_splits must be >= 1, got {self.k_splits}")


# Measured on an H100 (scripts/tune_projections.py, Qwen3-0.6B projections at M = 1 and 64, docs/perf_notes.md): at
# decode sizes the best tiles are 64 columns wide (128 contiguous bytes of each w row) and 128 deep, with split K
# giving the grid about one program per SM; narrower tiles without split K ran 1.1-2.2x slower.
# Decode (M <= 16) and batched decode (M <= 64): memory-bound on w; k_splits is set per shape by _default_config.
DECODE_CONFIG = RmsNormMatmulConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4)
BATCHED_DECODE_CONFIG = RmsNormMatmulConfig(block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=4)
# Prefill: compute-bound tiles.
PREFILL_CONFIG = RmsNormMatmulConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)

# H100 / H200 SMs: a memory-bound grid gets split K until it has about one program per SM.
NUM_SMS = 132
# Shared memory of one pipeline stage that compiled and ran with 4 stages on the H100 (48 KiB did, 64 KiB did not).
STAGE_BYTES = 56 << 10


def _block_m(config, m):
    return min(config.block_m, max(16, pl.next_power_of_2(m)))


def _stage_bytes(block_m, block_n, block_k, *, itemsize, w_tiles):
    """Shared memory of one pipeline stage: the x tile and w_tiles weight tiles."""
    return block_k * (block_m + w_tiles * block_n) * itemsize


def _default_config(m, k, n_out, dtype, *, silu_mul=False):
    """The preset for m rows, adapted to the problem:
    - block_k halves until a pipeline stage fits STAGE_BYTES (f32, or the two w tiles of silu_mul at M = 64);
    - M <= 64 (memory-bound on w): k_splits doubles (up to 8, and at most one K block per split) while the grid
      stays within NUM_SMS programs: QKV and gate/up of Qwen3-0.6B get 2 splits, o_proj and down_proj (N = 1024) 8.
    """
    preset = DECODE_CONFIG if m <= 16 else BATCHED_DECODE_CONFIG if m <= 64 else PREFILL_CONFIG
    block_m, block_k = _block_m(preset, m), preset.block_k
    itemsize, w_tiles = jnp.dtype(dtype).itemsize, 2 if silu_mul else 1
    while block_k > 16 and _stage_bytes(block_m, preset.block_n, block_k, itemsize=itemsize, w_tiles=w_tiles) > (
            STAGE_BYTES):
        block_k //= 2
    k_splits = 1
    if m <= 64:
        tiles = pl.cdiv(m, block_m) * pl.cdiv(n_out, preset.block_n)
        while k_splits < 8 and 2 * k_splits * tiles <= NUM_SMS and 2 * k_splits <= pl.cdiv(k, block_k):
            k_splits *= 2
    return dataclasses.replace(preset, block_k=block_k, k_splits=k_splits)


def _k_slice(kb, block_k, k):
    """-> columns [block_k] of the kb-th K slice and their in-bounds mask."""
    cols = kb * block_k + jnp.arange(block_k)
    return cols, cols < k


def _rmsnorm_matmul_kernel(x_ref, scale_ref, w_ref, bias_ref, res_ref, o_ref, *, eps, silu_mul, block_m, block_n,
                           block_k, n_out, k_blocks_per_split, partial):
    # x_ref: [M, K]; scale_ref: [K] or None; w_ref: [K, N]; bias_ref: [N] or None; res_ref: [M, N_out] or None;
    # o_ref: [M, N_out] with N_out = N, or N / 2 for silu_mul; if partial (split K): [k_splits, M, N] f32, where this
    #     program stores its split's accumulators and leaves bias, activation and residual to _epilogue in XLA.
    m, k = x_ref.shape
    rows = pl.program_id(0) * block_m + jnp.arange(block_m)
    cols_n = pl.program_id(1) * block_n + jnp.arange(block_n)
    row_ok, n_ok = rows < m, cols_n < n_out
    first_kb = pl.program_id(2) * k_blocks_per_split
    num_kb = jnp.minimum(pl.cdiv(k, block_k) - first_kb, k_blocks_per_split)
    # The w (and bias) columns this program reads: its output columns, or the gate and the up columns for them.
    col_groups = (cols_n, cols_n + n_out) if silu_mul else (cols_n,)

    def x_tile(cols_k, k_ok):  # -> [block_m, block_k], zeros outside x
        return load(x_ref.at[rows[:, None], cols_k[None, :]], mask=row_ok[:, None] & k_ok[None, :], other=0.0)

    if scale_ref is not None:
        # Unrolled (static trip count): the x loads are independent, so all of them are in flight at once rather
        # than paying one memory round trip per K slice before the first w slice is requested.
        sum_sq = sum(jnp.square(x_tile(*_k_slice(kb, block_k, k)).astype(jnp.float32)).sum(axis=1)
                     for kb in range(pl.cdiv(k, block_k)))
        rstd = lax.rsqrt(sum_sq / k + eps)

    def body(i, accs):
        cols_k, k_ok = _k_slice(first_kb + i, block_k, k)
        x = x_tile(cols_k, k_ok)
        if scale_ref is not None:
            # norm_scale is loaded as a [block_m, block_k] tile (repeated rows hit L1) so that Triton vectorizes it
            # and software-pipelines it with x and w; a 1-D bf16 load would be a stalling scalar load every
            # iteration.
            scale_idx = jnp.broadcast_to(cols_k[None, :], x.shape)
            scale = load(scale_ref.at[scale_idx], mask=jnp.broadcast_to(k_ok[None, :], x.shape), other=0.0)
            # As the reference (HF's RMSNorm): normalize in f32, round to x.dtype, then scale in x.dtype.
            x = scale.astype(x.dtype) * (x.astype(jnp.float32) * rstd[:, None]).astype(x.dtype)
        ws = [load(w_ref.at[cols_k[:, None], cols[None, :]], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
              for cols in col_groups]
        return tuple(acc + lax.dot(x, w, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
                     for acc, w in zip(accs, ws))

    zeros = jnp.zeros((block_m, block_n), jnp.float32)
    accs = lax.fori_loop(0, num_kb, body, tuple(zeros for _ in col_groups))
    if partial:
        for acc, cols in zip(accs, col_groups):
            store(o_ref.at[pl.program_id(2), rows[:, None], cols[None, :]], acc, mask=row_ok[:, None] & n_ok[None, :])
        return
    tile_mask = row_ok[:, None] & n_ok[None, :]
    biases = None if bias_ref is None else tuple(load(bias_ref.at[cols], mask=n_ok, other=0.0) for cols in col_groups)
    residual = None if res_ref is None else load(res_ref.at[rows[:, None], cols_n[None, :]], mask=tile_mask, other=0.0)
    store(o_ref.at[rows[:, None], cols_n[None, :]], _epilogue(accs, biases, residual, o_ref.dtype), mask=tile_mask)


def _epilogue(accs, biases, residual, dtype):
    """f32 accumulators (gate and up for silu_mul) [+ bias] [-> silu(gate) * up] [+ residual], rounded once to dtype.
    Shared by the kernel and the split-K path, which runs it in XLA on the summed partials."""
    if biases is not None:
        accs = tuple(acc + b.astype(jnp.float32)[None, :] for acc, b in zip(accs, biases))
    if len(accs) == 2:
        gate, up = accs
        out = gate * jax.nn.sigmoid(gate) * up  # sigmoid lowers to 1 / (1 + exp(-x)) in Triton
    else:
        (out,) = accs
    if residual is not None:
        out += residual.astype(jnp.float32)
    return out.astype(dtype)


def _check_inputs(x, norm_scale, w, bias, residual, eps, activation):
    """-> N_out, the output width; ValueError for anything the kernel does not handle."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if x.ndim != 2 or w.ndim != 2 or (norm_scale is not None and norm_scale.ndim != 1):
        raise ValueError(f"expected x [M, K], norm_scale [K] or None, w [K, N]; got {x.shape}, "
                         f"{None if norm_scale is None else norm_scale.shape}, {w.shape}")
    (m, k), n = x.shape, w.shape[1]
    if w.shape[0] != k or (norm_scale is not None and norm_scale.shape != (k,)):
        raise ValueError(f"K differs: x {x.shape}, norm_scale {None if norm_scale is None else norm_scale.shape}, "
                         f"w {w.shape}")
    if activation == "silu_mul" and n % 2:
        raise ValueError(f"silu_mul needs w = [K, 2 * I] (gate | up columns), got an odd N = {n}")
    n_out = n // 2 if activation == "silu_mul" else n
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [N] = [{n}] (w's columns), got {bias.shape}")
    if residual is not None and residual.shape != (m, n_out):
        raise ValueError(f"residual must be [M, N_out] = [{m}, {n_out}] (the output's shape), got {residual.shape}")
    if x.dtype != w.dtype or x.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
        raise ValueError(f"x and w must share a bf16, f16 or f32 dtype, got {x.dtype} and {w.dtype}")
    if residual is not None and residual.dtype != x.dtype:
        raise ValueError(f"residual dtype {residual.dtype} must be x's dtype {x.dtype}")
    if any(not jnp.issubdtype(a.dtype, jnp.floating) for a in (norm_scale, bias) if a is not None):
        raise ValueError("norm_scale and bias must be floating point")
    if norm_scale is not None and eps is None:
        raise ValueError("eps is required with a norm_scale")
    return n_out


@functools.partial(jax.jit, static_argnames=("eps", "activation", "config", "interpret"))
def rmsnorm_matmul(x, norm_scale, w, bias=None, *, eps=None, residual=None, activation=None, config=None,
                   interpret=False):
    """[RMSNorm](x) @ w [+ bias] [-> silu(gate) * up] [+ residual] in one kernel: rmsnorm_matmul_reference's
    semantics (see there), up to one rounding of x.dtype where the reference rounds the projection before the
    activation / residual add and the kernel rounds once at the end.

    x: [M, K]; norm_scale: [K] or None (no norm; eps is then unused); w: [K, N] (x.dtype); bias: [N] or None;
    residual: [M, N_out] (x.dtype) or None; activation: None, or "silu_mul" with w = [K, 2I] holding the gate
    columns then the up columns (N_out = I) -> [M, N_out] in x.dtype.
    config None picks DECODE_CONFIG for M <= 16, BATCHED_DECODE_CONFIG for M <= 64 and PREFILL_CONFIG above, adapted
    to the shape (see _default_config); a given config is used as is.
    """
    n_out = _check_inputs(x, norm_scale, w, bias, residual, eps, activation)
    m = x.shape[0]
    silu_mul = activation == "silu_mul"
    config = config or _default_config(m, x.shape[1], n_out, x.dtype, silu_mul=silu_mul)
    block_m = _block_m(config, m)
    k_blocks = pl.cdiv(x.shape[1], config.block_k)
    k_splits = min(config.k_splits, k_blocks)
    partial = k_splits > 1
    kernel = functools.partial(_rmsnorm_matmul_kernel, eps=eps, silu_mul=silu_mul, block_m=block_m,
                               block_n=config.block_n, block_k=config.block_k, n_out=n_out,
                               k_blocks_per_split=pl.cdiv(k_blocks, k_splits), partial=partial)
    out_shape = (k_splits, m, w.shape[1]) if partial else (m, n_out)
    out = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(m, block_m), pl.cdiv(n_out, config.block_n), k_splits),
        out_shape=jax.ShapeDtypeStruct(out_shape, jnp.float32 if partial else x.dtype),
        compiler_params=triton_params(config.num_warps, config.num_stages),
        interpret=interpret,
        name="rmsnorm_matmul",
    )(x, norm_scale, w, bias, residual)
    if not partial:
        return out
    # Split K: XLA sums the partials and runs the epilogue, one fusion after the kernel.
    groups = 2 if silu_mul else 1
    biases = None if bias is None else jnp.split(bias, groups)
    return _epilogue(jnp.split(out.sum(axis=0), groups, axis=1), biases, residual, x.dtype)
