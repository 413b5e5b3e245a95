"""Paged KV-cache block manager: reference counting + prefix caching (plain Python).

The KV cache is a pool of ``num_blocks`` pages of ``block_size`` token slots.  A
sequence owns the blocks listed in ``seq.block_table``; token position ``p`` is
stored in slot ``block_table[p // block_size] * block_size + p % block_size``.

Prefix caching
--------------
Only FULL blocks whose KV has been computed are cached (:meth:`BlockManager.commit`).
A cached block is identified by

* its chained hash ``h_i = hash_block_tokens(h_{i-1}, tokens_i)`` (``h_{-1} = None``),
  a stable 64-bit blake2b digest of the previous hash and the block's token ids
  (stable across processes, unlike Python's ``hash``);
* the *content identity* (``uid``) of the block before it, and
* the block's own token ids.

The lookup table is keyed by ``(h_i, parent_uid)`` and every hit is verified by
comparing the stored token ids.  Because the parent is identified by its uid (not
by a hash) and uids are only shared by blocks whose tokens AND parent uid are
equal, a hit is correct by induction over the prefix: a hash collision (even a
constant hash function) can only cause cache misses, never a wrong block.
Blocks computed twice for the same prefix (e.g. a burst of requests with the same
system prompt admitted in the same step) share a uid, so the prefix stays
reachable as long as any copy of it is alive or free-but-not-yet-reused.

Free list
---------
A block whose reference count drops to 0 goes to the free list but keeps its
hash and contents, so a later cache hit can revive it (that consumes a free
block, which :meth:`can_allocate` accounts for).  Fresh allocations take the
least recently freed block first; blocks that hold no cached content (partial or
never-committed blocks) are put at the front of the free list, i.e. reused before
any cached block.  Sequences free their blocks last-to-first, so the tail of a
prefix is evicted before its head.

Pinning
-------
:meth:`pin_blocks` takes one extra reference on a sequence's committed full
blocks; pinned blocks are never evicted, so every later request starting with
that prefix hits them, until :meth:`unpin`.

This module must not import JAX.
"""

from __future__ import annotations

import hashlib
import itertools
import struct
from collections import Counter, OrderedDict
from typing import TYPE_CHECKING, Sequence as SequenceLike

if TYPE_CHECKING:  # pragma: no cover
    from .sequence import Sequence

_ROOT = -1  # parent uid of a sequence's first block


def hash_block_tokens(prev_hash: int | None, token_ids: SequenceLike[int]) -> int:
    """Stable chained hash of one full block: blake2b(prev_hash, token ids) -> 64-bit int.

    Used only as an index; correctness never depends on it being collision free.
    Looked up as a module global at call time (tests monkeypatch it).
    """
    h = hashlib.blake2b(digest_size=8)
    h.update(b"\x00" if prev_hash is None else b"\x01" + int(prev_hash).to_bytes(8, "little"))
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return int.from_bytes(h.digest(), "little")


class _Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids", "parent_uid", "uid")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.clear()

    def clear(self) -> None:
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None
        self.parent_uid: int | None = None
        self.uid: int | None = None  # None <=> block holds no cached content

    @property
    def key(self) -> tuple[int | None, int | None]:
        return (self.hash, self.parent_uid)


class _SeqState:
    __slots__ = ("seq", "num_hashed")

    def __init__(self, seq: "Sequence", num_hashed: int):
        self.seq = seq
        self.num_hashed = num_hashed  # leading blocks of the table that are committed


