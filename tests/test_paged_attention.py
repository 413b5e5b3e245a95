"""paged_decode_attention and paged_prefill_attention against paged_attention_reference.

CPU tests run the kernels in interpret mode at small shapes; the `gpu` variants run the Triton kernels at model sizes.
Every case uses shuffled page ids and poisons with NaN every cache slot a sequence does not own (the tail of its last
page, unused page-table entries, unowned pages) and the queries of padding tokens. The kernel must never read them:
its output must match the reference run on a cleaned copy, be finite everywhere and be exactly zero on padding rows.
Interpret mode also fills output buffers with NaN before the kernel runs, so an element it fails to write shows up.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import requires_gpu

from pallas_kernels import paged_attention
from pallas_kernels._compat import can_lower_for_cuda
from pallas_kernels.paged_attention import (
    _MASK,
    DECODE_CONFIG,
    FEW_TOKENS_CONFIG,
    PREFILL_CONFIG,
    PagedAttentionConfig,
    _combine_splits,
    _default_config,
    _kv_tiling,
    _num_stages,
    combine_splits_reference,
    paged_attention_reference,
    paged_decode_attention,
    paged_prefill_attention,
)

TOLERANCE = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 2e-2}


@dataclasses.dataclass
class Case:
    q: jax.Array  # [B, T, Hq, D], NaN in padding tokens
    k_pages: jax.Array  # NaN wherever no live token is stored
    v_pages: jax.Array
    page_table: jax.Array
    seq_lens: jax.Array
    q_lens: jax.Array
    scale: float

    def reference(self):
        q, k, v = (jnp.nan_to_num(a) for a in (self.q, self.k_pages, self.v_pages))
        return paged_attention_reference(q, k, v, self.page_table, self.seq_lens, self.q_lens, scale=self.scale)


def make_case(seed, seq_lens, q_lens, *, q_tokens, num_q_heads, num_kv_heads, head_dim, page_size,
              dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    seq_lens, q_lens = np.asarray(seq_lens, np.int32), np.asarray(q_lens, np.int32)
    batch = len(seq_lens)
    pages_per_seq = -(-int(seq_lens.max()) // page_size) + 1  # always one unused table entry
    num_pages = batch * pages_per_seq + 2
    ids = rng.permutation(num_pages)
    page_table, poison_page = ids[:batch * pages_per_seq].reshape(batch, pages_per_seq), ids[-1]
    live = np.zeros((num_pages, page_size), bool)  # cache slots holding a token of some sequence
    for b, n in enumerate(seq_lens):
        used = -(-n // page_size)
        for j in range(used):
            live[page_table[b, j], :min(page_size, n - j * page_size)] = True
        page_table[b, used:] = poison_page

    def pages():
        x = rng.standard_normal((num_pages, num_kv_heads, page_size, head_dim), np.float32)
        return jnp.asarray(np.where(live[:, None, :, None], x, np.nan), dtype)

    q = rng.standard_normal((batch, q_tokens, num_q_heads, head_dim), np.float32)
    q = np.where((np.arange(q_tokens)[None] < q_lens[:, None])[:, :, None, None], q, np.nan)
    return Case(jnp.asarray(q, dtype), pages(), pages(), jnp.asarray(page_table, jnp.int32), jnp.asarray(seq_lens),
                jnp.asarray(q_lens), scale=head_dim ** -0.5)


def check(out, ref, q_valid, dtype):
    """out, ref: [B, T, Hq, D]; q_valid: [B, T] -> asserts finiteness, zero padding rows and closeness."""
    out, ref = np.asarray(out.astype(jnp.float32)), np.asarray(ref.astype(jnp.float32))
    assert np.isfinite(out).all(), "NaN/inf in the output"
    assert (out[~np.asarray(q_valid)] == 0).all(), "padding rows must be zero"
    tol = TOLERANCE[dtype]
    np.testing.assert_allclose(out, ref, rtol=tol, atol=tol)


def run_decode(case, config=None, interpret=True):
    out = paged_decode_attention(case.q[:, 0], case.k_pages, case.v_pages, case.page_table, case.seq_lens,
                                 scale=case.scale, config=config, interpret=interpret)
    check(out[:, None], case.reference()[:, :1], case.seq_lens[:, None] > 0, case.q.dtype)


def run_prefill(case, config=None, interpret=True):
    out = paged_prefill_attention(case.q, case.k_pages, case.v_pages, case.page_table, case.seq_lens, case.q_lens,
                                  scale=case.scale, config=config, interpret=interpret)
    q_valid = jnp.arange(case.q.shape[1])[None] < case.q_lens[:, None]
    check(out, case.reference(), q_valid, case.q.dtype)


def decode_case(seed, seq_lens, **kw):
    """One query token per row; rows with seq_len 0 are padding."""
    return make_case(seed, seq_lens, np.minimum(seq_lens, 1), q_tokens=1, **kw)


# Lengths around page boundaries (page_size 16): 1, page - 1, page, page + 1, several pages; 0 is a padding row.
DECODE_LENS = [1, 15, 16, 17, 0, 70]


@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(2, 2), (4, 2), (4, 1), (7, 1), (8, 1)])
def test_decode_gqa_ratios(num_q_heads, num_kv_heads):
    case = decode_case(0, DECODE_LENS, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=64,
                       page_size=16)
    run_decode(case)


@pytest.mark.parametrize("page_size,block_k,k_splits", [(8, 16, 1), (8, 32, 3), (16, 32, None), (32, 16, 4)])
def test_decode_pages_and_splits(page_size, block_k, k_splits):
    lens = [1, page_size - 1, page_size, page_size + 1, 5 * page_size + 3]
    case = decode_case(1, lens, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=page_size)
    run_decode(case, dataclasses.replace(DECODE_CONFIG, block_k=block_k, k_splits=k_splits))


def wild_table(case):
    """case with every unused page-table entry far out of the pool's range (below 0, or past its end on odd rows):
    decode reads page-table entries and K rows before it knows the length, and must clamp such ids, not follow them.
    The output cannot show a missing clamp (those rows are masked); a GPU run reading that far outside the pool
    faults. Interpret mode clamps gathers itself. The engine pads tables with page 0."""
    page_size, num_pages = case.k_pages.shape[2], case.k_pages.shape[0]
    table = np.asarray(case.page_table)
    unused = np.arange(table.shape[1])[None] >= -(-np.asarray(case.seq_lens)[:, None] // page_size)
    wild = np.where(np.arange(table.shape[0]) % 2, num_pages + 10 ** 5, -10 ** 5)[:, None]
    return dataclasses.replace(case, page_table=jnp.asarray(np.where(unused, wild, table), jnp.int32))


@pytest.mark.parametrize("k_splits", [1, 3])
def test_decode_out_of_range_table_entries(k_splits):
    case = wild_table(decode_case(5, [1, 15, 0, 40], num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16))
    run_decode(case, dataclasses.replace(DECODE_CONFIG, block_k=16, k_splits=k_splits))


def test_decode_head_dim_128_batch_1():
    case = decode_case(2, [45], num_q_heads=8, num_kv_heads=2, head_dim=128, page_size=16)
    run_decode(case, dataclasses.replace(DECODE_CONFIG, k_splits=2))


def test_decode_page_256():
    case = decode_case(3, [300, 1, 256], num_q_heads=2, num_kv_heads=1, head_dim=64, page_size=256)
    run_decode(case, dataclasses.replace(DECODE_CONFIG, k_splits=2))


# The H100's shared memory per thread block.
SHARED_MEMORY_BYTES = 227 << 10


def kv_buffer_bytes(block_k, num_stages, head_dim, itemsize):
    """Shared memory of the decode loop's K and V tiles, as DECODE_CONFIG's comment in paged_attention.py counts it:
    the pipeliner gives K/V two buffers at 5 stages (the page-table load takes the others), one below."""
    return (2 if num_stages >= 5 else 1) * 2 * block_k * head_dim * itemsize


@pytest.mark.parametrize("sms", [132, 108])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_decode_automatic_tiling_properties(sms, dtype, monkeypatch):
    """Whatever the grid, the table's width and the GPU's SM count, the automatic tiling keeps its K/V tiles in
    shared memory (f32 tiles are never doubled: with f32 dots they did not fit), covers the table with no split
    starting past its end, adds at most one wave of programs by splitting, and pipelines no deeper than its loop
    has steps (plus one)."""
    monkeypatch.setattr(paged_attention, "num_sms", lambda: sms)
    config = _default_config(DECODE_CONFIG, dtype)
    itemsize = jnp.dtype(dtype).itemsize
    for programs in (1, 2, 7, 8, 64, 100, sms - 1, sms, sms + 1, 2 * sms, 3 * sms, 4 * sms, 2048):
        for table_tokens in (16, 64, 100, 128, 129, 256, 1000, 4096, 16384):
            block_k, k_splits = _kv_tiling(config, programs, table_tokens, itemsize)
            steps = -(-(-(-table_tokens // block_k)) // k_splits)
            stages = _num_stages(config, block_k, k_splits, table_tokens)
            where = f"{programs} programs, {table_tokens} tokens: {block_k=} {k_splits=} {stages=}"
            assert block_k >= 16 and block_k & (block_k - 1) == 0, where
            assert block_k == config.block_k or itemsize <= 2, where
            assert kv_buffer_bytes(block_k, stages, 128, itemsize) <= SHARED_MEMORY_BYTES, where
            assert block_k * k_splits * steps >= table_tokens and (k_splits - 1) * block_k < table_tokens, where
            assert k_splits == 1 or programs * k_splits <= 2 * sms, where
            assert 1 <= stages <= min(config.num_stages, steps + 1), where


def test_explicit_decode_tiling_is_kept():
    """A config that sets k_splits keeps its block_k, k_splits and num_stages."""
    explicit = dataclasses.replace(DECODE_CONFIG, k_splits=3)
    for programs, table_tokens in ((8, 64), (512, 4096), (2048, 16384)):
        assert _kv_tiling(explicit, programs, table_tokens, 2) == (DECODE_CONFIG.block_k, 3)
        assert _num_stages(explicit, DECODE_CONFIG.block_k, 3, table_tokens) == DECODE_CONFIG.num_stages


@pytest.mark.parametrize("k_splits,dtype", [(2, jnp.float32), (3, jnp.bfloat16), (16, jnp.float32), (33, jnp.float32)])
def test_combine_splits(k_splits, dtype):
    """The split-merge kernel against its reference, with empty splits (m = _MASK, l = 0, o = 0, as the attention
    kernel leaves them) and a row whose splits are all empty (a padding row: zeros out)."""
    rng = np.random.default_rng(k_splits)
    shape = (k_splits, 3, 2, 4)  # [splits, B, T, Hq]
    m = rng.normal(0, 8, shape).astype(np.float32)
    l = rng.uniform(0.5, 4, shape).astype(np.float32)
    o = rng.normal(0, 1, (*shape, 64)).astype(np.float32)
    empty = rng.random(shape) < 0.3
    empty[:, 1, 0] = True
    m, l, o = np.where(empty, _MASK, m), np.where(empty, 0, l), np.where(empty[..., None], 0, o)
    out = _combine_splits(jnp.asarray(o), jnp.asarray(m), jnp.asarray(l), dtype, interpret=True)
    ref = combine_splits_reference(jnp.asarray(o), jnp.asarray(m), jnp.asarray(l), dtype)
    assert out.dtype == dtype and np.isfinite(np.asarray(out, np.float32)).all()
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), **{
        "rtol": TOLERANCE[jnp.dtype(dtype)], "atol": TOLERANCE[jnp.dtype(dtype)]})
    assert not np.asarray(out[1, 0], np.float32).any()


@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(4, 2), (7, 1), (3, 3)])
def test_decode_merges_counted_pieces(num_q_heads, num_kv_heads):
    """Decode with `pieces` (cascade_attention's shared pieces): each row's first counts[b] pieces (0 .. all) merged
    into its own attention in the kernel's epilogue, equal to the stats of the plain kernel merged with them by the
    reference; the slots past a row's count hold NaN and must not be read; a padding row stays zeros."""
    lens = [1, 15, 40, 0, 70, 33]
    case = decode_case(11, lens, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=64, page_size=8)
    rng = np.random.default_rng(12)
    batch, num_items = len(lens), 6
    m2 = rng.normal(0, 8, (num_items, batch, num_q_heads)).astype(np.float32)
    l2 = rng.uniform(0.5, 4, m2.shape).astype(np.float32)
    o2 = rng.normal(0, 1, (*m2.shape, 64)).astype(np.float32)
    counts = np.array([0, 6, 3, 0, 1, 2], np.int32)
    unused = np.arange(num_items)[:, None] >= counts[None]  # [W, B]
    o2[unused], m2[unused], l2[unused] = np.nan, np.nan, np.nan
    config = dataclasses.replace(DECODE_CONFIG, block_k=16, k_splits=1)
    starts = jnp.asarray([0, 5, 16, 0, 37, 32], jnp.int32)
    args = (case.q, case.k_pages, case.v_pages, case.page_table, case.seq_lens, None)
    out = paged_attention._paged_attention(*args, scale=case.scale, config=config, interpret=True, kv_starts=starts,
                                           pieces=(*map(jnp.asarray, (o2, m2, l2)), jnp.asarray(counts)))[:, 0]
    o, m, l = paged_attention._paged_attention(*args, scale=case.scale, config=config, interpret=True,
                                               kv_starts=starts, stats=True)
    used = ~unused[:, :, None]
    ref = combine_splits_reference(jnp.concatenate([o[:, :, 0], jnp.asarray(np.where(used[..., None], o2, 0))]),
                                   jnp.concatenate([m[:, :, 0], jnp.asarray(np.where(used, m2, _MASK))]),
                                   jnp.concatenate([l[:, :, 0], jnp.asarray(np.where(used, l2, 0))]), jnp.float32)
    assert np.isfinite(np.asarray(out)).all() and not np.asarray(out[3]).any()
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="one KV split"):
        paged_attention._paged_attention(*args, scale=case.scale, interpret=True, kv_starts=starts,
                                         config=dataclasses.replace(config, k_splits=2),
                                         pieces=(*map(jnp.asarray, (o2, m2, l2)), jnp.asarray(counts)))


