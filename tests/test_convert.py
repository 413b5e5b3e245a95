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


def test_rms_norm_scales_fold_into_the_projections(hf_model_dir):
    """input_layernorm's scale goes into the QKV rows and post_attention_layernorm's into gate/up, and the folded
    projection of the normalized x equals HF's RMSNorm (with its scale) followed by the projection."""
    import jax.numpy as jnp

    from convert.keys import fold_norm_scale
    from pallas_kernels.rms_norm import rms_norm, rms_normalize

    folder, model = hf_model_dir("llama")
    layer = params_from_source(open_source(folder), "float32")[1]["layers"][1]
    assert "attn_norm" not in layer and "mlp_norm" not in layer
    hf = model.model.layers[1]
    pairs = [(hf.input_layernorm, [hf.self_attn.q_proj, hf.self_attn.k_proj, hf.self_attn.v_proj], layer["qkv"]),
             (hf.post_attention_layernorm, [hf.mlp.gate_proj, hf.mlp.up_proj], layer["up"])]
    x = jnp.asarray(np.random.default_rng(0).standard_normal((5, 64), np.float32) * 3)
    for norm, projections, ours in pairs:
        scale = norm.weight.detach().numpy()
        w = np.concatenate([p.weight.detach().numpy() for p in projections]).T
        np.testing.assert_array_equal(ours["w"], fold_norm_scale(scale, w))
        hf_style = np.dot(rms_norm(x, jnp.asarray(scale), 1e-6), w)
        np.testing.assert_allclose(np.dot(rms_normalize(x, 1e-6), ours["w"]), hf_style, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("old_format", [1, 2])
def test_other_params_format_is_refused(hf_model_dir, tmp_path, old_format):
    """A checkpoint written before the norm scales were folded in (1) would run without them, one written as a single
    Orbax checkpoint (2) has no parts: loading either is an error that says how to convert it again."""
    dst = convert(str(hf_model_dir("qwen2")[0]), tmp_path / "ckpt", dtype="float32", progress=False)
    manifest = json.loads((dst / "manifest.json").read_text())
    assert manifest.pop("params_format") == 3
    if old_format == 2:
        manifest["params_format"] = 2
    (dst / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError,
                       match=rf"params format {old_format} .* reads format 3.*python -m convert .*--overwrite"):
        load_checkpoint(dst)


def test_experts_of_the_older_layout_are_refused(hf_model_dir, tmp_path):
    """A MoE checkpoint written before its router and experts were [N, K] (no moe_format) would be misread; a dense
    one's manifest needs no moe_format."""
    dst = convert(str(hf_model_dir("qwen3_moe")[0]), tmp_path / "moe", dtype="float32", progress=False)
    manifest = json.loads((dst / "manifest.json").read_text())
    assert manifest.pop("moe_format") == 2
    (dst / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"experts in layout 1 .* reads layout 2.*python -m convert "):
        load_checkpoint(dst)
    dense = convert(str(hf_model_dir("qwen2")[0]), tmp_path / "dense", dtype="float32", progress=False)
    assert "moe_format" not in json.loads((dense / "manifest.json").read_text())


def test_sharded_safetensors_equal_single_file(hf_model_dir, tmp_path):
    folder, model = hf_model_dir("llama")
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="20KB")
    assert len(list(sharded.glob("*.safetensors"))) > 2
    _tree_equal(params_from_source(open_source(sharded), "float32")[1],
                params_from_source(open_source(folder), "float32")[1])


def test_shard_missing_from_its_index(hf_model_dir, tmp_path, capsys):
    """An incomplete copy of a sharded model (a download that stopped between shards) names the absent shard."""
    sharded = tmp_path / "m"
    hf_model_dir("llama")[1].save_pretrained(sharded, max_shard_size="20KB")
    absent = sorted(sharded.glob("*.safetensors"))[1]
    absent.unlink()
    _expect_failure(sharded, tmp_path, f"shard(s) ['{absent.name}'] listed in model.safetensors.index.json", capsys)


