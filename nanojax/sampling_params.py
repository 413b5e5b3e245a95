"""Per-request sampling parameters, each declared once: default, range, dtype in the compiled step (`DEVICE_FIELDS`)."""
import dataclasses
import math

import numpy as np

from nanojax.structured import StructuredOutputs

MAX_LOGPROBS = 20  # OpenAI's limit on top logprobs; the compiled step computes this many
_INT32_MAX = 2**31 - 1


def _field(default, lo, hi, *, integer: bool = False, lo_open: bool = False, device=None, fill=None):
    """A field in [lo, hi] ((lo, hi] if lo_open; None if the default is); device, fill: its step dtype, a pad row's."""
    device = None if device is None else (np.dtype(device), fill)
    return dataclasses.field(default=default, metadata={"range": (lo, hi, integer, lo_open), "device": device})


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy; top_k 0, top_p 1 and min_p 0 disable those filters; seed: reproducible whatever else is
    in the batch; stop strings are cut from the text; n choices share the prompt's KV pages. logprobs: how many top
    tokens' logprobs come with each generated token; prompt_logprobs: with each prompt token after the first (such a
    request reads nothing from the prefix cache). structured_outputs: a StructuredOutputs (or a dict of its fields)
    that the output follows. Penalties: HF's repetition, OpenAI's presence and frequency."""

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
    structured_outputs: StructuredOutputs | None = None

    def __post_init__(self):
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))
        object.__setattr__(self, "structured_outputs", StructuredOutputs.of(self.structured_outputs))
        for f in dataclasses.fields(self):
            if "range" in f.metadata and not (getattr(self, f.name) is None and f.default is None):
                _check_range(f.name, getattr(self, f.name), *f.metadata["range"])
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


def _check_range(name: str, value, lo, hi, integer: bool, lo_open: bool) -> None:
    ok = _is_int(value) if integer else _is_number(value)
    if not (ok and (value > lo if lo_open else value >= lo) and value <= hi):
        kind = "an int" if integer else "a number"
        low = "(" if lo_open else "["
        raise ValueError(f"{name} must be {kind} in {low}{lo}, {hi}], got {value!r}")

