"""Fused RMSNorm + matmul: the pre-attention norm with the concatenated QKV projection (and any norm + projection)."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._compat import load, store, triton_params


def rmsnorm_matmul_reference(x, norm_scale, w, bias=None, *, eps):
    """x: [M, K]; norm_scale: [K]; w: [K, N]; bias: [N] or None -> [M, N] in x.dtype.

    The norm runs in f32, is cast back to x.dtype and then scaled (as HF's RMSNorm); the dot accumulates in f32.
    """
    xf = x.astype(jnp.float32)
    normed = (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)
    normed = norm_scale.astype(x.dtype) * normed
    out = jnp.dot(normed, w.astype(x.dtype), preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST)
    if bias is not None:
        out = out + bias.astype(jnp.float32)
    return out.astype(x.dtype)


# ---------------------------------------------------------------------------------------------------------------------
# Pallas (Triton) kernel. A program owns a block_m x block_n output tile: it first takes the sum of squares of its x
# rows over all of K (x rows are small and stay in L1/L2), then streams K in block_k slices, normalizing each x slice
# on the fly and accumulating the dot in f32. At decode sizes (M <= 64) the cost is streaming w once, so block_n is
# small enough to give ~one program per SM and num_stages keeps several w slices in flight per program.


@dataclasses.dataclass(frozen=True)
class RmsNormMatmulConfig:
    """Tiling of the fused kernel. block_m is an upper bound: the kernel uses next_pow2(M), at least 16 (tl.dot's
    minimum), when that is smaller. All blocks are powers of two >= 16; K and N need not be multiples of them."""
    block_m: int = 16
    block_n: int = 32
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 4

    def __post_init__(self):
        if any(b < 16 or b & (b - 1) for b in (self.block_m, self.block_n, self.block_k)):
            raise ValueError(f"block sizes must be powers of two >= 16, got {self}")


# Decode (M <= 16): memory-bound on w. 4096 / 32 = 128 programs for a Qwen3-0.6B QKV (~1 per SM), each keeping
# num_stages - 1 = 3 w slices of 16 KiB in flight, ~104 KiB of shared memory.
DECODE_CONFIG = RmsNormMatmulConfig(block_m=16, block_n=32, block_k=256, num_warps=4, num_stages=4)
# Batched decode (M <= 64): still memory-bound; the x and norm_scale tiles grow with block_m, so block_k shrinks.
BATCHED_DECODE_CONFIG = RmsNormMatmulConfig(block_m=64, block_n=32, block_k=128, num_warps=4, num_stages=4)
# Prefill: compute-bound tiles, 3 x 16 KiB of x, norm_scale and w per pipeline stage.
PREFILL_CONFIG = RmsNormMatmulConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)


def _default_config(m, dtype):
    """The preset for m rows; the presets are sized for 2-byte dtypes, so block_k is halved for f32 to keep the
    pipelined tiles within shared memory."""
    config = DECODE_CONFIG if m <= 16 else BATCHED_DECODE_CONFIG if m <= 64 else PREFILL_CONFIG
    return config if jnp.dtype(dtype).itemsize <= 2 else dataclasses.replace(config, block_k=config.block_k // 2)


def _k_slice(kb, block_k, k):
    """-> columns [block_k] of the kb-th K slice and their in-bounds mask."""
    cols = kb * block_k + jnp.arange(block_k)
    return cols, cols < k


def _rmsnorm_matmul_kernel(x_ref, scale_ref, w_ref, bias_ref, o_ref, *, eps, block_m, block_n, block_k):
    # x_ref: [M, K]; scale_ref: [K]; w_ref: [K, N]; bias_ref: [N] or None; o_ref: [M, N]
    (m, k), n = x_ref.shape, w_ref.shape[1]
    rows = pl.program_id(0) * block_m + jnp.arange(block_m)
    cols_n = pl.program_id(1) * block_n + jnp.arange(block_n)
    row_ok, n_ok = rows < m, cols_n < n

    def x_tile(cols_k, k_ok):  # -> [block_m, block_k], zeros outside x
        return load(x_ref.at[rows[:, None], cols_k[None, :]], mask=row_ok[:, None] & k_ok[None, :], other=0.0)

    # Unrolled (static trip count): the x loads are independent, so all of them are in flight at once rather than
    # paying one memory round trip per K slice before the first w slice is requested.
    sum_sq = sum(jnp.square(x_tile(*_k_slice(kb, block_k, k)).astype(jnp.float32)).sum(axis=1)
                 for kb in range(pl.cdiv(k, block_k)))
    rstd = lax.rsqrt(sum_sq / k + eps)

    def body(kb, acc):
        cols_k, k_ok = _k_slice(kb, block_k, k)
        x = x_tile(cols_k, k_ok)
        # norm_scale is loaded as a [block_m, block_k] tile (repeated rows hit L1) so that Triton vectorizes it and
        # software-pipelines it with x and w; a 1-D bf16 load would be a stalling scalar load every iteration.
        scale_idx = jnp.broadcast_to(cols_k[None, :], x.shape)
        scale = load(scale_ref.at[scale_idx], mask=jnp.broadcast_to(k_ok[None, :], x.shape), other=0.0)
        # As the reference (HF's RMSNorm): normalize in f32, round to x.dtype, then scale in x.dtype.
        normed = scale.astype(x.dtype) * (x.astype(jnp.float32) * rstd[:, None]).astype(x.dtype)
        w = load(w_ref.at[cols_k[:, None], cols_n[None, :]], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        return acc + lax.dot(normed, w, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, pl.cdiv(k, block_k), body, jnp.zeros((block_m, block_n), jnp.float32))
    if bias_ref is not None:
        acc += load(bias_ref.at[cols_n], mask=n_ok, other=0.0).astype(jnp.float32)[None, :]
    store(o_ref.at[rows[:, None], cols_n[None, :]], acc.astype(o_ref.dtype), mask=row_ok[:, None] & n_ok[None, :])


def _check_inputs(x, norm_scale, w, bias):
    if x.ndim != 2 or norm_scale.ndim != 1 or w.ndim != 2:
        raise ValueError(f"expected x [M, K], norm_scale [K], w [K, N]; got {x.shape}, {norm_scale.shape}, {w.shape}")
    if not x.shape[1] == norm_scale.shape[0] == w.shape[0]:
        raise ValueError(f"K differs: x {x.shape}, norm_scale {norm_scale.shape}, w {w.shape}")
    if bias is not None and bias.shape != (w.shape[1],):
        raise ValueError(f"bias must be [N] = [{w.shape[1]}], got {bias.shape}")
    if x.dtype != w.dtype or x.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
        raise ValueError(f"x and w must share a bf16, f16 or f32 dtype, got {x.dtype} and {w.dtype}")
    if any(not jnp.issubdtype(a.dtype, jnp.floating) for a in (norm_scale, bias) if a is not None):
        raise ValueError("norm_scale and bias must be floating point")


@functools.partial(jax.jit, static_argnames=("eps", "config", "interpret"))
def rmsnorm_matmul(x, norm_scale, w, bias=None, *, eps, config=None, interpret=False):
    """RMSNorm(x) @ w (+ bias), fused: the semantics of rmsnorm_matmul_reference.

    x: [M, K]; norm_scale: [K]; w: [K, N] (x.dtype); bias: [N] or None -> [M, N] in x.dtype.
    config None picks DECODE_CONFIG for M <= 16, BATCHED_DECODE_CONFIG for M <= 64 and PREFILL_CONFIG above
    (block_k halved for f32).
    """
    _check_inputs(x, norm_scale, w, bias)
    (m, _), n = x.shape, w.shape[1]
    config = config or _default_config(m, x.dtype)
    block_m = min(config.block_m, max(16, pl.next_power_of_2(m)))
    kernel = functools.partial(_rmsnorm_matmul_kernel, eps=eps, block_m=block_m, block_n=config.block_n,
                               block_k=config.block_k)
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(m, block_m), pl.cdiv(n, config.block_n)),
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        compiler_params=triton_params(config.num_warps, config.num_stages),
        interpret=interpret,
        name="rmsnorm_matmul",
    )(x, norm_scale, w, bias)