def test_hub_cache_resolution(hf_model_dir, tmp_path, monkeypatch):
    folder, _ = hf_model_dir("gpt2")
    snapshot = tmp_path / "hub" / "models--acme--tiny-gpt2" / "snapshots" / "abc123"
    shutil.copytree(folder, snapshot)
    (tmp_path / "hub" / "models--acme--tiny-gpt2" / "refs").mkdir()
    (tmp_path / "hub" / "models--acme--tiny-gpt2" / "refs" / "main").write_text("abc123")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)  # downloads: tests/test_hub_download.py
    source = open_source("acme/tiny-gpt2")
    assert source.description == str(snapshot)
    with pytest.raises(CheckpointError, match="not .*in the local Hugging Face cache.*HF_HUB_OFFLINE=1"):
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


def test_layers_converted_on_threads_come_in_order_and_errors_surface_in_order():
    """params_from_source converts layers on a thread per core: results keep the layer order, at most `threads`
    are held, and the first failing layer's error is the one raised."""
    import threading
    import time

    from convert.keys import _in_order

    held, most = set(), [0]
    lock = threading.Lock()

    def layer(i):
        with lock:
            held.add(i)
            most[0] = max(most[0], len(held))
        time.sleep(0.01 * (i % 3))
        if i in (5, 7):
            raise CheckpointError(f"layer {i} is broken")
        return i

    out = []
    with pytest.raises(CheckpointError, match="layer 5"):
        for i in _in_order(layer, 10, threads=3):
            out.append(i)
            held.discard(i)
    assert out == [0, 1, 2, 3, 4] and most[0] <= 4  # 3 running, one done and not yet taken
    assert list(_in_order(lambda i: i * i, 6, threads=1)) == [0, 1, 4, 9, 16, 25]


@pytest.mark.parametrize("shape", [(300, 7), (1, 513), (600, 260)])
@pytest.mark.parametrize("src,dst", [("float32", "bfloat16"), ("bfloat16", "bfloat16"), ("float32", "float32"),
                                     ("float32", "float16")])
def test_transposed_weights_copy_as_numpy_does(shape, src, dst):
    """The converter's banded copy of a transposed view (an HF [out, in] weight as [in, out]) gives numpy's C-order
    cast bit for bit, in bands that do not divide the rows."""
    from convert.checkpoint import DTYPES
    from convert.keys import _cast

    x = np.random.default_rng(0).standard_normal(shape[::-1]).astype(DTYPES[src]).T
    got = _cast(x, DTYPES[dst])
    want = np.array(x, dtype=DTYPES[dst], order="C")
    assert got.flags.c_contiguous and got.dtype == want.dtype
    np.testing.assert_array_equal(got.view(f"u{got.itemsize}"), want.view(f"u{want.itemsize}"))


@pytest.mark.parametrize("name", ["llama", "llama3", "qwen2", "qwen3", "ernie4_5", "gpt2", "qwen3_moe", "qwen2_moe",
                                  "mixtral"])
def test_param_shapes_are_the_conversions(hf_model_dir, name):
    """param_shapes, known from the config alone, is the tree and the shapes the conversion gives."""
    import jax

    from convert.keys import param_shapes

    folder, _ = hf_model_dir(name)
    config, params = params_from_source(open_source(folder), "bfloat16")
    shapes = param_shapes(config, next(iter(jax.tree.leaves(params))).dtype)
    assert shapes == jax.tree.map(lambda x: (x.shape, x.dtype), params)  # the same nesting, keys and shapes


@pytest.mark.parametrize("name,expert", [("qwen3_moe", "mlp.experts.7.up_proj"),
                                         ("mixtral", "block_sparse_moe.experts.7.w3"),
                                         ("qwen2_moe", "mlp.shared_expert.up_proj")])
def test_experts_stacked_or_one_tensor_each(hf_model_dir, tmp_path, name, expert):
    """A MoE model's experts convert alike from one tensor per expert (as save_pretrained writes them) and stacked
    [E, ...] as transformers 5 holds them (its state_dict, which scripts/random_model.py converts); a missing expert's
    tensor is named."""
    from convert.keys import hf_to_params

    folder, model = hf_model_dir(name)
    config, params = params_from_source(open_source(folder), "float32")
    state = {n: (lambda t=t: t.detach().numpy()) for n, t in model.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    _tree_equal(hf_to_params(config, name, state, np.float32), params)
    broken = _copy_model(folder, tmp_path / "broken")
    _rewrite(broken, lambda tensors: tensors.pop(f"model.layers.1.{expert}.weight"))
    with pytest.raises(CheckpointError, match=rf"missing tensor 'model.layers.1.{expert}.weight' \(expected shape"):
        params_from_source(open_source(broken), "float32")
