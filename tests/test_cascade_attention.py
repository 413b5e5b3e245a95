"""cascade_decode_attention against its reference and against plain paged attention (the cascade must not change
the result), in interpret mode on CPU at small shapes; the `gpu` variants run the Triton kernels at model sizes.

Batches are built as prefix caching leaves them: rows that share a prompt hold the same physical pages for its full
pages, a prompt's partial last page and each row's own tokens sit on pages of its own. Every cache slot that holds no
live token, unused page-table entries (a NaN page) and the queries of padding rows are NaN; interpret mode fills the
outputs (and the unfilled piece slots) with NaN too.
"""
import dataclasses
import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import requires_gpu
from test_cascade import batch_of
from test_paged_attention import MODELS, check

from nanojax.cascade import ARRAY_FIELDS, CascadeRules, plan_cascade
from pallas_kernels._compat import can_lower_for_cuda
from pallas_kernels.cascade_attention import (
    CASCADE_CONFIG,
    CascadeConfig,
    cascade_decode_attention,
    cascade_decode_attention_reference,
    cascade_members_per_item,
)
from pallas_kernels.paged_attention import paged_attention_reference

# One-page segments and pieces, few items: small batches then exercise pieces, slots and chunks.
SMALL_RULES = CascadeRules(min_shared_tokens=1, min_piece_tokens=1, min_saved_tokens=1, num_items=8)


@dataclasses.dataclass
class Case:
    q: jax.Array  # [B, Hq, D], NaN on padding rows
    k_pages: jax.Array  # NaN wherever no live token is stored
    v_pages: jax.Array
    page_table: jax.Array  # [B, P]
    seq_lens: jax.Array  # [B]
    scale: float

    def args(self):
        return self.q, self.k_pages, self.v_pages, self.page_table, self.seq_lens

    def clean_args(self):
        return (*(jnp.nan_to_num(a) for a in (self.q, self.k_pages, self.v_pages)), self.page_table, self.seq_lens)


def make_case(seed, rows, *, batch, num_q_heads, num_kv_heads, head_dim, page_size=8, dtype=jnp.float32):
    """rows: (shared blocks, own tokens) per live row, a block being (name, pages): the same physical pages in every
    row that names it; rows past len(rows) up to batch are padding (seq_len 0)."""
    rng = np.random.default_rng(seed)
    tables, lens, nan_page = batch_of(rows, page_size, seed)  # pages 0 .. nan_page - 1 hold the rows' tokens
    num_pages = nan_page + 1
    page_table = np.full((batch, max(map(len, tables)) + 1), nan_page, np.int32)  # unused entries: the NaN page
    live = np.zeros((num_pages, page_size), bool)
    for b, (table, n) in enumerate(zip(tables, lens)):
        page_table[b, :len(table)] = table
        for j, page in enumerate(table):
            live[page, :min(page_size, n - j * page_size)] = True
    seq_lens = np.zeros(batch, np.int32)
    seq_lens[:len(lens)] = lens

    def pages():
        x = rng.standard_normal((num_pages, num_kv_heads, page_size, head_dim), np.float32)
        return jnp.asarray(np.where(live[:, None, :, None], x, np.nan), dtype)

    q = rng.standard_normal((batch, num_q_heads, head_dim), np.float32)
    q[len(rows):] = np.nan
    return Case(jnp.asarray(q, dtype), pages(), pages(), jnp.asarray(page_table), jnp.asarray(seq_lens),
                head_dim ** -0.5)


def plan_for(case, rules=SMALL_RULES):
    """The planner's arrays for the case's live rows (as the runner would build them), as jnp arrays."""
    lens = np.asarray(case.seq_lens)
    live = int((lens > 0).sum())
    num_q_heads, num_kv_heads = case.q.shape[1], case.k_pages.shape[1]
    plan = plan_cascade(np.asarray(case.page_table)[:live], lens[:live], batch=len(lens),
                        page_size=case.k_pages.shape[2], members_per_item=cascade_members_per_item(
                            num_q_heads, num_kv_heads), rules=rules)
    return plan, tuple(jnp.asarray(a) for a in plan.arrays())


@functools.partial(jax.jit, static_argnames="scale")
def plain_reference(q, k_pages, v_pages, page_table, seq_lens, *, scale):
    """Plain paged attention, [B, Hq, D]: what the cascade path must equal. Jitted: eager, it took seconds."""
    return paged_attention_reference(q[:, None], k_pages, v_pages, page_table, seq_lens, jnp.minimum(seq_lens, 1),
                                     scale=scale)[:, 0]


cascade_reference = jax.jit(cascade_decode_attention_reference, static_argnames="scale")


