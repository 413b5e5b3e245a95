"""Cascade grouping (host numpy, each decode dispatch): decode rows whose page tables start with the same physical
pages (a prefix-cached prompt), as fixed-shape work items for pallas_kernels.cascade_attention, which reads each shared
page once per step for all its rows."""
import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class CascadeRules:
    """When a shared prefix is worth it (docs/perf_notes.md, "Cascade attention"); num_items is a shape."""

    min_members: int = 2  # member rows a segment needs
    min_shared_tokens: int = 256  # and tokens; a shorter run goes with each nested group, or to the rows' own suffixes
    # Pieces are at least this long (else about one wave of programs): each writes one f32 output per member and query
    # head for the merge, as costly as reading a few tokens of KV per member.
    min_piece_tokens: int = 256
    min_saved_tokens: int = 24576  # KV tokens saved per layer and step below which the kernel and merge do not pay
    max_levels: int = 2  # nesting levels (system prompt, document); deeper shared runs stay in the rows' suffixes
    num_items: int = 32  # work items per step: the kernel's grid (times the KV heads) and each row's piece slots
    min_batch: int = 8  # the smallest decode batch bucket with a cascade program (one more program to compile)

    def __post_init__(self):
        if self.min_members < 2 or min(self.min_shared_tokens, self.min_piece_tokens, self.max_levels,
                                       self.num_items, self.min_batch) < 1:
            raise ValueError(f"min_members must be >= 2 and the other rules >= 1, got {self}")


ARRAY_FIELDS = ("kv_starts", "num_pieces", "item_row", "item_start", "item_end", "item_members", "item_slots")


@dataclasses.dataclass(frozen=True)
class Segment:
    """Pages [start, end) (page-table indices) that all `rows` share, the same physical pages, at nesting `level`."""

    rows: tuple[int, ...]
    start: int
    end: int
    level: int


@dataclasses.dataclass(frozen=True, eq=False)
class CascadePlan:
    """A step's shared-prefix work, shaped by the batch bucket B, members_per_item M and num_items W only (one compiled
    program). An item is one piece of one segment for up to M of its members."""

    kv_starts: np.ndarray  # [B] first position of each row's own suffix, 0 for rows in no group
    num_pieces: np.ndarray  # [B] shared-prefix pieces of each row, in its slots 0 .. num_pieces - 1
    item_row: np.ndarray  # [W] a member row whose page table lists the item's pages (0 for empty items)
    item_start: np.ndarray  # [W] the item's first KV position, a multiple of page_size
    item_end: np.ndarray  # [W] its end position (== item_start: an empty item)
    item_members: np.ndarray  # [W, M] its member rows, -1 for none
    item_slots: np.ndarray  # [W, M] the slot each member's piece of this item fills (0 for none)
    segments: tuple[Segment, ...]
    saved_tokens: int  # KV tokens per layer and KV head not read, against reading every row's pages
    use_cascade: bool  # whether that saving pays (rules.min_saved_tokens)

    def arrays(self) -> tuple[np.ndarray, ...]:
        """In cascade_decode_attention's argument order."""
        return tuple(getattr(self, name) for name in ARRAY_FIELDS)


