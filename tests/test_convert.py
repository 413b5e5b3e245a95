"""The converter: sharded safetensors, HF-cache resolution, checkpoint round trip, and every bad input."""
import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import convert.__main__ as cli
from convert import CheckpointError, convert, load_checkpoint, open_source, params_from_source


def _tree_equal(a, b):
    import jax

    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    assert all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))


def _copy_model(src, dst):
    shutil.copytree(src, dst)
    return dst


def _rewrite(folder, edit):
    """Apply edit(dict of tensors) to model.safetensors."""
    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def test_checkpoint_round_trip_and_manifest(hf_model_dir, tmp_path):
    folder, _ = hf_model_dir("qwen3")
    dst = convert(str(folder), tmp_path / "ckpt", dtype="float32", progress=False)
    config, params, manifest = load_checkpoint(dst)
    ref_config, ref_params = params_from_source(open_source(folder), "float32")
    assert config == ref_config
    _tree_equal(params, ref_params)
    assert manifest["format"] == "safetensors" and manifest["dtype"] == "float32"
    assert manifest["num_parameters"] == sum(np.size(x) for x in __import__("jax").tree.leaves(params))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left


def test_sharded_safetensors_equal_single_file(hf_model_dir, tmp_path):
    folder, model = hf_model_dir("llama")
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="20KB")
    assert len(list(sharded.glob("*.safetensors"))) > 2
    _tree_equal(params_from_source(open_source(sharded), "float32")[1],
                params_from_source(open_source(folder), "float32")[1])


def test_hub_cache_resolution(hf_model_dir, tmp_path, monkeypatch):
    folder, _ = hf_model_dir("gpt2")
    snapshot = tmp_path / "hub" / "models--acme--tiny-gpt2" / "snapshots" / "abc123"
    shutil.copytree(folder, snapshot)
    (tmp_path / "hub" / "models--acme--tiny-gpt2" / "refs").mkdir()
    (tmp_path / "hub" / "models--acme--tiny-gpt2" / "refs" / "main").write_text("abc123")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    source = open_source("acme/tiny-gpt2")
    assert source.description == str(snapshot)
    with pytest.raises(CheckpointError, match="not in the local Hugging Face cache"):
        open_source("acme/absent-model")


def _expect_failure(src, tmp_path, match, capsys):
    dst = tmp_path / "out"
    assert cli.main([str(src), str(dst), "--dtype", "float32"]) == 1
    assert match in capsys.readouterr().err
    assert not dst.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_missing_tensor(hf_model_dir, tmp_path, capsys):
    src = _copy_model(hf_model_dir("llama")[0], tmp_path / "m")
    _rewrite(src, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    _expect_failure(src, tmp_path, "missing tensor 'model.layers.1.mlp.up_proj.weight'", capsys)


def test_wrong_shape(hf_model_dir, tmp_path, capsys):
    src = _copy_model(hf_model_dir("llama")[0], tmp_path / "m")
    _rewrite(src, lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": np.zeros((8, 64), np.float32)}))
    _expect_failure(src, tmp_path, "'model.layers.0.self_attn.k_proj.weight' has shape (8, 64)", capsys)


def test_unmapped_tensor(hf_model_dir, tmp_path, capsys):
    src = _copy_model(hf_model_dir("qwen2")[0], tmp_path / "m")
    _rewrite(src, lambda t: t.update({"model.layers.0.mystery.weight": np.zeros(3, np.float32)}))
    _expect_failure(src, tmp_path, "unmapped tensor(s) in the checkpoint: ['model.layers.0.mystery.weight']",
                    capsys)


def test_duplicated_tensor_across_shards(hf_model_dir, tmp_path, capsys):
    src = _copy_model(hf_model_dir("qwen2")[0], tmp_path / "m")
    save_file({"model.norm.weight": np.ones(56, np.float32)}, src / "extra.safetensors")
    _expect_failure(src, tmp_path, "'model.norm.weight' appears in both", capsys)


def test_unknown_architecture(hf_model_dir, tmp_path, capsys):
    src = _copy_model(hf_model_dir("llama")[0], tmp_path / "m")
    cfg = json.loads((src / "config.json").read_text())
    cfg["model_type"] = "mamba9"
    (src / "config.json").write_text(json.dumps(cfg))
    _expect_failure(src, tmp_path, "model_type='mamba9'", capsys)


def test_corrupt_safetensors(hf_model_dir, tmp_path, capsys):
    src = _copy_model(hf_model_dir("llama")[0], tmp_path / "m")
    data = (src / "model.safetensors").read_bytes()
    (src / "model.safetensors").write_bytes(data[: len(data) // 2])
    _expect_failure(src, tmp_path, "model.safetensors", capsys)


def test_mismatched_config(hf_model_dir, tmp_path, capsys):
    src = _copy_model(hf_model_dir("llama")[0], tmp_path / "m")
    cfg = json.loads((src / "config.json").read_text())
    cfg["intermediate_size"] = 128
    (src / "config.json").write_text(json.dumps(cfg))
    _expect_failure(src, tmp_path, "config expects", capsys)


def test_existing_destination_is_kept(hf_model_dir, tmp_path):
    dst = tmp_path / "ckpt"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="already exists"):
        convert(str(hf_model_dir("llama")[0]), dst, progress=False)
    assert (dst / "keep.txt").read_text() == "mine"


def test_nonexistent_source(tmp_path, capsys):
    assert cli.main([str(tmp_path / "nothing-here"), str(tmp_path / "out")]) == 1
    assert "no such folder" in capsys.readouterr().err
