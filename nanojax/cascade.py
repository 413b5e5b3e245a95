"""Cascade grouping: which decode rows share a prefix of physical KV pages, laid out as the fixed-shape work items
of pallas_kernels.cascade_attention (plain Python + numpy, run on the host each decode dispatch).

Prefix caching stores a shared prompt once, so rows that start with the same tokens have page tables that start with
the same physical page ids. A trie over the page ids finds them: each node is a run of pages [start, end) that a set
of >= 2 rows share, nested (level 0: e.g. a system prompt shared by all rows; level 1: a document shared by some of
them). A chosen node is a `Segment`; the kernel reads its pages once per step for all its members together.

Only full pages strictly before a row's last token are shareable: the last token's page is being written this step.
The pages of each row's chosen segments run contiguously from page 0 to kv_starts[row] / page_size; the rest of the
row (its own suffix) goes through paged decode attention.

Array layout (`CascadePlan`; shapes depend on the batch bucket B, members_per_item M and num_items W only, never on
the data, so the compiled step never recompiles):
    kv_starts [B]        first position of each row's own suffix (shared tokens before it), 0 for rows in no group
    num_pieces [B]       shared-prefix pieces of each row, in its slots 0 .. num_pieces - 1
    item_row [W]         a member row whose page table lists the item's pages (0 for empty items)
    item_start [W]       the item's first KV position, a multiple of page_size
    item_end [W]         its end position (item_start == item_end: an empty item)
    item_members [W, M]  its member rows, -1 for none
    item_slots [W, M]    the slot each member's piece of this item fills (0 for none)
An item is one piece of one segment for up to M of its members: long segments are cut into pieces (one program per
piece and KV head), segments with more than M members into several items.
"""
import dataclasses

import numpy as np

@dataclasses.dataclass(frozen=True)
class CascadeRules:
    """The planner's "worth it" rules, set from measurements (docs/perf_notes.md, "Cascade attention"). num_items is
    a shape: one value per engine."""

    # A segment needs this many member rows ...
    min_members: int = 2
    # ... and this many shared tokens; a shorter run of shared pages goes with each of its nested groups (they read
    # it with theirs), or to the rows' own suffixes when it has none.
    min_shared_tokens: int = 256
    # Segments are cut into pieces of at least this many tokens (else into about one wave of programs: plan_cascade's
    # wave_items): every piece writes (and the merge reads) one f32 output per member and query head, which costs as
    # much as reading a few tokens of KV per member.
    min_piece_tokens: int = 256
    # Below this many KV tokens saved per layer and step, plan.use_cascade is False: the cascade kernel and the merge
    # cost a few microseconds per layer, which a small saving does not pay for (about the measured break-even).
    min_saved_tokens: int = 24576
    # Nesting levels (system prompt, document); deeper shared runs stay in the rows' suffixes.
    max_levels: int = 2
    # Work items per step, the cascade kernel's grid (times the KV heads) and the slots of each row's pieces.
    num_items: int = 32
    # The smallest decode batch bucket that gets a cascade program (each is one more program to compile at start-up).
    min_batch: int = 8

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
    """The step's shared-prefix work (see the module docstring for the arrays); segments: the chosen ones;
    saved_tokens: KV tokens per layer and KV head this plan does not read, against reading every row's pages;
    use_cascade: whether that saving pays for the cascade kernel and merge (rules.min_saved_tokens)."""

    kv_starts: np.ndarray
    num_pieces: np.ndarray
    item_row: np.ndarray
    item_start: np.ndarray
    item_end: np.ndarray
    item_members: np.ndarray
    item_slots: np.ndarray
    segments: tuple[Segment, ...]
    saved_tokens: int
    use_cascade: bool

    def arrays(self) -> tuple[np.ndarray, ...]:
        """The arrays in cascade_decode_attention's argument order (ARRAY_FIELDS)."""
        return tuple(getattr(self, name) for name in ARRAY_FIELDS)


