"""Unit + property tests for nanojax.page_manager (plain Python, no JAX)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, event, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import nanojax.page_manager as pm_mod
from nanojax.page_manager import PageManager, hash_page_tokens
from nanojax.sequence import Sequence, SequenceStatus


def check_invariants(pm: PageManager) -> None:
    """Assert that the manager's state is consistent: reference counts match the owners (sequences
    and pins), the free list holds exactly the unreferenced pages, committed pages hold their
    sequence's tokens under the chained hash of its prefix, uncommitted pages are private."""
    ps, owners = pm.page_size, Counter()
    for sid, alloc in pm._seqs.items():
        seq, table = alloc.seq, alloc.seq.page_table
        assert seq.seq_id == sid and len(set(table)) == len(table), f"sequence {sid}: table {table}"
        assert 0 <= seq.num_computed_tokens <= min(seq.num_tokens, len(table) * ps), seq
        assert alloc.num_committed <= seq.num_computed_tokens // ps, f"sequence {sid} committed uncomputed pages"
        owners.update(table)
        parent = None
        for i, pid in enumerate(table):
            page = pm._pages[pid]
            if i < alloc.num_committed:
                tokens = tuple(seq.token_ids[i * ps : (i + 1) * ps])
                assert page.token_ids == tokens, f"sequence {sid}: page {pid} holds other tokens"
                assert page.hash == pm_mod.hash_page_tokens(parent, tokens), f"page {pid}: another prefix"
                parent = page.hash
            else:
                assert page.hash is None, f"sequence {sid}: uncommitted page {pid} is cached"
    for pages in pm._pins.values():
        owners.update(pages)
    for page in pm._pages:
        pid = page.page_id
        assert page.ref_count == owners[pid], f"page {pid}: refcount {page.ref_count} != {owners[pid]} owners"
        assert (page.ref_count == 0) == (pid in pm._free), f"page {pid}: refcount {page.ref_count}, free list"
        assert (page.hash is None) == (page.token_ids is None), f"page {pid}: half a cache entry"
        if page.hash is None:
            assert page.ref_count <= 1, f"uncommitted page {pid} is shared"
        else:
            assert len(page.token_ids) == ps and pid in pm._cache[page.hash], f"page {pid} not in the cache"
    for h, copies in pm._cache.items():
        assert copies and all(pm._pages[p].hash == h for p in copies), f"cache entry {h!r}: {copies}"


def computed(pm: PageManager, seq: Sequence, upto: int | None = None) -> None:
    """Pretend the engine computed KV up to ``upto`` (default: all tokens) and commit."""
    seq.num_computed_tokens = seq.num_tokens if upto is None else upto
    pm.commit(seq)


def allocated(pm: PageManager, token_ids) -> Sequence:
    """A new sequence with its pages allocated."""
    seq = Sequence(token_ids)
    pm.allocate(seq)
    return seq


def committed(pm: PageManager, token_ids) -> Sequence:
    """A new sequence with its pages allocated and its whole KV computed and committed."""
    seq = allocated(pm, token_ids)
    computed(pm, seq)
    return seq


def refcounts(pm: PageManager, pages) -> list[int]:
    return [pm._pages[b].ref_count for b in pages]


# ---------------------------------------------------------------- sequence
def test_sequence_basics():
    a, b = Sequence([1, 2, 3], request={"x": 1}), Sequence([4])
    assert a.seq_id != b.seq_id
    assert (a.num_tokens, a.num_prompt_tokens, a.num_generated) == (3, 3, 0)
    assert a.status is SequenceStatus.WAITING and a.page_table == [] and a.num_computed_tokens == 0
    a.token_ids.append(7)
    assert a.token_ids == [1, 2, 3, 7] and a.num_generated == 1 and a.num_known == 4
    assert a.request == {"x": 1}
    with pytest.raises(ValueError):
        Sequence([])


