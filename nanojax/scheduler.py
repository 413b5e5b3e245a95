"""Continuous-batching scheduler with chunked prefill and preemption (plain Python, no JAX).

Engine contract (one engine step)::

    chunks = scheduler.schedule(decode_steps=K)      # [] when nothing can run now
    pending = dispatch(chunks)                       # the device computes ...
    scheduler.advance(chunks)                        # ... while the host goes on: sampled tokens are placeholders
    (the next step may be scheduled and dispatched here, its inputs taken from `pending` on the device)
    for c in chunks:                                 # once pending's tokens are read back:
        if c.sample:
            scheduler.fill(c.seq, tokens, c.num_steps)
            if stop(c.seq):                          # eos / max_tokens / stop string /
                scheduler.finish(c.seq)              # c.seq.num_tokens >= max_model_len

``update(chunks, sampled)`` is advance then fill. ``finish(seq)`` also aborts a request at any time (mid-prefill
included): its pages are freed and a chunk of it still in flight is skipped. A step scheduled while another is in
flight sees every scheduled token as sampled (``Sequence.num_pending`` placeholders); a sequence that ends early
wastes its row of that step. No step goes past a sequence's ``max_num_tokens``.

For every :class:`ScheduledChunk` ``c`` the engine computes ``c.seq.token_ids[c.start : c.end]`` at positions
``c.start .. c.end - 1``, attending to the KV of all earlier positions, and writes their KV to slot
``page_table[p // page_size] * page_size + p % page_size``; if ``c.sample`` the chunk ends at the last token and the
engine samples the next one. In a pure-decode step (every chunk one token, sampled) a chunk may get
``c.num_steps = n`` in 1..K: n decode steps in one dispatch, step j feeding position ``c.start + j``, with pages
reserved for n new KV slots; the engine passes the n sampled tokens (or a prefix, e.g. cut after a stop token) to
:meth:`Scheduler.fill`. No KV position reaches max_model_len, so ``len(page_table)`` stays within
``ceil(max_model_len / page_size)`` (the engine's page-table width) while the engine finishes sequences there.

Policy (as nano-vllm / vLLM v1), one phase after the other within ``max_num_seqs``, the per-step token budget
``max_num_batched_tokens`` and the free pages:

1. decodes: one token for each running sequence whose prompt is computed, in admission order;
2. running partial prefills: the next chunk of each;
3. admissions: waiting sequences in FIFO order, none in a step that had to preempt, each allocating its whole
   prompt's pages (prefix-cache hits shared);
4. multi-step decode: in a pure-decode step each sequence gets ``num_steps`` = as many of K as it has room for
   (``max_model_len``, its ``max_num_tokens``, free pages given in admission order, no preemption), at least 1.

A prefill chunk is at most ``chunk_size`` tokens and what is left of the budget, and costs its length rounded up to
whole ``prefill_row``s, the rows the runner packs it into, so that a step's chunks fill one packed dispatch
(docs/perf_notes.md, "Prefill"). A decode costs one token. With ``chunk_size=None`` a prompt is never split: it is
admitted only when all its uncached tokens fit the budget left by the step's decodes (``max_num_batched_tokens >=
max_model_len + max_num_seqs`` never delays one).

When a decode needs a page and none is free, the most recently admitted running sequence is preempted by recompute:
its pages are freed and it goes back to the FRONT of the waiting queue with ``num_computed_tokens = 0``, keeping its
generated tokens. The oldest running sequence is never preempted, so the system always makes progress; one that
cannot proceed even alone raises :class:`CapacityError`.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections import deque
from dataclasses import dataclass
from typing import Any, Mapping, Sequence as SequenceLike

from .page_manager import PageManager
from .sequence import PLACEHOLDER, Sequence, SequenceStatus


class CapacityError(RuntimeError):
    """A sequence cannot make progress even with every unpinned page free.

    ``self.seq`` is the offending sequence.  The scheduler state is consistent when
    this is raised: the engine may ``finish(err.seq)`` (or unpin pages) and call
    ``schedule()`` again."""

    def __init__(self, seq: Sequence, message: str):
        super().__init__(message)
        self.seq = seq


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # running sequences (decoding or mid-prefill)
    max_num_batched_tokens: int = 4096  # tokens computed per model forward
    max_model_len: int = 4096  # max KV positions per sequence (prompt + generated)
    # max prefill tokens of one sequence per step (a chunk is also cut to the budget left, so the budget
    # is a fine value); None: whole prompts only, which needs max_num_batched_tokens >= max_model_len
    chunk_size: int | None = None
    page_size: int = 16
    prefill_row: int = 1  # tokens per row of a packed prefill dispatch (nanojax.runner.PREFILL_ROW)

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "page_size", "prefill_row"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.chunk_size is not None and (not isinstance(self.chunk_size, int) or self.chunk_size < 1):
            raise ValueError(f"chunk_size must be None or a positive int, got {self.chunk_size!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs}) so every running sequence can decode"
            )
        if self.chunk_size is None and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) "
                f"must be >= max_model_len ({self.max_model_len})"
            )


@dataclass(frozen=True, eq=False)
class ScheduledChunk:
    """Compute ``seq.token_ids[start:start + num_tokens]`` (start == seq.num_computed_tokens).

    ``sample``: the chunk ends at the sequence's last token, so the engine samples
    (defaults to ``start + num_tokens == seq.num_tokens`` at construction).
    ``num_steps``: decode steps to run in one dispatch (see module docstring)."""

    seq: Sequence
    start: int
    num_tokens: int
    sample: bool = None  # type: ignore[assignment]
    num_steps: int = 1

    def __post_init__(self) -> None:
        if self.sample is None:
            object.__setattr__(self, "sample", self.start + self.num_tokens == self.seq.num_tokens)

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


class Scheduler:
    """Continuous batching over a :class:`PageManager`.  ``waiting`` (deque, FIFO)
    and ``running`` (list, admission order) are public read-only views."""

    def __init__(self, config: SchedulerConfig, page_manager: PageManager):
        if config.page_size != page_manager.page_size:
            raise ValueError(
                f"config.page_size ({config.page_size}) != page_manager.page_size "
                f"({page_manager.page_size})"
            )
        self.config = config
        self.page_manager = page_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # ------------------------------------------------------------------ requests
    def add(self, seq: Sequence) -> None:
        """Queue a new WAITING sequence.  ValueError if its prompt is longer than
        max_model_len or needs more pages than the whole pool has."""
        if seq.status is not SequenceStatus.WAITING or seq.page_table or seq.num_computed_tokens:
            raise ValueError(f"sequence {seq.seq_id} is not a fresh WAITING sequence: {seq!r}")
        n, cfg, pm = seq.num_tokens, self.config, self.page_manager
        if n > cfg.max_model_len:
            raise ValueError(
                f"request {seq.seq_id}: prompt has {n} tokens, more than max_model_len={cfg.max_model_len}"
            )
        need = pm.num_pages_for(n)
        if need > pm.num_pages:
            raise ValueError(
                f"request {seq.seq_id}: prompt has {n} tokens and needs {need} KV pages of "
                f"{pm.page_size} tokens, but the whole pool has only {pm.num_pages} pages"
            )
        self.waiting.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Mark ``seq`` FINISHED and free its pages, whatever its state: decoding, mid-prefill
        (its committed pages stay cached) or waiting (aborted).  No-op if already finished."""
        if seq.status is SequenceStatus.FINISHED:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.page_manager.free(seq)
        seq.status = SequenceStatus.FINISHED

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ stepping
    def schedule(self, decode_steps: int = 1) -> list[ScheduledChunk]:
        """Pick the work of one engine step (see module docstring).  Returns [] only when nothing is
        unfinished.  ``decode_steps=K > 1`` applies to pure-decode steps only: each chunk gets as many
        of K steps as its room allows (see :meth:`_reserve_decode_steps`); other steps have num_steps 1."""
        if decode_steps < 1:
            raise ValueError(f"decode_steps must be >= 1, got {decode_steps}")
        preemptions_before = self.num_preemptions
        chunks = self._schedule_decodes()
        chunks += self._schedule_prefills(self._budget_left(chunks))
        # as vLLM v1: memory is short in a step that preempted, don't re-admit what was just evicted
        if self.num_preemptions == preemptions_before:
            chunks += self._admit(self._budget_left(chunks))
        if not chunks and self.waiting and not self.running:
            raise self._admission_error(self.waiting[0])
        return self._reserve_decode_steps(chunks, decode_steps)

    def _schedule_decodes(self) -> list[ScheduledChunk]:
        """One token for every running sequence whose prompt is computed, in admission order.  The
        budget always covers them (``max_num_batched_tokens >= max_num_seqs``); a page does not:
        see :meth:`_make_room`."""
        chunks = []
        for seq in [s for s in self.running if s.num_tokens - s.num_computed_tokens == 1 and not _at_limit(s)]:
            if seq.status is SequenceStatus.RUNNING and self._make_room(seq):  # not preempted meanwhile
                self.page_manager.ensure_capacity(seq, seq.num_tokens)
                chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, 1))
        return chunks

    def _make_room(self, seq: Sequence) -> bool:
        """Preempt the most recently admitted running sequences until ``seq`` has a slot for its
        last token, never one at its max_num_tokens (it ends once its pending tokens are read).
        False if that preempted ``seq`` itself; CapacityError if ``seq`` runs alone and still does
        not fit."""
        cfg, pm = self.config, self.page_manager
        if seq.num_tokens > cfg.max_model_len:
            raise RuntimeError(
                f"sequence {seq.seq_id} has {seq.num_tokens} tokens > max_model_len="
                f"{cfg.max_model_len}; the engine must finish sequences at max_model_len"
            )
        while not pm.can_ensure_capacity(seq, seq.num_tokens):
            if len(self.running) == 1:
                raise CapacityError(
                    seq,
                    f"sequence {seq.seq_id} needs {pm.num_pages_for(seq.num_tokens)} KV pages "
                    f"for {seq.num_tokens} tokens but the pool has {pm.num_pages} pages "
                    f"({pm.num_pinned_pages} pinned) and nothing else to preempt",
                )
            victim = next(s for s in reversed(self.running) if s is seq or not _at_limit(s))
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _schedule_prefills(self, budget: int) -> list[ScheduledChunk]:
        """The next chunk of every running sequence still prefilling (its pages were allocated at
        admission), in admission order, within ``budget`` tokens."""
        chunks = []
        for seq in self.running:
            remaining = seq.num_tokens - seq.num_computed_tokens
            n = self._prefill_len(remaining, budget) if remaining > 1 else 0
            if n:
                chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
                budget -= self._cost(chunks[-1], budget)
        return chunks

    def _admit(self, budget: int) -> list[ScheduledChunk]:
        """Admit waiting sequences in FIFO order (head-of-line blocking) while a sequence slot, the
        pages of the whole prompt and ``budget`` tokens for its first chunk are free."""
        pm, chunks = self.page_manager, []
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            n = self._prefill_len(seq.num_tokens - pm.num_cached_tokens(seq), budget)
            if not n or not pm.can_allocate(seq):
                break
            self.waiting.popleft()
            pm.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
            budget -= self._cost(chunks[-1], budget)
        return chunks

    def _admission_error(self, seq: Sequence) -> CapacityError:
        cfg, pm = self.config, self.page_manager
        return CapacityError(
            seq,
            f"waiting sequence {seq.seq_id} ({seq.num_tokens} tokens, "
            f"{pm.num_pages_for(seq.num_tokens)} pages) cannot be admitted although nothing "
            f"is running: pool has {pm.num_pages} pages, {pm.num_free_pages} free, "
            f"{pm.num_pinned_pages} pinned; token budget {cfg.max_num_batched_tokens}",
        )

    def _reserve_decode_steps(self, chunks: list[ScheduledChunk], decode_steps: int) -> list[ScheduledChunk]:
        """In a pure-decode step, each chunk with ``num_steps`` = as many of ``decode_steps`` as its room allows
        (``num_tokens + num_steps - 1 <= max_model_len``, ``num_tokens + num_steps <= max_num_tokens``, and
        free pages for the new KV slots, given in admission order, without preempting) and those pages
        reserved; else ``chunks`` as is."""
        k, pm = decode_steps, self.page_manager
        if k == 1 or not chunks or not all(c.num_tokens == 1 and c.sample for c in chunks):
            return chunks
        out = []
        for c in chunks:
            steps = min(k, self.config.max_model_len - c.seq.num_tokens + 1)
            if c.seq.max_num_tokens is not None:
                steps = min(steps, c.seq.max_num_tokens - c.seq.num_tokens)
            while steps > 1 and pm.num_pages_for(c.seq.num_tokens + steps - 1) - len(c.seq.page_table) \
                    > pm.num_free_pages:
                steps -= 1
            pm.ensure_capacity(c.seq, c.seq.num_tokens + steps - 1)
            out.append(dataclasses.replace(c, num_steps=steps))
        return out

    def advance(self, chunks: SequenceLike[ScheduledChunk]) -> None:
        """Apply the dispatch of ``chunks`` (the list from the last schedule()) before its tokens are read
        back: advances ``num_computed_tokens`` (to ``num_tokens - 1`` after them), gives each sampling chunk's
        sequence ``num_steps`` PLACEHOLDER tokens for :meth:`fill` to replace, and commits the full pages
        whose tokens are known to the prefix cache.  Chunks of sequences finished meanwhile are skipped."""
        for c in chunks:
            seq = c.seq
            if seq.status is SequenceStatus.FINISHED:
                continue
            if seq.status is not SequenceStatus.RUNNING or seq.num_computed_tokens != c.start:
                raise RuntimeError(f"stale chunk for sequence {seq.seq_id}: {c} vs {seq!r}")
            if c.sample:
                seq.num_computed_tokens = c.start + c.num_tokens + c.num_steps - 1
                seq.token_ids += [PLACEHOLDER] * c.num_steps
                seq.num_pending += c.num_steps
            else:
                seq.num_computed_tokens = c.start + c.num_tokens
            self.page_manager.commit(seq)

    def fill(self, seq: Sequence, tokens: list[int], num_steps: int) -> None:
        """The tokens of a sampling chunk of ``num_steps`` steps that :meth:`advance` applied (the oldest
        pending placeholders): 1..num_steps of them.  Fewer (cut after a stop token) ends what was scheduled
        for ``seq`` after them: its later placeholders are dropped (the engine finishes it, or schedules it
        again).  Commits the pages this completes."""
        _check_count(seq, len(tokens), num_steps)
        if num_steps > seq.num_pending:
            raise RuntimeError(f"sequence {seq.seq_id} has {seq.num_pending} pending tokens, not {num_steps}")
        first = seq.num_known
        seq.token_ids[first:first + len(tokens)] = tokens
        if len(tokens) < num_steps:
            del seq.token_ids[first + len(tokens):]
            seq.num_pending = 0
            seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens - 1)
        else:
            seq.num_pending -= num_steps
        if seq.status is SequenceStatus.RUNNING:
            self.page_manager.commit(seq)

    def update(self, chunks: SequenceLike[ScheduledChunk], sampled: Mapping[int, Any]) -> None:
        """:meth:`advance` then :meth:`fill`: apply ``chunks`` with their tokens known.

        ``sampled[seq_id]`` is required for every chunk with ``sample`` True: one token (int or 0-d array;
        same as ``[tok]``) or a list of 1..num_steps tokens for a multi-step decode chunk; checked before
        anything changes.  Other entries are ignored."""
        live = [c for c in chunks if c.sample and c.seq.status is not SequenceStatus.FINISHED]
        for c in live:
            if c.seq.seq_id not in sampled:
                raise KeyError(f"no sampled token for sequence {c.seq.seq_id}")
            _check_count(c.seq, len(_as_token_list(sampled[c.seq.seq_id])), c.num_steps)
        self.advance(chunks)
        for c in live:
            self.fill(c.seq, _as_token_list(sampled[c.seq.seq_id]), c.num_steps)

    # ------------------------------------------------------------------ internals
    def _budget_left(self, chunks: list[ScheduledChunk]) -> int:
        left = self.config.max_num_batched_tokens
        for c in chunks:
            left -= self._cost(c, left)
        return left

    def _cost(self, chunk: ScheduledChunk, budget: int) -> int:
        """A chunk's share of the ``budget`` left: one token for a decode (a one-token chunk that samples:
        the engine runs those as decodes), else its length in whole prefill rows, at most the budget (a
        chunk that fits by length always runs: a small budget never starves prefills)."""
        if chunk.num_tokens == 1 and chunk.sample:
            return 1
        row = self.config.prefill_row
        return min(-(-chunk.num_tokens // row) * row, budget)

    def _prefill_len(self, remaining: int, budget: int) -> int:
        if self.config.chunk_size is None:
            return remaining if remaining <= budget else 0
        return min(remaining, budget, self.config.chunk_size)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.page_manager.free(seq)  # also resets num_computed_tokens to 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1


def _check_count(seq: Sequence, count: int, num_steps: int) -> None:
    if not 1 <= count <= num_steps:
        raise ValueError(f"sequence {seq.seq_id}: got {count} sampled tokens, expected 1..{num_steps}")


def _at_limit(seq: Sequence) -> bool:
    """Whether the sequence has (or will have, once its pending tokens are read) its max_num_tokens."""
    return seq.max_num_tokens is not None and seq.num_tokens >= seq.max_num_tokens


def _as_token_list(x: Any) -> list[int]:
    if isinstance(x, numbers.Integral) or getattr(x, "ndim", None) == 0:
        return [int(x)]
    return [int(t) for t in x]
