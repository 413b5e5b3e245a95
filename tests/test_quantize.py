"""FP8 weight-only quantization (convert/quantize.py): the per-channel round trip, the params layout, and the model
with FP8 params, through the jnp references and through the Pallas kernels (interpret mode)."""
import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import random_prompts

from convert import open_source, params_from_source
from convert.quantize import CLIP_RATIOS, FP8_MAX, PROJECTIONS, dequantize, quantize_params, quantize_weight
from nanojax.kv_cache import Batch, KVCache
from nanojax.model import Projection, forward, lm_logits
from nanojax.ops import Ops
from pallas_kernels.rmsnorm_matmul import rmsnorm_matmul_reference

# E4M3 keeps 3 mantissa bits: a normal value rounds to within 2^-4 of itself (half a unit in the last place); below
# 2^-6 (subnormals, steps of 2^-9) the error is at most 2^-10 absolute, in units of the column's scale.
REL_STEP, SUBNORMAL_STEP = 2.0**-4, 2.0**-10


def spread_weights(seed, k, n, dtype=np.float32):
    """[K, N] weights whose columns differ in magnitude by up to e^6, one column all zeros and one with an outlier
    100x its other values."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((k, n)) * np.exp(rng.uniform(-3, 3, n))
    w[:, 3] = 0.0
    w[5, 7] = 100 * np.abs(w[:, 7]).max()
    return jnp.asarray(w.astype(np.float32), dtype)


def max_scaled_error(wf, amax):
    """Per-column squared error [N] of rounding wf [K, N] (float64) with the column's max mapped to 448 (no clip)."""
    scale = np.where(amax > 0, amax / FP8_MAX, 1.0).astype(np.float32)
    q = np.asarray(jnp.asarray(wf / scale, jnp.float32).astype(jnp.float8_e4m3fn).astype(jnp.float32), np.float64)
    return np.sum((q * scale - wf) ** 2, axis=0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("k,n", [(64, 40), (333, 17)])
def test_round_trip_error_per_channel(k, n, dtype):
    w = spread_weights(k + n, k, n, dtype)
    p = quantize_weight(w)
    assert p["w_t"].dtype == jnp.float8_e4m3fn and p["w_t"].shape == (n, k)
    assert p["scale"].dtype == jnp.float32 and p["scale"].shape == (n,)
    wf = np.asarray(w.astype(jnp.float32), np.float64)
    scale, q = np.asarray(p["scale"], np.float64), np.asarray(p["w_t"].astype(jnp.float32), np.float64).T
    amax = np.abs(wf).max(axis=0)
    assert np.all(np.isfinite(q)) and np.all(np.abs(q) <= FP8_MAX)
    nonzero = amax > 0
    # scale = r * amax / 448 with the clip ratio r in [0.75, 1]; XLA may compute it with two f32 roundings of 2^-24.
    ratio = scale[nonzero] * FP8_MAX / amax[nonzero]
    assert np.all(ratio >= min(CLIP_RATIOS) * (1 - 2**-23)) and np.all(ratio <= 1 + 2**-23)
    assert np.all(q[:, ~nonzero] == 0) and np.all(scale[~nonzero] == 1)
    deq = np.asarray(dequantize(p), np.float64)
    # The search keeps the no-clip candidate: no column is worse than the max mapped to 448.
    col_err = np.sum((deq - wf) ** 2, axis=0)
    assert np.all(col_err <= max_scaled_error(wf, amax) * (1 + 1e-5))
    # Values within +-448 * scale round to nearest: one f32 rounding of w / scale and of q * scale on top of E4M3's
    # own; the others saturate at +-448 * scale.
    inside = np.abs(wf) <= FP8_MAX * scale
    bound = (REL_STEP + 2**-22) * np.abs(wf) + SUBNORMAL_STEP * scale[None, :]
    assert np.all(np.abs(deq - wf)[inside] <= bound[inside])
    np.testing.assert_array_equal(q[~inside], FP8_MAX * np.sign(wf[~inside]))


def test_clip_search_lowers_the_error():
    """On Gaussian columns the search clips most columns and lowers the total squared error against the max mapped
    to 448; a column already on the E4M3 grid with its max at 448 keeps scale 1 (zero error, the first candidate)."""
    w = np.random.default_rng(5).standard_normal((512, 64)).astype(np.float32)
    w[:, 0] = np.asarray(jnp.asarray(w[:, 0] * 100).astype(jnp.float8_e4m3fn).astype(jnp.float32))
    w[0, 0] = FP8_MAX
    p = quantize_weight(w)
    wf = w.astype(np.float64)
    amax = np.abs(wf).max(axis=0)
    col_err = np.sum((np.asarray(dequantize(p), np.float64) - wf) ** 2, axis=0)
    assert float(p["scale"][0]) == 1.0 and col_err[0] == 0
    clipped = np.asarray(p["scale"]) < amax / FP8_MAX * (1 - 2**-10)
    assert clipped.mean() > 0.5
    assert col_err[1:].sum() < 0.97 * max_scaled_error(wf, amax)[1:].sum()


def test_dequantize_dtype():
    p = quantize_weight(spread_weights(0, 32, 16))
    out = dequantize(p, jnp.bfloat16)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(out, dequantize(p).astype(jnp.bfloat16))


def test_rounds_to_nearest():
    """Values halfway between two E4M3 values round to the even one; clipping the max (448, scale 1) would cost more
    than the search could gain, so the scale stays 1."""
    # With amax 448 the scale is 1: 17 and 19 lie halfway between 16, 18 and 20 (steps of 2 in [16, 32)).
    w = jnp.asarray([[448.0], [17.0], [19.0], [-17.0], [0.3]], jnp.float32)
    p = quantize_weight(w)
    assert float(p["scale"][0]) == 1.0
    np.testing.assert_array_equal(np.asarray(p["w_t"].astype(jnp.float32))[0],
                                  [448.0, 16.0, 20.0, -16.0, np.float32(jnp.asarray(0.3).astype(jnp.float8_e4m3fn))])


def load_tiny(hf_model_dir, name):
    folder, _ = hf_model_dir(name)
    return params_from_source(open_source(folder), "float32")


@pytest.mark.parametrize("name", ["llama", "llama3"])
def test_params_layout(hf_model_dir, name):
    """Projections and the LM head become {w_t fp8 [N, K], scale f32, b?}; embeddings and norms stay; tied
    embeddings keep embed and gain an FP8 lm_head quantized from embed.T."""
    config, params = load_tiny(hf_model_dir, name)
    fp8 = quantize_params(params, config)
    for lp, qp in zip(params["layers"], fp8["layers"]):
        assert set(qp) == set(lp)
        for key in set(lp) - set(PROJECTIONS):
            assert qp[key] is lp[key]
        for proj in PROJECTIONS:
            assert set(qp[proj]) == set(lp[proj]) - {"w"} | {"w_t", "scale"}
            k, n = lp[proj]["w"].shape
            assert qp[proj]["w_t"].dtype == jnp.float8_e4m3fn and qp[proj]["w_t"].shape == (n, k)
            assert qp[proj]["scale"].dtype == jnp.float32 and qp[proj]["scale"].shape == (n,)
            if "b" in lp[proj]:
                assert qp[proj]["b"] is lp[proj]["b"]
    assert fp8["embed"] is params["embed"] and fp8["final_norm"] is params["final_norm"]
    head = params["embed"].T if config.tie_word_embeddings else params["lm_head"]
    assert config.tie_word_embeddings == (name == "llama3")
    np.testing.assert_array_equal(fp8["lm_head"]["w_t"].astype(jnp.float32), quantize_weight(head)["w_t"].astype(
        jnp.float32))
    assert fp8["lm_head"]["scale"].shape == (config.vocab_size,)
    with pytest.raises(ValueError, match="quantized already"):
        quantize_params(fp8, config)
    keep_head = quantize_params(params, config, lm_head=False)
    assert keep_head.get("lm_head") is params.get("lm_head") and keep_head["layers"][0]["qkv"]["w_t"].dtype == (
        jnp.float8_e4m3fn)


def dequantized_layers(layers):
    """Every FP8 projection's {w_t, scale, b?} (a MoE layer's experts' too) replaced by its f32 weight {w, b?}."""
    def weight(p, experts=False):  # experts are [E, N, K] as w_t
        w = dequantize(p)
        return {key: v for key, v in p.items() if key not in ("w_t", "scale")} | {
            "w": jnp.swapaxes(w, 1, 2) if experts else w}

    def layer(lp):
        experts = {"experts": {k: weight(p, True) for k, p in lp["experts"].items()}} if "experts" in lp else {}
        return lp | {name: weight(lp[name]) for name in PROJECTIONS if name in lp} | experts

    return tuple(map(layer, layers))


def dequantized(params, config):
    """(params, config) of what the FP8 model stands for: every projection's {w_t, scale} and the LM head replaced by
    their f32 weights, the head untied from the embedding (which keeps its own, unquantized rows)."""
    untied = dataclasses.replace(config, tie_word_embeddings=False)
    return params | {"layers": dequantized_layers(params["layers"]), "lm_head": dequantize(params["lm_head"])}, untied


def run_model(params, config, ops):
    """Logits [rows, V] of three steps on a paged cache (page size 4, shuffled pages): a 2 x 40-token prefill (80
    rows), a 2-row decode and a 1-row decode (padded to FP8_XLA_MIN_ROWS for XLA's dot). The logits of each step's
    last tokens, concatenated."""
    tokens = np.array(random_prompts(config.vocab_size, [40, 40], seed=3))
    table = jnp.asarray(np.random.default_rng(0).permutation(24).reshape(2, 12), jnp.int32)
    cache = KVCache.create(config, 24, 4, jnp.float32)
    logits = []
    for step, rows in enumerate([tokens, tokens[:, :1], tokens[:1, 1:2]]):
        b, t = rows.shape
        batch = Batch(page_table=table[:b], seq_lens=jnp.full(b, 40 + step if step else 40), q_lens=jnp.full(b, t))
        hidden, cache = forward(params, jnp.asarray(rows), cache, batch, config=config, ops=ops)
        logits.append(np.asarray(lm_logits(params, hidden[:, -1])))
    return np.concatenate(logits)


MODELS = ["llama", "llama3", "qwen3", "gpt2"]  # untied, tied with biases, q/k norms, LayerNorm + GELU


@pytest.mark.parametrize("name", [*MODELS, "qwen3_moe", "qwen2_moe"])  # and FP8 experts, a scale per expert and column
def test_fp8_model_is_the_dequantized_model(hf_model_dir, name):
    """The FP8 forward (reference ops: dequantize-then-dot, scales after the dot) equals the f32 forward on the
    dequantized weights up to f32 rounding, and stays near the unquantized model. E4M3 rounds each weight by up to
    6.25%, 2.3% RMS on these weights; the LM head alone then moves the logits by 2.4-2.6%, and the tiny models (random
    weights of std 0.2) measured 3.4% (gpt2), 3.9% (llama), 4.4% (qwen3), 6.1% (llama3) and 3.6% (qwen3_moe) in all."""
    config, params = load_tiny(hf_model_dir, name)
    fp8 = quantize_params(params, config)
    out = run_model(fp8, config, Ops())
    np.testing.assert_allclose(out, run_model(*dequantized(fp8, config), Ops()), rtol=1e-4, atol=1e-4)
    full = run_model(params, config, Ops())
    assert np.linalg.norm(out - full) <= 0.08 * np.linalg.norm(full)


@pytest.mark.parametrize("name", MODELS)
def test_fp8_kernels_match_reference(hf_model_dir, name):
    """The FP8 model through the Pallas kernels (interpret mode) equals the reference path."""
    config, params = load_tiny(hf_model_dir, name)
    fp8 = quantize_params(params, config)
    np.testing.assert_allclose(run_model(fp8, config, Ops(pallas=True, interpret=True)), run_model(fp8, config, Ops()),
                               rtol=1e-4, atol=1e-4)


def test_fp8_projection_rows(monkeypatch):
    """An FP8 projection takes the fused kernel for one row of a weight up to PALLAS_FP8_MAX_WEIGHT elements and XLA's
    dot otherwise (more rows, a larger weight, or no kernels), with or without a norm; fewer rows than
    FP8_XLA_MIN_ROWS are padded for XLA's dot, which changes no value."""
    import nanojax.ops as ops_module

    rng = np.random.default_rng(0)
    w, x, residual = (jnp.asarray(rng.normal(size=shape), jnp.float32) for shape in ((32, 48), (3, 32), (3, 48)))
    p = quantize_weight(w)
    for max_weight, pallas, rows in itertools.product((32 * 48, 32 * 48 - 1), (True, False), (1, 2, 3)):
        monkeypatch.setattr(ops_module, "PALLAS_FP8_MAX_WEIGHT", max_weight)
        ops = Ops(pallas=pallas, interpret=pallas)
        kernel = pallas and rows == 1 and max_weight == w.size
        for kw in ({}, {"norm_eps": 1e-6}, {"residual": residual[:rows]}):
            jaxpr = str(jax.make_jaxpr(lambda x: ops.project(x, Projection(p), **kw))(x[:rows]))
            assert ("pallas_call" in jaxpr) == kernel, (rows, kw, max_weight, pallas)
            out = ops.project(x[:rows], Projection(p), **kw)
            ref = rmsnorm_matmul_reference(x[:rows], p["w_t"], w_scale=p["scale"], **kw)
            assert out.shape == ref.shape
            np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(out, rmsnorm_matmul_reference(x[:rows], dequantize(p), **kw), rtol=1e-5,
                                       atol=1e-5)


def test_llm_quantizes_at_load_and_rejects_unknown_formats(hf_model_dir):
    """LLM(quantization="fp8") serves FP8 projections (the LM head stays in the model dtype); its greedy tokens
    equal those of the same engine on the dequantized weights."""
    from nanojax import LLM, SamplingParams
    from nanojax.loader import load_model

    folder, _ = hf_model_dir("qwen3")
    llm = LLM(str(folder), dtype="float32", page_size=4, max_model_len=64, quantization="fp8")
    layer = llm.runner.params["layers"][0]
    assert layer["qkv"]["w_t"].dtype == jnp.float8_e4m3fn and layer["qkv"]["scale"].dtype == jnp.float32
    assert "lm_head" not in llm.runner.params or not isinstance(llm.runner.params["lm_head"], dict)
    loaded = load_model(str(folder), "float32")
    quantized = llm.runner.params
    dequantized = {**loaded.params, "layers": dequantized_layers(quantized["layers"])}
    reference = LLM(dataclasses.replace(loaded, params=jax.tree.map(np.asarray, dequantized)), dtype="float32",
                    page_size=4, max_model_len=64)
    prompts = random_prompts(97, [5, 17], seed=3)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert ([o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
            == [o.token_ids for o in reference.generate(prompts, greedy, use_tqdm=False)])
    with pytest.raises(ValueError, match="quantization must be None or 'fp8'"):
        LLM(str(folder), dtype="float32", max_model_len=64, quantization="int4")


def test_fp8_checkpoint_round_trip_and_refusals(hf_model_dir, tmp_path):
    """`python -m convert SRC DST --quantize fp8` writes FP8 projections and records the format; loading gives the
    params LLM(quantization="fp8") makes, and a checkpoint in a format this nanojax does not know is refused."""
    import json

    from convert import convert, load_checkpoint
    from convert.__main__ import main as convert_cli
    from convert.keys import CheckpointError

    folder, _ = hf_model_dir("llama3")
    dst = tmp_path / "fp8"
    assert convert_cli([str(folder), str(dst), "--dtype", "float32", "--quantize", "fp8"]) == 0
    config, params, manifest = load_checkpoint(dst)
    assert manifest["quantization"] == "fp8" and manifest["fp8_format"] == 2
    direct = quantize_params(params_from_source(open_source(str(folder)), "float32")[1], config, lm_head=False)
    for got, want in zip(params["layers"], direct["layers"]):
        for name in PROJECTIONS:
            assert got[name]["w_t"].dtype == jnp.float8_e4m3fn
            np.testing.assert_array_equal(np.asarray(got[name]["w_t"], np.float32),
                                          np.asarray(want[name]["w_t"], np.float32))
            np.testing.assert_array_equal(got[name]["scale"], np.asarray(want[name]["scale"]))
    del manifest["fp8_format"]  # written before the [N, K] layout: refused, not misread
    (dst / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="FP8 weights in layout 1"):
        load_checkpoint(dst)
    manifest["quantization"] = "int3"
    (dst / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="'int3' weights"):
        load_checkpoint(dst)
    with pytest.raises(CheckpointError, match="quantization 'int4'"):
        convert(str(folder), tmp_path / "x", quantization="int4")
