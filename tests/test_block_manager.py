"""Unit + property tests for nanojax.block_manager (plain Python, no JAX)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import nanojax.block_manager as bm_mod
from nanojax.block_manager import BlockManager, hash_block_tokens
from nanojax.sequence import Sequence, SequenceStatus


def computed(bm: BlockManager, seq: Sequence, upto: int | None = None) -> None:
    """Pretend the engine computed KV up to ``upto`` (default: all tokens) and commit."""
    seq.num_computed_tokens = seq.num_tokens if upto is None else upto
    bm.commit(seq)


def refcounts(bm: BlockManager, blocks) -> list[int]:
    return [bm._blocks[b].ref_count for b in blocks]


# ---------------------------------------------------------------- sequence
def test_sequence_basics():
    a, b = Sequence([1, 2, 3], params={"x": 1}), Sequence([4])
    assert a.seq_id != b.seq_id
    assert (a.num_tokens, a.num_prompt_tokens, a.num_generated) == (3, 3, 0)
    assert a.status is SequenceStatus.WAITING and a.block_table == [] and a.num_computed_tokens == 0
    a.append_token(7)
    assert a.token_ids == [1, 2, 3, 7] and a.num_generated == 1 and type(a.token_ids[-1]) is int
    assert a.params == {"x": 1}
    with pytest.raises(ValueError):
        Sequence([])


def test_hash_is_stable_and_chained():
    h1 = hash_block_tokens(None, [1, 2, 3, 4])
    assert h1 == hash_block_tokens(None, (1, 2, 3, 4))
    assert h1 != hash_block_tokens(None, [1, 2, 3, 5])
    assert hash_block_tokens(h1, [5, 6]) != hash_block_tokens(None, [5, 6])
    assert 0 <= h1 < 2**64


# ---------------------------------------------------------------- allocation
def test_allocate_free_roundtrip():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = Sequence(range(10))
    assert bm.can_allocate(seq) and bm.num_cached_tokens(seq) == 0
    bm.allocate(seq)
    assert len(seq.block_table) == 3 and seq.num_computed_tokens == 0
    assert bm.num_free_blocks == 5
    with pytest.raises(ValueError):
        bm.allocate(seq)  # already allocated
    bm.check_invariants()
    bm.free(seq)
    assert seq.block_table == [] and seq.num_computed_tokens == 0 and bm.num_free_blocks == 8
    bm.check_invariants()


def test_allocate_raises_without_blocks_and_changes_nothing():
    bm = BlockManager(num_blocks=2, block_size=4)
    seq = Sequence(range(9))  # needs 3 blocks
    assert not bm.can_allocate(seq)
    with pytest.raises(RuntimeError):
        bm.allocate(seq)
    assert seq.block_table == [] and bm.num_free_blocks == 2
    bm.check_invariants()


def test_ensure_capacity():
    bm = BlockManager(num_blocks=4, block_size=4)
    seq = Sequence(range(4))
    bm.allocate(seq)
    assert len(seq.block_table) == 1
    assert bm.can_ensure_capacity(seq, 4)
    bm.ensure_capacity(seq, 4)  # already covered
    assert len(seq.block_table) == 1
    bm.ensure_capacity(seq, 5)
    assert len(seq.block_table) == 2
    assert bm.can_ensure_capacity(seq, 16) and not bm.can_ensure_capacity(seq, 17)
    with pytest.raises(RuntimeError):
        bm.ensure_capacity(seq, 17)
    assert len(seq.block_table) == 2
    bm.ensure_capacity(seq, 3)  # never shrinks
    assert len(seq.block_table) == 2
    with pytest.raises(ValueError):
        bm.ensure_capacity(Sequence([1]), 1)  # not allocated
    bm.check_invariants()


# ---------------------------------------------------------------- prefix caching
def test_prefix_hit_shares_full_blocks():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = Sequence(list(range(12)) + [99])  # 3 full blocks + 1 token
    bm.allocate(a)
    computed(bm, a, 10)  # only 2 blocks full & computed
    b = Sequence(list(range(12)) + [50, 51])
    assert bm.num_cached_tokens(b) == 8
    bm.allocate(b)
    assert b.num_computed_tokens == b.num_cached_tokens == 8
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert refcounts(bm, a.block_table[:2]) == [2, 2]
    bm.check_invariants()
    computed(bm, a)  # block 2 of a now full and committed
    c = Sequence(list(range(12)) + [7])
    bm.allocate(c)
    assert c.num_computed_tokens == 12 and c.block_table[:3] == a.block_table[:3]
    bm.check_invariants()
    for s in (a, b, c):
        bm.free(s)
    assert bm.num_free_blocks == 10
    bm.check_invariants()


def test_partial_blocks_are_never_cached():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = Sequence(range(7))
    bm.allocate(a)
    computed(bm, a)
    b = Sequence(list(range(7)) + [1, 2, 3])
    bm.allocate(b)
    assert b.num_computed_tokens == 4  # only the full first block


def test_fully_cached_prompt_recomputes_last_token():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = Sequence(range(12))
    bm.allocate(a)
    computed(bm, a)
    # identical prompt, multiple of block_size: last block recomputed into a private block
    b = Sequence(range(12))
    bm.allocate(b)
    assert b.num_computed_tokens == 8 <= b.num_tokens - 1
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert bm._blocks[b.block_table[2]].ref_count == 1
    # the prompt plus one token: every full block hits, exactly the last token is recomputed
    c = Sequence(list(range(12)) + [5])
    bm.allocate(c)
    assert c.num_computed_tokens == 12 == c.num_tokens - 1
    # a prompt no longer than one block never hits
    d = Sequence(range(4))
    bm.allocate(d)
    assert d.num_computed_tokens == 0
    bm.check_invariants()


def test_free_blocks_keep_content_and_are_revived():
    bm = BlockManager(num_blocks=3, block_size=4)
    a = Sequence(range(9))
    bm.allocate(a)
    computed(bm, a)
    table = list(a.block_table)
    bm.free(a)
    assert bm.num_free_blocks == 3
    b = Sequence(list(range(8)) + [42])
    # 2 revived hits + 1 fresh block == all 3 free blocks: exactly allocatable
    assert bm.can_allocate(b) and bm.num_cached_tokens(b) == 8
    bm.allocate(b)
    assert b.block_table[:2] == table[:2] and bm.num_free_blocks == 0
    # with no free block left, even a full cache hit cannot be allocated ...
    c = Sequence(list(range(8)) + [43])
    assert not bm.can_allocate(c)
    bm.free(b)
    # ... and a revived hit on a refcount-0 block is counted as consuming a free block
    x = Sequence([7] * 4)
    bm.allocate(x)  # takes the un-cached block first
    assert bm.num_free_blocks == 2
    assert not bm.can_allocate(c)  # needs 2 revived + 1 fresh = 3 > 2
    with pytest.raises(RuntimeError):
        bm.allocate(c)
    bm.check_invariants()


def test_lru_eviction_order():
    bm = BlockManager(num_blocks=4, block_size=2)
    a, b = Sequence([1, 1, 9]), Sequence([2, 2, 9])  # one full block + one partial each
    bm.allocate(a)
    bm.allocate(b)
    computed(bm, a)
    computed(bm, b)
    bm.free(a)  # a's full block freed first (least recently)
    bm.free(b)
    # three fresh blocks: the two un-cached partial blocks go first, then the LRU cached one
    x = Sequence([5] * 6)
    bm.allocate(x)
    assert bm.num_cached_tokens(Sequence([1, 1, 0])) == 0  # a's block was evicted
    assert bm.num_cached_tokens(Sequence([2, 2, 0])) == 2  # b's block survives
    bm.check_invariants()


def test_uncached_blocks_are_reused_before_cached_ones():
    bm = BlockManager(num_blocks=2, block_size=2)
    a, b = Sequence([1, 2]), Sequence([5])
    bm.allocate(a)
    bm.allocate(b)
    computed(bm, a)  # a's block is full and cached, b's is partial
    bm.free(a)
    bm.free(b)  # freed later, but holds nothing worth caching
    bm.allocate(Sequence([7]))
    assert bm.num_cached_tokens(Sequence([1, 2, 0])) == 2
    bm.check_invariants()


def test_prefix_tail_is_evicted_before_head():
    bm = BlockManager(num_blocks=3, block_size=2)
    a = Sequence([1, 2, 3, 4, 5])
    bm.allocate(a)
    computed(bm, a)
    bm.free(a)
    x = Sequence([9, 9, 9])  # two fresh blocks: a's partial block, then a's TAIL full block
    bm.allocate(x)
    assert bm.num_cached_tokens(Sequence([1, 2, 3, 4, 0])) == 2
    bm.check_invariants()


def test_hash_collision_never_returns_wrong_block(monkeypatch):
    monkeypatch.setattr(bm_mod, "hash_block_tokens", lambda prev, toks: 12345)
    bm = BlockManager(num_blocks=16, block_size=4)
    a = Sequence([1, 2, 3, 4, 5, 6, 7, 8, 0])
    bm.allocate(a)
    computed(bm, a)
    # same second block, different first block: must not hit a's second block
    b = Sequence([9, 9, 9, 9, 5, 6, 7, 8, 0])
    assert bm.num_cached_tokens(b) == 0
    bm.allocate(b)
    assert set(b.block_table).isdisjoint(a.block_table)
    computed(bm, b)
    # same first block, different second block
    c = Sequence([1, 2, 3, 4, 9, 9, 9, 9, 0])
    bm.allocate(c)
    assert c.num_computed_tokens == 4 and c.block_table[0] == a.block_table[0]
    assert c.block_table[1] not in a.block_table + b.block_table
    # genuinely equal prefixes still hit despite the degenerate hash
    d = Sequence([1, 2, 3, 4, 5, 6, 7, 8, 1])
    bm.allocate(d)
    assert d.num_computed_tokens == 8 and d.block_table[:2] == a.block_table[:2]
    bm.check_invariants()


def test_duplicate_computation_keeps_prefix_reachable():
    """Two identical prompts computed concurrently: the copies share a content class,
    so evicting the mapped copy keeps the prefix reachable through the other one."""
    bm = BlockManager(num_blocks=6, block_size=2)
    a, b = Sequence([1, 2, 3, 4, 0]), Sequence([1, 2, 3, 4, 0])
    bm.allocate(a)
    bm.allocate(b)  # nothing committed yet: no hit
    assert b.num_computed_tokens == 0
    computed(bm, a)
    computed(bm, b)
    assert bm._blocks[a.block_table[0]].uid == bm._blocks[b.block_table[0]].uid
    bm.check_invariants()
    bm.free(a)  # a's copies freed, b's stay live
    x = Sequence(list(range(10, 16)))  # needs 3 blocks: evicts all of a's blocks
    bm.allocate(x)
    bm.free(x)
    c = Sequence([1, 2, 3, 4, 7])
    bm.allocate(c)
    assert c.num_computed_tokens == 4 and c.block_table[:2] == b.block_table[:2]
    bm.check_invariants()


def test_chat_followup_hits_generated_blocks():
    bm = BlockManager(num_blocks=10, block_size=4)
    turn1 = Sequence([1, 2, 3, 4, 5, 6])
    bm.allocate(turn1)
    computed(bm, turn1)
    for t in (7, 8, 9):  # decode three tokens
        turn1.append_token(t)
        bm.ensure_capacity(turn1, turn1.num_tokens)
        computed(bm, turn1)
    bm.free(turn1)
    turn2 = Sequence([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11])
    bm.allocate(turn2)
    assert turn2.num_computed_tokens == 8
    bm.check_invariants()


def test_pins_survive_eviction_pressure():
    bm = BlockManager(num_blocks=4, block_size=2)
    sys_prompt = [5, 6, 7, 8]
    a = Sequence(sys_prompt + [1])
    bm.allocate(a)
    computed(bm, a, 4)
    with pytest.raises(ValueError):
        bm.pin_blocks(a, num_tokens=6)  # not committed that far
    h = bm.pin_blocks(a, num_tokens=len(sys_prompt))
    assert bm.num_pinned_blocks == 2
    pinned = a.block_table[:2]
    bm.free(a)
    assert refcounts(bm, pinned) == [1, 1] and bm.num_free_blocks == 2
    for i in range(5):  # churn through the remaining blocks
        s = Sequence([100 + i] * 4)
        bm.allocate(s)
        computed(bm, s)
        bm.free(s)
        bm.check_invariants()
    b = Sequence(sys_prompt + [2, 3])
    bm.allocate(b)
    assert b.num_computed_tokens == 4 and b.block_table[:2] == pinned
    bm.free(b)
    bm.unpin(h)
    with pytest.raises(ValueError):
        bm.unpin(h)
    assert bm.num_free_blocks == 4 and bm.num_pinned_blocks == 0
    bm.check_invariants()


def test_check_invariants_detects_corruption():
    bm = BlockManager(num_blocks=4, block_size=2)
    s = Sequence([1, 2, 3])
    bm.allocate(s)
    bm.check_invariants()
    bm._blocks[s.block_table[0]].ref_count += 1
    with pytest.raises(AssertionError):
        bm.check_invariants()
    bm._blocks[s.block_table[0]].ref_count -= 1
    s.block_table.append(s.block_table[0])  # double-owned
    with pytest.raises(AssertionError):
        bm.check_invariants()


# ---------------------------------------------------------------- stateful property test
HASHES = {
    "real": hash_block_tokens,
    "const": lambda prev, toks: 7,
    "mod2": lambda prev, toks: hash_block_tokens(prev, toks) % 2,
}
BASES = [[0, 1, 2, 0, 1, 2, 0, 1, 2, 0], [0, 1, 2, 0, 2, 2, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]]


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate / compute / append / free / pin on a tiny pool.

    A shadow "KV store" records, for each written slot, the exact token prefix it was
    computed from; every cache hit and every pinned block is checked against it, so a
    wrong reuse (e.g. under a degenerate hash) or an overwrite of a shared block fails."""

    @initialize(
        num_blocks=st.integers(1, 16), bs=st.sampled_from([1, 2, 3, 4]), hash_mode=st.sampled_from(sorted(HASHES))
    )
    def setup(self, num_blocks, bs, hash_mode):
        self._saved_hash = bm_mod.hash_block_tokens
        bm_mod.hash_block_tokens = HASHES[hash_mode]
        self.bm = BlockManager(num_blocks, bs)
        self.bs = bs
        self.pending: list[Sequence] = []
        self.live: list[Sequence] = []
        self.kv: dict[tuple[int, int], tuple[int, ...]] = {}
        self.pins: dict[int, list[tuple[int, int, tuple[int, ...]]]] = {}
        self.hits = 0

    def teardown(self):
        if hasattr(self, "_saved_hash"):
            bm_mod.hash_block_tokens = self._saved_hash

    def _slot(self, seq, p):
        return (seq.block_table[p // self.bs], p % self.bs)

    @precondition(lambda self: hasattr(self, "bm") and len(self.pending) < 5)
    @rule(base=st.integers(0, len(BASES) - 1), cut=st.integers(0, 10), suffix=st.lists(st.integers(0, 2), max_size=4))
    def new_seq(self, base, cut, suffix):
        toks = BASES[base][:cut] + suffix
        if toks:
            self.pending.append(Sequence(toks))

    @precondition(lambda self: hasattr(self, "bm") and self.pending)
    @rule(data=st.data())
    def allocate(self, data):
        seq = self.pending.pop(data.draw(st.integers(0, len(self.pending) - 1)))
        bm = self.bm
        free_before = set(bm._free)
        predicted = bm.num_cached_tokens(seq)
        if bm.can_allocate(seq):
            bm.allocate(seq)
            n = seq.num_computed_tokens
            assert n == predicted == seq.num_cached_tokens and n % self.bs == 0 and n <= seq.num_tokens - 1
            assert len(seq.block_table) * self.bs >= seq.num_tokens
            hits = seq.block_table[: n // self.bs]
            revived = sum(1 for b in hits if b in free_before)
            assert len(free_before) - bm.num_free_blocks == len(seq.block_table) - len(hits) + revived
            for p in range(n):  # every reused slot holds KV computed from exactly this prefix
                assert self.kv[self._slot(seq, p)] == tuple(seq.token_ids[: p + 1])
            self.hits += n
            event("allocate: prefix hit" if n else "allocate: miss")
            if revived:
                event("allocate: revived a free cached block")
            self.live.append(seq)
        else:
            free_order = list(bm._free)
            with pytest.raises(RuntimeError):
                bm.allocate(seq)
            assert seq.block_table == [] and list(bm._free) == free_order
            event("allocate: pool exhausted")

    @precondition(lambda self: hasattr(self, "bm") and any(s.num_computed_tokens < s.num_tokens for s in self.live))
    @rule(data=st.data())
    def compute(self, data):
        cands = [s for s in self.live if s.num_computed_tokens < s.num_tokens]
        seq = data.draw(st.sampled_from(cands))
        upto = data.draw(st.integers(seq.num_computed_tokens + 1, seq.num_tokens))
        for p in range(seq.num_computed_tokens, upto):
            blk = self.bm._blocks[seq.block_table[p // self.bs]]
            assert blk.ref_count == 1 and blk.uid is None, "engine would write into a shared/cached block"
            self.kv[self._slot(seq, p)] = tuple(seq.token_ids[: p + 1])
        seq.num_computed_tokens = upto
        self.bm.commit(seq)

    @precondition(lambda self: hasattr(self, "bm") and any(s.num_computed_tokens == s.num_tokens for s in self.live))
    @rule(data=st.data(), tok=st.integers(0, 2), extra=st.integers(0, 3))
    def append(self, data, tok, extra):
        seq = data.draw(st.sampled_from([s for s in self.live if s.num_computed_tokens == s.num_tokens]))
        seq.append_token(tok)
        want = seq.num_tokens + extra
        table = list(seq.block_table)
        if self.bm.can_ensure_capacity(seq, want):
            self.bm.ensure_capacity(seq, want)
            assert len(seq.block_table) * self.bs >= want and seq.block_table[: len(table)] == table
        else:
            with pytest.raises(RuntimeError):
                self.bm.ensure_capacity(seq, want)
            assert seq.block_table == table
            # cannot grow: give up on this sequence (a scheduler would preempt)
            self.live.remove(seq)
            self.bm.free(seq)

    @precondition(lambda self: hasattr(self, "bm") and self.live)
    @rule(data=st.data(), again=st.booleans())
    def free(self, data, again):
        seq = self.live.pop(data.draw(st.integers(0, len(self.live) - 1)))
        self.bm.free(seq)
        assert seq.block_table == [] and seq.num_computed_tokens == 0
        if again and len(self.pending) < 5:  # a follow-up request with the same tokens
            self.pending.append(Sequence(seq.token_ids))

    @precondition(lambda self: hasattr(self, "bm") and any(s.num_computed_tokens >= self.bs for s in self.live))
    @rule(data=st.data())
    def pin(self, data):
        seq = data.draw(st.sampled_from([s for s in self.live if s.num_computed_tokens >= self.bs]))
        k = seq.num_computed_tokens // self.bs
        h = self.bm.pin_blocks(seq)
        self.pins[h] = [
            (seq.block_table[i], o, tuple(seq.token_ids[: i * self.bs + o + 1]))
            for i in range(k)
            for o in range(self.bs)
        ]

    @precondition(lambda self: hasattr(self, "bm") and self.pins)
    @rule(data=st.data())
    def unpin(self, data):
        h = data.draw(st.sampled_from(sorted(self.pins)))
        del self.pins[h]
        self.bm.unpin(h)

    @invariant()
    def consistent(self):
        if not hasattr(self, "bm"):
            return
        self.bm.check_invariants()
        for seq in self.live:
            for p in range(seq.num_computed_tokens):
                assert self.kv[self._slot(seq, p)] == tuple(seq.token_ids[: p + 1])
        for entries in self.pins.values():
            for b, o, content in entries:
                assert self.bm._blocks[b].ref_count >= 1 and b not in self.bm._free
                assert self.kv[(b, o)] == content
        if not self.live and not self.pins:
            assert self.bm.num_free_blocks == self.bm.num_blocks


BlockManagerMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=40, deadline=None, suppress_health_check=list(HealthCheck)
)
TestBlockManagerMachine = BlockManagerMachine.TestCase
