"""Tensor parallelism (nanojax.sharding) on 8 host devices: sizes 1, 2, 4 and 8 give HF's float32 greedy tokens for
every dense architecture and Qwen3-MoE (its experts split whole: Mixtral's layer is the same), KV heads fewer than the
devices included, through prefix-cache hits, chunked prefill and preemption; the Pallas kernels per shard in interpret
mode; FP8 weights per shard; a draft model's speculation; two all-reduces per layer in the compiled decode.

The host device count is fixed when jax starts, so under the default single device these tests re-run this file in
subprocesses with NANOJAX_TEST_DEVICES=8 (tests/conftest.py), in three parts of similar work: each part's process
gets a core of its own beside the other pytest-xdist worker, so that no part runs long under load.
"""
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import FAST_COMPILE_XLA_FLAGS, TINY, build_hf_model, hf_greedy, random_prompts

from nanojax import LLM, SamplingParams
from nanojax.sharding import TensorParallel

DEVICES = 8
on_host_devices = pytest.mark.skipif(jax.device_count() < DEVICES, reason="runs in test_on_8_host_devices")
# Each architecture with 8 query heads (so that every size splits them) and its KV heads: 8 (split), 4, 2 and 1
# (replicated where fewer than the devices). Vocabularies stay odd: the vocabulary shards are padded.
TP_TINY = {
    "llama": dict(TINY["llama"], num_attention_heads=8, num_key_value_heads=2),
    "llama3": TINY["llama3"],
    "qwen2": dict(TINY["qwen2"], hidden_size=64, num_attention_heads=8),
    "qwen3": dict(TINY["qwen3"], num_attention_heads=8),
    "ernie4_5": dict(TINY["ernie4_5"], num_attention_heads=8),
    "gpt2": dict(TINY["gpt2"], n_head=8),
    "qwen3_moe": dict(TINY["qwen3_moe"], num_attention_heads=8),  # 8 experts: 1 to 8 per device
    "qwen2_moe": dict(TINY["qwen2_moe"], num_attention_heads=8),  # and a shared expert split as a dense MLP
}
# For the kernels' tests: qwen3 (a head_dim the kernels take) in one layer, since every layer's kernels, interpreted,
# lengthen each compile, and a second layer checks nothing more of them.
KERNELS_TINY = dict(TP_TINY["qwen3"], num_hidden_layers=1)
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


_GREEDY = "test_greedy_tokens_match_hf_at_every_size"
PARTS = {"greedy-1": [f"::{_GREEDY}[{name}]" for name in ("ernie4_5", "gpt2", "llama", "qwen3_moe")],
         "greedy-2": [f"::{_GREEDY}[{name}]" for name in ("llama3", "qwen2", "qwen3", "qwen2_moe")],
         "rest": ["", "-k", f"not {_GREEDY} and not test_on_8_host_devices"]}


@pytest.mark.long
@pytest.mark.skipif(jax.device_count() >= DEVICES, reason="already on 8 host devices")
@pytest.mark.parametrize("part", sorted(PARTS))
def test_on_8_host_devices(part):
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={DEVICES} {FAST_COMPILE_XLA_FLAGS}",
           "NANOJAX_TEST_DEVICES": str(DEVICES)}
    targets = [__file__ + x if x.startswith("::") or x == "" else x for x in PARTS[part]]
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-p", "no:xdist",
                          *targets], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    summary = run.stdout.splitlines()[-1]
    assert re.fullmatch(r"\d+ passed(, \d+ deselected)?(, \d+ warnings?)? in .*", summary), run.stdout[-2000:]


@pytest.fixture(scope="module")
def tp_model(tmp_path_factory):
    made = {}

    def make(name):
        if name not in made:
            spec = {"kernels": KERNELS_TINY, "draft": dict(TP_TINY["qwen3"], num_hidden_layers=1)}.get(name)
            model = build_hf_model(spec or TP_TINY[name], seed=3 if name == "draft" else 0)
            folder = tmp_path_factory.mktemp(f"tp-{name}")
            model.save_pretrained(folder)
            made[name] = (str(folder), model)
        return made[name]

    return make


