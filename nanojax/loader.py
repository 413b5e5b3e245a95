"""What the user named, as (config, params, tokenizer): a nanojax checkpoint, or a source converted in memory."""
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
    """`model` with params in `dtype`; its tokenizer loads on a thread while the weights are read (see resolved).
    place: applied to each part of a converted source's params. on_config: called once for an HF folder or id, before
    the weights are read, with params None and the config as written if it holds every field (the caller checks it
    against the one returned), else the normalized config with the tokenizer's Futures."""
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
    early = config_as_written(path) if on_config is not None else None
    if early is not None:
        on_config(LoadedModel(early, None, None))
    source = open_source(path)
    if source.format == "gguf":
        config, params = params_from_source(source, dtype, place=place)
        with tempfile.TemporaryDirectory() as tmp:  # the HF tokenizer rebuilt from the GGUF's metadata
            source.save_tokenizer(tmp)
            return LoadedModel(config, params, load_hf_tokenizer(tmp))
    tokenizer = _start_tokenizer(source.description)
    if on_config is not None and early is None:
        on_config(LoadedModel(ModelConfig.from_hf_config(source.hf_config), None, *tokenizer))
    config, params = params_from_source(source, dtype, place=place)
    return LoadedModel(config, params, *tokenizer)


def _start_tokenizer(folder) -> tuple:
    """(the tokenizer's Future, its length's Future), or (None, None) without tokenizer files: building it imports
    transformers, so it runs on a thread while the weights are read."""
    if not has_tokenizer_files(folder):
        return None, None
    pool = ThreadPoolExecutor(1, thread_name_prefix="tokenizer")
    found = pool.submit(hf_tokenizer, folder)  # (length, build); one thread: the tasks run in this order
    size = pool.submit(lambda: found.result()[0])
    tokenizer = pool.submit(lambda: found.result()[1]())
    pool.shutdown(wait=False)
    return tokenizer, size


def _cast(params, dtype):
    """Casts float params to dtype; FP8 projections' w_t and scale keep theirs."""
    if isinstance(params, dict):
        kept = ("w_t", "scale") if is_quantized(params) else ()
        return {k: v if k in kept else _cast(v, dtype) for k, v in params.items()}
    if isinstance(params, (tuple, list)):
        return type(params)(_cast(v, dtype) for v in params)
    # Same dtype: no copy (the default checkpoint is stored in float32, the CPU's dtype: its start copies nothing).
    return params if params.dtype == dtype else params.astype(dtype)
