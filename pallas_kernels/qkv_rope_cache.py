"""Fused QKV epilogue: the QKV projection's split, Qwen3's q/k RMSNorm, RoPE of q and k, and the write of k and v into
the paged KV cache (pallas_kernels.paged_attention's layout), in one kernel over a flat list of N tokens:

    qkv:       [N, (Hq + 2 * Hkv) * D]   Hq query heads, then Hkv key heads, then Hkv value heads
    positions: [N] int32                 absolute positions; -1 marks a padding token (q zero, no KV write)
    cos_sin:   [N, D] in qkv's dtype      each token's RoPE table (rope_cos_sin)
    slots:     [N] int32                 page * page_size + offset of the token's KV; -1 (or outside the pool): none

Rounding as the model's XLA ops, up to one bf16 ulp where a compiler makes an fma; pools update in place if donated.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._compat import check_pow2, check_vector, is_power_of_2, load, store, triton_params
from pallas_kernels.paged_attention import _query_rows, check_kv_pages
from pallas_kernels.rms_norm import rms_norm


def rope_cos_sin(positions, inv_freq, dtype):
    """positions [N], inv_freq [D/2] -> [N, D]: cos, then sin of the angles; once a forward, for every layer."""
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq  # [N, D/2]
    return jnp.concatenate([jnp.cos(freqs), jnp.sin(freqs)], axis=-1).astype(dtype)


def _apply_rope(x, cos_sin):
    """HF's rotate-half RoPE for x: [N, heads, D] with the table cos_sin: [N, D] (rope_cos_sin)."""
    cos, sin = (c[:, None, :] for c in jnp.split(cos_sin, 2, axis=-1))
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def qkv_rope_cache_reference(qkv, positions, slots, k_pages, v_pages, cos_sin=None, q_norm=None, k_norm=None, *,
                             eps=None):
    """Plain jnp, shapes as qkv_rope_cache -> (q [N, Hq, D], zero on padding tokens; k_pages, v_pages)."""
    num_pages, num_kv_heads, page_size, head_dim = k_pages.shape
    heads = qkv.reshape(qkv.shape[0], -1, head_dim)
    q, k, v = jnp.split(heads, [heads.shape[1] - 2 * num_kv_heads, heads.shape[1] - num_kv_heads], axis=1)
    if q_norm is not None:
        q = rms_norm(q, q_norm, eps)
    if k_norm is not None:
        k = rms_norm(k, k_norm, eps)
    if cos_sin is not None:
        q, k = _apply_rope(q, cos_sin), _apply_rope(k, cos_sin)
    live = positions >= 0
    q = jnp.where(live[:, None, None], q, jnp.zeros((), q.dtype))
    write = live & (slots >= 0) & (slots < num_pages * page_size)
    page = jnp.where(write, slots // page_size, num_pages)  # out of range: dropped
    offset = jnp.where(write, slots % page_size, 0)
    k_pages = k_pages.at[page, :, offset].set(k.astype(k_pages.dtype), mode="drop")
    v_pages = v_pages.at[page, :, offset].set(v.astype(v_pages.dtype), mode="drop")
    return q, k_pages, v_pages


# A program owns (token block, KV head): its query heads (group_pad rows a token), key and value heads, as [rows, D/2]
# halves (RoPE rotates the two) or [block_t, D] tiles. Nothing loops: one round trip in, some f32 math, one out.
# Masked KV stores index page num_pages: interpret mode's masked store scatters old values there, which are dropped.


@dataclasses.dataclass(frozen=True)
class QkvRopeCacheConfig:
    """block_rows: query rows (tokens x padded query heads of a group) a program, fewer when N is smaller."""
    block_rows: int = 32
    num_warps: int = 4

    def __post_init__(self):
        check_pow2(self, ("block_rows", "num_warps"))


# Decode (N <= 256): latency-bound; small one-warp programs, so that even batch 1 spreads over Hkv programs.
DECODE_CONFIG = QkvRopeCacheConfig(block_rows=8, num_warps=1)
# Prefill: bandwidth-bound; 4 warps on [32, D/2] tiles, as many values per thread. Not tuned on a GPU.
PREFILL_CONFIG = QkvRopeCacheConfig(block_rows=32, num_warps=4)


def _norm_rope(x1, x2, token, token_ok, norm_ref, cos_sin_ref, *, eps):
    """x1, x2: [M, D/2] halves of token's [M] heads -> normed and roped halves, rounded as rms_norm and _apply_rope."""
    dtype, half = x1.dtype, x1.shape[1]
    d = jnp.arange(half)
    if norm_ref is not None:
        x1f, x2f = x1.astype(jnp.float32), x2.astype(jnp.float32)
        mean_sq = (jnp.sum(x1f * x1f, axis=1) + jnp.sum(x2f * x2f, axis=1)) / (2 * half)
        rstd = lax.rsqrt(mean_sq + eps)[:, None]
        w1, w2 = (load(norm_ref.at[cols]).astype(dtype)[None, :] for cols in (d, half + d))
        x1, x2 = w1 * (x1f * rstd).astype(dtype), w2 * (x2f * rstd).astype(dtype)
    if cos_sin_ref is not None:
        cos, sin = (load(cos_sin_ref.at[token[:, None], cols[None, :]], mask=token_ok[:, None], other=0.0)
                    for cols in (d, half + d))
        x1, x2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    return x1, x2


def _qkv_rope_cache_kernel(qkv_ref, pos_ref, slot_ref, k_in_ref, v_in_ref, cos_sin_ref, q_norm_ref, k_norm_ref,
                           q_ref, k_ref, v_ref, *, eps, num_kv_heads, group, group_pad, block_t):
    # qkv_ref: [N, (Hq + 2 * Hkv) * D]; pos_ref, slot_ref: [N] int32; cos_sin_ref: [N, D] or None
    # k_in_ref, v_in_ref: [num_pages, page_size, D], never read: the operands k_ref and v_ref alias
    # q_norm_ref, k_norm_ref: [D] or None; q_ref: [N, Hq, D]
    # k_ref, v_ref: [num_pages, page_size, D] this KV head's pools, written at the tokens' slots only
    del k_in_ref, v_in_ref
    num_tokens, _ = qkv_ref.shape
    num_q_heads = q_ref.shape[1]
    num_pages, page_size, head_dim = k_ref.shape
    half = head_dim // 2
    token_block, kv_head = pl.program_id(0), pl.program_id(1)
    d = jnp.arange(half)

    # Key and value: one row per token.
    token = token_block * block_t + jnp.arange(block_t)
    token_ok = token < num_tokens
    pos = load(pos_ref.at[token], mask=token_ok, other=-1)
    slot = load(slot_ref.at[token], mask=token_ok, other=-1)
    write = (pos >= 0) & (slot >= 0) & (slot < num_pages * page_size)
    page = jnp.where(write, lax.div(slot, page_size), num_pages)  # out of range where masked
    offset = jnp.where(write, lax.rem(slot, page_size), 0)
    k_col = (num_q_heads + kv_head) * head_dim
    k1, k2 = (load(qkv_ref.at[token[:, None], (k_col + cols)[None, :]], mask=write[:, None], other=0.0)
              for cols in (d, half + d))
    k1, k2 = _norm_rope(k1, k2, token, token_ok, k_norm_ref, cos_sin_ref, eps=eps)
    for cols, x in ((d, k1), (half + d, k2)):
        store(k_ref.at[page[:, None], offset[:, None], cols[None, :]], x.astype(k_ref.dtype), mask=write[:, None])
    v_col = (num_q_heads + num_kv_heads + kv_head) * head_dim
    dv = jnp.arange(head_dim)
    v = load(qkv_ref.at[token[:, None], (v_col + dv)[None, :]], mask=write[:, None], other=0.0)
    store(v_ref.at[page[:, None], offset[:, None], dv[None, :]], v.astype(v_ref.dtype), mask=write[:, None])

    # Queries: group_pad rows per token.
    q_token, head, head_ok = _query_rows(token_block * block_t, kv_head, block_t * group_pad, group, group_pad)
    row_ok = head_ok & (q_token < num_tokens)  # rows of q_ref this program stores
    q_pos = load(pos_ref.at[q_token], mask=row_ok, other=-1)
    live = row_ok & (q_pos >= 0)  # rows that are computed; the other stored rows are padding tokens: zeros
    q1, q2 = (load(qkv_ref.at[q_token[:, None], (head * head_dim)[:, None] + cols[None, :]], mask=live[:, None],
                   other=0.0) for cols in (d, half + d))
    q1, q2 = _norm_rope(q1, q2, q_token, row_ok, q_norm_ref, cos_sin_ref, eps=eps)
    for cols, x in ((d, q1), (half + d, q2)):
        x = jnp.where(live[:, None], x, jnp.zeros((), x.dtype))
        store(q_ref.at[q_token[:, None], head[:, None], cols[None, :]], x.astype(q_ref.dtype), mask=row_ok[:, None])


def _check_inputs(qkv, positions, slots, k_pages, v_pages, cos_sin, q_norm, k_norm, eps):
    """Raises ValueError for inputs the kernel cannot take; -> num_q_heads."""
    # One dtype: a narrower cache would round k and v once more, a wider one keep excess precision of the bf16 RoPE.
    check_kv_pages("qkv", qkv, k_pages, v_pages)
    num_pages, num_kv_heads, page_size, head_dim = k_pages.shape
    if head_dim < 16 or not is_power_of_2(head_dim):
        raise ValueError(f"head_dim must be a power of two >= 16, got {head_dim}")
    if num_pages * page_size >= 2**31:
        raise ValueError(f"the pool's {num_pages} x {page_size} slots do not fit int32 slot ids")
    if qkv.ndim != 2 or qkv.shape[0] < 1 or qkv.shape[1] % head_dim:
        raise ValueError(f"qkv must be [N >= 1, (Hq + 2 * Hkv) * D] with D = {head_dim}, got shape {qkv.shape}")
    num_tokens = qkv.shape[0]
    num_q_heads = qkv.shape[1] // head_dim - 2 * num_kv_heads
    if num_q_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(f"qkv's {qkv.shape[1] // head_dim} heads minus 2 * {num_kv_heads} KV heads leave "
                         f"{num_q_heads} query heads, not a positive multiple of num_kv_heads")
    check_vector("positions", positions, num_tokens)
    check_vector("slots", slots, num_tokens)
    if cos_sin is not None and (cos_sin.shape != (num_tokens, head_dim) or cos_sin.dtype != qkv.dtype):
        raise ValueError(f"cos_sin must be {qkv.dtype} [{num_tokens}, {head_dim}] or None, got "
                         f"{cos_sin.dtype}{cos_sin.shape}")
    for name, weight in (("q_norm", q_norm), ("k_norm", k_norm)):
        if weight is not None and (weight.shape != (head_dim,) or not jnp.issubdtype(weight.dtype, jnp.floating)):
            raise ValueError(f"{name} must be a float [{head_dim}] or None, got {weight.dtype}{weight.shape}")
    if (q_norm is not None or k_norm is not None) and not (isinstance(eps, (int, float)) and eps > 0):
        raise ValueError(f"q_norm / k_norm need a positive eps, got {eps!r}")
    return num_q_heads


@functools.partial(jax.jit, static_argnames=("eps", "config", "interpret"))
def qkv_rope_cache(qkv, positions, slots, k_pages, v_pages, cos_sin=None, q_norm=None, k_norm=None, *, eps=None,
                   config=None, interpret=False):
    """Split + q/k RMSNorm + RoPE + paged KV write, fused: qkv_rope_cache_reference (shapes: module docstring).
    cos_sin, q_norm, k_norm: None for no RoPE, no norm. Two tokens must not share a slot. config None: by N."""
    num_q_heads = _check_inputs(qkv, positions, slots, k_pages, v_pages, cos_sin, q_norm, k_norm, eps)
    num_tokens = qkv.shape[0]
    num_pages, num_kv_heads, page_size, head_dim = k_pages.shape
    group = num_q_heads // num_kv_heads
    group_pad = pl.next_power_of_2(group)
    config = config or (DECODE_CONFIG if num_tokens <= 256 else PREFILL_CONFIG)
    block_t = min(max(1, config.block_rows // group_pad), pl.next_power_of_2(num_tokens))

    def whole(x):
        return None if x is None else pl.BlockSpec(x.shape, lambda i, h: (0,) * x.ndim)

    kv_spec = pl.BlockSpec((num_pages, None, page_size, head_dim), lambda i, h: (0, h, 0, 0))
    q_shape = jax.ShapeDtypeStruct((num_tokens, num_q_heads, head_dim), qkv.dtype)
    kernel = functools.partial(_qkv_rope_cache_kernel, eps=eps, num_kv_heads=num_kv_heads, group=group,
                               group_pad=group_pad, block_t=block_t)
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(num_tokens, block_t), num_kv_heads),
        in_specs=[*map(whole, (qkv, positions, slots)), kv_spec, kv_spec, *map(whole, (cos_sin, q_norm, k_norm))],
        out_specs=[whole(q_shape), kv_spec, kv_spec],
        out_shape=[q_shape, *2 * [jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype)]],
        # Flat operand indices: None operands do not count, and the pools come before the optional ones.
        input_output_aliases={3: 1, 4: 2},
        compiler_params=triton_params(config.num_warps, num_stages=1),  # no loop to pipeline
        interpret=interpret,
        name="qkv_rope_cache",
    )(qkv, positions, slots, k_pages, v_pages, cos_sin, q_norm, k_norm)