def scenario(config_vocab: int):
    """Prompts that share a 9-token prefix (prefix-cache hits once the first has run), one longer than the chunk
    size (chunked prefill), more KV than the pool holds (preemption)."""
    prefix = random_prompts(config_vocab, [9], seed=5)[0]
    rest = random_prompts(config_vocab, [6, 3, 23, 1], seed=6)
    return [prefix + rest[0], prefix + rest[1], rest[2], prefix + rest[3]]


@on_host_devices
@pytest.mark.parametrize("name", sorted(TP_TINY))
def test_greedy_tokens_match_hf_at_every_size(tp_model, name):
    folder, model = tp_model(name)
    prompts = scenario(model.config.vocab_size)
    expected = [hf_greedy(model, p, GREEDY.max_tokens) for p in prompts]
    for size in (1, 2, 4, 8):
        llm = LLM(folder, dtype="float32", page_size=4, max_model_len=64, num_pages=12, max_num_seqs=2,
                  max_num_batched_tokens=16, decode_steps=4, tensor_parallel_size=size, progress=False)
        first = llm.generate([prompts[0]], GREEDY, use_tqdm=False)[0]
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [first.token_ids] + [o.token_ids for o in outs] == expected[:1] + expected, (name, size)
        assert outs[0].num_cached_tokens > 0 and llm.scheduler.num_preemptions > 0, (name, size)
        heads = llm.runner.cache.k[0].sharding.shard_shape(llm.runner.cache.k[0].shape)[1]
        assert heads == max(llm.config.num_kv_heads, size) // size  # KV heads per device


@on_host_devices
def test_pallas_kernels_per_shard(tp_model):
    folder, model = tp_model("kernels")
    prompts = random_prompts(model.config.vocab_size, [7, 2], seed=3)
    llm = LLM(folder, dtype="float32", page_size=8, max_model_len=32, max_num_seqs=2, decode_steps=2,
              kernels="interpret", tensor_parallel_size=2, progress=False)
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    assert [o.token_ids for o in outs] == [hf_greedy(model, p, 3) for p in prompts]
    # A seeded filtered request with logprobs (the sampling filters kernel at work on each shard): the same alone
    # and beside another.
    seeded = SamplingParams(temperature=1.0, top_p=0.8, top_k=20, max_tokens=3, ignore_eos=True, seed=5, logprobs=2)
    alone = llm.generate([prompts[0]], seeded, use_tqdm=False)[0]
    beside = llm.generate(prompts, [seeded, greedy], use_tqdm=False)[0]
    assert beside.token_ids == alone.token_ids and len(beside.logprobs) == 3
    # Prompt logprobs (their program takes the prefill's hidden states, replicated): those of one device.
    echo = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2)
    one = LLM(folder, dtype="float32", page_size=8, max_model_len=32, max_num_seqs=2, decode_steps=2,
              kernels="interpret", progress=False)
    expected = one.generate([prompts[0]], echo, use_tqdm=False)[0].prompt_logprobs
    for (logprob, top), (want, want_top) in zip(llm.generate([prompts[0]], echo, use_tqdm=False)[0].prompt_logprobs[1:],
                                                expected[1:], strict=True):
        assert logprob == pytest.approx(want, abs=1e-5) and top == pytest.approx(want_top, abs=1e-5)


@on_host_devices
@pytest.mark.parametrize("kernels", ["reference", "interpret"])
def test_cascade_per_shard(tp_model, kernels):
    """A pinned shared prefix read once per step by the cascade path (its kernel per shard in interpret mode), at
    size 2 with 4 KV heads: HF's greedy tokens."""
    from nanojax.cascade import CascadeRules

    folder, model = tp_model("kernels")
    system, doc, *questions = random_prompts(model.config.vocab_size, [18, 9, 1, 3, 5, 2, 4], seed=5)
    rules = CascadeRules(min_shared_tokens=8, min_piece_tokens=4, min_saved_tokens=1, min_batch=1, num_items=8)
    llm = LLM(folder, dtype="float32", page_size=4, max_model_len=64, decode_steps=4, kernels=kernels,
              tensor_parallel_size=2, cascade=rules, progress=False)
    llm.pin_prefix(system + doc)
    prompts = [system + doc + q for q in questions]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert llm.runner.cascade_dispatches > 0
    assert [o.token_ids for o in outs] == [hf_greedy(model, p, 8) for p in prompts]


