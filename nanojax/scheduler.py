"""Continuous-batching scheduler with chunked prefill and preemption (plain Python).

Engine contract (one engine step)::

    chunks = scheduler.schedule(decode_steps=K)      # [] only when nothing is unfinished
    sampled = run_model(chunks)                      # {seq_id: token or [tokens]} for c.sample
    scheduler.update(chunks, sampled)
    for c in chunks:
        if c.sample and stop(c.seq):                 # eos / max_tokens / stop string /
            scheduler.finish(c.seq)                  # c.seq.num_tokens >= max_model_len

For every :class:`ScheduledChunk` ``c`` the engine computes the tokens
``c.seq.token_ids[c.start : c.start + c.num_tokens]`` at positions ``c.start ..
c.end - 1``, attending to the KV of all earlier positions, and writes their KV to
slot ``block_table[p // block_size] * block_size + p % block_size``.  If
``c.sample`` the chunk ends at the last token and the engine samples the next token
from the last position's logits.

Multi-step decode: if ``c.num_steps == K > 1`` (all chunks of the step then have
``num_tokens == 1``, ``sample`` True and the same ``num_steps``) the engine runs K
decode steps in one dispatch: step j feeds the token at position ``c.start + j``
(the sequence's last token for j == 0, then the token sampled at step j-1) and
samples one token.  Blocks are reserved for positions ``c.start .. c.start + K - 1``
(K new KV slots).  The engine passes the K sampled tokens (or only a prefix of them,
e.g. cut after a stop token) as a list to :meth:`Scheduler.update`.

The scheduler never schedules a KV position >= max_model_len; as long as the engine
finishes sequences once ``num_tokens >= max_model_len``, ``len(block_table)`` never
exceeds ``ceil(max_model_len / block_size)`` (the engine's page-table width).

Policy (as nano-vllm / vLLM v1): running decodes first (in admission order), then
running partial prefills, then waiting requests in FIFO order (none in a step that
had to preempt), within ``max_num_seqs``, the per-step token budget
``max_num_batched_tokens`` and free blocks.  Admission allocates blocks for the
whole prompt; a decode grows the table by one block when needed.  With
``chunk_size=None`` a waiting prompt is admitted only when all its uncached tokens
fit in the budget left by that step's decodes (set ``max_num_batched_tokens >=
max_model_len + max_num_seqs`` to never delay admissions because of decodes).

When a decode needs a block and none is free, the most recently admitted
running sequence is preempted by recompute: its blocks are freed, it goes back to
the FRONT of the waiting queue with ``num_computed_tokens = 0`` keeping its generated
tokens (which it recomputes like a prompt, usually hitting its own still-cached
blocks).  The oldest running sequence is never preempted, so the system always
makes progress; a sequence that cannot proceed even alone raises
:class:`CapacityError`.

This module must not import JAX.
"""

from __future__ import annotations

import numbers
from collections import deque
from dataclasses import dataclass
from typing import Any, Mapping, Sequence as SequenceLike

from .block_manager import BlockManager
from .sequence import Sequence, SequenceStatus


