"""Cascade decode attention: KV pages that several sequences share read once per step for all of them. Work item w
(nanojax.cascade.plan_cascade) covers positions [item_start[w], item_end[w]) of row item_row[w]'s page table, shared
by rows item_members[w, :] (-1: none); member i's piece (return_stats' format) fills slot item_slots[w, i] of its
row. Row b's pieces, in slots 0 .. num_pieces[b] - 1, cover [0, kv_starts[b]); the paged decode kernel attends its
suffix [kv_starts[b], seq_lens[b]) and merges the pieces in its epilogue (_merge_pieces).
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import paged_attention as paged
from pallas_kernels._compat import check_pow2, check_vector, load, store, triton_params


@dataclasses.dataclass(frozen=True)
class CascadeConfig:
    """block_m: rows of a program at most (members x padded heads per KV head); block_k: KV tokens per loop step."""
    block_m: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        check_pow2(self, ("block_m", "block_k"), minimum=16)


# The sweep's choice, with two waves of items (docs/perf_notes.md, "Cascade attention").
CASCADE_CONFIG = CascadeConfig()


def cascade_members_per_item(num_q_heads: int, num_kv_heads: int, config: CascadeConfig | None = None) -> int:
    """Member rows per work item that fill block_m (the planner's members_per_item); config None: CASCADE_CONFIG."""
    return (config or CASCADE_CONFIG).block_m // pl.next_power_of_2(num_q_heads // num_kv_heads)


def cascade_decode_attention_reference(q, k_pages, v_pages, page_table, seq_lens, kv_starts, num_pieces, item_row,
                                       item_start, item_end, item_members, item_slots, *, scale):
    """Plain jnp: items' pieces and rows' suffixes merged by membership (num_pieces and item_slots go unused)."""
    del num_pieces, item_slots
    batch, num_q_heads, head_dim = q.shape
    _, num_kv_heads, page_size, _ = k_pages.shape
    group = num_q_heads // num_kv_heads
    pos = jnp.arange(page_table.shape[1] * page_size)

    def pieces(queries, table, valid):  # queries [..., Hq, D], table [..., P], valid [..., ctx] -> o, m, l
        k, v = paged.gather_pages(k_pages, table), paged.gather_pages(v_pages, table)  # [..., Hkv, ctx, D]
        by_kv_head = queries.reshape(*queries.shape[:-2], num_kv_heads, group, head_dim).astype(jnp.float32)
        valid = valid[..., None, None, :]  # [..., 1, 1, ctx]
        s = jnp.einsum("...rd,...kd->...rk", by_kv_head, k, precision=lax.Precision.HIGHEST) * (scale * paged._LOG2E)
        m = jnp.where(valid, s, paged._MASK).max(axis=-1)
        p = jnp.where(valid, jnp.exp2(s - m[..., None]), 0.0)
        o = jnp.einsum("...rk,...kd->...rd", p, v, precision=lax.Precision.HIGHEST)
        return o.reshape(queries.shape), m.reshape(queries.shape[:-1]), p.sum(axis=-1).reshape(queries.shape[:-1])

    suffix = pieces(q, page_table, (pos >= kv_starts[:, None]) & (pos < seq_lens[:, None]))  # [B, ...]
    members = jnp.where(item_members >= 0, item_members, batch)  # [W, M]; `batch`: a bucket that is dropped
    in_item = (pos >= item_start[:, None]) & (pos < item_end[:, None])  # [W, ctx]
    shared = pieces(q[jnp.minimum(members, batch - 1)].swapaxes(0, 1), page_table[item_row], in_item)  # [M, W, ...]
    ids = members.T.reshape(-1)
    o, m, l = (x.reshape(-1, *x.shape[2:]) for x in shared)
    m_row = jnp.maximum(suffix[1], jax.ops.segment_max(m, ids, batch + 1)[:batch])
    weight = jnp.where((ids < batch)[:, None], jnp.exp2(m - m_row[jnp.minimum(ids, batch - 1)]), 0.0)
    sums = [jax.ops.segment_sum(x, ids, batch + 1)[:batch] for x in (weight[..., None] * o, weight * l)]
    return paged.combine_splits_reference(jnp.stack([suffix[0], sums[0]]), jnp.stack([suffix[1], m_row]),
                                    jnp.stack([suffix[2], sums[1]]), q.dtype)


# A program per (item, KV head), rows (member, query head). The item's pages are positions in the flattened [B * P] page
# table (row * P * page_size + position), so paged attention's _attend serves.

def _cascade_kernel(item_row_ref, item_start_ref, item_end_ref, members_ref, slots_ref, q_ref, k_ref, v_ref,
                    page_table_ref, o_ref, m_ref, l_ref, *, block_m, group, group_pad, block_k, scale):
    # item_row_ref, item_start_ref, item_end_ref: [] int32; members_ref, slots_ref: [M] int32 (-1: no member)
    # q_ref: [B, Hq, D]; k_ref, v_ref: [num_pages, S, D] this KV head's pool; page_table_ref: [B * P] int32
    # o_ref: [W, B, Hq, D] bf16 or f32; m_ref, l_ref: [W, B, Hq] f32; written at this program's rows only
    num_members = members_ref.shape[0]
    batch, _, head_dim = q_ref.shape
    member, head, head_ok = paged._query_rows(0, pl.program_id(1), block_m, group, group_pad)
    member_ok = head_ok & (member < num_members)
    row = load(members_ref.at[member], mask=member_ok, other=-1)
    slot = load(slots_ref.at[member], mask=member_ok, other=0)
    row_ok = row >= 0
    # Masked lanes point past the batch: interpret mode's masked store writes old values there, which must not alias.
    row = jnp.where(row_ok, row, batch)
    idx = (row[:, None], head[:, None], jnp.arange(head_dim)[None, :])
    q = load(q_ref.at[idx], mask=row_ok[:, None], other=0.0)
    table_tokens = (page_table_ref.shape[0] // batch) * k_ref.shape[1]
    offset = item_row_ref[...] * table_tokens
    start, end = offset + item_start_ref[...], offset + item_end_ref[...]
    # Every member's last token lies past the item: no causal mask, every tile before `end` is full.
    o, m, l = paged._attend(q, jnp.full((block_m,), end), row_ok, k_ref, v_ref, page_table_ref, 0, 1, end, end,
                      block_k=block_k, scale=scale, decode=False, kv_start=start)
    store(o_ref.at[(slot[:, None], *idx)], o.astype(o_ref.dtype), mask=row_ok[:, None])
    store(m_ref.at[slot, row, head], m, mask=row_ok)
    store(l_ref.at[slot, row, head], l, mask=row_ok)


def _check_cascade_inputs(q, kv_starts, num_pieces, item_row, item_start, item_end, item_members, item_slots):
    """Raises ValueError for cascade arrays the kernel cannot take (q, pages, table: _check_inputs; rows: block_m)."""
    check_vector("kv_starts", kv_starts, q.shape[0])
    check_vector("num_pieces", num_pieces, q.shape[0])
    if item_members.ndim != 2 or item_slots.shape != item_members.shape:
        raise ValueError(f"item_members and item_slots must both be [num_items, members], got {item_members.shape} "
                         f"and {item_slots.shape}")
    num_items = item_members.shape[0]
    for name, x in (("item_row", item_row), ("item_start", item_start), ("item_end", item_end),
                    ("item_members", item_members), ("item_slots", item_slots)):
        if x.dtype != jnp.int32 or x.shape[:1] != (num_items,) or x.ndim > 2:
            raise ValueError(f"{name} must be int32 with {num_items} items, got {x.dtype}{x.shape}")


@functools.partial(jax.jit, static_argnames=("scale", "config", "interpret"))
def cascade_decode_attention(q, k_pages, v_pages, page_table, seq_lens, kv_starts, num_pieces, item_row, item_start,
                             item_end, item_members, item_slots, *, scale, config=None, interpret=False):
    """paged_decode_attention with shared prefixes read once per work item; plan_cascade's arrays in ARRAY_FIELDS
    order: kv_starts, num_pieces [B], item_row, item_start, item_end [W], item_members, item_slots [W, M], int32."""
    paged._check_inputs(q, k_pages, v_pages, page_table, seq_lens, None, kv_starts)
    # f32 halves block_k, so that the pipelined tiles fit in shared memory.
    config = config or (CASCADE_CONFIG if q.dtype.itemsize <= 2 else
                        dataclasses.replace(CASCADE_CONFIG, block_k=CASCADE_CONFIG.block_k // 2))
    _check_cascade_inputs(q, kv_starts, num_pieces, item_row, item_start, item_end, item_members, item_slots)
    batch, num_q_heads, head_dim = q.shape
    num_pages, num_kv_heads, page_size, _ = k_pages.shape
    num_items, num_members = item_members.shape
    group = num_q_heads // num_kv_heads
    group_pad = pl.next_power_of_2(group)
    if num_members * group_pad > config.block_m:
        raise ValueError(f"{num_members} members per item x padded query heads per KV head = {num_members * group_pad} "
                         f"rows, more than block_m {config.block_m} (see cascade_members_per_item)")
    item_spec = pl.BlockSpec((None,), lambda w, h: (w,))
    member_spec = pl.BlockSpec((None, num_members), lambda w, h: (w, 0))
    kv_spec = pl.BlockSpec((num_pages, None, page_size, head_dim), lambda w, h: (0, h, 0, 0))

    def whole(shape):  # every program sees (and writes into) the whole array
        return pl.BlockSpec(shape, lambda w, h: (0,) * len(shape))

    # The items' pieces o [W, B, Hq, D], m, l [W, B, Hq]; slots a row does not fill are garbage. bf16 pieces for bf16
    # q: their bytes are the step's second largest read (docs/perf_notes.md, "Cascade attention"). Not f16: a piece
    # sums up to 1,024 tokens' values, past f16's range for values above 64.
    pieces_shape = (num_items, batch, num_q_heads)
    pieces_dtype = jnp.bfloat16 if q.dtype == jnp.bfloat16 else jnp.float32
    kernel = functools.partial(_cascade_kernel, block_m=max(16, pl.next_power_of_2(num_members * group_pad)),
                               group=group, group_pad=group_pad, block_k=config.block_k, scale=scale)
    shared = pl.pallas_call(
        kernel,
        grid=(num_items, num_kv_heads),
        in_specs=[*3 * [item_spec], *2 * [member_spec], whole(q.shape), kv_spec, kv_spec, whole((page_table.size,))],
        out_specs=[whole((*pieces_shape, head_dim)), whole(pieces_shape), whole(pieces_shape)],
        out_shape=[jax.ShapeDtypeStruct((*pieces_shape, head_dim), pieces_dtype)] + 2 * [
            jax.ShapeDtypeStruct(pieces_shape, jnp.float32)],
        compiler_params=triton_params(config.num_warps, config.num_stages),
        interpret=interpret,
        name="cascade_attention",
    )(item_row, item_start, item_end, item_members, item_slots, q, k_pages, v_pages, page_table.reshape(-1))
    suffix_config = dataclasses.replace(paged._default_config(paged.DECODE_CONFIG, q.dtype), k_splits=1)
    return paged._paged_attention(q[:, None], k_pages, v_pages, page_table, seq_lens, None, scale=scale,
                                  config=suffix_config, interpret=interpret, kv_starts=kv_starts,
                                  pieces=(*shared, num_pieces))[:, 0]
