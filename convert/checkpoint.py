"""The nanojax checkpoint folder: params as Orbax checkpoints, config.json, tokenizer files, manifest.json.

The params are one Orbax checkpoint per part (params/layers/{i}, params/top), saved as each part is converted: Orbax
holds a copy of what it saves, so saving the whole tree at once would need the model twice in memory. A conversion
writes a temporary sibling folder and renames it into place (convert/cache.py), so it never leaves half a checkpoint.
"""
import concurrent.futures
import json
import os
from pathlib import Path
from typing import Callable

import jax
import numpy as np

from convert.cache import move_into_place, temporary_folder
from convert.config import ModelConfig
from convert.files import MANIFEST, convert_command, read_json, recovery
from convert.keys import CheckpointError, param_parts, params_from_parts
from convert.quantize import quantize_layer
from convert.sources import Source, open_source

PARAMS = "params"
# The params layout this code reads. 3: one Orbax checkpoint per part. 2: one of the whole tree. 1 (no
# "params_format" in the manifest) kept the RMSNorm scales apart, which this code would run without them.
PARAMS_FORMAT = 3
DTYPES = {"float32": np.float32, "bfloat16": jax.numpy.bfloat16, "float16": np.float16}
# "fp8": every projection in FP8 (convert/quantize.py); embeddings, norms and the LM head stay in dtype.
QUANTIZATIONS = (None, "fp8")
# The FP8 layout this code reads. 2: {w_t [N, K], scale [N]}. 1 (no "fp8_format" in the manifest): {w [K, N],
# scale [N]}, which this code would misread.
FP8_FORMAT = 2
# The mixture-of-experts layout this code reads. 2: router [E, H], experts [E, N, K]. 1 (no "moe_format" in a MoE
# model's manifest): [H, E] and [E, K, N], which this code would misread.
MOE_FORMAT = 2


def params_from_source(source: Source, dtype: str,
                       place: Callable[[dict], dict] | None = None) -> tuple[ModelConfig, dict]:
    """The whole model in memory, its layers converted on a thread per core (docs/perf_notes.md, "Conversion and
    placement"). place: applied to each part on a thread of its own while the next parts convert."""
    config = ModelConfig.from_hf_config(source.hf_config)
    parts = _parts(source, config, dtype, progress=False, threads=min(16, os.cpu_count() or 1))
    if place is not None:
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="place") as pool:
            placing = [(name, pool.submit(place, part)) for name, part in parts]
        parts = [(name, future.result()) for name, future in placing]
    return config, params_from_parts(parts, config.num_layers)


def _parts(source: Source, config: ModelConfig, dtype: str, progress: bool, threads: int = 1):
    """One layer at a time by default: `convert` holds a part at a time."""
    return param_parts(config, source.hf_config["model_type"], source.tensors, DTYPES[dtype], progress, source.label,
                       threads)


def convert(src, dst, dtype: str = "bfloat16", overwrite: bool = False, progress: bool = True,
            quantization: str | None = None) -> Path:
    """Convert `src` (HF folder, Hub model id or .gguf) into a nanojax checkpoint folder `dst`."""
    if dtype not in DTYPES:
        raise CheckpointError(f"dtype {dtype!r} is not one of {sorted(DTYPES)}")
    if quantization not in QUANTIZATIONS:
        raise CheckpointError(f"quantization {quantization!r} is not one of {list(QUANTIZATIONS)}")
    dst = Path(dst).expanduser().absolute()
    if dst.exists() and not overwrite:
        raise CheckpointError(f"{dst} already exists (pass --overwrite to replace it)")
    source = open_source(src)
    config = ModelConfig.from_hf_config(source.hf_config)
    with temporary_folder(dst.parent, dst.name) as tmp:
        parts = _parts(source, config, dtype, progress)
        if quantization == "fp8":
            parts = ((name, jax.tree.map(np.asarray, quantize_layer(part)) if name.startswith("layers/") else part)
                     for name, part in parts)
        num_parameters = _save_params(tmp / PARAMS, parts)
        (tmp / "config.json").write_text(json.dumps(source.hf_config, indent=2, default=str))
        has_tokenizer = source.save_tokenizer(tmp)
        manifest = {"source": source.description, "format": source.format, "architecture": config.architecture,
                    "dtype": dtype, "quantization": quantization,
                    **({"fp8_format": FP8_FORMAT} if quantization == "fp8" else {}),
                    **({"moe_format": MOE_FORMAT} if config.moe else {}),
                    "params_format": PARAMS_FORMAT, "num_parameters": num_parameters, "tokenizer": has_tokenizer}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
        move_into_place(tmp, dst)
    return dst