def window_reference(case, kv_starts):
    """Decode attention of each row over its positions kv_starts .. seq_len - 1 only: [B, Hq, D] f32 (numpy)."""
    q, k_pages, v_pages = (np.nan_to_num(np.asarray(a, np.float32)) for a in (case.q, case.k_pages, case.v_pages))
    table, lens = np.asarray(case.page_table), np.asarray(case.seq_lens)
    batch, _, num_q_heads, head_dim = q.shape
    group = num_q_heads // k_pages.shape[1]
    out = np.zeros((batch, num_q_heads, head_dim), np.float32)
    for b in np.flatnonzero(lens):
        pos = np.arange(kv_starts[b], lens[b])
        page, slot = table[b, pos // k_pages.shape[2]], pos % k_pages.shape[2]
        for h in range(num_q_heads):
            k, v = k_pages[page, h // group, slot], v_pages[page, h // group, slot]  # [n, D]
            s = k @ q[b, 0, h] * case.scale
            p = np.exp(s - s.max())
            out[b, h] = p @ v / p.sum()
    return out


@pytest.mark.parametrize("k_splits", [1, 3, None])
def test_decode_kv_starts_and_stats(k_splits):
    """kv_starts (0, mid-page, mid-tile, a page boundary, the last token) skip the positions before them: they hold
    NaN here. The stats pieces merge (combine_splits_reference) into the same output; kv_starts 0 equals the plain
    kernel bit for bit."""
    lens = [1, 15, 40, 0, 70, 33]
    starts = np.array([0, 5, 16, 0, 37, 32], np.int32)
    case = decode_case(6, lens, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=8)
    table = np.asarray(case.page_table)
    before = np.zeros(case.k_pages.shape[0:1] + case.k_pages.shape[2:3], bool)  # [num_pages, S] slots to poison
    for b, start in enumerate(starts):
        pos = np.arange(start)
        before[table[b, pos // 8], pos % 8] = True
    poison = jnp.asarray(before)[:, None, :, None]
    case = dataclasses.replace(case, k_pages=jnp.where(poison, jnp.nan, case.k_pages),
                               v_pages=jnp.where(poison, jnp.nan, case.v_pages))
    config = dataclasses.replace(DECODE_CONFIG, block_k=16, k_splits=k_splits)
    args = (case.q[:, 0], case.k_pages, case.v_pages, case.page_table, case.seq_lens)
    o, m, l = paged_decode_attention(*args, scale=case.scale, config=config, interpret=True,
                                     kv_starts=jnp.asarray(starts), return_stats=True)
    assert o.shape[1:] == case.q[:, 0].shape and m.shape == l.shape == o.shape[:-1] and o.dtype == jnp.float32
    out = combine_splits_reference(o, m, l, jnp.float32)
    assert np.isfinite(np.asarray(out)).all() and not np.asarray(out[3]).any()
    np.testing.assert_allclose(np.asarray(out), window_reference(case, starts), rtol=1e-5, atol=1e-5)
    fresh = decode_case(9, lens, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=8)
    args = (fresh.q[:, 0], fresh.k_pages, fresh.v_pages, fresh.page_table, fresh.seq_lens)
    plain = paged_decode_attention(*args, scale=fresh.scale, config=config, interpret=True)
    zero = paged_decode_attention(*args, scale=fresh.scale, config=config, interpret=True,
                                  kv_starts=jnp.zeros(len(lens), jnp.int32))
    np.testing.assert_array_equal(np.asarray(zero), np.asarray(plain))


@pytest.mark.parametrize("k_splits", [1, 4, None])
def test_decode_bf16(k_splits):
    """None: the automatic tiling, one 128-token tile over this 96-token table (6 programs)."""
    case = decode_case(4, DECODE_LENS, num_q_heads=7, num_kv_heads=1, head_dim=64, page_size=16,
                       dtype=jnp.bfloat16)
    run_decode(case, dataclasses.replace(DECODE_CONFIG, k_splits=k_splits))


# Prefill rows: (seq_len, q_len). q_len == seq_len is a fresh prompt, q_len < seq_len a chunk behind a cached prefix
# (prefix-cache hit, chunked prefill, a later chat turn); q_len 0 is a padding row.
PREFILL_ROWS = [(13, 13), (40, 9), (0, 0), (17, 1), (33, 16)]


def prefill_case(seed, rows, q_tokens, **kw):
    seq_lens, q_lens = zip(*rows)
    return make_case(seed, seq_lens, q_lens, q_tokens=q_tokens, **kw)


@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(2, 2), (4, 2), (4, 1), (7, 1), (8, 1)])
def test_prefill_gqa_ratios(num_q_heads, num_kv_heads):
    # block_m 32 -> 32 / next_pow2(ratio) tokens per query block; T = 19 is a multiple of none of them.
    case = prefill_case(5, PREFILL_ROWS, 19, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=64,
                        page_size=16)
    run_prefill(case, dataclasses.replace(PREFILL_CONFIG, block_m=32, block_k=16))


@pytest.mark.parametrize("page_size", [8, 16, 32])
def test_prefill_page_sizes(page_size):
    case = prefill_case(6, [(11, 11), (2 * page_size + 5, page_size + 1)], 13, num_q_heads=4, num_kv_heads=2,
                        head_dim=64, page_size=page_size)
    run_prefill(case, dataclasses.replace(PREFILL_CONFIG, block_m=16, block_k=16))


def test_prefill_head_dim_128_batch_1_no_prefix():
    case = prefill_case(7, [(37, 37)], 37, num_q_heads=2, num_kv_heads=1, head_dim=128, page_size=16)
    run_prefill(case, dataclasses.replace(PREFILL_CONFIG, block_m=32, block_k=32))


def test_prefill_k_splits():
    case = prefill_case(8, [(50, 7), (9, 9), (0, 0)], 8, num_q_heads=4, num_kv_heads=1, head_dim=64, page_size=8)
    run_prefill(case, dataclasses.replace(PREFILL_CONFIG, block_m=16, block_k=16, k_splits=3))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_prefill_few_tokens_split_as_decode(dtype):
    """Verification's shape, a few tokens a row over long tables: the default config splits the KV as decode does."""
    case = prefill_case(11, [(130, 5), (37, 3), (0, 0), (71, 1)], 5, num_q_heads=8, num_kv_heads=2, head_dim=64,
                        page_size=16, dtype=dtype)
    run_prefill(case)
    run_prefill(case, dataclasses.replace(FEW_TOKENS_CONFIG, block_k=16, k_splits=3))


def test_prefill_default_config_bf16():
    case = prefill_case(9, PREFILL_ROWS, 16, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16,
                        dtype=jnp.bfloat16)
    run_prefill(case)


def test_decode_matches_prefill_with_one_token():
    case = decode_case(10, [1, 30], num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=8)
    args = (case.k_pages, case.v_pages, case.page_table, case.seq_lens)
    dec = paged_decode_attention(case.q[:, 0], *args, scale=case.scale, interpret=True)
    pre = paged_prefill_attention(case.q, *args, case.q_lens, scale=case.scale, interpret=True)
    np.testing.assert_allclose(np.asarray(dec), np.asarray(pre[:, 0]), rtol=1e-6, atol=1e-6)


def _inputs():
    """Valid prefill inputs: B=2, T=3, Hq=4, Hkv=2, D=64, page_size=16 (each test breaks one thing)."""
    pages = jnp.zeros((6, 2, 16, 64))
    lens = jnp.ones((2,), jnp.int32)
    return {"q": jnp.zeros((2, 3, 4, 64)), "k_pages": pages, "v_pages": pages,
            "page_table": jnp.zeros((2, 3), jnp.int32), "seq_lens": lens, "q_lens": lens}


@pytest.mark.parametrize("change,message", [
    ({"q": jnp.zeros((2, 4, 64))}, "q must be"),
    ({"k_pages": jnp.zeros((6, 2, 16, 64)), "v_pages": jnp.zeros((6, 2, 8, 64))}, "k_pages and v_pages"),
    ({"k_pages": jnp.zeros((6, 3, 16, 64)), "v_pages": jnp.zeros((6, 3, 16, 64))}, "multiple of num_kv_heads"),
    ({"q": jnp.zeros((2, 3, 4, 48)), "k_pages": jnp.zeros((6, 2, 16, 48)), "v_pages": jnp.zeros((6, 2, 16, 48))},
     "power of two"),
    ({"q": jnp.zeros((2, 3, 4, 64), jnp.bfloat16)}, "dtype"),
    ({"k_pages": jnp.zeros((6, 2, 12, 64)), "v_pages": jnp.zeros((6, 2, 12, 64))}, "page_size"),
    ({"page_table": jnp.zeros((3, 3), jnp.int32)}, "page_table"),
    ({"page_table": jnp.zeros((2, 3), jnp.float32)}, "page_table"),
    ({"seq_lens": jnp.ones((3,), jnp.int32)}, "seq_lens"),
    ({"q_lens": jnp.ones((2,), jnp.float32)}, "q_lens"),
])
def test_prefill_rejects_bad_inputs(change, message):
    args = {**_inputs(), **change}
    with pytest.raises(ValueError, match=message):
        paged_prefill_attention(**args, scale=1.0, interpret=True)


def test_decode_rejects_bad_inputs():
    args = _inputs()
    del args["q_lens"]
    with pytest.raises(ValueError, match="q must be"):
        paged_decode_attention(**args, scale=1.0, interpret=True)  # q is 4-D here
    with pytest.raises(ValueError, match="seq_lens"):
        paged_decode_attention(**{**args, "q": args["q"][:, 0], "seq_lens": jnp.ones((2, 1), jnp.int32)},
                               scale=1.0, interpret=True)
    with pytest.raises(ValueError, match="kv_starts"):
        paged_decode_attention(**{**args, "q": args["q"][:, 0]}, kv_starts=jnp.zeros((2,), jnp.float32), scale=1.0,
                               interpret=True)


@pytest.mark.parametrize("field,value", [("block_m", 8), ("block_k", 48), ("k_splits", 0)])
def test_config_rejects_bad_blocks(field, value):
    with pytest.raises(ValueError):
        PagedAttentionConfig(**{field: value})


# Qwen3-0.6B: 16 query heads, 8 KV heads, head_dim 128; Llama-3.2-1B: 32 / 8, head_dim 64.
MODELS = {"qwen3-0.6b": {"num_q_heads": 16, "num_kv_heads": 8, "head_dim": 128},
          "llama-3.2-1b": {"num_q_heads": 32, "num_kv_heads": 8, "head_dim": 64}}


@pytest.mark.skipif(not can_lower_for_cuda(), reason="this jaxlib compiles Triton kernels while lowering")
@pytest.mark.parametrize("model", ["qwen3-0.6b", "llama-3.2-1b"])
def test_lowers_to_triton(model):
    """The Triton lowering rules (power-of-two tensors, supported primitives), checked on CPU by lowering for cuda."""
    hq, hkv, d = (MODELS[model][key] for key in ("num_q_heads", "num_kv_heads", "head_dim"))
    pages = jax.ShapeDtypeStruct((1000, hkv, 16, d), jnp.bfloat16)
    table, lens = jax.ShapeDtypeStruct((4, 64), jnp.int32), jax.ShapeDtypeStruct((4,), jnp.int32)
    for fn, q in ((paged_decode_attention, (4, hq, d)), (paged_prefill_attention, (4, 300, hq, d))):
        extra = () if fn is paged_decode_attention else (lens,)
        args = (jax.ShapeDtypeStruct(q, jnp.bfloat16), pages, pages, table, lens, *extra)
        lowered = jax.jit(lambda *a, fn=fn: fn(*a, scale=0.1)).trace(*args).lower(lowering_platforms=("cuda",))
        assert "triton" in lowered.as_text()
    args = (jax.ShapeDtypeStruct((4, hq, d), jnp.bfloat16), pages, pages, table, lens)
    stats = jax.jit(lambda *a: paged_decode_attention(*a[:5], kv_starts=a[5], return_stats=True, scale=0.1))
    assert "triton" in stats.trace(*args, lens).lower(lowering_platforms=("cuda",)).as_text()


# ------------------------------------------------------------------------------------------------ GPU, model sizes
@requires_gpu
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_gpu_decode(model, dtype):
    lens = [1, 15, 16, 17, 0, 1000, 4097] + list(np.random.default_rng(11).integers(1, 3000, 57))
    case = decode_case(11, lens, page_size=16, dtype=dtype, **MODELS[model])
    # None: 64 sequences x 8 KV heads over a table of > 4096 tokens: bf16 takes the automatic tiling's 2x deeper
    # tiles, unsplit.
    for k_splits in (1, 4, None):
        run_decode(case, dataclasses.replace(DECODE_CONFIG, k_splits=k_splits), interpret=False)
    # Batch 1 and 3: the automatic k_splits is large (16 and 5 here for 8 KV heads).
    for seed, lens in ((15, [4097]), (16, [3000, 0, 17])):
        run_decode(decode_case(seed, lens, page_size=16, dtype=dtype, **MODELS[model]), interpret=False)
    # A 128-token table, 32 programs: bf16 takes the automatic tiling's one doubled tile, unsplit.
    run_decode(wild_table(decode_case(17, [1, 0, 100, 17], page_size=16, dtype=dtype, **MODELS[model])),
               interpret=False)


@requires_gpu
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_gpu_decode_kv_starts_and_stats(model, dtype):
    rng = np.random.default_rng(18)
    lens = np.concatenate([[1, 16, 0, 4097], rng.integers(1, 3000, 12)]).astype(np.int32)
    starts = np.where(lens > 0, rng.integers(0, np.maximum(lens, 1)), 0).astype(np.int32)
    case = decode_case(18, lens, page_size=16, dtype=dtype, **MODELS[model])
    for k_splits in (1, 4, None):
        config = dataclasses.replace(_default_config(DECODE_CONFIG, dtype), k_splits=k_splits)
        pieces = paged_decode_attention(case.q[:, 0], case.k_pages, case.v_pages, case.page_table, case.seq_lens,
                                        scale=case.scale, config=config, kv_starts=jnp.asarray(starts),
                                        return_stats=True)
        out = np.asarray(combine_splits_reference(*pieces, jnp.float32))
        tol = TOLERANCE[jnp.dtype(dtype)]
        np.testing.assert_allclose(out, window_reference(case, starts), rtol=tol, atol=tol)


@requires_gpu
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_gpu_prefill(model, dtype):
    rows = [(2048, 2048), (1500, 700), (0, 0), (300, 1), (777, 777)]
    run_prefill(prefill_case(12, rows, 2048, page_size=16, dtype=dtype, **MODELS[model]), interpret=False)


@requires_gpu
@pytest.mark.parametrize("page_size", [8, 32, 256])
def test_gpu_page_sizes(page_size):
    case = prefill_case(13, [(900, 300), (33, 33)], 300, page_size=page_size, dtype=jnp.bfloat16,
                        **MODELS["qwen3-0.6b"])
    run_prefill(case, interpret=False)
    run_decode(decode_case(14, [1, page_size + 1, 2000], page_size=page_size, dtype=jnp.bfloat16,
                           **MODELS["qwen3-0.6b"]), interpret=False)