class CapacityError(RuntimeError):
    """A sequence cannot make progress even with every unpinned block free.

    ``self.seq`` is the offending sequence.  The scheduler state is consistent when
    this is raised: the engine may ``finish(err.seq)`` (or unpin blocks) and call
    ``schedule()`` again."""

    def __init__(self, seq: Sequence, message: str):
        super().__init__(message)
        self.seq = seq


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # running sequences (decoding or mid-prefill)
    max_num_batched_tokens: int = 4096  # tokens computed per model forward
    max_model_len: int = 4096  # max KV positions per sequence (prompt + generated)
    chunk_size: int | None = None  # max prefill tokens of one sequence per step; None: whole prompts only
    block_size: int = 16

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size"):
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
    """Continuous batching over a :class:`BlockManager`.  ``waiting`` (deque, FIFO)
    and ``running`` (list, admission order) are public read-only views."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        if config.block_size != block_manager.block_size:
            raise ValueError(
                f"config.block_size ({config.block_size}) != block_manager.block_size "
                f"({block_manager.block_size})"
            )
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # ------------------------------------------------------------------ requests
    def add(self, seq: Sequence) -> None:
        """Queue a new WAITING sequence.  ValueError if its prompt is longer than
        max_model_len or needs more blocks than the whole pool has."""
        if seq.status is not SequenceStatus.WAITING or seq.block_table or seq.num_computed_tokens:
            raise ValueError(f"sequence {seq.seq_id} is not a fresh WAITING sequence: {seq!r}")
        n, cfg, bm = seq.num_tokens, self.config, self.block_manager
        if n > cfg.max_model_len:
            raise ValueError(
                f"request {seq.seq_id}: prompt has {n} tokens, more than max_model_len={cfg.max_model_len}"
            )
        need = bm.num_blocks_for(n)
        if need > bm.num_blocks:
            raise ValueError(
                f"request {seq.seq_id}: prompt has {n} tokens and needs {need} KV blocks of "
                f"{bm.block_size} tokens, but the whole pool has only {bm.num_blocks} blocks"
            )
        self.waiting.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Mark ``seq`` FINISHED (also aborts a waiting one), free its blocks, drop it
        from the queues.  No-op if already finished."""
        if seq.status is SequenceStatus.FINISHED:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ stepping
    def schedule(self, decode_steps: int = 1) -> list[ScheduledChunk]:
        """Pick the work of one engine step (see module docstring).  Returns [] only
        when nothing is unfinished.  ``decode_steps=K > 1`` is honoured (all chunks
        get ``num_steps=K``) only for a pure-decode step where every sequence has
        blocks for K new KV slots without preempting anyone and
        ``num_tokens + K - 1 <= max_model_len``; otherwise the step has num_steps 1."""
        if decode_steps < 1:
            raise ValueError(f"decode_steps must be >= 1, got {decode_steps}")
        cfg, bm = self.config, self.block_manager
        budget = cfg.max_num_batched_tokens
        plan: list[tuple[Sequence, int, int]] = []  # (seq, start, num_tokens)
        preemptions_before = self.num_preemptions

        # 1. decodes (one token each), preempting the newest running sequences for blocks
        for seq in [s for s in self.running if s.num_tokens - s.num_computed_tokens == 1]:
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted as a victim earlier in this loop
            if budget == 0:
                break
            if seq.num_tokens > cfg.max_model_len:
                raise RuntimeError(
                    f"sequence {seq.seq_id} has {seq.num_tokens} tokens > max_model_len="
                    f"{cfg.max_model_len}; the engine must finish sequences at max_model_len"
                )
            while not bm.can_ensure_capacity(seq, seq.num_tokens):
                if len(self.running) == 1:
                    raise CapacityError(
                        seq,
                        f"sequence {seq.seq_id} needs {bm.num_blocks_for(seq.num_tokens)} KV blocks "
                        f"for {seq.num_tokens} tokens but the pool has {bm.num_blocks} blocks "
                        f"({bm.num_pinned_blocks} pinned) and nothing else to preempt",
                    )
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                bm.ensure_capacity(seq, seq.num_tokens)
                plan.append((seq, seq.num_computed_tokens, 1))
                budget -= 1

        # 2. running partial prefills (their blocks were allocated at admission)
        for seq in list(self.running):
            remaining = seq.num_tokens - seq.num_computed_tokens
            if remaining <= 1:
                continue
            if budget == 0:
                break
            n = self._prefill_len(remaining, budget)
            if n:
                plan.append((seq, seq.num_computed_tokens, n))
                budget -= n

        # 3. admit waiting sequences in FIFO order (head-of-line blocking); not in a step
        #    that had to preempt (as vLLM v1: memory is short, don't re-admit what was just evicted)
        while (
            self.waiting
            and budget > 0
            and len(self.running) < cfg.max_num_seqs
            and self.num_preemptions == preemptions_before
        ):
            seq = self.waiting[0]
            cached = bm.num_cached_tokens(seq)
            n = self._prefill_len(seq.num_tokens - cached, budget)
            if not n or not bm.can_allocate(seq):
                break
            self.waiting.popleft()
            bm.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            plan.append((seq, seq.num_computed_tokens, n))
            budget -= n

        if not plan and self.waiting and not self.running:
            seq = self.waiting[0]
            raise CapacityError(
                seq,
                f"waiting sequence {seq.seq_id} ({seq.num_tokens} tokens, "
                f"{bm.num_blocks_for(seq.num_tokens)} blocks) cannot be admitted although nothing "
                f"is running: pool has {bm.num_blocks} blocks, {bm.num_free_blocks} free, "
                f"{bm.num_pinned_blocks} pinned; token budget {cfg.max_num_batched_tokens}",
            )

        # 4. multi-step decode: only for pure-decode steps, never at the cost of a preemption
        num_steps = 1
        if decode_steps > 1 and plan and all(n == 1 and st + 1 == s.num_tokens for s, st, n in plan):
            k = decode_steps
            if all(s.num_tokens + k - 1 <= cfg.max_model_len for s, _, _ in plan):
                extra = sum(
                    max(0, bm.num_blocks_for(s.num_tokens + k - 1) - len(s.block_table)) for s, _, _ in plan
                )
                if extra <= bm.num_free_blocks:
                    for s, _, _ in plan:
                        bm.ensure_capacity(s, s.num_tokens + k - 1)
                    num_steps = k

        return [
            ScheduledChunk(s, st, n, sample=st + n == s.num_tokens, num_steps=num_steps) for s, st, n in plan
        ]

    def update(self, chunks: SequenceLike[ScheduledChunk], sampled: Mapping[int, Any]) -> None:
        """Apply the results of running ``chunks`` (the list from the last schedule()).

        ``sampled[seq_id]`` is required for every chunk with ``sample`` True: one
        token (int or 0-d array; same as ``[tok]``) or a list of 1..num_steps tokens
        for a multi-step decode chunk.  Other entries are ignored.  Advances
        ``num_computed_tokens`` (to ``num_tokens - 1`` after appending the sampled
        tokens of a sampling chunk), appends the tokens and commits full blocks to
        the prefix cache.  Chunks of sequences finished meanwhile are skipped."""
        for c in chunks:
            seq = c.seq
            if seq.status is SequenceStatus.FINISHED:
                continue
            if seq.status is not SequenceStatus.RUNNING or seq.num_computed_tokens != c.start:
                raise RuntimeError(f"stale chunk for sequence {seq.seq_id}: {c} vs {seq!r}")
            if c.sample:
                if seq.seq_id not in sampled:
                    raise KeyError(f"no sampled token for sequence {seq.seq_id}")
                toks = _as_token_list(sampled[seq.seq_id])
                if not 1 <= len(toks) <= c.num_steps:
                    raise ValueError(
                        f"sequence {seq.seq_id}: got {len(toks)} sampled tokens, expected 1..{c.num_steps}"
                    )
                seq.num_computed_tokens = c.start + c.num_tokens + len(toks) - 1
                for t in toks:
                    seq.append_token(t)
            else:
                seq.num_computed_tokens = c.start + c.num_tokens
            self.block_manager.commit(seq)

    # ------------------------------------------------------------------ internals
    def _prefill_len(self, remaining: int, budget: int) -> int:
        if self.config.chunk_size is None:
            return remaining if remaining <= budget else 0
        return min(remaining, budget, self.config.chunk_size)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)  # also resets num_computed_tokens to 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1


def _as_token_list(x: Any) -> list[int]:
    if isinstance(x, numbers.Integral) or getattr(x, "ndim", None) == 0:
        return [int(x)]
    return [int(t) for t in x]