def test_hash_is_stable_chained_and_wide():
    h1 = hash_page_tokens(None, [1, 2, 3, 4])
    assert h1 == hash_page_tokens(None, (1, 2, 3, 4))
    assert h1 != hash_page_tokens(None, [1, 2, 3, 5])
    assert hash_page_tokens(h1, [5, 6]) != hash_page_tokens(None, [5, 6])
    assert isinstance(h1, bytes) and len(h1) >= 16  # 128 bits: collisions are not a concern


# ---------------------------------------------------------------- allocation
def test_allocate_free_roundtrip():
    pm = PageManager(num_pages=8, page_size=4)
    seq = Sequence(range(10))
    assert pm.can_allocate(seq) and pm.num_cached_tokens(seq) == 0
    pm.allocate(seq)
    assert len(seq.page_table) == 3 and seq.num_computed_tokens == 0
    assert pm.num_free_pages == 5
    with pytest.raises(ValueError):
        pm.allocate(seq)  # already allocated
    check_invariants(pm)
    pm.free(seq)
    assert seq.page_table == [] and seq.num_computed_tokens == 0 and pm.num_free_pages == 8
    check_invariants(pm)


def test_allocate_raises_without_pages_and_changes_nothing():
    pm = PageManager(num_pages=2, page_size=4)
    seq = Sequence(range(9))  # needs 3 pages
    assert not pm.can_allocate(seq)
    with pytest.raises(RuntimeError):
        pm.allocate(seq)
    assert seq.page_table == [] and pm.num_free_pages == 2
    check_invariants(pm)


def test_ensure_capacity():
    pm = PageManager(num_pages=4, page_size=4)
    seq = allocated(pm, range(4))
    assert len(seq.page_table) == 1
    assert pm.can_ensure_capacity(seq, 4)
    pm.ensure_capacity(seq, 4)  # already covered
    assert len(seq.page_table) == 1
    pm.ensure_capacity(seq, 5)
    assert len(seq.page_table) == 2
    assert pm.can_ensure_capacity(seq, 16) and not pm.can_ensure_capacity(seq, 17)
    with pytest.raises(RuntimeError):
        pm.ensure_capacity(seq, 17)
    assert len(seq.page_table) == 2
    pm.ensure_capacity(seq, 3)  # never shrinks
    assert len(seq.page_table) == 2
    with pytest.raises(ValueError):
        pm.ensure_capacity(Sequence([1]), 1)  # not allocated
    check_invariants(pm)


# ---------------------------------------------------------------- prefix caching
def test_prefix_hit_shares_full_pages():
    pm = PageManager(num_pages=10, page_size=4)
    a = Sequence(list(range(12)) + [99])  # 3 full pages + 1 token
    pm.allocate(a)
    computed(pm, a, 10)  # only 2 pages full & computed
    b = Sequence(list(range(12)) + [50, 51])
    assert pm.num_cached_tokens(b) == 8
    pm.allocate(b)
    assert b.num_computed_tokens == b.num_cached_tokens == 8
    assert b.page_table[:2] == a.page_table[:2] and b.page_table[2] != a.page_table[2]
    assert refcounts(pm, a.page_table[:2]) == [2, 2]
    check_invariants(pm)
    computed(pm, a)  # page 2 of a now full and committed
    c = allocated(pm, list(range(12)) + [7])
    assert c.num_computed_tokens == 12 and c.page_table[:3] == a.page_table[:3]
    check_invariants(pm)
    for s in (a, b, c):
        pm.free(s)
    assert pm.num_free_pages == 10
    check_invariants(pm)


def test_a_sequence_that_reads_no_cache_computes_its_prompt():
    pm = PageManager(num_pages=10, page_size=4)
    a = allocated(pm, list(range(12)) + [99])
    computed(pm, a)
    b = Sequence(list(range(12)) + [99], reads_prefix_cache=False)
    assert pm.num_cached_tokens(b) == 0
    pm.allocate(b)
    assert b.num_computed_tokens == 0 and not set(b.page_table) & set(a.page_table)
    computed(pm, b)  # its pages are committed too: the cache holds two copies of the prefix
    check_invariants(pm)


