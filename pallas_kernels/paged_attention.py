"""Paged attention over the KV page pool.

KV page layout (shared by the model, the cache writer and the kernels):
    k_pages, v_pages: [num_pages, num_kv_heads, page_size, head_dim]
A page holds `page_size` consecutive tokens of one sequence for all KV heads. Each (page, kv_head) tile is one
contiguous page_size x head_dim run, so a kernel program that owns one KV head streams whole tiles with wide,
coalesced loads, and a page (all heads) is one contiguous block for the cache writer and for page copies.

Query layout (prefill, chunked prefill and decode alike):
    q: [batch, q_tokens, num_q_heads, head_dim], padded per sequence.
Row b holds q_lens[b] new tokens whose KV is already written; token t of row b sits at absolute position
seq_lens[b] - q_lens[b] + t and attends to cached positions 0..that position (causal). Rows t >= q_lens[b] are
padding and come out as zeros. Query head h reads KV head h // (num_q_heads // num_kv_heads), as HF's repeat_kv.
"""
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._compat import dot, is_power_of_2, load, store, num_sms, triton_params


def paged_attention_reference(q, k_pages, v_pages, page_table, seq_lens, q_lens, *, scale):
    """Plain jnp paged attention.

    q: [B, T, Hq, D]; k_pages, v_pages: [num_pages, Hkv, S, D]; page_table: [B, pages_per_seq] int32;
    seq_lens, q_lens: [B] int32. Returns [B, T, Hq, D] in q.dtype (f32 math).
    """
    batch, q_tokens, num_q_heads, head_dim = q.shape
    _, num_kv_heads, page_size, _ = k_pages.shape
    group = num_q_heads // num_kv_heads
    pages_per_seq = page_table.shape[1]
    ctx = pages_per_seq * page_size

    def gather(pages):  # -> [B, Hkv, ctx, D]
        seq_pages = pages[page_table]  # [B, P, Hkv, S, D]
        return seq_pages.transpose(0, 2, 1, 3, 4).reshape(batch, num_kv_heads, ctx, head_dim).astype(jnp.float32)

    k, v = gather(k_pages), gather(v_pages)
    qg = q.reshape(batch, q_tokens, num_kv_heads, group, head_dim).astype(jnp.float32)
    scores = jnp.einsum("btgrd,bgkd->bgrtk", qg, k, precision=jax.lax.Precision.HIGHEST) * scale

    t = jnp.arange(q_tokens)
    q_pos = (seq_lens - q_lens)[:, None] + t[None, :]  # [B, T]
    k_pos = jnp.arange(ctx)
    valid_q = t[None, :] < q_lens[:, None]  # [B, T]
    mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & valid_q[:, :, None]  # [B, T, ctx]
    mask = mask[:, None, None]  # [B, 1, 1, T, ctx]
    scores = jnp.where(mask, scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    probs = jnp.where(mask, jnp.exp(scores - jnp.where(jnp.isfinite(row_max), row_max, 0.0)), 0.0)
    denom = jnp.sum(probs, axis=-1, keepdims=True)
    probs = probs / jnp.where(denom > 0, denom, 1.0)
    out = jnp.einsum("bgrtk,bgkd->btgrd", probs, v, precision=jax.lax.Precision.HIGHEST)
    return out.reshape(batch, q_tokens, num_q_heads, head_dim).astype(q.dtype)


# ---------------------------------------------------------------------------------------------------------------------
# Pallas (Triton) kernel.
#
# One kernel serves decode and prefill. A program owns (sequence, query block, KV head, KV split). Its query rows are
# (token, query head) pairs of that KV head, `group_pad` = next_pow2(group) rows per token: one K/V tile then feeds
# every query head that reads it (GQA), and decode's 1..8 heads are padded to the >= 16 rows that tl.dot needs.
# K/V rows are gathered token by token through the page table, so block_k is independent of page_size (8-token pages
# work, and a 256-token page is streamed in block_k slices). The softmax runs online, in log2 units.

_LOG2E = math.log2(math.e)
# Finite "minus infinity": exp2(_MASK - m) == 0 for any real m and _MASK - _MASK == 0, so fully masked rows and empty
# splits never produce inf - inf = NaN.
_MASK = -1e30
# A grid of 2-4 programs per SM over long sequences streams them in 2x deeper KV tiles, unsplit: its last, partly
# filled wave then takes half the loop steps (docs/perf_notes.md, "Decode attention: splits and tile sizes").
_LONG_KV_TOKENS = 4096


@dataclasses.dataclass(frozen=True)
class PagedAttentionConfig:
    """Tiling of the paged attention kernel.

    block_m: query rows per program, an upper bound (shrunk to the chunk, never below 16); a power of two.
    block_k: KV tokens per inner-loop step; a power of two >= 16, independent of page_size.
    k_splits: programs sharing one query block's KV tiles, dealt round-robin (flash decoding); None picks one
        program per SM, and doubles block_k, unsplit, for grids of 2-4 programs per SM with long sequences and
        for grids under one wave over tables of two tiles (see _kv_tiling), and caps num_stages for short loops
        (see _num_stages).
    """
    block_m: int = 128
    block_k: int = 64
    k_splits: int | None = 1
    num_warps: int = 8
    num_stages: int = 5

    def __post_init__(self):
        if not all(is_power_of_2(b) and b >= 16 for b in (self.block_m, self.block_k)):
            raise ValueError(f"block_m and block_k must be powers of two >= 16, got {self}")
        if self.k_splits is not None and self.k_splits < 1:
            raise ValueError(f"k_splits must be None or >= 1, got {self.k_splits}")


# num_stages: the page-table load is one level of indirection in front of the K/V loads, and Triton's pipeliner
# splits the stages between the two; 5 stages give K/V two buffers (one tile computing, one in flight), fewer give one
# buffer and no overlap of loads with compute inside a program (checked on Triton 3.6 TTGIR for sm_90).
# Decode is memory-bound: 16 rows, 2 x 16 KiB K/V tiles (D=128, bf16), ~72 KiB shared memory, k_splits fills the GPU.
DECODE_CONFIG = PagedAttentionConfig(block_m=16, block_k=64, k_splits=None, num_warps=4, num_stages=5)
# Prefill is compute-bound: FlashAttention-2's usual 128 x 64 tiles.
PREFILL_CONFIG = PagedAttentionConfig()


def _default_config(config, dtype):
    """config (DECODE_CONFIG or PREFILL_CONFIG, sized for 2-byte dtypes), with block_m and block_k halved for f32
    so that the pipelined tiles fit in shared memory and the f32 operands in registers (no spills at D=128)."""
    if jnp.dtype(dtype).itemsize <= 2:
        return config
    return dataclasses.replace(config, block_m=max(16, config.block_m // 2), block_k=max(16, config.block_k // 2))


def _cdiv(a, b):
    """Ceil division of non-negative traced ints with lax.div (jnp's // adds floor-rounding fix-ups)."""
    return lax.div(a + (b - 1), b)


def _query_rows(first_token, kv_head, block_m, group, group_pad):
    """-> token, query head, head_ok: each [block_m], for this program's query rows."""
    rows = jnp.arange(block_m)
    slot = lax.rem(rows, group_pad)
    return first_token + lax.div(rows, group_pad), kv_head * group + slot, slot < group


def _kv_end(seq_len, q_len, first_token, block_tokens):
    """-> the end of the KV positions a query block attends to. Causal skip: the block needs the positions up to its
    last valid query, a block of padding tokens none."""
    last_token = jnp.minimum(q_len, first_token + block_tokens)
    return jnp.where(first_token < q_len, seq_len - q_len + last_token, 0)


def _tiles_of_split(end, split, k_splits, block_k):
    """How many of the block_k tiles that end by `end` (tile t covers [t * block_k, (t + 1) * block_k)) go to this
    split. Tiles are dealt round-robin, split s takes s, s + k_splits, ...: every split's first tile then sits at a
    position known before the length is loaded (contiguous chunks start at a multiple of length / k_splits), which
    lets decode fetch it early (see _load_kv_tile), and the splits' work differs by at most one tile."""
    return _cdiv(jnp.maximum(lax.div(end, block_k) - split, 0), k_splits)


def _load_kv_tile(k_ref, v_ref, page_table_ref, pos, valid, *, decode=False):
    """Gathers the K and V rows of KV positions pos [N] -> two [N, D] tiles (valid None: all positions are valid).

    Masking the loads, not just the scores, keeps stale or NaN cache slots and unused page-table entries out: a masked
    lane is never read, whereas a 0 probability times a NaN V row would poison the output.
    decode: the page-table entries and K rows are read unmasked (table entries and page ids clamped, so every lane
    reads inside the pool), and only V waits for `valid`. Valid depends on the sequence's length, a load of its own:
    unmasked, a program's first page-table and K loads go out together with the length's instead of after it. The
    caller masks the scores of invalid positions (jnp.where selects, so a NaN K row drops out).
    """
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
            decode, kv_start=None):
    """Online softmax of q [M, D] over this split's tiles of the KV positions [kv_start, kv_end), causal on q_pos [M].

    kv_start None means 0 (the trace is then the one without it). Tiles start at kv_start, not at a multiple of
    block_k: a range that starts mid-tile (a cascade piece, a suffix behind shared pages) takes no extra tile.

    Prefill: tiles that end by full_end hold only positions every row sees, so they run without the mask (no compare
    or select on the [M, block_k] scores); rows that are not row_ok get garbage there, which the caller zeroes.
    Decode (block_m 16, little compute per tile): one loop of masked tiles loaded as _load_kv_tile's decode, at least
    one step, so that the first tile's loads need not wait for the length to know whether there is one
    (docs/perf_notes.md, "Decode attention: loads, and the split merge").
    -> o [M, D] f32 unnormalized, m [M] running max (log2 units), l [M] softmax denominator.
    """
    def body(j, carry, masked):
        o, m, l = carry
        pos = (split + j * k_splits) * block_k + jnp.arange(block_k)
        pos = pos if kv_start is None else kv_start + pos
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

    def span(end):  # positions from kv_start to end
        return end if kv_start is None else end - kv_start

    num_tiles = _tiles_of_split(span(kv_end) + block_k - 1, split, k_splits, block_k)  # tiles starting before kv_end
    if decode:
        return lax.fori_loop(0, jnp.maximum(num_tiles, 1), functools.partial(body, masked=True), init)
    num_full = _tiles_of_split(span(full_end), split, k_splits, block_k)
    carry = lax.fori_loop(0, num_full, functools.partial(body, masked=False), init)
    return lax.fori_loop(num_full, num_tiles, functools.partial(body, masked=True), carry)


def _merge_pieces(o, m, l, row_ok, kv_head, group, pieces_refs):
    """Decode's epilogue for a sequence's shared pieces (cascade_attention): the log-sum-exp merge of this program's
    o [M, D], m, l [M] (row r < group: query head kv_head * group + r of the one token) with the sequence's first
    `count` pieces. pieces_refs: o_ref [W, Hq, D] unnormalized, m_ref, l_ref [W, Hq] f32, count_ref [] int32.
    -> the merged (o, m, l)."""
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
    # q_ref: [T, Hq, D] this sequence's queries
    # k_ref, v_ref: [num_pages, S, D] the page pool of this program's KV head
    # page_table_ref: [P] this sequence's pages
    # seq_len_ref, q_len_ref: [] cached tokens (this chunk included) and new tokens; q_len_ref is None for decode
    # kv_start_ref: [] the first KV position attended to (decode only), or None for 0
    # pieces_refs: None, or (decode, one split) this sequence's shared pieces merged into the output: o [W, Hq, D]
    #   unnormalized, m, l [W, Hq] f32, count [] int32 (its first count pieces hold one); see _merge_pieces
    # o_ref: [T, Hq, D] the output, or (with stat_refs) this split's f32 unnormalized output
    # stat_refs: () or (m_ref, l_ref), each [T, Hq] f32: this split's running max (log2 units) and denominator
    num_tokens, _, head_dim = q_ref.shape
    # Query blocks in reverse: causal work grows with the block index, and launching the heaviest first shortens the
    # tail of the grid.
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
    kv_end = _kv_end(seq_len, q_len, first_token, block_tokens)
    # Every row sees the positions up to the block's first token: unmasked tiles end there.
    full_end = jnp.minimum(kv_end, seq_len - q_len + first_token + 1)
    o, m, l = _attend(q, seq_len - q_len + token, row_ok, k_ref, v_ref, page_table_ref, split, k_splits, kv_end,
                      full_end, block_k=block_k, scale=scale, decode=q_len_ref is None,
                      kv_start=None if kv_start_ref is None else kv_start_ref[...])
    o, l = jnp.where(row_ok[:, None], o, 0.0), jnp.where(row_ok, l, 0.0)
    if pieces_refs is not None:
        o, m, l = _merge_pieces(o, m, l, row_ok, kv_head, group, pieces_refs)
    out_ok = head_ok & (token < num_tokens)  # padding tokens are written too: as zeros (l == 0, o == 0)
    if stat_refs:
        m_ref, l_ref = stat_refs
        store(o_ref.at[idx], o, mask=out_ok[:, None])
        store(m_ref.at[token, head], m, mask=out_ok)
        store(l_ref.at[token, head], l, mask=out_ok)
    else:
        store(o_ref.at[idx], (o / jnp.where(l > 0, l, 1.0)[:, None]).astype(o_ref.dtype), mask=out_ok[:, None])


def combine_splits_reference(o, m, l, dtype):
    """Log-sum-exp merge of per-split results: o [splits, ..., D] unnormalized, m and l [splits, ...] -> [..., D]."""
    weight = jnp.exp2(m - m.max(axis=0))  # <= 1; empty splits have l == 0 and o == 0 and drop out
    denom = (weight * l).sum(axis=0)
    out = (weight[..., None] * o).sum(axis=0) / jnp.where(denom > 0, denom, 1.0)[..., None]
    return out.astype(dtype)


def _combine_splits_kernel(o_ref, m_ref, l_ref, out_ref):
    # o_ref: [k_splits, D] f32 the splits' unnormalized outputs of one (sequence, token, query head)
    # m_ref, l_ref: [k_splits] f32 their running max (log2 units) and softmax denominator
    # out_ref: [D] the merged output
    k_splits, head_dim = o_ref.shape
    split = jnp.arange(pl.next_power_of_2(k_splits))
    ok = split < k_splits
    m = load(m_ref.at[split], mask=ok, other=_MASK)
    l = load(l_ref.at[split], mask=ok, other=0.0)
    o = load(o_ref.at[split[:, None], jnp.arange(head_dim)[None, :]], mask=ok[:, None], other=0.0)
    weight = jnp.exp2(m - m.max())  # empty splits and padding lanes have l == 0 and o == 0, so they drop out
    denom = (weight * l).sum()
    out = (weight[:, None] * o).sum(axis=0) / jnp.where(denom > 0, denom, 1.0)
    store(out_ref.at[jnp.arange(head_dim)], out.astype(out_ref.dtype))


def _combine_splits(o, m, l, dtype, interpret):
    """combine_splits_reference as one kernel, a program per (sequence, token, query head), where XLA emits up to
    three (docs/perf_notes.md, "Decode attention: loads, and the split merge").
    o: [k_splits, B, T, Hq, D] f32; m, l: [k_splits, B, T, Hq] f32 -> [B, T, Hq, D] in dtype."""
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
    """-> (block_k, k_splits) for a grid of `programs` (sequences x query blocks x KV heads) over page tables of
    max_kv_tokens, for KV of itemsize bytes; config's own when it sets k_splits."""
    if config.k_splits is not None:
        return config.block_k, config.k_splits
    # Doubled tiles, unsplit, for 2-byte KV only (f32's do not fit in shared memory). A table of two tiles under one
    # wave takes one doubled tile: the split merge's launch costs more than the second tile's loads
    # (docs/perf_notes.md, "Decode attention: splits and tile sizes").
    sms = num_sms()
    long_grid = 2 * sms <= programs < 4 * sms and max_kv_tokens >= _LONG_KV_TOKENS
    two_tiles = programs < sms and config.block_k < max_kv_tokens <= 2 * config.block_k
    if itemsize <= 2 and (long_grid or two_tiles):
        return 2 * config.block_k, 1
    # One program per SM, and at most one split per KV tile of the table (the same subject).
    return config.block_k, max(1, min(sms // programs, max_kv_tokens // config.block_k))


def _num_stages(config, block_k, k_splits, max_kv_tokens):
    """-> the pipeline depth for a tiling (block_k, k_splits) over page tables of max_kv_tokens: config's, and for the
    automatic tiling at most one more than the loop's steps: deeper stages only add masked-off prologue loads and
    shared memory that keeps other programs off the SM (docs/perf_notes.md, "Decode attention: pipeline depth and
    warps")."""
    if config.k_splits is not None:
        return config.num_stages
    steps = pl.cdiv(pl.cdiv(max_kv_tokens, block_k), k_splits)
    return min(config.num_stages, steps + 1)


def _paged_attention(q, k_pages, v_pages, page_table, seq_lens, q_lens, *, scale, config, interpret, kv_starts=None,
                     stats=False, pieces=None):
    """q: [B, T, Hq, D] -> [B, T, Hq, D]; q_lens None means decode (q_len = min(seq_len, 1)). kv_starts: None or
    [B] (decode only), each row's first KV position. stats: return the splits' pieces (o [k_splits, B, T, Hq, D],
    m, l [k_splits, B, T, Hq], all f32) instead of their merge. pieces: None, or (decode with k_splits 1) more
    pieces merged into each row's output in the kernel's epilogue: (o [W, B, Hq, D] unnormalized, m, l [W, B, Hq]
    f32, counts [B] int32), of which row b has counts[b] (the first ones; the others are never read)."""
    batch, num_tokens, num_q_heads, head_dim = q.shape
    num_pages, num_kv_heads, page_size, _ = k_pages.shape
    pages_per_seq = page_table.shape[1]
    group = num_q_heads // num_kv_heads
    group_pad = pl.next_power_of_2(group)
    block_m = max(16, group_pad, min(config.block_m, pl.next_power_of_2(num_tokens * group_pad)))
    q_blocks = pl.cdiv(num_tokens, block_m // group_pad)
    table_tokens = pages_per_seq * page_size
    block_k, k_splits = _kv_tiling(config, batch * q_blocks * num_kv_heads, table_tokens, k_pages.dtype.itemsize)
    num_stages = _num_stages(config, block_k, k_splits, table_tokens)
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
        compiler_params=triton_params(config.num_warps, num_stages),
        interpret=interpret,
        name="paged_attention",
    )(q, k_pages, v_pages, page_table, seq_lens, q_lens, kv_starts, None if pieces is None else tuple(pieces))
    if stats or k_splits == 1:
        return out
    return _combine_splits(*out, q.dtype, interpret)


def _check_inputs(q, k_pages, v_pages, page_table, seq_lens, q_lens, kv_starts=None):
    """Raises ValueError for inputs the kernel cannot take; q is [B, T, Hq, D] here."""
    if k_pages.ndim != 4 or v_pages.shape != k_pages.shape:
        raise ValueError(f"k_pages and v_pages must both be [num_pages, Hkv, page_size, D], got {k_pages.shape} "
                         f"and {v_pages.shape}")
    batch, _, num_q_heads, head_dim = q.shape
    _, num_kv_heads, page_size, kv_head_dim = k_pages.shape
    if not q.dtype == k_pages.dtype == v_pages.dtype or not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q, k_pages and v_pages must share one float dtype, got {q.dtype}, {k_pages.dtype}, "
                         f"{v_pages.dtype}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if head_dim != kv_head_dim or head_dim < 16 or not is_power_of_2(head_dim):
        raise ValueError(f"head_dim must match ({head_dim} vs {kv_head_dim}) and be a power of two >= 16")
    if not is_power_of_2(page_size):
        raise ValueError(f"page_size must be a power of two, got {page_size}")
    if page_table.ndim != 2 or page_table.shape[0] != batch or page_table.dtype != jnp.int32:
        raise ValueError(f"page_table must be int32 [{batch}, pages_per_seq], got {page_table.dtype}{page_table.shape}")
    for name, lens in (("seq_lens", seq_lens), ("q_lens", q_lens), ("kv_starts", kv_starts)):
        if lens is not None and (lens.shape != (batch,) or lens.dtype != jnp.int32):
            raise ValueError(f"{name} must be int32 [{batch}], got {lens.dtype}{lens.shape}")


@functools.partial(jax.jit, static_argnames=("scale", "config", "interpret", "return_stats"))
def paged_decode_attention(q, k_pages, v_pages, page_table, seq_lens, *, scale, config=None, interpret=False,
                           kv_starts=None, return_stats=False):
    """One new token per sequence, its KV already in the cache (position seq_lens - 1).

    q: [B, Hq, D]; k_pages, v_pages: [num_pages, Hkv, page_size, D]; page_table: [B, P] int32; seq_lens: [B] int32
    (0 marks a padding row, whose output is zeros). Returns [B, Hq, D] in q.dtype, as paged_attention_reference with
    T = 1 and q_lens = 1. config None: DECODE_CONFIG (smaller blocks for f32).
    kv_starts: None (0), or [B] int32: row b attends to positions kv_starts[b] .. seq_lens[b] - 1 only (the ones
    before are attended elsewhere: cascade_decode_attention's shared prefixes).
    return_stats: return, instead of the output, the KV splits' pieces for a log-sum-exp merge with others:
    (o [k_splits, B, Hq, D] unnormalized, m [k_splits, B, Hq] running max of the scores times scale in log2 units,
    l [k_splits, B, Hq] softmax denominator), all f32; empty pieces have o = 0, m = -1e30, l = 0.
    """
    if q.ndim != 3:
        raise ValueError(f"q must be [batch, num_q_heads, head_dim], got shape {q.shape}")
    _check_inputs(q[:, None], k_pages, v_pages, page_table, seq_lens, None, kv_starts)
    config = config or _default_config(DECODE_CONFIG, q.dtype)
    out = _paged_attention(q[:, None], k_pages, v_pages, page_table, seq_lens, None, scale=scale, config=config,
                           interpret=interpret, kv_starts=kv_starts, stats=return_stats)
    if return_stats:
        return tuple(x[:, :, 0] for x in out)
    return out[:, 0]


@functools.partial(jax.jit, static_argnames=("scale", "config", "interpret"))
def paged_prefill_attention(q, k_pages, v_pages, page_table, seq_lens, q_lens, *, scale, config=None,
                            interpret=False):
    """Ragged chunked prefill with prefix cache: exactly paged_attention_reference (see the module docstring).

    q: [B, T, Hq, D]; k_pages, v_pages: [num_pages, Hkv, page_size, D]; page_table: [B, P] int32;
    seq_lens, q_lens: [B] int32 with q_lens <= T and q_lens <= seq_lens <= P * page_size. Returns [B, T, Hq, D].
    config None: PREFILL_CONFIG (smaller blocks for f32).
    """
    if q.ndim != 4:
        raise ValueError(f"q must be [batch, q_tokens, num_q_heads, head_dim], got shape {q.shape}")
    _check_inputs(q, k_pages, v_pages, page_table, seq_lens, q_lens)
    config = config or _default_config(PREFILL_CONFIG, q.dtype)
    return _paged_attention(q, k_pages, v_pages, page_table, seq_lens, q_lens, scale=scale, config=config,
                            interpret=interpret)
