"""A request's token sequence and scheduling state (plain Python, no JAX), changed by the scheduler and page manager."""
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
        self.token_ids: list[int] = [int(t) for t in token_ids]  # prompt + generated
        if not self.token_ids:
            raise ValueError("a sequence needs at least one prompt token")
        self.seq_id: int = next(Sequence._next_id)
        self.num_prompt_tokens: int = len(self.token_ids)  # kept when a preempted sequence recomputes
        self.num_computed_tokens: int = 0  # token_ids[:n] have their KV in the cache, prefix-cache hits included
        self.num_cached_tokens: int = 0  # of those, from the prefix cache at the last admission (statistics)
        self.page_table: list[int] = []  # physical KV page ids: position p is in page_table[p // page_size]
        self.status: SequenceStatus = SequenceStatus.WAITING
        self.request: R | None = request  # the engine's state of the request; the scheduler never looks inside
        self.reads_prefix_cache = reads_prefix_cache  # False: computes the whole prompt (for its logprobs)
        self.max_num_tokens = max_num_tokens  # prompt + max_tokens, within max_model_len: no step goes past it
        self.num_pending: int = 0  # trailing PLACEHOLDERs: tokens of a dispatched step not read back yet

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_known(self) -> int:
        """All but the pending placeholders."""
        return len(self.token_ids) - self.num_pending

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, status={self.status.name}, tokens={self.num_tokens}, "
                f"prompt={self.num_prompt_tokens}, computed={self.num_computed_tokens}, pages={len(self.page_table)})")