def run(case, arrays, *, interpret=True, config=None, with_cascade_reference=True):
    """The kernel against plain paged attention and the cascade reference (on clean copies of the inputs). At model
    sizes on the GPU the cascade reference is left out: it gathers every item's pages for each of its members."""
    out = cascade_decode_attention(*case.args(), *arrays, scale=case.scale, config=config, interpret=interpret)
    plain = plain_reference(*case.clean_args(), scale=case.scale)
    valid = (case.seq_lens > 0)[:, None]
    check(out[:, None], plain[:, None], valid, case.q.dtype)
    if with_cascade_reference:
        ref = cascade_reference(*case.clean_args(), *arrays, scale=case.scale)
        check(ref[:, None], plain[:, None], valid, case.q.dtype)
        check(out[:, None], ref[:, None], valid, case.q.dtype)


# Live rows, page_size 8: a system prompt of 3 pages shared by 6 rows; documents A (2 pages, rows 0-2: 3 members)
# and B (4 pages, rows 3-4) nested in it; row 5 shares only the system prompt; row 6 shares nothing. Own tails: a
# partial page (the prompt ending mid-page), exactly a page, none (the last token on the last shared page: that page
# is not shared), several pages.
NESTED = [([("sys", 3), ("A", 2)], 3), ([("sys", 3), ("A", 2)], 8), ([("sys", 3), ("A", 2)], 0),
          ([("sys", 3), ("B", 4)], 21), ([("sys", 3), ("B", 4)], 1), ([("sys", 3)], 5), ([("own", 2)], 9)]


def test_nested_plan_is_what_the_tests_mean():
    case = make_case(0, NESTED, batch=9, num_q_heads=4, num_kv_heads=2, head_dim=32)
    plan, _ = plan_for(case)
    assert [(s.rows, s.start, s.end, s.level) for s in plan.segments] == [
        ((0, 1, 2, 3, 4, 5), 0, 3, 0), ((3, 4), 3, 7, 1), ((0, 1, 2), 3, 4, 1)]
    # Row 2's last token sits on A's last page: the three share A's first page only (rows 0 and 1 sharing the second
    # would be a third level; it stays in their suffixes).
    assert plan.kv_starts.tolist() == [32, 32, 32, 56, 56, 24, 0, 0, 0]


@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(2, 2), (4, 2), (7, 1), (8, 1)])
def test_gqa_ratios(num_q_heads, num_kv_heads):
    """GQA 1, 2, 7, 8 (4: the bf16 test): 64, 32, 16, 16 members per item for block_m 128. Batch 9: the 7 live rows
    of NESTED and two padding rows."""
    case = make_case(1, NESTED, batch=9, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=32)
    run(case, plan_for(case)[1])


def test_bf16_and_members_split_over_items():
    """bf16, GQA 4, and a block_m of 16: 4 members per item, so the 6-member system prompt spans two items of 3."""
    case = make_case(2, NESTED, batch=8, num_q_heads=8, num_kv_heads=2, head_dim=64, dtype=jnp.bfloat16)
    config = CascadeConfig(block_m=16, block_k=16)
    plan = plan_cascade(np.asarray(case.page_table)[:7], np.asarray(case.seq_lens)[:7], batch=8, page_size=8,
                        members_per_item=cascade_members_per_item(8, 2, config), rules=SMALL_RULES)
    assert plan.item_members.shape[1] == 4 and (plan.item_members[:, :3] >= 0).all(axis=1).sum() >= 2
    run(case, tuple(jnp.asarray(a) for a in plan.arrays()), config=config)


@pytest.mark.parametrize("rows,batch", [
    ([([("p", 3)], 5)], 1),  # batch 1: nothing to share
    ([([("a", 3)], 5), ([("b", 3)], 5), ([("c", 1)], 20)], 3),  # groups of one: no cascade
])
def test_batches_without_groups(rows, batch):
    case = make_case(3, rows, batch=batch, num_q_heads=4, num_kv_heads=2, head_dim=32)
    plan, arrays = plan_for(case)
    assert not plan.segments
    run(case, arrays)


def test_hand_built_items():
    """Items as the kernel allows beyond the planner's: pieces that start and end mid-page and mid-tile, members out
    of order with holes, slots in any order, an empty item between full ones, a piece of one token."""
    case = make_case(4, [([("p", 6)], 5)] * 3 + [([("q", 2)], 3)] * 2, batch=6, num_q_heads=4, num_kv_heads=1,
                     head_dim=32)
    # Rows 0-2 share 48 tokens: pieces [0, 13), [13, 14), [14, 45); rows 3, 4 share [0, 16). Row 5 is padding.
    kv_starts = np.array([45, 45, 45, 16, 16, 0], np.int32)
    item = np.array([[1, 0, 13], [0, 0, 0], [2, 13, 14], [0, 14, 45], [4, 0, 16]], np.int32)
    members = np.array([[2, -1, 0, 1], [-1] * 4, [-1, 1, 2, 0], [0, 2, -1, 1], [4, -1, -1, 3]], np.int32)
    slots = np.array([[1, 0, 0, 2], [0] * 4, [0, 0, 2, 1], [2, 0, 0, 1], [0, 0, 0, 0]], np.int32)
    num_pieces = np.array([3, 3, 3, 1, 1, 0], np.int32)
    arrays = (kv_starts, num_pieces, item[:, 0], item[:, 1], item[:, 2], members, slots)
    run(case, tuple(map(jnp.asarray, arrays)), config=CascadeConfig(block_k=16))


