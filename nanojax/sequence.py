"""A request's token sequence and its scheduling state (plain Python, no JAX).

A :class:`Sequence` is created by the engine from a tokenized prompt, handed to
``Scheduler.add`` and then mutated only by the scheduler and the page manager:

* ``token_ids``            prompt + generated tokens (grown by ``Scheduler.advance`` / ``fill``).
* ``num_prompt_tokens``    length of the original prompt (never changes, also not
                           when a preempted sequence recomputes its generated tokens).
* ``num_computed_tokens``  tokens ``token_ids[:num_computed_tokens]`` have their KV in
                           the cache (prefix-cache hits included).
* ``num_cached_tokens``    how many of those came from the prefix cache at the last
                           admission (statistics only).
* ``page_table``           physical KV page ids; token position ``p`` lives in page
                           ``page_table[p // page_size]`` at offset ``p % page_size``.
* ``status``               :class:`SequenceStatus`.
* ``request``              the engine's state of the request (nanojax.engine.Request); the
                           scheduler never looks inside.
* ``reads_prefix_cache``   False: admission computes the whole prompt, whatever the cache
                           holds (a request that wants every prompt position's logits).
* ``max_num_tokens``       the length at which the engine ends it (prompt + max_tokens, at most
                           max_model_len, at least prompt + 1): no step is scheduled past it.
* ``num_pending``          trailing ``token_ids`` that are PLACEHOLDERs: tokens of a dispatched step
                           not read back yet (``Scheduler.advance``), replaced by ``Scheduler.fill``.
"""

from __future__ import annotations

import enum
import itertools
from typing import Generic, Iterable, TypeVar

PLACEHOLDER = -1  # a token sampled on the device and not read back yet


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


R = TypeVar("R")


class Sequence(Generic[R]):
    _next_id = itertools.count()

    def __init__(self, token_ids: Iterable[int], request: R | None = None, reads_prefix_cache: bool = True,
                 max_num_tokens: int | None = None):
        self.token_ids: list[int] = [int(t) for t in token_ids]
        if not self.token_ids:
            raise ValueError("a sequence needs at least one prompt token")
        self.seq_id: int = next(Sequence._next_id)
        self.num_prompt_tokens: int = len(self.token_ids)
        self.num_computed_tokens: int = 0
        self.num_cached_tokens: int = 0
        self.page_table: list[int] = []
        self.status: SequenceStatus = SequenceStatus.WAITING
        self.request: R | None = request
        self.reads_prefix_cache = reads_prefix_cache
        self.max_num_tokens = max_num_tokens
        self.num_pending: int = 0

    @property
    def num_tokens(self) -> int:
        """Prompt + generated tokens."""
        return len(self.token_ids)

    @property
    def num_known(self) -> int:
        """Tokens whose ids the host has (all but the pending placeholders)."""
        return len(self.token_ids) - self.num_pending

    @property
    def num_generated(self) -> int:
        """Generated tokens (``num_tokens - num_prompt_tokens``)."""
        return len(self.token_ids) - self.num_prompt_tokens

    def __len__(self) -> int:
        return len(self.token_ids)

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, status={self.status.name}, tokens={self.num_tokens}, "
            f"prompt={self.num_prompt_tokens}, computed={self.num_computed_tokens}, "
            f"pages={len(self.page_table)})"
        )