def test_partial_pages_are_never_cached():
    pm = PageManager(num_pages=10, page_size=4)
    committed(pm, range(7))
    b = allocated(pm, list(range(7)) + [1, 2, 3])
    assert b.num_computed_tokens == 4  # only the full first page


def test_fully_cached_prompt_recomputes_last_token():
    pm = PageManager(num_pages=10, page_size=4)
    a = committed(pm, range(12))
    # identical prompt, multiple of page_size: last page recomputed into a private page
    b = allocated(pm, range(12))
    assert b.num_computed_tokens == 8 <= b.num_tokens - 1
    assert b.page_table[:2] == a.page_table[:2] and b.page_table[2] != a.page_table[2]
    assert pm._pages[b.page_table[2]].ref_count == 1
    # the prompt plus one token: every full page hits, exactly the last token is recomputed
    c = allocated(pm, list(range(12)) + [5])
    assert c.num_computed_tokens == 12 == c.num_tokens - 1
    # a prompt no longer than one page never hits
    d = allocated(pm, range(4))
    assert d.num_computed_tokens == 0
    check_invariants(pm)


def test_free_pages_keep_content_and_are_revived():
    pm = PageManager(num_pages=3, page_size=4)
    a = committed(pm, range(9))
    table = list(a.page_table)
    pm.free(a)
    assert pm.num_free_pages == 3
    b = Sequence(list(range(8)) + [42])
    # 2 revived hits + 1 fresh page == all 3 free pages: exactly allocatable
    assert pm.can_allocate(b) and pm.num_cached_tokens(b) == 8
    pm.allocate(b)
    assert b.page_table[:2] == table[:2] and pm.num_free_pages == 0
    # with no free page left, even a full cache hit cannot be allocated ...
    c = Sequence(list(range(8)) + [43])
    assert not pm.can_allocate(c)
    pm.free(b)
    # ... and a revived hit on a refcount-0 page is counted as consuming a free page
    x = Sequence([7] * 4)
    pm.allocate(x)  # takes the un-cached page first
    assert pm.num_free_pages == 2
    assert not pm.can_allocate(c)  # needs 2 revived + 1 fresh = 3 > 2
    with pytest.raises(RuntimeError):
        pm.allocate(c)
    check_invariants(pm)


def test_lru_eviction_order():
    pm = PageManager(num_pages=4, page_size=2)
    a, b = Sequence([1, 1, 9]), Sequence([2, 2, 9])  # one full page + one partial each
    pm.allocate(a)
    pm.allocate(b)
    computed(pm, a)
    computed(pm, b)
    pm.free(a)  # a's full page freed first (least recently)
    pm.free(b)
    # three fresh pages: the two un-cached partial pages go first, then the LRU cached one
    allocated(pm, [5] * 6)
    assert pm.num_cached_tokens(Sequence([1, 1, 0])) == 0  # a's page was evicted
    assert pm.num_cached_tokens(Sequence([2, 2, 0])) == 2  # b's page survives
    check_invariants(pm)


def test_uncached_pages_are_reused_before_cached_ones():
    pm = PageManager(num_pages=2, page_size=2)
    a, b = Sequence([1, 2]), Sequence([5])
    pm.allocate(a)
    pm.allocate(b)
    computed(pm, a)  # a's page is full and cached, b's is partial
    pm.free(a)
    pm.free(b)  # freed later, but holds nothing worth caching
    pm.allocate(Sequence([7]))
    assert pm.num_cached_tokens(Sequence([1, 2, 0])) == 2
    check_invariants(pm)


