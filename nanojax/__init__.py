"""nanojax: a small, fast LLM inference engine in JAX."""
from nanojax import xla_flags

xla_flags.set_defaults()  # before JAX starts a backend: nanojax.xla_flags

from nanojax.llm import LLM, RequestOutput  # noqa: E402
from nanojax.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput"]
