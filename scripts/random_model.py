"""Benchmark and GPU-parity models: real architectures (scripts/configs/*.json, copied from the HF configs)
with random weights, built where they run (weights do not travel to the GPU machine).

The HF model is built by transformers itself (its own init) and converted through convert/'s key table, so
nanojax and HF hold the same weights and can be compared token for token.
"""
import json
from pathlib import Path

import numpy as np

CONFIGS = Path(__file__).parent / "configs"


def config_path(name: str) -> Path:
    path = CONFIGS / f"{name}.json"
    if not path.is_file():
        raise SystemExit(f"no config {path}; have {sorted(p.stem for p in CONFIGS.glob('*.json'))}")
    return path


def random_hf_model(name: str, torch_dtype="float32", seed: int = 0, device: str | None = None):
    """The HF model with transformers' random init (on the GPU when there is one)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = json.loads(config_path(name).read_text())
    config = AutoConfig.for_model(raw.pop("model_type"), **raw)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, torch_dtype))
    return model.eval()


def loaded_model(hf_model, dtype: str = "bfloat16"):
    """nanojax's LoadedModel holding the HF model's weights (no tokenizer)."""
    from convert.checkpoint import DTYPES
    from convert.keys import hf_to_params
    from nanojax.config import ModelConfig
    from nanojax.loader import LoadedModel

    hf_config = hf_model.config.to_dict()
    config = ModelConfig.from_hf_config(hf_config)
    state = hf_model.state_dict()
    tensors = {n: (lambda t=t: t.detach().float().cpu().numpy()) for n, t in state.items()}
    params = hf_to_params(config, hf_config["model_type"], tensors, DTYPES[dtype])
    return LoadedModel(config, params, None)


def weight_bytes(params) -> int:
    import jax

    return int(sum(np.size(x) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(params)))
