"""Where weights come from: an HF folder (one or many safetensors shards), a model id in the local HF hub
cache (offline), or a GGUF file. Each source yields an HF config dict and HF-named tensors,
each read when it is asked for."""
import dataclasses
import json
import os
from pathlib import Path
from typing import Callable

import numpy as np
from safetensors import SafetensorError, safe_open

from convert.keys import CheckpointError


@dataclasses.dataclass
class Source:
    description: str  # what the user named, resolved
    format: str  # "safetensors" | "gguf"
    hf_config: dict  # normalized by transformers (every field present)
    tensors: dict[str, Callable[[], np.ndarray]]
    save_tokenizer: Callable[[Path], bool]  # writes tokenizer files into a folder; False if the source has none
    label: Callable[[str], str] = repr  # how errors name a tensor (a GGUF adds its name in the file)


def open_source(src: str | os.PathLike) -> Source:
    path = Path(src).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        from convert.gguf_source import gguf_source

        return gguf_source(path)
    if path.is_dir():
        return _hf_folder_source(path)
    if path.exists():
        raise CheckpointError(f"{src}: not a model folder or a .gguf file")
    if isinstance(src, str) and src.count("/") == 1 and not src.startswith(("/", ".")):
        return _hf_folder_source(resolve_hub_cache(src))
    raise CheckpointError(f"{src}: no such folder or file, and not an 'org/name' model id")


def resolve_hub_cache(model_id: str) -> Path:
    """The snapshot folder of `model_id` in the local HF hub cache (HF_HUB_CACHE / HF_HOME honoured), offline."""
    from huggingface_hub import try_to_load_from_cache

    config_path = try_to_load_from_cache(model_id, "config.json")
    if not isinstance(config_path, str):
        raise CheckpointError(f"model id {model_id!r} is not in the local Hugging Face cache "
                              f"(looked for models--{model_id.replace('/', '--')}/snapshots/*/config.json)")
    return Path(config_path).parent


def normalized_hf_config(raw: dict) -> dict:
    """Every field filled in by the model's transformers config class (so defaults are not guessed here)."""
    from transformers import AutoConfig

    model_type = raw.get("model_type")
    try:
        config = AutoConfig.for_model(model_type, **{k: v for k, v in raw.items() if k != "model_type"})
    except (ValueError, KeyError) as e:
        raise CheckpointError(f"config.json: unknown or unsupported model_type={model_type!r}: {e}") from None
    return config.to_dict()


def _hf_folder_source(folder: Path) -> Source:
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{folder}: no config.json")
    try:
        raw = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{config_file}: not valid JSON ({e})") from None
    _merge_generation_eos(raw, folder / "generation_config.json")
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise CheckpointError(f"{folder}: no *.safetensors files")
    return Source(str(folder), "safetensors", normalized_hf_config(raw), _safetensors_tensors(shards),
                  lambda dst: _save_hf_tokenizer(folder, dst))


def _merge_generation_eos(raw: dict, generation_config: Path) -> None:
    """Chat models list extra end-of-turn ids in generation_config.json; generation stops on all of them."""
    if not generation_config.is_file():
        return
    extra = json.loads(generation_config.read_text()).get("eos_token_id")
    ids = [] if raw.get("eos_token_id") is None else np.atleast_1d(raw["eos_token_id"]).tolist()
    for i in np.atleast_1d(extra if extra is not None else []).tolist():
        if i not in ids:
            ids.append(i)
    if ids:
        raw["eos_token_id"] = ids


def _safetensors_tensors(shards: list[Path]) -> dict[str, Callable[[], np.ndarray]]:
    tensors: dict[str, Callable[[], np.ndarray]] = {}
    owner: dict[str, Path] = {}
    for shard in shards:
        try:
            with safe_open(shard, framework="numpy") as f:
                names = list(f.keys())
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{shard.name}: corrupt or unreadable safetensors file ({e})") from None
        for name in names:
            if name in tensors:
                raise CheckpointError(f"tensor {name!r} appears in both {owner[name].name} and {shard.name}")
            owner[name] = shard
            tensors[name] = _loader(shard, name)
    return tensors


def _loader(shard: Path, name: str) -> Callable[[], np.ndarray]:
    def load():
        try:
            with safe_open(shard, framework="numpy") as f:
                return f.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{shard.name}: cannot read tensor {name!r} ({e})") from None

    return load


def has_tokenizer_files(folder) -> bool:
    return any((Path(folder) / f).is_file() for f in TOKENIZER_FILES)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def _save_hf_tokenizer(folder: Path, dst: Path) -> bool:
    if not has_tokenizer_files(folder):
        return False
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(folder).save_pretrained(dst)
    return True
