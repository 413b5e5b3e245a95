"""Per-request sampling parameters (plain Python, validated on construction)."""
import dataclasses

MAX_LOGPROBS = 20  # OpenAI's limit on top logprobs; the compiled step computes this many


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy. top_k 0 and top_p 1 and min_p 0 disable those filters.

    seed: makes this request's samples reproducible whatever else is in the batch.
    stop_token_ids: end generation (like EOS); stop: strings that end generation, cut from the text.
    min_tokens: EOS and stop_token_ids cannot end generation before this many tokens.
    n: independent choices for the prompt (they share its KV pages).
    logprobs: None, or the number (0..20) of most likely tokens whose logprobs come with each generated token, beside
    the generated token's own (RequestOutput.logprobs).
    prompt_logprobs: None, or the same for every prompt token after the first, from the model's distribution at the
    position before it (RequestOutput.prompt_logprobs; OpenAI's `echo` with `logprobs`). Such a request computes its
    whole prompt: it reads nothing from the prefix cache.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    max_tokens: int = 256
    min_tokens: int = 0
    ignore_eos: bool = False
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    logit_bias: dict[int, float] | None = None
    repetition_penalty: float = 1.0  # HF's: divides positive / multiplies negative logits of seen tokens
    presence_penalty: float = 0.0  # OpenAI's: subtracted once from every token already in the output
    frequency_penalty: float = 0.0  # OpenAI's: subtracted per occurrence in the output
    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))
        checks = [
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (self.top_k >= 0, f"top_k must be >= 0 (0 disables it), got {self.top_k}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}"),
            (0 <= self.min_tokens <= self.max_tokens,
             f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"),
            (self.seed is None or 0 <= self.seed < 2**32, f"seed must be in [0, 2**32), got {self.seed}"),
            (all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
             f"stop_token_ids must be non-negative ints, got {self.stop_token_ids}"),
            (all(isinstance(s, str) and s for s in self.stop), f"stop must be non-empty strings, got {self.stop}"),
            (self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2 <= self.frequency_penalty <= 2,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (isinstance(self.n, int) and self.n >= 1, f"n must be an int >= 1, got {self.n}"),
            (self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS),
             f"logprobs must be None or an int in [0, {MAX_LOGPROBS}], got {self.logprobs}"),
            (self.prompt_logprobs is None
             or (isinstance(self.prompt_logprobs, int) and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
             f"prompt_logprobs must be None or an int in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}"),
            (all(isinstance(t, int) and t >= 0 for t in (self.logit_bias or {})),
             f"logit_bias keys must be non-negative token ids, got {list(self.logit_bias or {})[:4]}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0
