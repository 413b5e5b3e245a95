"""nanojax.cascade: shared-prefix segments and their fixed-shape work items (plain Python, no device).

Every plan is checked against the invariants the kernel relies on (check_plan): each row's pieces cover its positions
[0, kv_starts) exactly once, with pages that every member of the piece holds, all before each member's last token's
page; slots 0 .. num_pieces - 1 each filled once; shapes fixed by (batch, members_per_item, num_items).
"""
import numpy as np
import pytest

from nanojax.cascade import (
    ARRAY_FIELDS,
    CascadeRules,
    Segment,
    find_segments,
    plan_cascade,
    shareable_pages,
)

PAGE = 16
# Small thresholds so that a few pages make a segment: 2 pages per segment, 1-page pieces.
RULES = CascadeRules(min_shared_tokens=2 * PAGE, min_piece_tokens=PAGE, min_saved_tokens=1, num_items=8)


def batch_of(rows, page_size=PAGE, seed=0):
    """rows: (shared blocks, own tokens) per row; a shared block is (name, pages). -> (page tables, seq_lens,
    num_pages): each block's pages are one set of physical pages for every row that names it, the rest of a row
    (own tokens, from a page boundary on) its own pages; the ids are a shuffle of 0 .. num_pages - 1."""
    blocks, tables, lens = {}, [], []
    next_page = iter(range(10 ** 6))
    for shared, own in rows:
        table = []
        for name, pages in shared:
            if name not in blocks:
                blocks[name] = [next(next_page) for _ in range(pages)]
            table += blocks[name]
        lens.append(len(table) * page_size + own)
        tables.append(table + [next(next_page) for _ in range(-(-own // page_size))])
    num_pages = next(next_page)
    ids = np.random.default_rng(seed).permutation(num_pages)
    return [ids[table].tolist() for table in tables], lens, num_pages


def check_plan(plan, tables, lens, *, batch, members_per_item, num_items):
    assert plan.kv_starts.shape == plan.num_pieces.shape == (batch,)
    for name in ("item_row", "item_start", "item_end"):
        assert getattr(plan, name).shape == (num_items,)
    assert plan.item_members.shape == plan.item_slots.shape == (num_items, members_per_item)
    assert all(getattr(plan, name).dtype == np.int32 for name in ARRAY_FIELDS)
    limits = shareable_pages(lens, PAGE)
    covered = [[] for _ in range(batch)]
    slots = [[] for _ in range(batch)]
    for w in range(num_items):
        start, end = plan.item_start[w], plan.item_end[w]
        members = [int(r) for r in plan.item_members[w] if r >= 0]
        assert start % PAGE == 0 and end % PAGE == 0 and start <= end
        assert bool(members) == (end > start), "an item has members exactly when it has pages"
        pages = tables[plan.item_row[w]][start // PAGE:end // PAGE] if members else []
        assert plan.item_row[w] in members or not members
        for i, r in enumerate(members):
            assert end // PAGE <= limits[r], "shared pages end before the member's last token's page"
            assert tables[r][start // PAGE:end // PAGE] == pages, "members hold the same physical pages"
            covered[r].append((start, end))
            slots[r].append(int(plan.item_slots[w, i]))
    for r in range(batch):
        ends = [0] + [b for _, b in sorted(covered[r])]
        assert [a for a, _ in sorted(covered[r])] == ends[:-1], f"row {r}: pieces not contiguous from 0"
        assert ends[-1] == plan.kv_starts[r]
        assert sorted(slots[r]) == list(range(plan.num_pieces[r]))


def plan(tables, lens, batch=8, members_per_item=4, rules=RULES):
    out = plan_cascade(tables, lens, batch=batch, page_size=PAGE, members_per_item=members_per_item, rules=rules)
    check_plan(out, tables, lens, batch=batch, members_per_item=members_per_item, num_items=rules.num_items)
    return out


def test_shareable_pages_exclude_the_last_tokens_page():
    # The last token sits at seq_len - 1: 16 tokens fill page 0 with it, 17 put it on page 1.
    assert shareable_pages([0, 1, 15, 16, 17, 32, 33], PAGE).tolist() == [0, 0, 0, 0, 1, 1, 2]


def test_no_sharing_and_groups_of_one():
    tables, lens, _ = batch_of([([("a", 3)], 5), ([("b", 3)], 9), ([], 40)])
    result = plan(tables, lens)
    assert result.segments == () and not result.use_cascade and result.saved_tokens == 0
    assert not result.kv_starts.any() and not result.num_pieces.any() and (result.item_members == -1).all()


def test_one_prefix_shared_by_all():
    tables, lens, _ = batch_of([([("sys", 5)], own) for own in (1, 7, 16, 30, 3)])
    result = plan(tables, lens)
    assert result.segments == (Segment((0, 1, 2, 3, 4), 0, 5, 0),)
    assert result.kv_starts.tolist() == [5 * PAGE] * 5 + [0] * 3
    # 5 members in chunks of <= 4: two items' worth of members (3 + 2), each piece read once per chunk.
    assert result.saved_tokens == (5 - 2) * 5 * PAGE


def test_two_nested_levels_and_a_row_in_no_group():
    rows = [([("sys", 3), ("docA", 2)], 5), ([("sys", 3), ("docA", 2)], 20), ([("sys", 3), ("docB", 4)], 1),
            ([("sys", 3), ("docB", 4)], 16), ([("sys", 3)], 9), ([("other", 4)], 3), ([("sys", 3), ("docC", 2)], 2)]
    tables, lens, _ = batch_of(rows)
    result = plan(tables, lens)
    assert set(result.segments) == {Segment((0, 1, 2, 3, 4, 6), 0, 3, 0), Segment((0, 1), 3, 5, 1),
                                     Segment((2, 3), 3, 7, 1)}
    assert result.kv_starts.tolist() == [5 * PAGE, 5 * PAGE, 7 * PAGE, 7 * PAGE, 3 * PAGE, 0, 3 * PAGE, 0]


def test_prefix_ending_mid_page_and_at_the_last_token():
    # Rows 0-1 share 3 full pages (the prompt's partial fourth page is each row's own copy). Rows 2-3 hold the same
    # 3 pages, and their last token sits on the third: only the first two pages are shareable for them.
    tables, lens, _ = batch_of([([("p", 3)], 8), ([("p", 3)], 8), ([("q", 3)], 0), ([("q", 3)], 0)])
    result = plan(tables, lens)
    assert set(result.segments) == {Segment((0, 1), 0, 3, 0), Segment((2, 3), 0, 2, 0)}


def test_short_shared_run_goes_with_its_nested_groups():
    """A 1-page common run (too short alone) is read with each nested group's pages; a row that shares only it
    keeps it in its suffix."""
    rows = [([("t", 1), ("a", 3)], 4), ([("t", 1), ("a", 3)], 4), ([("t", 1), ("b", 2)], 4),
            ([("t", 1), ("b", 2)], 4), ([("t", 1)], 20)]
    tables, lens, _ = batch_of(rows)
    result = plan(tables, lens)
    assert set(result.segments) == {Segment((0, 1), 0, 4, 0), Segment((2, 3), 0, 3, 0)}
    assert result.kv_starts[4] == 0


def test_levels_and_members_rules():
    rows = [([("sys", 3), ("doc", 2), ("q", 2)], 5)] * 2 + [([("sys", 3), ("doc", 2)], 5)] + [([("sys", 3)], 5)]
    tables, lens, _ = batch_of(rows)
    # two levels by default
    assert [s.level for s in find_segments(tables, lens, page_size=PAGE, rules=RULES)] == [0, 1]
    three = find_segments(tables, lens, page_size=PAGE, rules=CascadeRules(min_shared_tokens=2 * PAGE, max_levels=3))
    assert [(s.rows, s.level) for s in three] == [((0, 1, 2, 3), 0), ((0, 1, 2), 1), ((0, 1), 2)]
    one = find_segments(tables, lens, page_size=PAGE, rules=CascadeRules(min_shared_tokens=2 * PAGE, max_levels=1))
    assert one == [Segment((0, 1, 2, 3), 0, 3, 0)]
    four = find_segments(tables, lens, page_size=PAGE, rules=CascadeRules(min_shared_tokens=2 * PAGE, min_members=4))
    assert four == [Segment((0, 1, 2, 3), 0, 3, 0)]
    assert CascadeRules().max_levels == 2


def test_long_segments_cut_into_pieces():
    tables, lens, _ = batch_of([([("sys", 20)], 3)] * 3 + [([("doc", 3)], 1)] * 2)
    result = plan(tables, lens, members_per_item=2)
    # Chunks: sys (3 members) x 2 + doc x 1; the other 5 items cut them into near-equal pieces of <= ceil(43 / 5) =
    # 9 pages.
    spans = sorted((int(s), int(e)) for s, e in zip(result.item_start // PAGE, result.item_end // PAGE) if e > s)
    assert spans == [(0, 3), (0, 6), (0, 6), (6, 13), (6, 13), (13, 20), (13, 20)]
    assert result.num_pieces.tolist() == [3, 3, 3, 1, 1, 0, 0, 0]


@pytest.mark.parametrize("wave_items,pieces", [(None, 7), (4, 4), (2, 2), (1, 1)])
def test_wave_items_size_the_pieces(wave_items, pieces):
    """One segment of 40 pages: cut into as many pieces as fill the wave (a piece at least; the items left, 7 of
    8, without one)."""
    tables, lens, _ = batch_of([([("sys", 40)], 3)] * 3)
    rules = CascadeRules(min_shared_tokens=PAGE, min_piece_tokens=PAGE, min_saved_tokens=1, num_items=8)
    result = plan_cascade(tables, lens, batch=4, page_size=PAGE, members_per_item=4, rules=rules,
                          wave_items=wave_items)
    check_plan(result, tables, lens, batch=4, members_per_item=4, num_items=8)
    assert int((result.item_end > result.item_start).sum()) == pieces


def test_more_groups_than_items_keeps_those_saving_most():
    rows = [([(f"g{i}", 2 + i)], 3) for i in range(6) for _ in range(2)]
    tables, lens, _ = batch_of(rows)
    rules = CascadeRules(min_shared_tokens=PAGE, min_piece_tokens=PAGE, num_items=4)
    result = plan(tables, lens, batch=16, rules=rules)
    assert sorted(s.end for s in result.segments) == [4, 5, 6, 7]


def test_nested_group_dropped_with_its_parent():
    rows = [([("big", 9)], 3)] * 2 + [([("sys", 2), ("doc", 2)], 3)] * 2
    tables, lens, _ = batch_of(rows)
    rules = CascadeRules(min_shared_tokens=2 * PAGE, min_piece_tokens=PAGE, num_items=1)
    result = plan(tables, lens, rules=rules)
    assert result.segments == (Segment((0, 1), 0, 9, 0),)


@pytest.mark.parametrize("seed", range(8))
def test_random_trees(seed):
    """Random prefix trees (a few roots, nested documents, own tails of any length, padding rows): the invariants
    hold and the shapes stay fixed."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(int(rng.integers(1, 30))):
        root = int(rng.integers(0, 3))
        shared = [(f"r{root}", 1 + root)]
        if rng.random() < 0.7:
            doc = int(rng.integers(0, 3))
            shared.append((f"r{root}d{doc}", 1 + doc))
            if rng.random() < 0.5:
                shared.append((f"r{root}d{doc}q", 1))
        rows.append((shared, int(rng.integers(0, 40))))
    tables, lens, _ = batch_of(rows, seed=seed)
    batch = 32
    lens[int(rng.integers(0, len(lens)))] = 0  # a padding row inside the live ones
    rules = CascadeRules(min_shared_tokens=PAGE * int(rng.integers(1, 3)), min_piece_tokens=PAGE,
                         num_items=int(rng.integers(1, 12)))
    plan(tables, lens, batch=batch, members_per_item=int(rng.integers(1, 6)), rules=rules)


def test_defaults():
    tables, lens, _ = batch_of([([("sys", 250)], 16)] * 64)
    result = plan_cascade(tables, lens, batch=64, page_size=PAGE, members_per_item=64)
    check_plan(result, tables, lens, batch=64, members_per_item=64, num_items=CascadeRules().num_items)
    assert result.use_cascade and result.saved_tokens == 63 * 250 * PAGE


@pytest.mark.parametrize("call,message", [
    (lambda: plan_cascade([[1]] * 3, [5] * 3, batch=2, page_size=PAGE, members_per_item=2), "do not fit"),
    (lambda: plan_cascade([[1]], [5], batch=2, page_size=PAGE, members_per_item=0), "members_per_item"),
    (lambda: find_segments([[1], [1]], [5], page_size=PAGE), "seq_lens"),
    (lambda: find_segments([[1], [1]], [40, 5], page_size=PAGE), "row 0"),
    (lambda: CascadeRules(min_members=1), "min_members"),
    (lambda: CascadeRules(num_items=0), "min_members"),
])
def test_rejects_bad_input(call, message):
    with pytest.raises(ValueError, match=message):
        call()
