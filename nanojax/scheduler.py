"""Continuous-batching scheduler with chunked prefill and preemption (plain Python, no JAX), as nano-vllm / vLLM v1; a
prefill chunk costs whole ``prefill_row``s (docs/perf_notes.md, "Prefill"). A step: ``schedule``, dispatch, ``advance``
(placeholders: the next step may go before this one is read back), then per sampling chunk ``fill`` and ``finish``."""
import dataclasses
import numbers
from collections import deque
from typing import Any, Mapping, Sequence as SequenceLike

from .page_manager import PageManager
from .sequence import PLACEHOLDER, Sequence, SequenceStatus


class CapacityError(RuntimeError):
    """``self.seq`` cannot proceed even with every unpinned page free; the engine may finish it and schedule again."""

    def __init__(self, seq: Sequence, message: str):
        super().__init__(message)
        self.seq = seq


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # running sequences (decoding or mid-prefill)
    max_num_batched_tokens: int = 4096  # tokens computed per model forward
    max_model_len: int = 4096  # max KV positions per sequence (prompt + generated)
    chunk_size: int | None = None  # max prefill tokens of one sequence per step; None: whole prompts only
    page_size: int = 16
    prefill_row: int = 1  # tokens per row of a packed prefill dispatch (nanojax.runner.PREFILL_ROW)

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            v = getattr(self, field.name)
            if (v is not None or field.name != "chunk_size") and (not isinstance(v, int) or v < 1):
                raise ValueError(f"{field.name} must be a positive int, got {v!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                             f"max_num_seqs ({self.max_num_seqs}) so every running sequence can decode")
        if self.chunk_size is None and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) "
                             f"must be >= max_model_len ({self.max_model_len})")


@dataclasses.dataclass(frozen=True, eq=False)
class ScheduledChunk:
    """Compute ``seq.token_ids[start:start + num_tokens]``, then if ``sample`` (it ends at the last token) sample."""
    seq: Sequence
    start: int
    num_tokens: int
    sample: bool = None  # type: ignore[assignment]
    num_steps: int = 1  # decode steps in one dispatch

    def __post_init__(self) -> None:
        if self.sample is None:
            object.__setattr__(self, "sample", self.start + self.num_tokens == self.seq.num_tokens)

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


