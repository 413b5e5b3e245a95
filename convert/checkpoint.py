"""The nanojax checkpoint folder: params as Orbax checkpoints, config.json, tokenizer files, manifest.json.

The params are one Orbax checkpoint per part (params/layers/{i} for each layer, params/top for the rest), written
as each part is converted: Orbax holds a second copy of what it saves, so saving the whole tree at once would
need twice the model in memory. A conversion writes everything into a temporary sibling folder and renames it
into place at the end, so a failed or interrupted conversion leaves nothing half-written at the destination, and
the folder a killed one left is removed by the next conversion beside it (convert/cache.py).
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
# The params layout this code writes and reads. 3: one Orbax checkpoint per part. 2: one Orbax checkpoint of the
# whole tree. 2 and 3 fold the RMSNorm scales into the qkv / up weights (convert/keys.py); format 1 (no
# "params_format" in the manifest) kept them apart, and this model code would run it without those scales.
PARAMS_FORMAT = 3
DTYPES = {"float32": np.float32, "bfloat16": jax.numpy.bfloat16, "float16": np.float16}
# Weight formats a checkpoint may record besides its dtype: "fp8", every projection in FP8 (E4M3) with
# per-output-channel scales (convert/quantize.py); embeddings, norms and the LM head stay in dtype.
QUANTIZATIONS = (None, "fp8")
# The FP8 layout this code writes and reads. 2: {w_t [N, K], scale [N]} (a row per output channel). 1 (no "fp8_format"
# in the manifest): {w [K, N], scale [N]}, which this code would misread.
FP8_FORMAT = 2


def params_from_source(source: Source, dtype: str, progress: bool = False,
                       place: Callable[[dict], dict] | None = None) -> tuple[ModelConfig, dict]:
    """The whole model in memory; its layers converted on a thread per core (up to 16): the whole model is held
    anyway, and conversion was most of a warm start of `LLM(hf_folder)` (docs/perf_notes.md, "Conversion and
    placement").
    place: applied to each part on a thread of its own as the part is converted (`jax.device_put`: the copies to
    the device run while the next parts convert)."""
    config = ModelConfig.from_hf_config(source.hf_config)
    threads = min(16, os.cpu_count() or 1)
    parts = _parts(source, config, dtype, progress, threads)
    if place is not None:
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="place") as pool:
            placing = [(name, pool.submit(place, part)) for name, part in parts]
        parts = [(name, future.result()) for name, future in placing]
    return config, params_from_parts(parts, config.num_layers)


def _parts(source: Source, config: ModelConfig, dtype: str, progress: bool, threads: int = 1):
    """One layer at a time by default: `convert` holds a part at a time, in bounded memory."""
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
            parts = ((name, _fp8_layer(part) if name.startswith("layers/") else part) for name, part in parts)
        num_parameters = _save_params(tmp / PARAMS, parts)
        (tmp / "config.json").write_text(json.dumps(source.hf_config, indent=2, default=str))
        has_tokenizer = source.save_tokenizer(tmp)
        manifest = {
            "source": source.description,
            "format": source.format,
            "architecture": config.architecture,
            "dtype": dtype,
            "quantization": quantization,
            **({"fp8_format": FP8_FORMAT} if quantization == "fp8" else {}),
            "params_format": PARAMS_FORMAT,
            "num_parameters": num_parameters,
            "tokenizer": has_tokenizer,
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
        move_into_place(tmp, dst)
    return dst


def _fp8_layer(part: dict) -> dict:
    return jax.tree.map(np.asarray, quantize_layer(part))


def is_checkpoint(path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def params_format(path) -> int:
    """The params layout of the checkpoint at `path`."""
    return _params_format(_read_manifest(Path(path)))


def _read_manifest(path: Path) -> dict:
    manifest = read_json(path / MANIFEST)
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{path / MANIFEST}: not a JSON object; {recovery(path)}")
    return manifest


def _params_format(manifest: dict) -> int:
    return manifest.get("params_format", 1)  # 1: written before the layout was recorded


def load_checkpoint(path) -> tuple[ModelConfig, dict, dict]:
    """-> (config, params as numpy arrays, manifest); CheckpointError for a params layout this code does not read."""
    path = Path(path)
    manifest = _read_manifest(path)
    if _params_format(manifest) != PARAMS_FORMAT:
        raise CheckpointError(
            f"{path} holds params format {_params_format(manifest)} (written by another nanojax version), this nanojax "
            f"reads format {PARAMS_FORMAT}; convert its source again: {convert_command(path)}")
    if manifest.get("quantization") not in QUANTIZATIONS:
        raise CheckpointError(f"{path} holds {manifest['quantization']!r} weights, which this nanojax does not read "
                              f"(it reads {list(QUANTIZATIONS)})")
    fp8_format = manifest.get("fp8_format", 1)  # 1: written before the format was recorded
    if manifest.get("quantization") == "fp8" and fp8_format != FP8_FORMAT:
        raise CheckpointError(
            f"{path} holds FP8 weights in layout {fp8_format} (written by another nanojax version), "
            f"this nanojax reads layout {FP8_FORMAT}; convert its source again: {convert_command(path)}")
    config = ModelConfig.from_hf_config(read_json(path / "config.json"))
    return config, _load_params(path, config), manifest


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
    """The first line of the innermost exception of `error`'s chain: Orbax wraps TensorStore's, which names the array
    and what is wrong with its file (without the spec of the store it opened)."""
    while error.__cause__ or error.__context__:
        error = error.__cause__ or error.__context__
    return str(error).splitlines()[0].split(" [tensorstore_spec=")[0]