class BlockManager:
    """Reference-counted KV blocks with prefix caching. See the module docstring."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._blocks = [_Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cache: dict[tuple[int, int], int] = {}  # (hash, parent_uid) -> block id
        self._classes: dict[int, set[int]] = {}  # uid -> ids of blocks holding that content
        self._uids = itertools.count()
        self._seqs: dict[int, _SeqState] = {}  # seq_id -> state, for allocated sequences
        self._hash_memo: dict[int, list[int]] = {}  # seq_id -> chained hashes of its full blocks
        self._pins: dict[int, list[int]] = {}
        self._pin_ids = itertools.count(1)

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks with reference count 0 (including cached ones that could be revived)."""
        return len(self._free)

    @property
    def num_pinned_blocks(self) -> int:
        """Distinct blocks held by pins."""
        return len({b for blocks in self._pins.values() for b in blocks})

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` token slots."""
        return -(-num_tokens // self.block_size)

    def num_cached_tokens(self, seq: "Sequence") -> int:
        """Side-effect-free prefix-cache lookup: what :meth:`allocate` would set
        ``seq.num_computed_tokens`` to (a multiple of block_size, <= num_tokens - 1)."""
        return len(self._match(seq)) * self.block_size

    def can_allocate(self, seq: "Sequence") -> bool:
        """Whether :meth:`allocate` would succeed now (cache hits on free blocks count
        as consuming a free block)."""
        return self._blocks_to_take(seq, self._match(seq)) <= len(self._free)

    def can_ensure_capacity(self, seq: "Sequence", num_tokens: int) -> bool:
        """Whether :meth:`ensure_capacity` ``(seq, num_tokens)`` would succeed now."""
        self._state(seq)
        return self._extra_blocks(seq, num_tokens) <= len(self._free)

    # ------------------------------------------------------------------ mutations
    def allocate(self, seq: "Sequence") -> None:
        """Give a sequence with an empty block table blocks for all ``seq.num_tokens``.

        The longest prefix of full blocks found in the cache is shared (limited to
        the first ``num_tokens - 1`` tokens, so at least the last token -- the whole
        last block if the prompt is a multiple of block_size -- is recomputed into a
        fresh private block); ``seq.num_computed_tokens`` and ``seq.num_cached_tokens``
        are set to the cached length.  Raises RuntimeError (changing nothing) if
        there are not enough free blocks: check :meth:`can_allocate` first.
        """
        if seq.block_table or seq.seq_id in self._seqs:
            raise ValueError(f"sequence {seq.seq_id} already has blocks")
        hits = self._match(seq)
        need = self._blocks_to_take(seq, hits)
        if need > len(self._free):
            raise RuntimeError(
                f"cannot allocate sequence {seq.seq_id}: needs {need} free blocks, "
                f"{len(self._free)} free"
            )
        for bid in hits:
            self._incref(bid)
        fresh = [self._pop_free() for _ in range(self.num_blocks_for(seq.num_tokens) - len(hits))]
        seq.block_table = hits + fresh
        seq.num_computed_tokens = seq.num_cached_tokens = len(hits) * self.block_size
        self._seqs[seq.seq_id] = _SeqState(seq, len(hits))

    def ensure_capacity(self, seq: "Sequence", num_tokens: int) -> None:
        """Grow ``seq.block_table`` (fresh blocks) until it has at least ``num_tokens``
        token slots, i.e. positions ``0 .. num_tokens-1`` can be written.  Never
        shrinks.  Raises RuntimeError (changing nothing) if there are not enough
        free blocks: check :meth:`can_ensure_capacity` first."""
        self._state(seq)
        extra = self._extra_blocks(seq, num_tokens)
        if extra > len(self._free):
            raise RuntimeError(
                f"cannot grow sequence {seq.seq_id} to {num_tokens} tokens: needs {extra} "
                f"free blocks, {len(self._free)} free"
            )
        seq.block_table.extend(self._pop_free() for _ in range(extra))

    def commit(self, seq: "Sequence") -> None:
        """Register in the prefix cache every full block of ``seq`` lying entirely in
        ``token_ids[:num_computed_tokens]`` (call after the KV was written). Idempotent."""
        st = self._state(seq)
        bs = self.block_size
        if seq.num_computed_tokens > seq.num_tokens:
            raise RuntimeError(
                f"sequence {seq.seq_id}: num_computed_tokens {seq.num_computed_tokens} > "
                f"num_tokens {seq.num_tokens}"
            )
        k = seq.num_computed_tokens // bs
        if k > len(seq.block_table):
            raise RuntimeError(
                f"sequence {seq.seq_id}: {seq.num_computed_tokens} computed tokens but only "
                f"{len(seq.block_table)} blocks"
            )
        if k <= st.num_hashed:
            return
        hashes = self._block_hashes(seq, k)
        table = seq.block_table
        parent = self._blocks[table[st.num_hashed - 1]].uid if st.num_hashed else _ROOT
        for i in range(st.num_hashed, k):
            blk = self._blocks[table[i]]
            if blk.uid is not None or blk.ref_count != 1:
                raise RuntimeError(f"block {blk.block_id} is not a private uncommitted block")
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            key = (hashes[i], parent)
            cached_id = self._cache.get(key)
            cached = self._blocks[cached_id] if cached_id is not None else None
            if cached is not None and cached.token_ids == tokens:
                uid = cached.uid  # same content already cached: join its class
                if cached.ref_count == 0:  # prefer a live copy: hits then revive nothing
                    self._cache[key] = blk.block_id
            else:
                uid = next(self._uids)
                if cached is None:  # on a (hash, parent) collision the first block keeps the key
                    self._cache[key] = blk.block_id
            blk.hash, blk.token_ids, blk.parent_uid, blk.uid = key[0], tokens, parent, uid
            self._classes.setdefault(uid, set()).add(blk.block_id)
            parent = uid
        st.num_hashed = k

    def free(self, seq: "Sequence") -> None:
        """Drop the sequence's references (last block first), clear its table and set
        ``num_computed_tokens`` to 0.  Blocks reaching refcount 0 go to the free list
        keeping their cached content.  Safe on a sequence that holds no blocks."""
        st = self._seqs.pop(seq.seq_id, None)
        self._hash_memo.pop(seq.seq_id, None)
        if st is None and seq.block_table:
            raise ValueError(f"sequence {seq.seq_id} holds blocks not allocated by this manager")
        for bid in reversed(seq.block_table):
            self._decref(bid)
        seq.block_table = []
        seq.num_computed_tokens = 0

    def pin_blocks(self, seq: "Sequence", num_tokens: int | None = None) -> int:
        """Take an extra reference on the committed full blocks covering the first
        ``num_tokens`` tokens of ``seq`` (``num_tokens // block_size`` blocks; all
        committed blocks if None) and return a handle for :meth:`unpin`.  Pinned
        blocks are never evicted.  Call before the sequence is freed/finished.
        Raises ValueError if those blocks are not committed yet."""
        st = self._state(seq)
        k = st.num_hashed if num_tokens is None else num_tokens // self.block_size
        if k > st.num_hashed:
            raise ValueError(
                f"sequence {seq.seq_id}: cannot pin {k} blocks, only {st.num_hashed} are committed"
            )
        blocks = list(seq.block_table[:k])
        for bid in blocks:
            self._incref(bid)
        handle = next(self._pin_ids)
        self._pins[handle] = blocks
        return handle

    def unpin(self, handle: int) -> None:
        """Release a pin taken by :meth:`pin_blocks`."""
        try:
            blocks = self._pins.pop(handle)
        except KeyError:
            raise ValueError(f"unknown pin handle {handle!r}") from None
        for bid in reversed(blocks):
            self._decref(bid)

    # ------------------------------------------------------------------ checks
    def check_invariants(self) -> None:
        """Raise AssertionError if the internal state is inconsistent (for tests)."""

        def fail(msg: str) -> None:
            raise AssertionError(msg)

        bs = self.block_size
        owners: Counter[int] = Counter()
        for sid, st in self._seqs.items():
            seq = st.seq
            table = seq.block_table
            if seq.seq_id != sid:
                fail(f"seq state {sid} holds sequence {seq.seq_id}")
            if len(set(table)) != len(table):
                fail(f"sequence {sid} has a duplicate block in {table}")
            if not 0 <= seq.num_computed_tokens <= min(seq.num_tokens, len(table) * bs):
                fail(f"sequence {sid}: computed {seq.num_computed_tokens} outside table/tokens")
            if st.num_hashed > seq.num_computed_tokens // bs:
                fail(f"sequence {sid}: {st.num_hashed} committed blocks > computed full blocks")
            owners.update(table)
            parent = _ROOT
            for i, bid in enumerate(table):
                blk = self._blocks[bid]
                if i < st.num_hashed:
                    if blk.uid is None:
                        fail(f"sequence {sid}: committed block {bid} has no identity")
                    if blk.token_ids != tuple(seq.token_ids[i * bs : (i + 1) * bs]):
                        fail(f"sequence {sid}: block {bid} holds other tokens than position {i}")
                    if blk.parent_uid != parent:
                        fail(f"sequence {sid}: block {bid} was computed after another prefix")
                    parent = blk.uid
                elif blk.uid is not None:
                    fail(f"sequence {sid}: uncommitted block {bid} has a cached identity")
        for blocks in self._pins.values():
            owners.update(blocks)
        for blk in self._blocks:
            if blk.ref_count != owners[blk.block_id]:
                fail(f"block {blk.block_id}: refcount {blk.ref_count} != {owners[blk.block_id]} owners")
            if (blk.ref_count == 0) != (blk.block_id in self._free):
                fail(f"block {blk.block_id}: refcount {blk.ref_count} but free={blk.block_id in self._free}")
            if blk.uid is None:
                if blk.ref_count > 1:
                    fail(f"uncommitted block {blk.block_id} is shared ({blk.ref_count} owners)")
                if blk.hash is not None or blk.token_ids is not None:
                    fail(f"block {blk.block_id}: stale hash without identity")
            else:
                if blk.token_ids is None or len(blk.token_ids) != bs or blk.hash is None:
                    fail(f"block {blk.block_id}: incomplete identity")
                if blk.block_id not in self._classes.get(blk.uid, ()):
                    fail(f"block {blk.block_id} missing from its content class {blk.uid}")
        if len(self._free) != sum(1 for b in self._blocks if b.ref_count == 0):
            fail("free list size mismatch")
        for key, bid in self._cache.items():
            blk = self._blocks[bid]
            if blk.uid is None or blk.key != key:
                fail(f"cache entry {key} -> block {bid} with key {blk.key}")
        for uid, members in self._classes.items():
            if not members:
                fail(f"empty content class {uid}")
            idents = {(self._blocks[b].uid, self._blocks[b].key, self._blocks[b].token_ids) for b in members}
            if len(idents) != 1 or next(iter(idents))[0] != uid:
                fail(f"content class {uid} is inconsistent: {idents}")

    # ------------------------------------------------------------------ internals
    def _state(self, seq: "Sequence") -> _SeqState:
        try:
            return self._seqs[seq.seq_id]
        except KeyError:
            raise ValueError(f"sequence {seq.seq_id} is not allocated") from None

    def _block_hashes(self, seq: "Sequence", k: int) -> list[int]:
        memo = self._hash_memo.setdefault(seq.seq_id, [])
        bs, toks = self.block_size, seq.token_ids
        while len(memo) < k:
            i = len(memo)
            memo.append(hash_block_tokens(memo[-1] if memo else None, toks[i * bs : (i + 1) * bs]))
        return memo

    def _match(self, seq: "Sequence") -> list[int]:
        """Block ids of the longest verified cached prefix within token_ids[:-1]."""
        bs = self.block_size
        k = (seq.num_tokens - 1) // bs
        if k <= 0:
            return []
        hashes = self._block_hashes(seq, k)
        toks = seq.token_ids
        hits: list[int] = []
        parent = _ROOT
        for i in range(k):
            bid = self._cache.get((hashes[i], parent))
            if bid is None:
                break
            blk = self._blocks[bid]
            if blk.token_ids != tuple(toks[i * bs : (i + 1) * bs]):
                break  # hash collision: miss, never a wrong block
            hits.append(bid)
            parent = blk.uid
        return hits

    def _blocks_to_take(self, seq: "Sequence", hits: list[int]) -> int:
        revived = sum(1 for b in hits if self._blocks[b].ref_count == 0)
        return self.num_blocks_for(seq.num_tokens) - len(hits) + revived

    def _extra_blocks(self, seq: "Sequence", num_tokens: int) -> int:
        return max(0, self.num_blocks_for(num_tokens) - len(seq.block_table))

    def _incref(self, bid: int) -> None:
        blk = self._blocks[bid]
        if blk.ref_count == 0:
            del self._free[bid]  # revive a cached free block
        blk.ref_count += 1

    def _decref(self, bid: int) -> None:
        blk = self._blocks[bid]
        if blk.ref_count <= 0:
            raise RuntimeError(f"double free of block {bid}")
        blk.ref_count -= 1
        if blk.ref_count == 0:
            self._free[bid] = None  # most recently freed: evicted last
            if blk.uid is None:  # no cached content: reuse first
                self._free.move_to_end(bid, last=False)

    def _pop_free(self) -> int:
        bid, _ = self._free.popitem(last=False)
        blk = self._blocks[bid]
        if blk.uid is not None:
            self._evict(blk)
        blk.ref_count = 1
        return bid

    def _evict(self, blk: _Block) -> None:
        members = self._classes[blk.uid]
        members.discard(blk.block_id)
        key = blk.key
        if self._cache.get(key) == blk.block_id:
            if members:  # another copy of the same content: keep the prefix reachable
                self._cache[key] = max(members, key=lambda b: self._blocks[b].ref_count)
            else:
                del self._cache[key]
        if not members:
            del self._classes[blk.uid]
        blk.clear()