def test_prefix_tail_is_evicted_before_head():
    pm = PageManager(num_pages=3, page_size=2)
    a = committed(pm, [1, 2, 3, 4, 5])
    pm.free(a)
    x = Sequence([9, 9, 9])  # two fresh pages: a's partial page, then a's TAIL full page
    pm.allocate(x)
    assert pm.num_cached_tokens(Sequence([1, 2, 3, 4, 0])) == 2
    check_invariants(pm)


def test_forced_collision_with_other_tokens_is_a_miss(monkeypatch):
    """A hit compares the page's own tokens: a hash colliding with a page of other tokens is a
    miss, never that page (the prefix before the page is named by the 128-bit chain)."""
    monkeypatch.setattr(pm_mod, "hash_page_tokens", lambda parent, toks: b"collision")
    pm = PageManager(num_pages=16, page_size=4)
    a = committed(pm, [1, 2, 3, 4, 5, 6, 7, 8, 0])
    b = Sequence([9, 9, 9, 9, 5, 6, 7, 8, 0])  # every page's hash collides with both of a's pages
    assert pm.num_cached_tokens(b) == 0
    pm.allocate(b)
    assert set(b.page_table).isdisjoint(a.page_table)
    computed(pm, b)
    c = Sequence([1, 2, 3, 4, 0])  # equal tokens under the same hash still hit
    pm.allocate(c)
    assert c.num_computed_tokens == 4 and c.page_table[0] == a.page_table[0]
    check_invariants(pm)


def test_duplicate_computation_keeps_prefix_reachable():
    """Two identical prompts computed concurrently: both copies are cached, so evicting one keeps
    the prefix reachable through the other, and a hit prefers the copy in use."""
    pm = PageManager(num_pages=6, page_size=2)
    a, b = Sequence([1, 2, 3, 4, 0]), Sequence([1, 2, 3, 4, 0])
    pm.allocate(a)
    pm.allocate(b)  # nothing committed yet: no hit
    assert b.num_computed_tokens == 0
    computed(pm, a)
    computed(pm, b)
    check_invariants(pm)
    pm.free(a)  # a's copies freed, b's stay in use
    c = Sequence([1, 2, 3, 4, 7])
    assert pm.can_allocate(c) and pm.num_cached_tokens(c) == 4
    pm.allocate(c)
    assert c.page_table[:2] == b.page_table[:2] and pm.num_free_pages == 2  # nothing revived
    pm.free(c)
    x = Sequence(list(range(10, 16)))  # needs 3 pages: evicts all of a's pages
    pm.allocate(x)
    pm.free(x)
    d = allocated(pm, [1, 2, 3, 4, 7])
    assert d.num_computed_tokens == 4 and d.page_table[:2] == b.page_table[:2]
    check_invariants(pm)


def test_chat_followup_hits_generated_pages():
    pm = PageManager(num_pages=10, page_size=4)
    turn1 = committed(pm, [1, 2, 3, 4, 5, 6])
    for t in (7, 8, 9):  # decode three tokens
        turn1.token_ids.append(t)
        pm.ensure_capacity(turn1, turn1.num_tokens)
        computed(pm, turn1)
    pm.free(turn1)
    turn2 = allocated(pm, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11])
    assert turn2.num_computed_tokens == 8
    check_invariants(pm)


def test_pins_survive_eviction_pressure():
    pm = PageManager(num_pages=4, page_size=2)
    sys_prompt = [5, 6, 7, 8]
    a = allocated(pm, sys_prompt + [1])
    computed(pm, a, 4)
    with pytest.raises(ValueError):
        pm.pin_pages(a, num_tokens=6)  # not committed that far
    h = pm.pin_pages(a, num_tokens=len(sys_prompt))
    assert pm.num_pinned_pages == 2
    pinned = a.page_table[:2]
    pm.free(a)
    assert refcounts(pm, pinned) == [1, 1] and pm.num_free_pages == 2
    for i in range(5):  # churn through the remaining pages
        s = Sequence([100 + i] * 4)
        pm.allocate(s)
        computed(pm, s)
        pm.free(s)
        check_invariants(pm)
    b = allocated(pm, sys_prompt + [2, 3])
    assert b.num_computed_tokens == 4 and b.page_table[:2] == pinned
    pm.free(b)
    pm.unpin(h)
    with pytest.raises(ValueError):
        pm.unpin(h)
    assert pm.num_free_pages == 4 and pm.num_pinned_pages == 0
    check_invariants(pm)


