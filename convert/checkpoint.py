"""The nanojax checkpoint folder: params as an Orbax checkpoint, config.json, tokenizer files, manifest.json.

A conversion writes everything into a temporary sibling folder and renames it into place at the end, so a
failed or interrupted conversion leaves nothing half-written at the destination.
"""
import json
import os
import shutil
import uuid
from pathlib import Path

import jax
import numpy as np

from convert.keys import CheckpointError, hf_to_params
from convert.sources import Source, open_source
from nanojax.config import ModelConfig

MANIFEST = "manifest.json"
PARAMS = "params"
# The params layout this code writes and reads. 2: RMSNorm scales folded into the qkv / up weights (convert/keys.py).
# Format 1 (no "params_format" in the manifest) kept them apart; this model code would run it without those scales.
PARAMS_FORMAT = 2
DTYPES = {"float32": np.float32, "bfloat16": jax.numpy.bfloat16, "float16": np.float16}


def params_from_source(source: Source, dtype: str, progress: bool = False) -> tuple[ModelConfig, dict]:
    config = ModelConfig.from_hf_config(source.hf_config)
    params = hf_to_params(config, source.hf_config["model_type"], source.tensors, DTYPES[dtype], progress)
    return config, params


def convert(src, dst, dtype: str = "bfloat16", overwrite: bool = False, progress: bool = True) -> Path:
    """Convert `src` (HF folder, hub-cache model id or .gguf) into a nanojax checkpoint folder `dst`."""
    if dtype not in DTYPES:
        raise CheckpointError(f"dtype {dtype!r} is not one of {sorted(DTYPES)}")
    dst = Path(dst).expanduser().absolute()
    if dst.exists() and not overwrite:
        raise CheckpointError(f"{dst} already exists (pass --overwrite to replace it)")
    source = open_source(src)
    config, params = params_from_source(source, dtype, progress)
    tmp = dst.parent / f".{dst.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir(parents=True)
        _save_params(tmp / PARAMS, params)
        (tmp / "config.json").write_text(json.dumps(source.hf_config, indent=2, default=str))
        has_tokenizer = source.save_tokenizer(tmp)
        manifest = {
            "source": source.description,
            "format": source.format,
            "architecture": config.architecture,
            "dtype": dtype,
            "params_format": PARAMS_FORMAT,
            "num_parameters": int(sum(np.size(x) for x in jax.tree.leaves(params))),
            "tokenizer": has_tokenizer,
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
        if dst.exists():
            shutil.rmtree(dst)
        os.replace(tmp, dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dst


def is_checkpoint(path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def params_format(path) -> int:
    """The params layout of the checkpoint at `path`."""
    return _params_format(json.loads((Path(path) / MANIFEST).read_text()))


def _params_format(manifest: dict) -> int:
    return manifest.get("params_format", 1)  # 1: written before the layout was recorded


def load_checkpoint(path) -> tuple[ModelConfig, dict, dict]:
    """-> (config, params as numpy arrays, manifest); CheckpointError for a params layout this code does not read."""
    path = Path(path)
    manifest = json.loads((path / MANIFEST).read_text())
    if _params_format(manifest) != PARAMS_FORMAT:
        raise CheckpointError(
            f"{path} holds params format {_params_format(manifest)} (written by another nanojax version), this nanojax "
            f"reads format {PARAMS_FORMAT}; convert its source again: python -m convert "
            f"{manifest.get('source', 'SRC')} {path} --overwrite")
    config = ModelConfig.from_hf_config(json.loads((path / "config.json").read_text()))
    return config, _load_params(path / PARAMS, config), manifest


def _save_params(path: Path, params: dict) -> None:
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, _to_storable(params))


def _load_params(path: Path, config: ModelConfig) -> dict:
    import orbax.checkpoint as ocp

    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    with ocp.StandardCheckpointer() as ckptr:
        meta = ckptr.metadata(path)
        meta = getattr(meta, "item_metadata", meta)
        target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=cpu), meta)
        stored = ckptr.restore(path, target)
    params = jax.tree.map(np.asarray, stored)
    params["layers"] = tuple(params["layers"][str(i)] for i in range(config.num_layers))
    return params


def _to_storable(params: dict) -> dict:
    """Orbax keys are names: the layer tuple is stored as {"0": ..., "1": ...}."""
    return {**params, "layers": {str(i): layer for i, layer in enumerate(params["layers"])}}
