"""Where weights come from: an HF folder of safetensors shards, a model id (its snapshot in the HF hub cache), or a
GGUF file; each gives an HF config dict and HF-named tensors, read when asked for."""
import dataclasses
import functools
import importlib
import json
import os
from pathlib import Path
from typing import Callable

import numpy as np
from safetensors import SafetensorError, safe_open

from convert.cache import remembered
from convert.config import ModelConfig
from convert.files import read_json, recovery
from convert.keys import CheckpointError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")  # any one of them
ALL_TOKENIZER_FILES = (*TOKENIZER_FILES, "special_tokens_map.json", "added_tokens.json", "merges.txt",
                       "chat_template.jinja")
# Everything AutoTokenizer reads to pick and build a tokenizer (config.json: the model type, when no class is named).
_TOKENIZER_INPUTS = (*ALL_TOKENIZER_FILES, "config.json")


@dataclasses.dataclass
class Source:
    description: str  # what the user named, resolved
    format: str  # "safetensors" | "gguf"
    hf_config: dict  # normalized by transformers (every field present)
    tensors: dict[str, Callable[[], np.ndarray]]
    save_tokenizer: Callable[[Path], bool]  # writes tokenizer files into a folder; False if the source has none
    label: Callable[[str], str] = repr  # how errors name a tensor (a GGUF adds its name in the file)


def open_source(src: str | os.PathLike) -> Source:
    path = local_path(src)
    if path.is_file() and path.suffix == ".gguf":
        # Imported here: the gguf package loads only for a GGUF file (some machines lack it).
        from convert.gguf_source import read_gguf, save_gguf_tokenizer, tensor_label

        cfg, tensors = read_gguf(path)
        return Source(str(path), "gguf", normalized_hf_config(cfg), tensors,
                      functools.partial(save_gguf_tokenizer, path), tensor_label)
    if path.is_dir():
        return _hf_folder_source(path)
    raise CheckpointError(f"{src}: not a model folder or a .gguf file")


def local_path(src: str | os.PathLike) -> Path:
    """The path `src` names, or a model id's snapshot folder in the HF hub cache."""
    path = Path(src).expanduser()
    if path.exists():
        return path
    if isinstance(src, str) and src.count("/") == 1 and not src.startswith(("/", ".")):
        return hub_snapshot(src)
    raise CheckpointError(f"{src}: no such folder or file, and not an 'org/name' model id")


# What a conversion reads from a Hub repository; other weight formats (.bin, .pth, .gguf, ...) are not fetched.
HUB_FILES = ["config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
             *ALL_TOKENIZER_FILES]


def hub_snapshot(model_id: str) -> Path:
    """The snapshot folder of `model_id` in the HF hub cache, the missing HUB_FILES downloaded first (HF_HUB_OFFLINE=1:
    the cache only); huggingface_hub moves a file there only once it is complete."""
    import httpx2  # huggingface_hub's HTTP client: its transport errors are not OSErrors
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return Path(snapshot_download(model_id, allow_patterns=HUB_FILES))
    except RepositoryNotFoundError:
        raise CheckpointError(f"model id {model_id!r}: no such model on {constants.ENDPOINT} "
                              "(a private or gated one needs HF_TOKEN)") from None
    except LocalEntryNotFoundError as e:
        if constants.is_offline_mode():
            raise CheckpointError(f"model id {model_id!r} is not (or not completely) in the local Hugging Face cache "
                                  f"{constants.HF_HUB_CACHE}, and HF_HUB_OFFLINE=1 forbids downloading it") from None
        raise CheckpointError(f"model id {model_id!r}: {constants.ENDPOINT} cannot be reached and the model is not "
                              f"in the local Hugging Face cache ({e})") from None
    except (HfHubHTTPError, httpx2.HTTPError, OSError) as e:  # e.g. a download cut off midway
        raise CheckpointError(f"model id {model_id!r}: downloading from {constants.ENDPOINT} failed ({e}); "
                              "nothing partial is used; run again") from None


def normalized_hf_config(raw: dict) -> dict:
    """Every field filled in by the model's transformers config class, so defaults are not guessed here (remembered:
    the config classes import torch)."""
    def normalize():
        from transformers import AutoConfig

        model_type = raw.get("model_type")
        try:
            config = AutoConfig.for_model(model_type, **{k: v for k, v in raw.items() if k != "model_type"})
        except (ValueError, KeyError) as e:
            raise CheckpointError(f"config.json: unknown or unsupported model_type={model_type!r}: {e}") from None
        return config.to_dict()

    return remembered("hf_config", json.dumps(raw, sort_keys=True).encode(), normalize)