def test_check_invariants_detects_corruption():
    pm = PageManager(num_pages=4, page_size=2)
    s = allocated(pm, [1, 2, 3])
    check_invariants(pm)
    pm._pages[s.page_table[0]].ref_count += 1
    with pytest.raises(AssertionError):
        check_invariants(pm)
    pm._pages[s.page_table[0]].ref_count -= 1
    s.page_table.append(s.page_table[0])  # double-owned
    with pytest.raises(AssertionError):
        check_invariants(pm)
    s.page_table.pop()
    computed(pm, s)
    check_invariants(pm)
    pm._pages[s.page_table[0]].token_ids = (1, 3)  # cached content not matching its hash
    with pytest.raises(AssertionError):
        check_invariants(pm)


# ---------------------------------------------------------------- stateful property test
BASES = [[0, 1, 2, 0, 1, 2, 0, 1, 2, 0], [0, 1, 2, 0, 2, 2, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]]


class PageManagerMachine(RuleBasedStateMachine):
    """Random allocate / compute / append / free / pin on a tiny pool.

    A shadow "KV store" records, for each written slot, the exact token prefix it was
    computed from; every cache hit and every pinned page is checked against it, so a
    wrong reuse or an overwrite of a shared page fails."""

    @initialize(num_pages=st.integers(1, 16), ps=st.sampled_from([1, 2, 3, 4]))
    def setup(self, num_pages, ps):
        self.pm = PageManager(num_pages, ps)
        self.ps = ps
        self.pending: list[Sequence] = []
        self.live: list[Sequence] = []
        self.kv: dict[tuple[int, int], tuple[int, ...]] = {}
        self.pins: dict[int, list[tuple[int, int, tuple[int, ...]]]] = {}
        self.hits = 0

    def _slot(self, seq, p):
        return (seq.page_table[p // self.ps], p % self.ps)

    @precondition(lambda self: hasattr(self, "pm") and len(self.pending) < 5)
    @rule(base=st.integers(0, len(BASES) - 1), cut=st.integers(0, 10), suffix=st.lists(st.integers(0, 2), max_size=4))
    def new_seq(self, base, cut, suffix):
        toks = BASES[base][:cut] + suffix
        if toks:
            self.pending.append(Sequence(toks))

    @precondition(lambda self: hasattr(self, "pm") and self.pending)
    @rule(data=st.data())
    def allocate(self, data):
        seq = self.pending.pop(data.draw(st.integers(0, len(self.pending) - 1)))
        pm = self.pm
        free_before = set(pm._free)
        predicted = pm.num_cached_tokens(seq)
        if pm.can_allocate(seq):
            pm.allocate(seq)
            n = seq.num_computed_tokens
            assert n == predicted == seq.num_cached_tokens and n % self.ps == 0 and n <= seq.num_tokens - 1
            assert len(seq.page_table) * self.ps >= seq.num_tokens
            hits = seq.page_table[: n // self.ps]
            revived = sum(1 for b in hits if b in free_before)
            assert len(free_before) - pm.num_free_pages == len(seq.page_table) - len(hits) + revived
            for p in range(n):  # every reused slot holds KV computed from exactly this prefix
                assert self.kv[self._slot(seq, p)] == tuple(seq.token_ids[: p + 1])
            self.hits += n
            event("allocate: prefix hit" if n else "allocate: miss")
            if revived:
                event("allocate: revived a free cached page")
            self.live.append(seq)
        else:
            free_order = list(pm._free)
            with pytest.raises(RuntimeError):
                pm.allocate(seq)
            assert seq.page_table == [] and list(pm._free) == free_order
            event("allocate: pool exhausted")

    @precondition(lambda self: hasattr(self, "pm") and any(s.num_computed_tokens < s.num_tokens for s in self.live))
    @rule(data=st.data())
    def compute(self, data):
        cands = [s for s in self.live if s.num_computed_tokens < s.num_tokens]
        seq = data.draw(st.sampled_from(cands))
        upto = data.draw(st.integers(seq.num_computed_tokens + 1, seq.num_tokens))
        for p in range(seq.num_computed_tokens, upto):
            page = self.pm._pages[seq.page_table[p // self.ps]]
            assert page.ref_count == 1 and page.hash is None, "engine would write into a shared/cached page"
            self.kv[self._slot(seq, p)] = tuple(seq.token_ids[: p + 1])
        seq.num_computed_tokens = upto
        self.pm.commit(seq)

    @precondition(lambda self: hasattr(self, "pm") and any(s.num_computed_tokens == s.num_tokens for s in self.live))
    @rule(data=st.data(), tok=st.integers(0, 2), extra=st.integers(0, 3))
    def append(self, data, tok, extra):
        seq = data.draw(st.sampled_from([s for s in self.live if s.num_computed_tokens == s.num_tokens]))
        seq.token_ids.append(tok)
        want = seq.num_tokens + extra
        table = list(seq.page_table)
        if self.pm.can_ensure_capacity(seq, want):
            self.pm.ensure_capacity(seq, want)
            assert len(seq.page_table) * self.ps >= want and seq.page_table[: len(table)] == table
        else:
            with pytest.raises(RuntimeError):
                self.pm.ensure_capacity(seq, want)
            assert seq.page_table == table
            # cannot grow: give up on this sequence (a scheduler would preempt)
            self.live.remove(seq)
            self.pm.free(seq)

    @precondition(lambda self: hasattr(self, "pm") and self.live)
    @rule(data=st.data(), again=st.booleans())
    def free(self, data, again):
        seq = self.live.pop(data.draw(st.integers(0, len(self.live) - 1)))
        self.pm.free(seq)
        assert seq.page_table == [] and seq.num_computed_tokens == 0
        if again and len(self.pending) < 5:  # a follow-up request with the same tokens
            self.pending.append(Sequence(seq.token_ids))

    @precondition(lambda self: hasattr(self, "pm") and any(s.num_computed_tokens >= self.ps for s in self.live))
    @rule(data=st.data())
    def pin(self, data):
        seq = data.draw(st.sampled_from([s for s in self.live if s.num_computed_tokens >= self.ps]))
        k = seq.num_computed_tokens // self.ps
        h = self.pm.pin_pages(seq)
        self.pins[h] = [
            (seq.page_table[i], o, tuple(seq.token_ids[: i * self.ps + o + 1]))
            for i in range(k)
            for o in range(self.ps)
        ]

    @precondition(lambda self: hasattr(self, "pm") and self.pins)
    @rule(data=st.data())
    def unpin(self, data):
        h = data.draw(st.sampled_from(sorted(self.pins)))
        del self.pins[h]
        self.pm.unpin(h)

    @invariant()
    def consistent(self):
        if not hasattr(self, "pm"):
            return
        check_invariants(self.pm)
        for seq in self.live:
            for p in range(seq.num_computed_tokens):
                assert self.kv[self._slot(seq, p)] == tuple(seq.token_ids[: p + 1])
        for entries in self.pins.values():
            for b, o, content in entries:
                assert self.pm._pages[b].ref_count >= 1 and b not in self.pm._free
                assert self.kv[(b, o)] == content
        if not self.live and not self.pins:
            assert self.pm.num_free_pages == self.pm.num_pages


PageManagerMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=40, deadline=None, suppress_health_check=list(HealthCheck)
)
TestPageManagerMachine = PageManagerMachine.TestCase
