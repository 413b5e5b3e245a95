"""nanojax: a small, fast LLM inference engine in JAX."""
from nanojax.config import EngineConfig
from nanojax.llm import LLM, RequestOutput
from nanojax.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "EngineConfig"]