@on_host_devices
def test_draft_model_speculation_per_shard(tp_model):
    """A draft model (whole on every device) proposing for the split model: HF's greedy tokens, proposals checked."""
    folder, model = tp_model("qwen3")
    draft_folder, _ = tp_model("draft")
    prompts = scenario(model.config.vocab_size)
    expected = [hf_greedy(model, p, GREEDY.max_tokens) for p in prompts]
    spec = {"method": "draft_model", "model": draft_folder, "num_speculative_tokens": 3}
    for size in (2, 4):
        llm = LLM(folder, dtype="float32", page_size=4, max_model_len=64, max_num_seqs=4, decode_steps=4,
                  tensor_parallel_size=size, speculative_config=spec, progress=False)
        assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected, size
        assert llm.speculation_stats()[1] > 0  # forwards that checked proposals


@on_host_devices
def test_decode_collectives(tp_model):
    """The compiled multi-step decode keeps its collectives inside: per step the embedding's all-reduce, two per
    layer, the logits' all-gather."""
    folder, model = tp_model("llama")
    llm = LLM(folder, dtype="float32", page_size=4, max_model_len=32, max_num_seqs=2, decode_steps=4,
              tensor_parallel_size=4, progress=False)
    from nanojax.runner import Program

    hlo = llm.runner.lower(Program(2, 4)).compile().as_text()
    assert "while" in hlo
    layers = model.config.num_hidden_layers
    assert len(re.findall(r"= \S+ all-reduce\(", hlo)) == 2 * layers + 1
    assert len(re.findall(r"= \S+ all-gather\(", hlo)) == 1


@on_host_devices
def test_uneven_shapes_are_refused():
    import dataclasses

    from transformers import AutoConfig

    from convert.config import ModelConfig, MoE

    spec = dict(TINY["qwen2"])
    qwen2 = ModelConfig.from_hf_config(AutoConfig.for_model(spec.pop("model_type"), **spec).to_dict())
    with pytest.raises(ValueError, match="num_heads=7 is not divisible by tensor_parallel_size=2"):
        TensorParallel.create(qwen2, 2)
    with pytest.raises(ValueError, match="num_kv_heads=3 and tensor_parallel_size=2"):
        TensorParallel.create(dataclasses.replace(qwen2, num_heads=6, num_kv_heads=3), 2)
    with pytest.raises(ValueError, match="intermediate_size=84 is not divisible by tensor_parallel_size=8"):
        TensorParallel.create(dataclasses.replace(qwen2, num_heads=8, intermediate_size=84), 8)
    with pytest.raises(ValueError, match="num_experts=6 is not divisible by tensor_parallel_size=4"):
        TensorParallel.create(dataclasses.replace(qwen2, num_heads=8, moe=MoE(6, 2, True)), 4)
    with pytest.raises(ValueError, match="tensor_parallel_size=16 but only 8 devices"):
        TensorParallel.create(qwen2, 16)