def shareable_pages(seq_lens, page_size: int) -> np.ndarray:
    """[rows] full pages strictly before each row's last token (position seq_len - 1); 0 for padding rows."""
    seq_lens = np.asarray(seq_lens, np.int64)
    return np.where(seq_lens > 0, (seq_lens - 1) // page_size, 0)


def _shareable_table(page_tables, limits) -> np.ndarray:
    """[rows, max(limits)] int32: each row's shareable page ids, then a negative id of its own (-1 - row) past them,
    which no other row holds: rows then group by plain equality. page_tables: a [rows, P] array (the runner's
    padded table: one copy, no per-row loop) or one list per row."""
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


def _common_end(table, rows, col):
    """The end of the run of pages from col on that all rows (which share column col) hold."""
    differs = (table[rows, col:] != table[rows[0], col:]).any(axis=0)
    return col + (int(np.argmax(differs)) if differs.any() else differs.size)


def _collect(table, rows, col, start, level, rules, min_pages, out):
    """Appends the segments of the trie node of `rows`, which share pages [start, col) not yet in a segment (an
    ancestor too short to be one) and column col, then recurses into its nested groups."""
    end = _common_end(table, rows, col)
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
    """The shared-prefix segments of a decode batch, parents before their nested ones.

    page_tables: the physical page ids of each row, a [rows, P] array (entries past a row's pages are ignored) or one
    list per row; seq_lens: tokens of each row, its last token included (0: a padding row). A segment's pages are
    the same physical pages in every member's table, all before each member's last token's page, and each row's
    segments run contiguously from page 0.
    """
    if len(page_tables) != len(seq_lens):
        raise ValueError(f"{len(page_tables)} page tables but {len(seq_lens)} seq_lens")
    table = _shareable_table(page_tables, shareable_pages(seq_lens, page_size))
    min_pages = -(-rules.min_shared_tokens // page_size)
    out = []
    for group in _groups_at(table, np.arange(len(page_tables)), 0, rules.min_members):
        _collect(table, group, 0, 0, 0, rules, min_pages, out)
    return out


def _chunks(rows, members_per_item):
    """rows split into the fewest near-equal consecutive parts of <= members_per_item."""
    parts = -(-len(rows) // members_per_item)
    return [rows[i * len(rows) // parts:(i + 1) * len(rows) // parts] for i in range(parts)]


def _within_budget(segments, num_rows, members_per_item, num_items):
    """The segments that fit num_items items, one item per chunk of members at least, those saving the most first;
    a nested segment only with its parent (a row's segments must run contiguously from page 0). -> (segments
    parents first, each row's end of its shared pages)."""
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


def _pieces(start, end, piece_pages):
    """[start, end) cut into the fewest near-equal page ranges of <= piece_pages."""
    parts = -(-(end - start) // piece_pages)
    return [(start + i * (end - start) // parts, start + (i + 1) * (end - start) // parts) for i in range(parts)]


def plan_cascade(page_tables, seq_lens, *, batch: int, page_size: int, members_per_item: int,
                 rules: CascadeRules = CascadeRules(), wave_items: int | None = None) -> CascadePlan:
    """The decode batch's shared prefixes as fixed-shape work items (module docstring).

    page_tables, seq_lens: the live rows (as find_segments), at most `batch` (the batch bucket; rows past them are
    padding). members_per_item: member rows per item, pallas_kernels.cascade_attention.cascade_members_per_item for
    the model. Segments are kept while their items fit rules.num_items; each is then cut into pieces of at least
    rules.min_piece_tokens, as many as fill wave_items items (the kernel's programs are items x KV heads: the GPU's
    SMs / KV heads fill one wave; None: all the items left), the fastest piece size measured (docs/perf_notes.md,
    "Cascade attention").
    """
    if len(page_tables) > batch:
        raise ValueError(f"{len(page_tables)} rows do not fit batch {batch}")
    if members_per_item < 1:
        raise ValueError(f"members_per_item must be >= 1, got {members_per_item}")
    num_items = rules.num_items
    segments = find_segments(page_tables, seq_lens, page_size=page_size, rules=rules)
    segments, covered = _within_budget(segments, len(page_tables), members_per_item, num_items)
    chunks = [(seg, part) for seg in segments for part in _chunks(seg.rows, members_per_item)]
    # sum(ceil(pages / piece_pages)) < total / piece_pages + len(chunks) <= num_items for this piece_pages.
    spare = num_items - len(chunks)
    if wave_items:  # then about wave_items pieces in all (each chunk's last piece may be short: one more at most)
        spare = min(spare, wave_items)
    total = sum(seg.end - seg.start for seg, _ in chunks)
    piece_pages = max(-(-rules.min_piece_tokens // page_size), -(-total // spare) if spare > 0 else total, 1)

    kv_starts, num_pieces = np.zeros(batch, np.int32), np.zeros(batch, np.int32)
    kv_starts[:len(covered)] = covered * page_size
    item_row, item_start, item_end = (np.zeros(num_items, np.int32) for _ in range(3))
    item_members = np.full((num_items, members_per_item), -1, np.int32)
    item_slots = np.zeros((num_items, members_per_item), np.int32)
    items = [(rows, piece) for seg, rows in chunks for piece in _pieces(seg.start, seg.end, piece_pages)]
    for w, (rows, (start, end)) in enumerate(items):
        item_row[w], item_start[w], item_end[w] = rows[0], start * page_size, end * page_size
        item_members[w, :len(rows)] = rows
        item_slots[w, :len(rows)] = num_pieces[list(rows)]
        num_pieces[list(rows)] += 1
    saved = sum((len(seg.rows) - len(_chunks(seg.rows, members_per_item))) * (seg.end - seg.start) * page_size
                for seg in segments)
    return CascadePlan(kv_starts, num_pieces, item_row, item_start, item_end, item_members, item_slots,
                       tuple(segments), saved, saved >= rules.min_saved_tokens)