def test_array_fields_follow_the_wrapper():
    params = list(inspect.signature(cascade_decode_attention).parameters)
    assert tuple(params[5:5 + len(ARRAY_FIELDS)]) == ARRAY_FIELDS
    assert cascade_members_per_item(16, 8) == 32 and cascade_members_per_item(32, 8) == 16
    assert cascade_members_per_item(7, 1) == 8 and CASCADE_CONFIG.block_m == 64


def _bad_input_args():
    case = make_case(5, [([("p", 2)], 3)] * 2, batch=2, num_q_heads=4, num_kv_heads=2, head_dim=32)
    return case, dict(zip(ARRAY_FIELDS, plan_for(case)[1]))


@pytest.mark.parametrize("change,message", [
    ({"kv_starts": None}, "kv_starts"),
    ({"num_pieces": jnp.zeros((3,), jnp.int32)}, "num_pieces"),
    ({"item_end": jnp.zeros((8,), jnp.float32)}, "item_end"),
    ({"item_row": jnp.zeros((7,), jnp.int32)}, "item_row"),
    ({"item_slots": jnp.zeros((8, 3), jnp.int32)}, "item_members and item_slots"),
    ({"item_members": jnp.zeros((8, 65), jnp.int32), "item_slots": jnp.zeros((8, 65), jnp.int32)}, "block_m"),
])
def test_rejects_bad_inputs(change, message):
    case, arrays = _bad_input_args()
    with pytest.raises(ValueError, match=message):
        cascade_decode_attention(*case.args(), **{**arrays, **change}, scale=1.0, interpret=True)


def test_config_rejects_bad_blocks():
    with pytest.raises(ValueError):
        CascadeConfig(block_m=8)


@pytest.mark.skipif(not can_lower_for_cuda(), reason="this jaxlib compiles Triton kernels while lowering")
@pytest.mark.parametrize("model,dtype", [("qwen3-0.6b", jnp.bfloat16), ("llama-3.2-1b", jnp.float32)])
def test_lowers_to_triton(model, dtype):
    """The Triton lowering rules, checked on CPU by lowering for cuda: the cascade kernel and the suffix kernel,
    which merges the pieces in its epilogue (no merge kernel of its own)."""
    hq, hkv, d = (MODELS[model][key] for key in ("num_q_heads", "num_kv_heads", "head_dim"))
    batch, width, items, members = 64, 300, 32, cascade_members_per_item(hq, hkv)

    def ints(*shape):
        return jax.ShapeDtypeStruct(shape, jnp.int32)

    pages = jax.ShapeDtypeStruct((1000, hkv, 16, d), dtype)
    args = (jax.ShapeDtypeStruct((batch, hq, d), dtype), pages, pages, ints(batch, width), ints(batch), ints(batch),
            ints(batch), ints(items), ints(items), ints(items), ints(items, members), ints(items, members))
    lowered = jax.jit(lambda *a: cascade_decode_attention(*a, scale=0.1)).trace(*args).lower(
        lowering_platforms=("cuda",))
    assert lowered.as_text().count("xla.gpu.triton") == 2


# ------------------------------------------------------------------------------------------------ GPU, model sizes
def gpu_rows(rng, batch, system_pages, docs, doc_pages):
    """batch rows: a system prompt shared by all but every eighth row, one of `docs` documents nested in it for
    three rows in four, own tails of 0-300 tokens."""
    rows = []
    for b in range(batch):
        shared = [("sys", system_pages)] if b % 8 else [(f"solo{b}", 3)]
        if b % 4 and docs:
            shared.append((f"doc{b % docs}", doc_pages))
        rows.append((shared, int(rng.integers(0, 300))))
    return rows


@requires_gpu
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_gpu_cascade(model, dtype):
    rng = np.random.default_rng(20)
    for batch, live, system_pages, docs in ((64, 64, 63, 3), (256, 250, 20, 8), (8, 7, 100, 2), (1, 1, 30, 0)):
        rows = gpu_rows(rng, live, system_pages, docs, doc_pages=17)
        case = make_case(21, rows, batch=batch, page_size=16, dtype=dtype, **MODELS[model])
        for rules in (CascadeRules(min_saved_tokens=1), SMALL_RULES):
            run(case, plan_for(case, rules)[1], interpret=False, with_cascade_reference=False)
