"""Resolve what the user named into (config, params, tokenizer): a nanojax checkpoint, or any source that
convert/ reads (HF folder, hub-cache id, GGUF), converted in memory."""
import dataclasses
from concurrent.futures import ThreadPoolExecutor

from nanojax.config import ModelConfig


@dataclasses.dataclass
class LoadedModel:
    config: ModelConfig
    params: dict  # numpy arrays, see nanojax.model
    tokenizer: object | None  # an HF tokenizer, or None for weights-only checkpoints


def load_model(model: "str | LoadedModel | None", dtype: str) -> LoadedModel:
    """Resolve `model` and cast its params to `dtype`. The tokenizer loads on a thread while the weights are read."""
    # convert/ builds on nanojax.config, so it is imported here rather than at module level.
    from convert import is_checkpoint, load_checkpoint, open_source, params_from_source
    from convert.checkpoint import DTYPES
    from convert.sources import load_hf_tokenizer

    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(DTYPES)}")
    if isinstance(model, LoadedModel):
        return dataclasses.replace(model, params=_cast(model.params, DTYPES[dtype]))
    if model is None:
        from nanojax.default_model import default_checkpoint

        model = str(default_checkpoint())
    with ThreadPoolExecutor(1) as pool:
        if is_checkpoint(model):
            tokenizer = pool.submit(load_hf_tokenizer, model)  # None where the manifest says it has none
            config, params, _ = load_checkpoint(model)
            return LoadedModel(config, _cast(params, DTYPES[dtype]), tokenizer.result())
        source = open_source(model)
        tokenizer = pool.submit(_gguf_tokenizer if source.format == "gguf" else load_hf_tokenizer,
                                source.description)
        config, params = params_from_source(source, dtype)
        return LoadedModel(config, params, tokenizer.result())


def _cast(params, dtype):
    """Casts float params to dtype; FP8 projections ({w: float8, scale: float32}, nanojax.quantize) stay as they are."""
    if isinstance(params, dict) and "w" in params and params["w"].dtype.itemsize == 1:
        return {k: v if k in ("w", "scale") else _cast(v, dtype) for k, v in params.items()}
    if isinstance(params, (dict, tuple, list)):
        items = params.items() if isinstance(params, dict) else enumerate(params)
        cast = {k: _cast(v, dtype) for k, v in items}
        return cast if isinstance(params, dict) else type(params)(cast.values())
    # Same dtype: no copy (the default checkpoint is stored in float32, the CPU's dtype; copying it took 1.5 s).
    return params if params.dtype == dtype else params.astype(dtype)


def _gguf_tokenizer(path):
    import tempfile

    from convert.gguf_source import save_gguf_tokenizer
    from convert.sources import load_hf_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        save_gguf_tokenizer(path, tmp)
        return load_hf_tokenizer(tmp)