@on_host_devices
def test_each_device_holds_only_its_slices(tp_model):
    """qkv re-ordered to [q_i | k_i | v_i] per device, KV heads replicated, vocabulary padded with zeros."""
    folder, model = tp_model("llama")  # 8 q heads, 2 KV heads, head_dim 8, vocabulary 101
    from nanojax.loader import load_model

    params = load_model(folder, "float32").params
    tp = TensorParallel.create(load_model(folder, "float32").config, 4)
    placed = tp.place(params)
    qkv = params["layers"][0]["qkv"]["w"]  # [64, (8 + 2 + 2) * 8]
    shards = sorted(placed["layers"][0]["qkv"]["w"].addressable_shards, key=lambda s: s.device.id)
    for i, shard in enumerate(shards):
        q = qkv[:, 16 * i:16 * (i + 1)]
        k = qkv[:, 64 + 8 * (i // 2):64 + 8 * (i // 2 + 1)]
        v = qkv[:, 80 + 8 * (i // 2):80 + 8 * (i // 2 + 1)]
        np.testing.assert_array_equal(np.asarray(shard.data), np.concatenate([q, k, v], axis=1))
    embed = placed["embed"]
    assert embed.shape == (104, 64)
    np.testing.assert_array_equal(np.asarray(embed)[:101], params["embed"])
    assert not np.asarray(embed)[101:].any()


@on_host_devices
@pytest.mark.parametrize("size", [2, 8])
def test_experts_are_split_whole(tp_model, size):
    """Expert parallelism: device i holds experts i E / size onwards whole (FP8 ones with their scales); the router
    and the norm before it are on every device."""
    from convert.quantize import quantize_params
    from nanojax.loader import load_model

    loaded = load_model(tp_model("qwen3_moe")[0], "float32")
    layer = quantize_params(loaded.params, loaded.config, lm_head=False)["layers"][0]
    placed = TensorParallel.create(loaded.config, size).place({"layers": (layer,)})["layers"][0]
    per_device = 8 // size
    for leaf in ("w_t", "scale"):
        source = np.asarray(layer["experts"]["up"][leaf], np.float32)
        for shard in placed["experts"]["up"][leaf].addressable_shards:
            first = shard.device.id * per_device
            np.testing.assert_array_equal(np.asarray(shard.data, np.float32), source[first:first + per_device])
    for name in ("router", "mlp_norm"):
        assert all(s.data.shape == v.shape for v in jax.tree.leaves(placed[name]) for s in v.addressable_shards)


@on_host_devices
def test_layout_is_where_place_puts_each_tensor(tp_model):
    """TensorParallel.layout (what the benchmarks' random weights are drawn by) gives place's shape and sharding."""
    folder, _ = tp_model("llama")
    from nanojax.loader import load_model
    from nanojax.sharding import param_names

    loaded = load_model(folder, "float32")
    tp = TensorParallel.create(loaded.config, 4)
    placed = tp.place(loaded.params)
    groups = [((), {k: v for k, v in loaded.params.items() if k != "layers"},
               {k: v for k, v in placed.items() if k != "layers"}),
              (("layers",), loaded.params["layers"][0], placed["layers"][0])]
    for root, group, placed_group in groups:
        for (path, x), out in zip(jax.tree_util.tree_leaves_with_path(group), jax.tree.leaves(placed_group)):
            shape, sharding, _ = tp.layout(root + param_names(path), x.shape)
            assert (shape, sharding) == (out.shape, out.sharding), path


@on_host_devices
@pytest.mark.parametrize("kernels", ["reference", "interpret"])
def test_fp8_weights_per_shard(tp_model, kernels):
    """LLM(quantization="fp8") split over 2 and 4 devices (each with its columns' or rows' FP8 slices and their
    scales, qkv re-ordered per device with its scales) gives the unsharded FP8 engine's greedy tokens; with the
    kernels (interpreted), one-row projections read each shard's FP8 slice in the fused kernel."""
    # 8 q heads, 2 KV heads (replicated at size 4); the kernels need KERNELS_TINY's head_dim, and one sequence decodes
    # one row, which the FP8 kernel takes
    folder, model = tp_model("llama" if kernels == "reference" else "kernels")
    prompts = scenario(model.config.vocab_size)[slice(None) if kernels == "reference" else slice(2, 3)]
    kw = dict(dtype="float32", page_size=4, max_model_len=64, max_num_seqs=4, decode_steps=4, quantization="fp8",
              kernels=kernels, progress=False)
    expected = [o.token_ids for o in LLM(folder, **kw).generate(prompts, GREEDY, use_tqdm=False)]
    for size in (2, 4) if kernels == "reference" else (2,):
        llm = LLM(folder, tensor_parallel_size=size, **kw)
        assert str(llm.runner.params["layers"][0]["qkv"]["w_t"].dtype) == "float8_e4m3fn"
        assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected, size