def is_checkpoint(path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def params_format(path) -> int:
    """The params layout of the checkpoint at `path` (1: written before the layout was recorded)."""
    return read_json(Path(path) / MANIFEST).get("params_format", 1)


def load_checkpoint(path) -> tuple[ModelConfig, dict, dict]:
    """-> (config, params as numpy arrays, manifest); CheckpointError for a layout this code does not read."""
    path = Path(path)
    manifest = read_json(path / MANIFEST)
    _check_layout(path, manifest, "params_format", PARAMS_FORMAT, "params", "format")
    if manifest.get("quantization") not in QUANTIZATIONS:
        raise CheckpointError(f"{path} holds {manifest['quantization']!r} weights, which this nanojax does not read "
                              f"(it reads {list(QUANTIZATIONS)})")
    if manifest.get("quantization") == "fp8":
        _check_layout(path, manifest, "fp8_format", FP8_FORMAT, "FP8 weights in", "layout")
    config = ModelConfig.from_hf_config(read_json(path / "config.json"))
    if config.moe:
        _check_layout(path, manifest, "moe_format", MOE_FORMAT, "experts in", "layout")
    return config, _load_params(path, config), manifest


def _check_layout(path: Path, manifest: dict, key: str, expected: int, what: str, kind: str) -> None:
    if (found := manifest.get(key, 1)) != expected:
        raise CheckpointError(f"{path} holds {what} {kind} {found} (written by another nanojax version), this nanojax "
                              f"reads {kind} {expected}; convert its source again: {convert_command(path)}")


def _save_params(path: Path, parts) -> int:
    """Saves each (name, part) as the Orbax checkpoint path/name; returns the number of parameters."""
    import orbax.checkpoint as ocp

    count = 0
    with ocp.StandardCheckpointer() as ckptr:
        for name, part in parts:
            ckptr.save(path / name, part)
            count += sum(np.size(x) for x in jax.tree.leaves(part))
    return int(count)


def _load_params(checkpoint: Path, config: ModelConfig) -> dict:
    import orbax.checkpoint as ocp

    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    with ocp.StandardCheckpointer() as ckptr:
        def restore(name):
            part = checkpoint / PARAMS / name
            try:
                meta = ckptr.metadata(part)
                meta = getattr(meta, "item_metadata", meta)
                target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=cpu), meta)
                return name, jax.tree.map(np.asarray, ckptr.restore(part, target))
            except Exception as e:  # Orbax and TensorStore raise plain Exceptions for missing or cut short files
                raise CheckpointError(f"{part}: unreadable Orbax checkpoint, a file missing or cut short "
                                      f"({_innermost(e)}); {recovery(checkpoint)}") from e

        names = ["top", *(f"layers/{i}" for i in range(config.num_layers))]
        return params_from_parts(map(restore, names), config.num_layers)


def _innermost(error: BaseException) -> str:
    """The first line of the innermost exception of `error`'s chain: TensorStore's, under Orbax's, names the array
    and what is wrong with its file (the store's spec cut off)."""
    while error.__cause__ or error.__context__:
        error = error.__cause__ or error.__context__
    return str(error).splitlines()[0].split(" [tensorstore_spec=")[0]
