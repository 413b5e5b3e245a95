"""KV-cache pages with reference counting and prefix caching (plain Python, no JAX): a full computed page is cached
under the chained hash of its token prefix, and a freed page keeps its content until reused: a later hit revives it."""
import hashlib
import itertools
import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence as SequenceLike

from .sequence import Sequence


def hash_page_tokens(parent: bytes | None, token_ids: SequenceLike[int]) -> bytes:
    """128-bit blake2b of the previous page's hash and this page's tokens: stable across processes, unlike ``hash``."""
    return hashlib.blake2b((parent or b"") + struct.pack(f"<{len(token_ids)}q", *token_ids), digest_size=16).digest()


@dataclass(eq=False)
class _Page:
    page_id: int
    ref_count: int = 0
    hash: bytes | None = None  # set <=> the page holds a committed prefix (cached content)
    token_ids: tuple[int, ...] | None = None  # the page's own tokens, checked on every hit


@dataclass(eq=False)
class _Allocation:
    seq: "Sequence"
    num_committed: int  # leading pages of seq.page_table registered in the prefix cache


class PageManager:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages ({num_pages}) and page_size ({page_size}) must be >= 1")
        self.num_pages, self.page_size = num_pages, page_size
        self._pages = [_Page(i) for i in range(num_pages)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_pages))  # taken from the front
        self._cache: dict[bytes, set[int]] = {}  # prefix hash -> ids of the pages holding that prefix
        self._seqs: dict[int, _Allocation] = {}  # seq_id -> allocation, for sequences holding pages
        self._hashes: dict[int, list[bytes]] = {}  # seq_id -> chained hashes of its full pages (memo)
        self._pins: dict[int, list[int]] = {}  # handle -> pinned page ids
        self._pin_ids = itertools.count(1)

    @property
    def num_free_pages(self) -> int:
        """Including cached pages that a hit could revive."""
        return len(self._free)

    @property
    def num_pinned_pages(self) -> int:
        return len({p for pages in self._pins.values() for p in pages})

    def num_pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def num_cached_tokens(self, seq: "Sequence") -> int:
        """What :meth:`allocate` would set ``seq.num_computed_tokens`` to, without side effects."""
        return len(self._match(seq)) * self.page_size

    def can_allocate(self, seq: "Sequence") -> bool:
        """Whether :meth:`allocate` would succeed now (a hit on a free page consumes a free page)."""
        return self._pages_to_take(seq, self._match(seq)) <= len(self._free)

    def can_ensure_capacity(self, seq: "Sequence", num_tokens: int) -> bool:
        return self._new_pages(seq, num_tokens) <= len(self._free)

    def allocate(self, seq: "Sequence") -> None:
        """Pages for ``seq``, sharing the longest cached prefix short of its last token (RuntimeError: none free)."""
        if seq.page_table or seq.seq_id in self._seqs:
            raise ValueError(f"sequence {seq.seq_id} already has pages")
        hits = self._match(seq)
        self._check_free(self._pages_to_take(seq, hits), f"allocate sequence {seq.seq_id}")
        for pid in hits:
            self._incref(pid)
        seq.page_table = hits + [self._pop_free() for _ in range(self.num_pages_for(seq.num_tokens) - len(hits))]
        seq.num_computed_tokens = seq.num_cached_tokens = len(hits) * self.page_size
        self._seqs[seq.seq_id] = _Allocation(seq, len(hits))

    def ensure_capacity(self, seq: "Sequence", num_tokens: int) -> None:
        """Slots for positions ``0 .. num_tokens - 1``; RuntimeError, changing nothing, unless can_ensure_capacity."""
        new = self._new_pages(seq, num_tokens)
        self._check_free(new, f"grow sequence {seq.seq_id} to {num_tokens} tokens")
        seq.page_table.extend(self._pop_free() for _ in range(new))

    def commit(self, seq: "Sequence") -> None:
        """Registers every full computed page whose tokens are known (its KV written or dispatched); idempotent."""
        alloc, ps = self._allocation(seq), self.page_size
        k = min(seq.num_computed_tokens, seq.num_known) // ps
        if seq.num_computed_tokens > seq.num_tokens or k > len(seq.page_table):
            raise RuntimeError(f"sequence {seq.seq_id}: {seq.num_computed_tokens} computed tokens but "
                               f"{seq.num_tokens} tokens and {len(seq.page_table)} pages")
        hashes = self._page_hashes(seq, k)
        for i in range(alloc.num_committed, k):
            page = self._pages[seq.page_table[i]]
            if page.hash is not None or page.ref_count != 1:
                raise RuntimeError(f"page {page.page_id} is not a private uncommitted page")
            page.hash, page.token_ids = hashes[i], tuple(seq.token_ids[i * ps : (i + 1) * ps])
            self._cache.setdefault(page.hash, set()).add(page.page_id)
        alloc.num_committed = max(alloc.num_committed, k)

    def free(self, seq: "Sequence") -> None:
        """Drops the sequence's pages, last first, and resets ``num_computed_tokens``; a no-op on one without."""
        alloc = self._seqs.pop(seq.seq_id, None)
        self._hashes.pop(seq.seq_id, None)
        if alloc is None and seq.page_table:
            raise ValueError(f"sequence {seq.seq_id} holds pages not allocated by this manager")
        for pid in reversed(seq.page_table):
            self._decref(pid)
        seq.page_table = []
        seq.num_computed_tokens = 0

    def pin_pages(self, seq: "Sequence", num_tokens: int | None = None) -> int:
        """Pins the committed pages of the first ``num_tokens`` (None: all of them) -> a handle for :meth:`unpin`."""
        alloc = self._allocation(seq)
        k = alloc.num_committed if num_tokens is None else num_tokens // self.page_size
        if k > alloc.num_committed:
            raise ValueError(f"sequence {seq.seq_id}: cannot pin {k} pages, only {alloc.num_committed} are committed")
        pages = seq.page_table[:k]
        for pid in pages:
            self._incref(pid)
        handle = next(self._pin_ids)
        self._pins[handle] = pages
        return handle

    def unpin(self, handle: int) -> None:
        if handle not in self._pins:
            raise ValueError(f"unknown pin handle {handle!r}")
        for pid in reversed(self._pins.pop(handle)):
            self._decref(pid)

    def _allocation(self, seq: "Sequence") -> _Allocation:
        if seq.seq_id not in self._seqs:
            raise ValueError(f"sequence {seq.seq_id} holds no pages")
        return self._seqs[seq.seq_id]

    def _page_hashes(self, seq: "Sequence", k: int) -> list[bytes]:
        """At least the first ``k`` pages' hashes, memoized: the waiting head is looked up at every step."""
        memo = self._hashes.setdefault(seq.seq_id, [])
        ps = self.page_size
        for i in range(len(memo), k):
            memo.append(hash_page_tokens(memo[-1] if memo else None, seq.token_ids[i * ps : (i + 1) * ps]))
        return memo

    def _match(self, seq: "Sequence") -> list[int]:
        """Pages holding the longest cached prefix of ``token_ids[:-1]``."""
        if not seq.reads_prefix_cache:
            return []
        ps = self.page_size
        k = (seq.num_tokens - 1) // ps
        hashes = self._page_hashes(seq, k)
        hits: list[int] = []
        for i in range(k):
            tokens = tuple(seq.token_ids[i * ps : (i + 1) * ps])
            copies = [p for p in self._cache.get(hashes[i], ()) if self._pages[p].token_ids == tokens]
            if not copies:
                break
            hits.append(max(copies, key=lambda p: self._pages[p].ref_count))  # in use: revives nothing
        return hits

    def _pages_to_take(self, seq: "Sequence", hits: list[int]) -> int:
        """Free pages that allocating ``seq`` consumes: fresh ones and revived hits."""
        revived = sum(1 for p in hits if self._pages[p].ref_count == 0)
        return self.num_pages_for(seq.num_tokens) - len(hits) + revived

    def _new_pages(self, seq: "Sequence", num_tokens: int) -> int:
        self._allocation(seq)  # (ValueError unless it holds pages)
        return max(0, self.num_pages_for(num_tokens) - len(seq.page_table))

    def _check_free(self, need: int, what: str) -> None:
        if need > len(self._free):
            raise RuntimeError(f"cannot {what}: needs {need} free pages, {len(self._free)} free")

    def _incref(self, pid: int) -> None:
        page = self._pages[pid]
        if page.ref_count == 0:
            del self._free[pid]  # a cache hit revives a free page
        page.ref_count += 1

    def _decref(self, pid: int) -> None:
        page = self._pages[pid]
        if page.ref_count <= 0:
            raise RuntimeError(f"double free of page {pid}")
        page.ref_count -= 1
        if page.ref_count == 0:
            self._free[pid] = None  # most recently freed: evicted last ...
            if page.hash is None:
                self._free.move_to_end(pid, last=False)  # ... unless there is nothing to keep: reused first

    def _pop_free(self) -> int:
        pid, _ = self._free.popitem(last=False)
        page = self._pages[pid]
        if page.hash is not None:  # evict its cached content
            copies = self._cache[page.hash]
            copies.discard(pid)
            if not copies:
                del self._cache[page.hash]
            page.hash = page.token_ids = None
        page.ref_count = 1
        return pid
