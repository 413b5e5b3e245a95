"""Paged attention over the KV page pool, one kernel for prefill, chunked prefill and decode.

k_pages, v_pages: [num_pages, Hkv, page_size, D]: a (page, KV head) tile is one contiguous run, streamed whole by the
program of its KV head. q: [B, T, Hq, D]: row b's q_lens[b] new tokens, their KV written, sit at positions
seq_lens[b] - q_lens[b] + t and attend causally; padding tokens give zeros. Query head h reads KV head h // (Hq // Hkv).
"""
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._compat import check_pow2, check_vector, dot, is_power_of_2, load, num_sms, store, triton_params


def gather_pages(pages, table):
    """pages [num_pages, Hkv, S, D] at table [..., P] -> the references' f32 KV rows [..., Hkv, P * S, D]."""
    x = jnp.moveaxis(pages[table], -3, -4)
    return x.reshape(*x.shape[:-3], -1, x.shape[-1]).astype(jnp.float32)


def paged_attention_reference(q, k_pages, v_pages, page_table, seq_lens, q_lens, *, scale):
    """Plain jnp, f32 math: q [B, T, Hq, D], page_table [B, P], seq_lens, q_lens [B] -> [B, T, Hq, D] in q.dtype."""
    batch, q_tokens, num_q_heads, head_dim = q.shape
    _, num_kv_heads, page_size, _ = k_pages.shape
    group = num_q_heads // num_kv_heads
    k, v = gather_pages(k_pages, page_table), gather_pages(v_pages, page_table)
    qg = q.reshape(batch, q_tokens, num_kv_heads, group, head_dim).astype(jnp.float32)
    scores = jnp.einsum("btgrd,bgkd->bgrtk", qg, k, precision=jax.lax.Precision.HIGHEST) * scale

    t = jnp.arange(q_tokens)
    q_pos = (seq_lens - q_lens)[:, None] + t[None, :]  # [B, T]
    k_pos = jnp.arange(page_table.shape[1] * page_size)
    valid_q = t[None, :] < q_lens[:, None]  # [B, T]
    mask = ((k_pos[None, None, :] <= q_pos[:, :, None]) & valid_q[:, :, None])[:, None, None]  # [B, 1, 1, T, ctx]
    scores = jnp.where(mask, scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    probs = jnp.where(mask, jnp.exp(scores - jnp.where(jnp.isfinite(row_max), row_max, 0.0)), 0.0)
    denom = jnp.sum(probs, axis=-1, keepdims=True)
    probs = probs / jnp.where(denom > 0, denom, 1.0)
    out = jnp.einsum("bgrtk,bgkd->btgrd", probs, v, precision=jax.lax.Precision.HIGHEST)
    return out.reshape(batch, q_tokens, num_q_heads, head_dim).astype(q.dtype)


# A program owns (sequence, query block, KV head, KV split), rows (token, query head): a K/V tile feeds every head that
# reads it, and decode's few heads pad to tl.dot's 16 rows. K/V rows are gathered: block_k does not depend on pages.

_LOG2E = math.log2(math.e)
# Finite "minus infinity": exp2(_MASK - m) == 0 and _MASK - _MASK == 0, so masked rows never make inf - inf = NaN.
_MASK = -1e30
# Tables from this long, in grids of 2-4 programs per SM, take doubled tiles unsplit (see _kv_tiling).
_LONG_KV_TOKENS = 4096


@dataclasses.dataclass(frozen=True)
class PagedAttentionConfig:
    """block_m: query rows a program at most; block_k: KV tokens a loop step; k_splits: programs sharing a query
    block's KV tiles (flash decoding), None for the automatic tiling (_kv_tiling)."""
    block_m: int = 128
    block_k: int = 64
    k_splits: int | None = 1
    num_warps: int = 8
    num_stages: int = 5

    def __post_init__(self):
        check_pow2(self, ("block_m", "block_k"), minimum=16)
        if self.k_splits is not None and self.k_splits < 1:
            raise ValueError(f"k_splits must be None or >= 1, got {self.k_splits}")


# Decode is memory-bound. Triton's pipeliner splits the stages between the page-table load and the K/V loads behind
# it: 5 stages give K/V two buffers (one computing, one in flight), fewer give one and no overlap.
DECODE_CONFIG = PagedAttentionConfig(block_m=16, block_k=64, k_splits=None, num_warps=4, num_stages=5)
# Prefill is compute-bound: FlashAttention-2's 128 x 64 tiles.
PREFILL_CONFIG = PagedAttentionConfig()
# Up to FEW_TOKENS a row (speculative verification) read as decode does: the KV split over the SMs.
FEW_TOKENS, FEW_TOKENS_CONFIG = 32, PagedAttentionConfig(block_k=64, k_splits=None, num_warps=4, num_stages=5)


def _default_config(config, dtype):
    """config, with block_m and block_k halved for f32: its tiles fit shared memory and its operands registers."""
    return config if jnp.dtype(dtype).itemsize <= 2 else dataclasses.replace(
        config, block_m=max(16, config.block_m // 2), block_k=max(16, config.block_k // 2))


def _query_rows(first_token, kv_head, block_m, group, group_pad):
    """-> token, query head, head_ok: each [block_m], of this program's rows."""
    rows = jnp.arange(block_m)
    slot = lax.rem(rows, group_pad)
    return first_token + lax.div(rows, group_pad), kv_head * group + slot, slot < group


def _tiles_of_split(end, split, k_splits, block_k):
    """The tiles ending by `end` this split takes, round-robin: its first tile is known before the length is. lax.div
    rounds up a non-negative count without the floor-rounding fix-ups of jnp's //."""
    tiles = jnp.maximum(lax.div(end, block_k) - split, 0)
    return lax.div(tiles + (k_splits - 1), k_splits)


def _load_kv_tile(k_ref, v_ref, page_table_ref, pos, valid, *, decode=False):
    """K and V rows of positions pos [N] -> two [N, D] tiles. Masked loads keep stale NaN slots out (0 * NaN is NaN).
    decode: table entries (clamped) and K load unmasked, beside the length's load; the caller masks the scores."""
    num_pages, page_size, head_dim = k_ref.shape
    entry = lax.div(pos, page_size)
    if valid is None:
        page = load(page_table_ref.at[entry])
    elif decode:
        page = jnp.clip(load(page_table_ref.at[jnp.minimum(entry, page_table_ref.shape[0] - 1)]), 0, num_pages - 1)
    else:
        page = load(page_table_ref.at[entry], mask=valid, other=0)
    idx = (page[:, None], lax.rem(pos, page_size)[:, None], jnp.arange(head_dim)[None, :])
    v_mask = {} if valid is None else {"mask": valid[:, None], "other": 0.0}
    k_mask = {} if valid is None or decode else v_mask
    return load(k_ref.at[idx], **k_mask), load(v_ref.at[idx], **v_mask)


def _attend(q, q_pos, row_ok, k_ref, v_ref, page_table_ref, split, k_splits, kv_end, full_end, *, block_k, scale,
            decode, kv_start=0):
    """Online softmax (log2 units) of q [M, D] over this split's tiles of [kv_start, kv_end) -> o [M, D], m, l [M].
    Tiles ending by full_end skip the mask (garbage in rows not row_ok); decode runs one masked loop of 1+ steps."""
    def body(j, carry, masked):
        o, m, l = carry
        pos = kv_start + (split + j * k_splits) * block_k + jnp.arange(block_k)
        valid = pos < kv_end if masked else None
        k, v = _load_kv_tile(k_ref, v_ref, page_table_ref, pos, valid, decode=decode)
        s = dot(q, k, trans_b=True) * (scale * _LOG2E)  # [M, block_k]
        if masked:
            mask = row_ok[:, None] & (pos[None, :] <= q_pos[:, None]) & valid[None, :]
            s = jnp.where(mask, s, _MASK)
        m_new = jnp.maximum(m, s.max(axis=1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(s - m_new[:, None])
        if masked:  # explicit zeros: in a row with nothing valid yet s - m_new == 0, and exp2 would count it as 1
            p = jnp.where(mask, p, 0.0)
        return alpha[:, None] * o + dot(p.astype(v.dtype), v), m_new, alpha * l + p.sum(axis=1)

    block_m, head_dim = q.shape
    init = (jnp.zeros((block_m, head_dim), jnp.float32), jnp.full((block_m,), _MASK, jnp.float32),
            jnp.zeros((block_m,), jnp.float32))
    num_tiles = _tiles_of_split(kv_end - kv_start + block_k - 1, split, k_splits, block_k)  # starting before kv_end
    if decode:
        return lax.fori_loop(0, jnp.maximum(num_tiles, 1), functools.partial(body, masked=True), init)
    num_full = _tiles_of_split(full_end - kv_start, split, k_splits, block_k)
    carry = lax.fori_loop(0, num_full, functools.partial(body, masked=False), init)
    return lax.fori_loop(num_full, num_tiles, functools.partial(body, masked=True), carry)


def _merge_pieces(o, m, l, row_ok, kv_head, group, pieces_refs):
    """Decode's epilogue for cascade_attention: o [M, D], m, l [M] (row r: query head kv_head * group + r) merged with
    the sequence's first `count` pieces. pieces_refs: o [W, Hq, D], m, l [W, Hq] f32, count [] int32."""
    po_ref, pm_ref, pl_ref, count_ref = pieces_refs
    num_items, _, head_dim = po_ref.shape
    rows = jnp.arange(o.shape[0])
    head = kv_head * group + rows
    item = jnp.arange(pl.next_power_of_2(num_items))
    used = (item < jnp.minimum(count_ref[...], num_items))[:, None] & (row_ok & (rows < group))[None, :]  # [J, M]
    pm = load(pm_ref.at[item[:, None], head[None, :]], mask=used, other=_MASK)
    pl_ = load(pl_ref.at[item[:, None], head[None, :]], mask=used, other=0.0)
    m_all = jnp.maximum(m, pm.max(axis=0))
    weight = jnp.where(used, jnp.exp2(pm - m_all[None, :]), 0.0)  # [J, M]
    own = jnp.exp2(m - m_all)
    o = own[:, None] * o
    d = jnp.arange(head_dim)
    for r in range(group):  # one [J, D] load per query head (a column of `weight` is a masked reduction in Triton)
        w_r = jnp.sum(jnp.where(rows[None, :] == r, weight, 0.0), axis=1)  # [J]
        po = load(po_ref.at[item[:, None], kv_head * group + r, d[None, :]], mask=(w_r > 0)[:, None], other=0.0)
        o = o + jnp.where((rows == r)[:, None], jnp.sum(w_r[:, None] * po.astype(jnp.float32), axis=0)[None, :], 0.0)
    return o, m_all, own * l + jnp.sum(weight * pl_, axis=0)


def _paged_attention_kernel(q_ref, k_ref, v_ref, page_table_ref, seq_len_ref, q_len_ref, kv_start_ref, pieces_refs,
                            o_ref, *stat_refs, block_m, group, group_pad, block_k, k_splits, scale):
    # q_ref: [T, Hq, D]; k_ref, v_ref: [num_pages, S, D] this KV head's pool; page_table_ref: [P]
    # seq_len_ref, q_len_ref: [] (q_len_ref None: decode); kv_start_ref: [] first KV position, or None (0)
    # pieces_refs: None, or shared pieces to merge (_merge_pieces); o_ref: [T, Hq, D]
    # stat_refs: () or (m_ref, l_ref) [T, Hq] f32; with them o_ref holds this split's unnormalized f32 output
    num_tokens, _, head_dim = q_ref.shape
    # The heaviest (last, causal) query blocks launch first: a shorter tail of the grid.
    q_block = pl.num_programs(1) - 1 - pl.program_id(1)
    kv_head = pl.program_id(2)
    split = pl.program_id(3) if k_splits > 1 else 0
    block_tokens = block_m // group_pad
    first_token = q_block * block_tokens
    token, head, head_ok = _query_rows(first_token, kv_head, block_m, group, group_pad)
    seq_len = seq_len_ref[...]
    # Decode: one new token per live sequence; a padding row (seq_len 0) has none.
    q_len = jnp.minimum(seq_len, 1) if q_len_ref is None else q_len_ref[...]
    row_ok = head_ok & (token < q_len)
    idx = (token[:, None], head[:, None], jnp.arange(head_dim)[None, :])
    q = load(q_ref.at[idx], mask=row_ok[:, None], other=0.0)
    # The block attends up to its last valid query (causal); a block of padding tokens to nothing.
    last_token = jnp.minimum(q_len, first_token + block_tokens)
    kv_end = jnp.where(first_token < q_len, seq_len - q_len + last_token, 0)
    # Every row sees the positions up to the block's first token: unmasked tiles end there.
    full_end = jnp.minimum(kv_end, seq_len - q_len + first_token + 1)
    o, m, l = _attend(q, seq_len - q_len + token, row_ok, k_ref, v_ref, page_table_ref, split, k_splits, kv_end,
                      full_end, block_k=block_k, scale=scale, decode=q_len_ref is None,
                      kv_start=0 if kv_start_ref is None else kv_start_ref[...])
    o, l = jnp.where(row_ok[:, None], o, 0.0), jnp.where(row_ok, l, 0.0)
    if pieces_refs is not None:
        o, m, l = _merge_pieces(o, m, l, row_ok, kv_head, group, pieces_refs)
    out_ok = head_ok & (token < num_tokens)  # padding tokens are written too: as zeros (l == 0, o == 0)
    if stat_refs:
        store(o_ref.at[idx], o, mask=out_ok[:, None])
        for ref, x in zip(stat_refs, (m, l)):
            store(ref.at[token, head], x, mask=out_ok)
    else:
        store(o_ref.at[idx], (o / jnp.where(l > 0, l, 1.0)[:, None]).astype(o_ref.dtype), mask=out_ok[:, None])


def combine_splits_reference(o, m, l, dtype):
    """Log-sum-exp merge of per-split results: o [splits, ..., D] unnormalized, m and l [splits, ...] -> [..., D]."""
    weight = jnp.exp2(m - m.max(axis=0))  # <= 1; empty splits have l == 0 and o == 0 and drop out
    denom = (weight * l).sum(axis=0)
    out = (weight[..., None] * o).sum(axis=0) / jnp.where(denom > 0, denom, 1.0)[..., None]
    return out.astype(dtype)


def _combine_splits_kernel(o_ref, m_ref, l_ref, out_ref):
    # o_ref: [k_splits, D] f32 unnormalized; m_ref, l_ref: [k_splits] f32; out_ref: [D]
    k_splits, head_dim = o_ref.shape
    split = jnp.arange(pl.next_power_of_2(k_splits))
    ok = split < k_splits
    m = load(m_ref.at[split], mask=ok, other=_MASK)
    l = load(l_ref.at[split], mask=ok, other=0.0)
    o = load(o_ref.at[split[:, None], jnp.arange(head_dim)[None, :]], mask=ok[:, None], other=0.0)
    # Padding lanes, as empty splits, have l == 0 and o == 0.
    store(out_ref.at[jnp.arange(head_dim)], combine_splits_reference(o, m, l, out_ref.dtype))


def _combine_splits(o, m, l, dtype, interpret):
    """combine_splits_reference in one kernel (docs/perf_notes.md, "Decode attention: loads, and the split merge")."""
    k_splits, batch, num_tokens, num_q_heads, head_dim = o.shape
    stat_spec = pl.BlockSpec((k_splits, None, None, None), lambda b, t, h: (0, b, t, h))
    return pl.pallas_call(
        _combine_splits_kernel,
        grid=(batch, num_tokens, num_q_heads),
        in_specs=[pl.BlockSpec((k_splits, None, None, None, head_dim), lambda b, t, h: (0, b, t, h, 0)), stat_spec,
                  stat_spec],
        out_specs=pl.BlockSpec((None, None, None, head_dim), lambda b, t, h: (b, t, h, 0)),
        out_shape=jax.ShapeDtypeStruct(o.shape[1:], dtype),
        compiler_params=triton_params(num_warps=4, num_stages=1),
        interpret=interpret,
        name="combine_splits",
    )(o, m, l)


def _kv_tiling(config, programs, max_kv_tokens, itemsize):
    """-> (block_k, k_splits) (docs/perf_notes.md, "Decode attention: splits and tile sizes")."""
    if config.k_splits is not None:
        return config.block_k, config.k_splits
    sms = num_sms()
    long_grid = 2 * sms <= programs < 4 * sms and max_kv_tokens >= _LONG_KV_TOKENS
    two_tiles = programs < sms and config.block_k < max_kv_tokens <= 2 * config.block_k
    if itemsize <= 2 and (long_grid or two_tiles):
        return 2 * config.block_k, 1
    return config.block_k, max(1, min(sms // programs, max_kv_tokens // config.block_k))


def _num_stages(config, block_k, k_splits, max_kv_tokens):
    """Auto tiling: the loop's steps + 1 at most (docs/perf_notes.md, "Decode attention: pipeline depth and warps")."""
    if config.k_splits is not None:
        return config.num_stages
    return min(config.num_stages, pl.cdiv(pl.cdiv(max_kv_tokens, block_k), k_splits) + 1)


def _paged_attention(q, k_pages, v_pages, page_table, seq_lens, q_lens, *, scale, config, interpret, kv_starts=None,
                     stats=False, pieces=None):
    """q: [B, T, Hq, D] -> [B, T, Hq, D]; q_lens None: decode. stats: the splits' f32 pieces, unmerged. pieces:
    (decode, one split) o [W, B, Hq, D], m, l [W, B, Hq], counts [B]: row b's first counts[b] merged into it."""
    batch, num_tokens, num_q_heads, head_dim = q.shape
    num_pages, num_kv_heads, page_size, _ = k_pages.shape
    pages_per_seq = page_table.shape[1]
    group = num_q_heads // num_kv_heads
    group_pad = pl.next_power_of_2(group)
    block_m = max(16, group_pad, min(config.block_m, pl.next_power_of_2(num_tokens * group_pad)))
    q_blocks = pl.cdiv(num_tokens, block_m // group_pad)
    table_tokens = pages_per_seq * page_size
    block_k, k_splits = _kv_tiling(config, batch * q_blocks * num_kv_heads, table_tokens, k_pages.dtype.itemsize)
    if pieces is not None and (q_lens is not None or k_splits != 1 or stats):
        raise ValueError("pieces are merged by decode with one KV split and no stats")

    seq_spec = pl.BlockSpec((None,), lambda b, i, h, s: (b,))
    kv_spec = pl.BlockSpec((num_pages, None, page_size, head_dim), lambda b, i, h, s: (0, h, 0, 0))
    q_spec = pl.BlockSpec((None, *q.shape[1:]), lambda b, i, h, s: (b, 0, 0, 0))
    in_specs = [q_spec, kv_spec, kv_spec, pl.BlockSpec((None, pages_per_seq), lambda b, i, h, s: (b, 0)),
                seq_spec, None if q_lens is None else seq_spec, None if kv_starts is None else seq_spec, None]
    if pieces is not None:
        num_items = pieces[0].shape[0]
        in_specs[-1] = (pl.BlockSpec((num_items, None, num_q_heads, head_dim), lambda b, i, h, s: (0, b, 0, 0)),
                        *2 * [pl.BlockSpec((num_items, None, num_q_heads), lambda b, i, h, s: (0, b, 0))], seq_spec)
    if k_splits == 1 and not stats:
        out_specs, out_shape = q_spec, jax.ShapeDtypeStruct(q.shape, q.dtype)
    else:
        out_specs = [pl.BlockSpec((None, None, *q.shape[1:]), lambda b, i, h, s: (s, b, 0, 0, 0))] + 2 * [
            pl.BlockSpec((None, None, num_tokens, num_q_heads), lambda b, i, h, s: (s, b, 0, 0))]
        out_shape = [jax.ShapeDtypeStruct((k_splits, *q.shape), jnp.float32)] + 2 * [
            jax.ShapeDtypeStruct((k_splits, *q.shape[:-1]), jnp.float32)]
    kernel = functools.partial(_paged_attention_kernel, block_m=block_m, group=group, group_pad=group_pad,
                               block_k=block_k, k_splits=k_splits, scale=scale)
    out = pl.pallas_call(
        kernel,
        grid=(batch, q_blocks, num_kv_heads, k_splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=triton_params(config.num_warps, _num_stages(config, block_k, k_splits, table_tokens)),
        interpret=interpret,
        name="paged_attention",
    )(q, k_pages, v_pages, page_table, seq_lens, q_lens, kv_starts, None if pieces is None else tuple(pieces))
    return out if stats or k_splits == 1 else _combine_splits(*out, q.dtype, interpret)


def check_kv_pages(x_name, x, k_pages, v_pages):
    if k_pages.ndim != 4 or v_pages.shape != k_pages.shape:
        raise ValueError(f"k_pages and v_pages must both be [num_pages, Hkv, page_size, D], got {k_pages.shape} "
                         f"and {v_pages.shape}")
    if not x.dtype == k_pages.dtype == v_pages.dtype or not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{x_name}, k_pages and v_pages must share one float dtype, got {x.dtype}, {k_pages.dtype} "
                         f"and {v_pages.dtype}")


def _check_inputs(q, k_pages, v_pages, page_table, seq_lens, q_lens, kv_starts=None):
    """Raises ValueError for inputs the kernel cannot take; q: [B, Hq, D] if q_lens is None (decode), else 4-D."""
    if q.ndim != (3 if q_lens is None else 4):
        layout = "[batch, num_q_heads, head_dim]" if q_lens is None else "[batch, q_tokens, num_q_heads, head_dim]"
        raise ValueError(f"q must be {layout}, got shape {q.shape}")
    check_kv_pages("q", q, k_pages, v_pages)
    batch, num_q_heads, head_dim = q.shape[0], q.shape[-2], q.shape[-1]
    _, num_kv_heads, page_size, kv_head_dim = k_pages.shape
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if head_dim != kv_head_dim or head_dim < 16 or not is_power_of_2(head_dim):
        raise ValueError(f"head_dim must match ({head_dim} vs {kv_head_dim}) and be a power of two >= 16")
    if not is_power_of_2(page_size):
        raise ValueError(f"page_size must be a power of two, got {page_size}")
    if page_table.ndim != 2 or page_table.shape[0] != batch or page_table.dtype != jnp.int32:
        raise ValueError(f"page_table must be int32 [{batch}, pages_per_seq], got {page_table.dtype}{page_table.shape}")
    for name, lens in (("seq_lens", seq_lens), ("q_lens", q_lens), ("kv_starts", kv_starts)):
        if lens is not None:
            check_vector(name, lens, batch)


@functools.partial(jax.jit, static_argnames=("scale", "config", "interpret", "return_stats"))
def paged_decode_attention(q, k_pages, v_pages, page_table, seq_lens, *, scale, config=None, interpret=False,
                           kv_starts=None, return_stats=False):
    """paged_attention_reference for one new token a sequence (seq_lens 0: padding); kv_starts: first positions.
    return_stats: the splits' unmerged o [k_splits, B, Hq, D], m, l [k_splits, B, Hq] (empty: 0, _MASK, 0)."""
    _check_inputs(q, k_pages, v_pages, page_table, seq_lens, None, kv_starts)
    config = config or _default_config(DECODE_CONFIG, q.dtype)
    out = _paged_attention(q[:, None], k_pages, v_pages, page_table, seq_lens, None, scale=scale, config=config,
                           interpret=interpret, kv_starts=kv_starts, stats=return_stats)
    return tuple(x[:, :, 0] for x in out) if return_stats else out[:, 0]


@functools.partial(jax.jit, static_argnames=("scale", "config", "interpret"))
def paged_prefill_attention(q, k_pages, v_pages, page_table, seq_lens, q_lens, *, scale, config=None, interpret=False):
    """paged_attention_reference for ragged chunked prefill: q_lens <= T and q_lens <= seq_lens <= P * page_size."""
    _check_inputs(q, k_pages, v_pages, page_table, seq_lens, q_lens)
    config = config or _default_config(FEW_TOKENS_CONFIG if q.shape[1] <= FEW_TOKENS else PREFILL_CONFIG, q.dtype)
    return _paged_attention(q, k_pages, v_pages, page_table, seq_lens, q_lens, scale=scale, config=config,
                            interpret=interpret)