def shareable_pages(seq_lens, page_size: int) -> np.ndarray:
    """[rows] full pages strictly before each row's last token (position seq_len - 1); 0 for padding rows."""
    seq_lens = np.asarray(seq_lens, np.int64)
    return np.where(seq_lens > 0, (seq_lens - 1) // page_size, 0)


def _shareable_table(page_tables, limits) -> np.ndarray:
    """[rows, max(limits)] int32: each row's shareable page ids, then an id of its own (-1 - row), so that rows group
    by plain equality. page_tables: a [rows, P] array or one list per row."""
    width = int(limits.max(initial=0))
    if isinstance(page_tables, np.ndarray):
        if page_tables.ndim != 2 or page_tables.shape[1] < width:
            raise ValueError(f"page table of shape {page_tables.shape} has fewer pages than a seq_len needs")
        table = page_tables[:, :width]
    else:
        table = np.zeros((len(page_tables), width), np.int32)
        for row, (pages, limit) in enumerate(zip(page_tables, limits)):
            if len(pages) < limit:
                raise ValueError(f"page table of row {row} has {len(pages)} pages, fewer than its seq_len needs")
            table[row, :limit] = pages[:limit]
    own = -1 - np.arange(len(table), dtype=np.int32)[:, None]
    return np.where(np.arange(width)[None, :] < limits[:, None], table, own).astype(np.int32, copy=False)


def _groups_at(table, rows, col, min_members):
    """The groups of >= min_members of `rows` (ascending) holding the same page at column col, each ascending."""
    if col >= table.shape[1]:
        return []
    ids = table[rows, col]
    order = np.argsort(ids, kind="stable")
    _, first, counts = np.unique(ids[order], return_index=True, return_counts=True)
    return [rows[order[i:i + n]] for i, n in zip(first, counts) if n >= min_members]


def _collect(table, rows, col, start, level, rules, min_pages, out):
    """Appends the segments of the trie node of `rows`, which share column col and pages [start, col) left over
    from an ancestor too short to be a segment."""
    differs = (table[rows, col:] != table[rows[0], col:]).any(axis=0)  # from col on, where the rows' pages part
    end = col + (int(np.argmax(differs)) if differs.any() else differs.size)
    nested = _groups_at(table, rows, end, rules.min_members)
    if end - start < min_pages:  # too short: its pages go with each nested group's
        for group in nested:
            _collect(table, group, end, start, level, rules, min_pages, out)
        return
    out.append(Segment(tuple(int(r) for r in rows), start, end, level))
    if level + 1 < rules.max_levels:
        for group in nested:
            _collect(table, group, end, end, level + 1, rules, min_pages, out)


def find_segments(page_tables, seq_lens, *, page_size: int, rules: CascadeRules = CascadeRules()) -> list[Segment]:
    """The shared-prefix segments of a decode batch, parents first. page_tables: [rows, P] or one list per row;
    seq_lens: each row's tokens, its last included (0: a padding row)."""
    if len(page_tables) != len(seq_lens):
        raise ValueError(f"{len(page_tables)} page tables but {len(seq_lens)} seq_lens")
    table = _shareable_table(page_tables, shareable_pages(seq_lens, page_size))
    min_pages = -(-rules.min_shared_tokens // page_size)
    out = []
    for group in _groups_at(table, np.arange(len(page_tables)), 0, rules.min_members):
        _collect(table, group, 0, 0, 0, rules, min_pages, out)
    return out


def _split(items, most):
    """items (a sequence or a range) split into the fewest near-equal consecutive parts of <= most."""
    parts = -(-len(items) // most)
    return [items[i * len(items) // parts:(i + 1) * len(items) // parts] for i in range(parts)]


def _within_budget(segments, num_rows, members_per_item, num_items):
    """-> (the segments that fit num_items items, those saving the most first, each nested one only with its parent;
    each row's end of its shared pages)."""
    covered = np.zeros(num_rows, np.int64)
    kept, items = [], 0
    ranked = sorted(segments, key=lambda s: (s.level, -(len(s.rows) - 1) * (s.end - s.start)))
    for seg in ranked:
        chunks = -(-len(seg.rows) // members_per_item)
        if items + chunks <= num_items and all(covered[r] == seg.start for r in seg.rows):
            kept.append(seg)
            items += chunks
            covered[list(seg.rows)] = seg.end
    return kept, covered


def plan_cascade(page_tables, seq_lens, *, batch: int, page_size: int, members_per_item: int,
                 rules: CascadeRules = CascadeRules(), wave_items: int | None = None) -> CascadePlan:
    """find_segments' shared prefixes of up to `batch` rows as fixed-shape work items of up to members_per_item rows,
    pieces sized to fill about wave_items items (one wave of SMs, the fastest measured; None: all items left)."""
    if len(page_tables) > batch:
        raise ValueError(f"{len(page_tables)} rows do not fit batch {batch}")
    if members_per_item < 1:
        raise ValueError(f"members_per_item must be >= 1, got {members_per_item}")
    num_items = rules.num_items
    segments = find_segments(page_tables, seq_lens, page_size=page_size, rules=rules)
    segments, covered = _within_budget(segments, len(page_tables), members_per_item, num_items)
    chunks = [(seg, part) for seg in segments for part in _split(seg.rows, members_per_item)]
    # sum(ceil(pages / piece_pages)) < total / piece_pages + len(chunks) <= num_items (or about wave_items) pieces.
    spare = min(num_items - len(chunks), wave_items or num_items)
    total = sum(seg.end - seg.start for seg, _ in chunks)
    piece_pages = max(-(-rules.min_piece_tokens // page_size), -(-total // spare) if spare > 0 else total, 1)

    kv_starts, num_pieces = np.zeros(batch, np.int32), np.zeros(batch, np.int32)
    kv_starts[:len(covered)] = covered * page_size
    item_row, item_start, item_end = (np.zeros(num_items, np.int32) for _ in range(3))
    item_members = np.full((num_items, members_per_item), -1, np.int32)
    item_slots = np.zeros((num_items, members_per_item), np.int32)
    items = [(rows, pages) for seg, rows in chunks for pages in _split(range(seg.start, seg.end), piece_pages)]
    for w, (rows, pages) in enumerate(items):
        item_row[w], item_start[w], item_end[w] = rows[0], pages.start * page_size, pages.stop * page_size
        item_members[w, :len(rows)] = rows
        item_slots[w, :len(rows)] = num_pieces[list(rows)]
        num_pieces[list(rows)] += 1
    saved = sum((len(rows) - 1) * (seg.end - seg.start) for seg, rows in chunks) * page_size  # one reader per chunk
    return CascadePlan(kv_starts, num_pieces, item_row, item_start, item_end, item_members, item_slots,
                       tuple(segments), saved, saved >= rules.min_saved_tokens)
