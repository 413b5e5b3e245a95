"""Per-request sampling parameters (plain Python, validated on construction).

Each field is declared once: its type and default, its allowed range, and for the fields the compiled step reads,
the device dtype and the value a row without a request takes (`DEVICE_FIELDS`; nanojax.sampling reads them).
"""
import dataclasses
import math

import numpy as np

MAX_LOGPROBS = 20  # OpenAI's limit on top logprobs; the compiled step computes this many
_INT32_MAX = 2**31 - 1


def _field(default, lo, hi, *, integer: bool = False, lo_open: bool = False, device=None, fill=None):
    """A SamplingParams field: the default, the range [lo, hi] (lo_open: (lo, hi]) a value must lie in (or be None,
    where the default is); device: its dtype in the compiled step's SamplingBatch, where `fill` is the value of a
    row without a request."""
    check = dict(lo=lo, hi=hi, integer=integer, lo_open=lo_open, optional=default is None)
    return dataclasses.field(default=default, metadata=dict(
        check=check, device=None if device is None else (np.dtype(device), fill)))


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
    repetition_penalty: HF's, divides positive / multiplies negative logits of seen tokens; presence_penalty:
    OpenAI's, subtracted once from every token already in the output; frequency_penalty: per occurrence.
    """

    temperature: float = _field(1.0, 0, 100, device=np.float32, fill=0.0)
    top_k: int = _field(0, 0, _INT32_MAX, integer=True, device=np.int32, fill=0)
    top_p: float = _field(1.0, 0, 1, lo_open=True, device=np.float32, fill=1.0)
    min_p: float = _field(0.0, 0, 1, device=np.float32, fill=0.0)
    max_tokens: int = _field(256, 1, _INT32_MAX, integer=True)
    min_tokens: int = _field(0, 0, _INT32_MAX, integer=True)
    ignore_eos: bool = False
    seed: int | None = _field(None, 0, 2**32 - 1, integer=True)
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    logit_bias: dict[int, float] | None = None
    repetition_penalty: float = _field(1.0, 0.01, 100, device=np.float32, fill=1.0)
    presence_penalty: float = _field(0.0, -2, 2, device=np.float32, fill=0.0)
    frequency_penalty: float = _field(0.0, -2, 2, device=np.float32, fill=0.0)
    n: int = _field(1, 1, _INT32_MAX, integer=True)
    logprobs: int | None = _field(None, 0, MAX_LOGPROBS, integer=True, device=np.int32, fill=0)
    prompt_logprobs: int | None = _field(None, 0, MAX_LOGPROBS, integer=True)

    def __post_init__(self):
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))
        for f in dataclasses.fields(self):
            if "check" in f.metadata:
                _check_range(f.name, getattr(self, f.name), **f.metadata["check"])
        checks = [
            (self.min_tokens <= self.max_tokens,
             f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"),
            (all(_is_int(t) and 0 <= t <= _INT32_MAX for t in self.stop_token_ids),
             f"stop_token_ids must be token ids (non-negative ints), got {self.stop_token_ids}"),
            (all(isinstance(s, str) and s for s in self.stop), f"stop must be non-empty strings, got {self.stop}"),
            (all(_is_int(t) and 0 <= t <= _INT32_MAX for t in (self.logit_bias or {})),
             f"logit_bias keys must be token ids (non-negative ints), got {list(self.logit_bias or {})[:4]}"),
            (all(_is_number(b) and -100 <= b <= 100 for b in (self.logit_bias or {}).values()),
             f"logit_bias values must be numbers in [-100, 100], got {list((self.logit_bias or {}).values())[:4]}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    def device_values(self) -> dict:
        """The fields the compiled step reads, as this request sets them (None: the field's fill)."""
        return {name: fill if getattr(self, name) is None else getattr(self, name)
                for name, (_, fill) in DEVICE_FIELDS.items()}


DEVICE_FIELDS: dict[str, tuple[np.dtype, object]] = {
    f.name: f.metadata["device"] for f in dataclasses.fields(SamplingParams) if f.metadata.get("device")}


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool) and math.isfinite(x)


def _check_range(name: str, value, lo, hi, integer: bool, lo_open: bool, optional: bool) -> None:
    """ValueError naming the field unless value is a finite number of the field's kind in its range (or None, where
    that is the default)."""
    if value is None and optional:
        return
    kind = "an int" if integer else "a number"
    ok = _is_int(value) if integer else _is_number(value)
    if ok and lo is not None:
        ok = (value > lo if lo_open else value >= lo) and value <= hi
    if not ok:
        low = "(" if lo_open else "["
        raise ValueError(f"{name} must be {kind} in {low}{lo}, {hi}], got {value!r}")