class Scheduler:
    """``waiting`` (FIFO) and ``running`` (admission order) are public read-only views."""

    def __init__(self, config: SchedulerConfig, page_manager: PageManager):
        if config.page_size != page_manager.page_size:
            raise ValueError(f"config.page_size ({config.page_size}) != page_manager.page_size "
                             f"({page_manager.page_size})")
        self.config, self.page_manager = config, page_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        """ValueError if the prompt could never run: longer than max_model_len or more pages than the pool has."""
        if seq.status is not SequenceStatus.WAITING or seq.page_table or seq.num_computed_tokens:
            raise ValueError(f"sequence {seq.seq_id} is not a fresh WAITING sequence: {seq!r}")
        n, cfg, pm = seq.num_tokens, self.config, self.page_manager
        if n > cfg.max_model_len:
            raise ValueError(f"request {seq.seq_id}: prompt has {n} tokens, more than "
                             f"max_model_len={cfg.max_model_len}")
        need = pm.num_pages_for(n)
        if need > pm.num_pages:
            raise ValueError(f"request {seq.seq_id}: prompt has {n} tokens and needs {need} KV pages of "
                             f"{pm.page_size} tokens, but the whole pool has only {pm.num_pages} pages")
        self.waiting.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Ends ``seq`` in any state (an abort included), freeing its pages; its committed pages stay cached."""
        if seq.status is SequenceStatus.FINISHED:
            return
        (self.running if seq.status is SequenceStatus.RUNNING else self.waiting).remove(seq)
        self.page_manager.free(seq)
        seq.status = SequenceStatus.FINISHED

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, decode_steps: int = 1) -> list[ScheduledChunk]:
        """The work of one engine step, [] only when nothing is unfinished; decode_steps apply to pure-decode steps."""
        preemptions_before = self.num_preemptions
        chunks = self._schedule_decodes()
        chunks += self._schedule_prefills(self._budget_left(chunks))
        # as vLLM v1: memory is short in a step that preempted, don't re-admit what was just evicted
        if self.num_preemptions == preemptions_before:
            chunks += self._admit(self._budget_left(chunks))
        if not chunks and self.waiting and not self.running:
            seq, pm = self.waiting[0], self.page_manager
            raise CapacityError(seq, f"waiting sequence {seq.seq_id} ({seq.num_tokens} tokens, "
                                     f"{pm.num_pages_for(seq.num_tokens)} pages) cannot be admitted although nothing "
                                     f"is running: pool has {pm.num_pages} pages, {pm.num_free_pages} free, "
                                     f"{pm.num_pinned_pages} pinned; token budget {self.config.max_num_batched_tokens}")
        return self._reserve_decode_steps(chunks, decode_steps)

    def _schedule_decodes(self) -> list[ScheduledChunk]:
        """The budget always covers the decodes (max_num_batched_tokens >= max_num_seqs); a page may not."""
        chunks = []
        for seq in [s for s in self.running if s.num_tokens - s.num_computed_tokens == 1 and not _at_limit(s)]:
            if seq.status is SequenceStatus.RUNNING and self._make_room(seq):  # not preempted meanwhile
                self.page_manager.ensure_capacity(seq, seq.num_tokens)
                chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, 1))
        return chunks

    def _make_room(self, seq: Sequence) -> bool:
        """Preempts the newest running sequences until ``seq`` has a slot for its last token; False if ``seq``
        itself went. One at its max_num_tokens is spared: it ends once its pending tokens are read."""
        cfg, pm = self.config, self.page_manager
        if seq.num_tokens > cfg.max_model_len:
            raise RuntimeError(f"sequence {seq.seq_id} has {seq.num_tokens} tokens > max_model_len="
                               f"{cfg.max_model_len}; the engine must finish sequences at max_model_len")
        while not pm.can_ensure_capacity(seq, seq.num_tokens):
            if len(self.running) == 1:
                raise CapacityError(seq, f"sequence {seq.seq_id} needs {pm.num_pages_for(seq.num_tokens)} KV pages "
                                         f"for {seq.num_tokens} tokens but the pool has {pm.num_pages} pages "
                                         f"({pm.num_pinned_pages} pinned) and nothing else to preempt")
            victim = next(s for s in reversed(self.running) if s is seq or not _at_limit(s))
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _schedule_prefills(self, budget: int) -> list[ScheduledChunk]:
        chunks = []
        for seq in self.running:
            remaining = seq.num_tokens - seq.num_computed_tokens
            if remaining > 1 and (n := self._prefill_len(remaining, budget)):
                chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
                budget -= self._cost(chunks[-1], budget)
        return chunks

    def _admit(self, budget: int) -> list[ScheduledChunk]:
        """FIFO with head-of-line blocking: the whole prompt's pages are allocated at admission."""
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

    def _reserve_decode_steps(self, chunks: list[ScheduledChunk], decode_steps: int) -> list[ScheduledChunk]:
        """In a pure-decode step, as many steps per chunk as its limits and the free pages allow, at least 1."""
        pm = self.page_manager
        if decode_steps == 1 or not all(c.num_tokens == 1 and c.sample for c in chunks):
            return chunks
        out = []
        for c in chunks:
            steps = min(decode_steps, self.config.max_model_len - c.seq.num_tokens + 1)
            if c.seq.max_num_tokens is not None:
                steps = min(steps, c.seq.max_num_tokens - c.seq.num_tokens)
            while steps > 1 and not pm.can_ensure_capacity(c.seq, c.seq.num_tokens + steps - 1):
                steps -= 1
            pm.ensure_capacity(c.seq, c.seq.num_tokens + steps - 1)
            out.append(dataclasses.replace(c, num_steps=steps))
        return out

    def advance(self, chunks: SequenceLike[ScheduledChunk]) -> None:
        """Applies a dispatch before it is read back (sampled tokens are PLACEHOLDERs); finished sequences skipped."""
        for c in chunks:
            seq = c.seq
            if seq.status is SequenceStatus.FINISHED:
                continue
            if seq.status is not SequenceStatus.RUNNING or seq.num_computed_tokens != c.start:
                raise RuntimeError(f"stale chunk for sequence {seq.seq_id}: {c} vs {seq!r}")
            seq.num_computed_tokens = c.end + c.num_steps - 1 if c.sample else c.end
            if c.sample:
                seq.token_ids += [PLACEHOLDER] * c.num_steps
                seq.num_pending += c.num_steps
            self.page_manager.commit(seq)

    def fill(self, seq: Sequence, tokens: list[int], num_steps: int) -> None:
        """The oldest ``num_steps`` placeholders become 1..num_steps tokens; fewer (a stop) drops the rest too."""
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
        """:meth:`advance` then :meth:`fill`, each ``sampled[seq_id]`` (a token or a list) checked before either."""
        live = [c for c in chunks if c.sample and c.seq.status is not SequenceStatus.FINISHED]
        for c in live:
            if c.seq.seq_id not in sampled:
                raise KeyError(f"no sampled token for sequence {c.seq.seq_id}")
            _check_count(c.seq, len(_as_token_list(sampled[c.seq.seq_id])), c.num_steps)
        self.advance(chunks)
        for c in live:
            self.fill(c.seq, _as_token_list(sampled[c.seq.seq_id]), c.num_steps)

    def _budget_left(self, chunks: list[ScheduledChunk]) -> int:
        left = self.config.max_num_batched_tokens
        for c in chunks:
            left -= self._cost(c, left)
        return left

    def _cost(self, chunk: ScheduledChunk, budget: int) -> int:
        """A decode's token, or whole prefill rows up to the budget (so a small budget never starves prefills)."""
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
    """Whether the sequence has its max_num_tokens, counting pending tokens."""
    return seq.max_num_tokens is not None and seq.num_tokens >= seq.max_num_tokens


def _as_token_list(x: Any) -> list[int]:
    return [int(x)] if isinstance(x, numbers.Integral) or getattr(x, "ndim", None) == 0 else [int(t) for t in x]
