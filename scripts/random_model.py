"""Benchmark and GPU-parity models: real architectures (scripts/configs/*.json, copied from the HF configs)
with random weights, built where they run (weights do not travel to the GPU machine).

The HF model is built by transformers itself (its own init) and converted through convert/'s key table, so
nanojax and HF hold the same weights and can be compared token for token. Models that no single GPU (or no host
copy) holds are made by `random_params` instead: random values drawn on the devices, each device only its shards.
"""
import dataclasses
import functools
import json
from pathlib import Path

import numpy as np

CONFIGS = Path(__file__).parent / "configs"


def config_path(name: str) -> Path:
    path = CONFIGS / f"{name}.json"
    if not path.is_file():
        raise SystemExit(f"no config {path}; have {sorted(p.stem for p in CONFIGS.glob('*.json'))}")
    return path


def hf_config(name: str, **overrides):
    from transformers import AutoConfig

    raw = {**json.loads(config_path(name).read_text()), **overrides}
    if "layer_types" in raw:  # one per layer
        raw["layer_types"] = raw["layer_types"][:raw["num_hidden_layers"]]
    return AutoConfig.for_model(raw.pop("model_type"), **raw)


def random_hf_model(name: str, torch_dtype="float32", seed: int = 0, device: str | None = None):
    """The HF model with transformers' random init (on the GPU when there is one)."""
    import torch
    from transformers import AutoModelForCausalLM

    config = hf_config(name)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, torch_dtype))
    return model.eval()


def loaded_model(hf_model, dtype: str = "bfloat16"):
    """nanojax's LoadedModel holding the HF model's weights (no tokenizer)."""
    from convert.checkpoint import DTYPES
    from convert.config import ModelConfig
    from convert.keys import hf_to_params
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


def model_config(name: str):
    from convert.config import ModelConfig

    return ModelConfig.from_hf_config(hf_config(name).to_dict())


def random_params(name: str, tensor_parallel=None, seed: int = 0):
    """nanojax's LoadedModel (no tokenizer) of random bf16 weights drawn on the device (or, given a
    nanojax.sharding.TensorParallel, on its mesh, each device drawing only its shards): no HF model and no host copy,
    so Llama-3.1-70B builds in seconds; no parity check is possible on these weights. Shapes come from convert/'s key
    table run on one layer of zero-stride tensors of the HF model's shapes."""
    import jax
    import torch
    from transformers import AutoModelForCausalLM

    from convert.keys import hf_to_params
    from nanojax.loader import LoadedModel
    from nanojax.sharding import param_names

    config = model_config(name)
    one_layer = hf_config(name, num_hidden_layers=1)
    with torch.device("meta"):
        shapes = {n: tuple(t.shape) for n, t in AutoModelForCausalLM.from_config(one_layer).state_dict().items()}
    tensors = {n: (lambda s=s: np.broadcast_to(np.zeros((), np.float32), s)) for n, s in shapes.items()}
    one = hf_to_params(dataclasses.replace(config, num_layers=1), one_layer.model_type, tensors, np.float32)
    top_shapes, layer_shapes = {k: v for k, v in one.items() if k != "layers"}, one["layers"][0]
    count = len(jax.tree.leaves(top_shapes)) + config.num_layers * len(jax.tree.leaves(layer_shapes))
    keys = iter(jax.random.split(jax.random.key(seed), count))

    def leaf(names, x):
        shape = tuple(x.shape)
        if tensor_parallel is None:
            sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        else:
            shape, sharding, _ = tensor_parallel.layout(names, shape)
        # N(0, 0.02) weights; vectors (norm scales, biases) near 1
        return random_array(next(keys), shape, sharding, offset=1.0 if x.ndim == 1 else 0.0)

    def group(tree, root):
        return jax.tree_util.tree_map_with_path(lambda path, x: leaf(root + param_names(path), x), tree)

    top = group(top_shapes, ())
    layers = tuple(group(layer_shapes, ("layers",)) for _ in range(config.num_layers))
    return LoadedModel(config, {**top, "layers": layers}, None)


def random_array(key, shape: tuple[int, ...], sharding, dtype="bfloat16", scale: float = 0.02, offset: float = 0.0):
    """offset + scale * N(0, 1) values of `shape`, drawn where `sharding` puts them (one compile per shape)."""
    return _draw(tuple(shape), sharding, str(dtype), scale, offset)(key)


@functools.cache
def _draw(shape, sharding, dtype: str, scale: float, offset: float):
    import jax
    import jax.numpy as jnp

    def draw(key):
        return (offset + scale * jax.random.normal(key, shape, jnp.float32)).astype(dtype)

    return jax.jit(draw, out_shardings=sharding)


def saved_tokenizer(folder):
    """The tokenizer.json in `folder` (e.g. Qwen3's, saved by scripts/bench_grammar.py's load_qwen3), <|im_end|> its
    EOS."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(Path(folder) / "tokenizer.json"), eos_token="<|im_end|>")


def random_llm(name: str, tokenizer, **llm_kwargs):
    """An LLM of `name`'s architecture with random bf16 weights (transformers' init) and `tokenizer`."""
    from nanojax import LLM

    loaded = loaded_model(random_hf_model(name, torch_dtype="bfloat16"))
    return LLM(type(loaded)(loaded.config, loaded.params, tokenizer), dtype="bfloat16", **llm_kwargs)
