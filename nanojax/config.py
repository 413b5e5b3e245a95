"""The engine's knobs: one frozen `EngineConfig`, checked once; platform defaults and context length filled later."""
import argparse
import dataclasses
import json

from convert.config import ModelConfig
from nanojax.cascade import CascadeRules

# (on a GPU, on a CPU) for the knobs left as None. decode_steps: the CPU streams text in bursts of this many tokens.
_PLATFORM_DEFAULTS = {"dtype": ("bfloat16", "float32"), "max_num_seqs": (256, 64),
                      "max_num_batched_tokens": (8192, 2048), "decode_steps": (32, 8), "warmup": (True, False),
                      "hosted_masks": (True, False)}
DEFAULT_MODEL_LEN = 4096  # when the model allows more


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (nanojax.speculative) in vLLM's terms: "ngram" proposes the tokens that followed an earlier
    occurrence of the last n tokens (prompt_lookup_min <= n <= prompt_lookup_max), "draft_model" what `model` drafts."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    model: str | None = None

    def __post_init__(self):
        if self.method not in ("ngram", "draft_model"):
            raise ValueError(f"speculative_config method must be 'ngram' or 'draft_model', got {self.method!r}")
        if (self.method == "draft_model") != isinstance(self.model, str):
            raise ValueError(f"speculative_config model must be the draft model's path or name for method "
                             f"'draft_model' and unset for 'ngram', got {self.model!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 16:
                raise ValueError(f"{name} must be an int in [1, 16], got {value!r}")
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise ValueError(f"prompt_lookup_max={self.prompt_lookup_max} is below prompt_lookup_min="
                             f"{self.prompt_lookup_min}")

    @classmethod
    def of(cls, value) -> "SpeculativeConfig | None":
        """From None, a SpeculativeConfig, a dict of its fields (LLM's speculative_config) or that dict as JSON."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not JSON: {e}") from None
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict, got {value!r}")
        if unknown := set(value) - {f.name for f in dataclasses.fields(cls)}:
            raise ValueError(f"speculative_config has unknown keys {sorted(unknown)}")
        return cls(**value)


def speculative_option(text: str) -> SpeculativeConfig:
    """--speculative-config's JSON (argparse refuses it with the config's own message)."""
    try:
        return SpeculativeConfig.of(text)
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """The model's and EngineConfig's flags that the generate command line and the server share."""
    p.add_argument("--model", default=None, help="checkpoint, HF folder, 'org/name' in the HF cache or .gguf "
                   "(default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float32"])
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--quantization", default=None, choices=["fp8"],
                   help="fp8: the projections' weights in FP8 (E4M3), quantized at load (default: as the checkpoint)")
    p.add_argument("--speculative-config", type=speculative_option, default=None,
                   help='speculative decoding, as JSON: {"method": "ngram", "num_speculative_tokens": 4, '
                   '"prompt_lookup_min": 1, "prompt_lookup_max": 4}')


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """max_model_len: prompt + output tokens (None: 4096, or the model's positions if fewer). num_pages: the KV pool
    (None: sized from `memory_fraction` of the device after the weights). Prompts prefill in chunks of at most
    chunk_size tokens (None: the step's budget). decode_steps: steps per dispatch of a decode-only step. kernels:
    "interpret" runs the Pallas kernels interpreted (CPU tests), "auto" on a GPU where the shapes allow. quantization
    "fp8": the projections' weights, at load. tensor_parallel_size: None is one device, or every device of a
    multi-process job. cascade: read a prefix that running requests share once per step, where the rules say so.
    hosted_masks: a constrained row alone takes several steps a dispatch, its masks from a host callback between them
    (the program compiled in this process, on a thread, once a constraint is near)."""

    dtype: str | None = None
    max_model_len: int | None = None
    page_size: int = 16
    num_pages: int | None = None
    memory_fraction: float = 0.85
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    chunk_size: int | None = None
    decode_steps: int | None = None
    kernels: str = "auto"
    seed: int = 0
    warmup: bool | None = None
    progress: bool = True
    tensor_parallel_size: int | None = None
    quantization: str | None = None
    cascade: bool | CascadeRules = True
    speculative_config: SpeculativeConfig | dict | None = None
    hosted_masks: bool | None = None

    def __post_init__(self):
        object.__setattr__(self, "speculative_config", SpeculativeConfig.of(self.speculative_config))
        for name in ("max_model_len", "page_size", "num_pages", "max_num_seqs", "max_num_batched_tokens",
                     "chunk_size", "decode_steps", "tensor_parallel_size"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be >= 1, got {value!r}")
        checks = [
            (self.dtype in (None, "bfloat16", "float32"), f"dtype must be 'bfloat16' or 'float32', got {self.dtype!r}"),
            (isinstance(self.memory_fraction, (int, float)) and 0 < self.memory_fraction <= 1,
             f"memory_fraction must be in (0, 1], got {self.memory_fraction!r}"),
            (self.kernels in ("auto", "pallas", "reference", "interpret"),
             f"kernels must be 'auto', 'pallas', 'reference' or 'interpret', got {self.kernels!r}"),
            (self.quantization in (None, "fp8"), f"quantization must be None or 'fp8', got {self.quantization!r}"),
            (isinstance(self.cascade, (bool, CascadeRules)),
             f"cascade must be True, False or a nanojax.cascade.CascadeRules, got {self.cascade!r}"),
            (isinstance(self.seed, int), f"seed must be an int, got {self.seed!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    def resolved(self, on_gpu: bool) -> "EngineConfig":
        """The platform's defaults for the knobs left as None."""
        return dataclasses.replace(self, **{name: values[0 if on_gpu else 1] for name, values in
                                            _PLATFORM_DEFAULTS.items() if getattr(self, name) is None})

    def for_model(self, config: ModelConfig) -> "EngineConfig":
        """max_model_len checked against the model's positions, and set where it was None."""
        if self.max_model_len and self.max_model_len > config.max_position_embeddings:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's max_position_embeddings="
                             f"{config.max_position_embeddings}")
        return dataclasses.replace(self, max_model_len=min(self.max_model_len or DEFAULT_MODEL_LEN,
                                                           config.max_position_embeddings))

    @property
    def pages_per_seq(self) -> int:
        return -(-self.max_model_len // self.page_size)

    @property
    def cascade_rules(self) -> CascadeRules | None:
        return CascadeRules() if self.cascade is True else self.cascade or None