def config_as_written(folder: Path) -> ModelConfig | None:
    """An HF folder's config read without transformers (rope_theta / rope_scaling moved into rope_parameters, as
    transformers 5 does), for work checked later against the normalized one; None if unreadable or incomplete."""
    try:
        raw = _read_config(folder)
        if "rope_parameters" not in raw and "rope_theta" in raw:
            raw["rope_parameters"] = {**(raw.get("rope_scaling") or {}), "rope_theta": raw["rope_theta"]}
        return ModelConfig.from_hf_config(raw)
    except (OSError, ValueError, TypeError, KeyError):  # CheckpointError, ConfigError, or a field of another type
        return None


def _read_config(folder: Path) -> dict:
    """config.json with the end-of-turn ids of generation_config.json, where chat models list extra ones: generation
    stops on all of them."""
    config_file, generation_config = folder / "config.json", folder / "generation_config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{folder}: no config.json")
    raw = read_json(config_file)
    if generation_config.is_file():
        ids = [i for value in (raw.get("eos_token_id"), read_json(generation_config).get("eos_token_id"))
               if value is not None for i in np.atleast_1d(value).tolist()]
        if ids:
            raw["eos_token_id"] = list(dict.fromkeys(ids))
    return raw


def _hf_folder_source(folder: Path) -> Source:
    raw = _read_config(folder)
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise CheckpointError(f"{folder}: no *.safetensors files")
    index = folder / "model.safetensors.index.json"  # a shard it lists but the folder lacks: an incomplete copy
    absent = sorted(set(read_json(index)["weight_map"].values()) - {s.name for s in shards}) if index.is_file() else []
    if absent:
        raise CheckpointError(f"{folder}: shard(s) {absent} listed in {index.name} are missing")
    return Source(str(folder), "safetensors", normalized_hf_config(raw), _safetensors_tensors(shards),
                  lambda dst: _save_hf_tokenizer(folder, dst))


def _safetensors_tensors(shards: list[Path]) -> dict[str, Callable[[], np.ndarray]]:
    owner: dict[str, Path] = {}
    for shard in shards:
        try:
            with safe_open(shard, framework="numpy") as f:
                names = list(f.keys())
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{shard}: cut short, damaged or unreadable safetensors file ({e}); "
                                  f"{recovery(shard.parent)}") from None
        for name in names:
            if name in owner:
                raise CheckpointError(f"tensor {name!r} appears in both {owner[name].name} and {shard.name}")
            owner[name] = shard
    return {name: functools.partial(_read_tensor, shard, name) for name, shard in owner.items()}


def _read_tensor(shard: Path, name: str) -> np.ndarray:
    try:
        with safe_open(shard, framework="numpy") as f:
            return f.get_tensor(name)
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{shard}: cannot read tensor {name!r} ({e}); {recovery(shard.parent)}") from None


def has_tokenizer_files(folder) -> bool:
    return any((Path(folder) / f).is_file() for f in TOKENIZER_FILES)


def hf_tokenizer(folder) -> "tuple[int, Callable[[], object]] | None":
    """(the length of the tokenizer AutoTokenizer builds from `folder`, a function building it); None for a
    weights-only folder, which transformers would give an empty tokenizer. The class and length are remembered, so
    later loads build that class without importing the auto classes (they import torch)."""
    folder = Path(folder)
    if not has_tokenizer_files(folder):
        return None
    built = {}

    def pick_class():
        from transformers import AutoTokenizer

        try:
            built["tokenizer"] = tokenizer = AutoTokenizer.from_pretrained(folder)
        except Exception:
            for file_name in _TOKENIZER_INPUTS:  # transformers' error for a damaged JSON file names no file
                if file_name.endswith(".json") and (folder / file_name).is_file():
                    read_json(folder / file_name)
            raise
        return [type(tokenizer).__module__, type(tokenizer).__qualname__, len(tokenizer)]

    key = b"".join(name.encode() + b"\0" + (folder / name).read_bytes() + b"\0"
                   for name in _TOKENIZER_INPUTS if (folder / name).is_file())
    module, name, size = remembered("tokenizer", key, pick_class)
    if "tokenizer" in built:
        return size, lambda: built["tokenizer"]
    return size, lambda: getattr(importlib.import_module(module), name).from_pretrained(folder)


def load_hf_tokenizer(folder):
    """The tokenizer AutoTokenizer builds from `folder`, or None."""
    found = hf_tokenizer(folder)
    return None if found is None else found[1]()


def _save_hf_tokenizer(folder: Path, dst: Path) -> bool:
    if (tokenizer := load_hf_tokenizer(folder)) is not None:
        tokenizer.save_pretrained(dst)
    return tokenizer is not None
