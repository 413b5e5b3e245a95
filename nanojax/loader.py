"""Resolve what the user named into (config, params, tokenizer): a nanojax checkpoint, or any source that
convert/ reads (HF folder, hub-cache id, GGUF), converted in memory."""
import dataclasses
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from convert import is_checkpoint, load_checkpoint, open_source, params_from_source
from convert.checkpoint import DTYPES
from convert.config import ModelConfig
from convert.quantize import is_quantized
from convert.sources import config_as_written, has_tokenizer_files, hf_tokenizer, load_hf_tokenizer, local_path
from nanojax.default_model import default_checkpoint


@dataclasses.dataclass
class LoadedModel:
    config: ModelConfig
    params: dict | None  # numpy arrays (device arrays where load_model placed them), see nanojax.model; None: unread
    tokenizer: "object | Future | None"  # an HF tokenizer (or a Future of it, while it loads); None: weights only
    tokenizer_len: Future | None = None  # the Future of len(tokenizer), beside the tokenizer's Future

    def resolved(self) -> "LoadedModel":
        """With the tokenizer loaded (waits for its Future)."""
        if isinstance(self.tokenizer, Future):
            return dataclasses.replace(self, tokenizer=self.tokenizer.result(), tokenizer_len=None)
        return self

    def vocab_limit(self) -> int:
        """Token ids the model may sample: those the tokenizer knows, at most the embedding's rows."""
        if self.tokenizer is None:
            return self.config.vocab_size
        size = self.tokenizer_len.result() if isinstance(self.tokenizer, Future) else len(self.tokenizer)
        return min(size, self.config.vocab_size)


def load_model(model: "str | LoadedModel | None", dtype: str, place=None,
               on_config: "Callable[[LoadedModel], None] | None" = None) -> LoadedModel:
    """Resolve `model` and cast its params to `dtype`. The tokenizer of an HF folder or a checkpoint loads on a
    thread while the weights are read, and may still be loading when this returns (see LoadedModel.resolved).
    place: applied to each part of a converted source's params (a layer, the rest) while the next ones convert
    (params_from_source); other params come as they are. on_config: called once, for an HF folder or model id only,
    before the weights are read, with a LoadedModel of params None: the config of config.json as written where it
    holds every field (before transformers is imported), else the normalized config with the tokenizer's Futures.
    The first may differ from the config returned (a field left to transformers' defaults): the caller checks."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(DTYPES)}")
    if isinstance(model, LoadedModel):
        return dataclasses.replace(model, params=_cast(model.params, DTYPES[dtype]))
    if model is None:
        model = str(default_checkpoint())
    if is_checkpoint(model):
        tokenizer = _start_tokenizer(model)
        config, params, _ = load_checkpoint(model)
        return LoadedModel(config, _cast(params, DTYPES[dtype]), *tokenizer)
    path = local_path(model)
    early = _config_as_written(path) if on_config is not None else None
    if early is not None:
        on_config(LoadedModel(early, None, None))
    source = open_source(path)
    if source.format == "gguf":
        config, params = params_from_source(source, dtype, place=place)
        return LoadedModel(config, params, _gguf_tokenizer(source))
    tokenizer = _start_tokenizer(source.description)
    if on_config is not None and early is None:
        on_config(LoadedModel(ModelConfig.from_hf_config(source.hf_config), None, *tokenizer))
    config, params = params_from_source(source, dtype, place=place)
    return LoadedModel(config, params, *tokenizer)


def _config_as_written(path) -> ModelConfig | None:
    """The config of an HF folder's config.json as it stands (convert.sources.config_as_written), or None where that
    is no folder or lacks a field ModelConfig reads."""
    written = config_as_written(path) if path.is_dir() else None
    try:
        return None if written is None else ModelConfig.from_hf_config(written)
    except (ValueError, TypeError, KeyError):  # a field missing (ConfigError) or of another type
        return None


def _start_tokenizer(folder) -> tuple:
    """-> (the tokenizer's Future, its length's Future), or (None, None) for a folder without tokenizer files.
    hf_tokenizer runs on a thread of its own while the weights are read and placed: the first load of a tokenizer
    asks transformers' AutoTokenizer which class it is (the answer is kept), and building it imports transformers
    (with torch, on some versions)."""
    if not has_tokenizer_files(folder):
        return None, None
    pool = ThreadPoolExecutor(1, thread_name_prefix="tokenizer")
    found = pool.submit(hf_tokenizer, folder)  # (length, build); one thread: the tasks run in this order
    size = pool.submit(lambda: found.result()[0])
    tokenizer = pool.submit(lambda: found.result()[1]())
    pool.shutdown(wait=False)
    return tokenizer, size


def _cast(params, dtype):
    """Casts float params to dtype; FP8 projections ({w_t: float8, scale: float32}, convert.quantize) stay as they
    are."""
    if isinstance(params, dict) and is_quantized(params):
        return {k: v if k in ("w_t", "scale") else _cast(v, dtype) for k, v in params.items()}
    if isinstance(params, (dict, tuple, list)):
        items = params.items() if isinstance(params, dict) else enumerate(params)
        cast = {k: _cast(v, dtype) for k, v in items}
        return cast if isinstance(params, dict) else type(params)(cast.values())
    # Same dtype: no copy (the default checkpoint is stored in float32, the CPU's dtype: its start copies nothing).
    return params if params.dtype == dtype else params.astype(dtype)


def _gguf_tokenizer(source):
    """The HF tokenizer rebuilt from a GGUF's metadata."""
    with tempfile.TemporaryDirectory() as tmp:
        source.save_tokenizer(tmp)
        return load_hf_tokenizer(tmp)
