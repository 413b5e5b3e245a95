"""On the GPU: the model with the Pallas kernels gives HF's greedy tokens (float32, random weights of the real
Qwen3-0.6B and Llama-3.2-1B architectures, a small Qwen3-MoE and a small Qwen2-MoE), as does the reference path. Run
with `pytest -m gpu`."""
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import requires_gpu

sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
from random_model import loaded_model, random_hf_model  # noqa: E402

from nanojax import LLM, SamplingParams  # noqa: E402
from nanojax.runner import CUBLAS_GEMMS, CUBLAS_MIN_ROWS, Program, decode_tiling  # noqa: E402


@requires_gpu
@pytest.mark.parametrize("name", ["qwen3-0.6b", "llama-3.2-1b", "tiny-qwen3-moe", "tiny-qwen2-moe"])
def test_kernels_and_reference_give_hf_greedy_tokens(name):
    import torch

    hf = random_hf_model(name, "float32")
    prompts = np.random.default_rng(0).integers(0, min(10000, hf.config.vocab_size), (3, 45)).tolist()
    prompts[1] = prompts[1][:17]  # lengths 45, 17, 45: not multiples of the page size
    with torch.no_grad():
        expected = [hf.generate(torch.tensor([p], device=hf.device), max_new_tokens=12, min_new_tokens=12,
                                do_sample=False)[0, len(p):].tolist() for p in prompts]
        log_probs = torch.log_softmax(hf(torch.tensor([prompts[0]], device=hf.device)).logits[0].double(), -1)
    log_probs = log_probs.cpu().numpy()
    loaded = loaded_model(hf, "float32")
    del hf
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for kernels in ("pallas", "reference"):
        # chunked prefill: cached-prefix attention too; only the programs that run are compiled
        llm = LLM(loaded, dtype="float32", kernels=kernels, max_model_len=128, max_num_seqs=4, decode_steps=4,
                  chunk_size=16, max_num_batched_tokens=32, warmup=False)
        assert [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == expected, kernels
        # Alone, a sequence decodes with one row: the M = 1 path of the fused projections.
        assert llm.generate(prompts[1], greedy, use_tqdm=False)[0].token_ids == expected[1], kernels
        # Prompt logprobs (runner.prompt_step, after the chunks' prefills): HF's log-softmax, and its top token.
        out = llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=3),
                           use_tqdm=False)[0]
        for pos in range(1, len(prompts[0])):
            logprob, top = out.prompt_logprobs[pos]
            np.testing.assert_allclose(logprob, log_probs[pos - 1, prompts[0][pos]], atol=1e-3, err_msg=kernels)
            assert max(top, key=top.get) == log_probs[pos - 1].argmax(), (kernels, pos)
        del llm


@requires_gpu
@pytest.mark.parametrize("name", ["qwen3-0.6b", "llama-3.2-1b"])
def test_cascade_gives_hf_greedy_tokens(name):
    """Nine requests over a pinned 300-token system prompt and two pinned documents (two nested levels), decoded
    through the cascade kernel: HF's greedy tokens, float32."""
    import torch

    from nanojax.cascade import CascadeRules

    hf = random_hf_model(name, "float32")
    rng = np.random.default_rng(1)
    system, doc_a, doc_b = (rng.integers(0, 10000, n).tolist() for n in (300, 83, 140))
    prompts = [system + (doc_a if i < 5 else doc_b) + rng.integers(0, 10000, 1 + i).tolist() for i in range(9)]
    with torch.no_grad():
        expected = [hf.generate(torch.tensor([p], device=hf.device), max_new_tokens=12, min_new_tokens=12,
                                do_sample=False)[0, len(p):].tolist() for p in prompts]
    loaded = loaded_model(hf, "float32")
    del hf
    rules = CascadeRules(min_shared_tokens=32, min_piece_tokens=64, min_saved_tokens=1, min_batch=8)
    llm = LLM(loaded, dtype="float32", kernels="pallas", max_model_len=640, max_num_seqs=16, decode_steps=4,
              cascade=rules, warmup=False)  # compiles only what runs: every program would take minutes in float32
    for prefix in (system + doc_a, system + doc_b):
        llm.pin_prefix(prefix)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == expected
    assert llm.runner.cascade_dispatches > 0


@requires_gpu
@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("name", ["qwen3-0.6b", "llama-3.2-1b"])
def test_tensor_parallel_gives_hf_greedy_tokens(name, size):
    """The model split over `size` GPUs (nanojax.sharding, NCCL all-reduces inside the compiled steps), the Pallas
    kernels per shard: HF's greedy tokens, float32, through chunked prefill and a prefix-cache hit."""
    import jax
    import torch

    if jax.device_count() < size:
        pytest.skip(f"needs {size} GPUs, has {jax.device_count()}")
    hf = random_hf_model(name, "float32")
    rng = np.random.default_rng(2)
    shared = rng.integers(0, 10000, 40).tolist()
    prompts = [shared + rng.integers(0, 10000, n).tolist() for n in (5, 23)] + [rng.integers(0, 10000, 17).tolist()]
    with torch.no_grad():
        expected = [hf.generate(torch.tensor([p], device=hf.device), max_new_tokens=12, min_new_tokens=12,
                                do_sample=False)[0, len(p):].tolist() for p in prompts]
    loaded = loaded_model(hf, "float32")
    del hf
    llm = LLM(loaded, dtype="float32", kernels="pallas", max_model_len=128, max_num_seqs=4, decode_steps=4,
              chunk_size=16, max_num_batched_tokens=32, tensor_parallel_size=size, warmup=False)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert llm.generate(prompts[0], greedy, use_tqdm=False)[0].token_ids == expected[0]
    outs = llm.generate(prompts, greedy, use_tqdm=False)  # the first two read the cached shared pages
    assert [o.token_ids for o in outs] == expected
    assert outs[1].num_cached_tokens >= 32


@requires_gpu
@pytest.mark.parametrize("name", ["qwen3-0.6b", "llama-3.2-1b"])
def test_fp8_gives_the_dequantized_models_greedy_tokens(name):
    """LLM(quantization="fp8") on the GPU (FP8 projections through the fused kernel at one row where the weight is
    small enough, every one of Qwen3-0.6B's and Llama-3.2-1B's QKV and o; XLA's dequantize-dot elsewhere) gives the
    greedy tokens of the same engine on the dequantized weights, float32, at one row and at three."""
    import dataclasses

    import jax
    from test_quantize import dequantized_layers

    loaded = loaded_model(random_hf_model(name, "float32"), "float32")
    kw = dict(dtype="float32", kernels="pallas", max_model_len=128, max_num_seqs=4, decode_steps=4, warmup=False)
    llm = LLM(loaded, quantization="fp8", **kw)
    layers = dequantized_layers(llm.runner.params["layers"])
    params = jax.tree.map(np.asarray, {**llm.runner.params, "layers": layers})
    reference = LLM(dataclasses.replace(loaded, params=params), **kw)
    prompts = np.random.default_rng(3).integers(0, 10000, (3, 29)).tolist()
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for batch in (prompts[:1], prompts):
        assert ([o.token_ids for o in llm.generate(batch, greedy, use_tqdm=False)]
                == [o.token_ids for o in reference.generate(batch, greedy, use_tqdm=False)])


@requires_gpu
def test_programs_from_compile_workers_give_hf_greedy_tokens(tmp_path, monkeypatch, caplog):
    """LLM(hf_folder, warmup=True) on the GPU with an empty executable cache: compile workers (nanojax.compile_workers)
    spawned before the weights load are handed their programs once the config is read, none fails, the engine uses
    every program they stored, and it gives HF's greedy tokens, float32."""
    import logging

    import torch

    from nanojax import compilation, compile_workers
    from nanojax.runner import ModelRunner

    monkeypatch.setenv("NANOJAX_CACHE", str(tmp_path / "cache"))  # an empty executable cache
    spawned, spawn = [], compile_workers.spawn
    monkeypatch.setattr(compile_workers, "spawn", lambda: spawned.append(spawn()) or spawned[-1])
    handed_out, hand_out = [], compilation.hand_out
    monkeypatch.setattr(compilation, "hand_out", lambda r, w: handed_out.append(r.params) or hand_out(r, w))
    lowered_here, lower = [], ModelRunner.lower
    monkeypatch.setattr(ModelRunner, "lower", lambda self, p: lowered_here.append(p) or lower(self, p))
    hf = random_hf_model("qwen3-0.6b", "float32")
    prompts = np.random.default_rng(4).integers(0, 10000, (3, 37)).tolist()
    with torch.no_grad():
        expected = [hf.generate(torch.tensor([p], device=hf.device), max_new_tokens=10, min_new_tokens=10,
                                do_sample=False)[0, len(p):].tolist() for p in prompts]
    hf.save_pretrained(tmp_path / "model")
    del hf
    with caplog.at_level(logging.WARNING, logger="nanojax.compile_workers"):
        llm = LLM(str(tmp_path / "model"), dtype="float32", kernels="pallas", max_model_len=128, max_num_seqs=4,
                  decode_steps=4, max_num_batched_tokens=128, warmup=True, progress=False)
    assert not caplog.records and llm.runner.compiles == len(llm.runner.programs()) and llm.runner.loaded == 0
    assert len(handed_out) == 1  # from the params' shapes, before the weights were read
    assert not lowered_here  # every program was the workers'
    assert len(spawned) == compile_workers.WORKERS and all(w.process.returncode == 0 for w in spawned)
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == expected


@requires_gpu
@pytest.mark.parametrize("rows", [37, CUBLAS_MIN_ROWS + 3])
def test_decodes_and_prefills_on_their_gemm_options_give_hf_greedy_tokens(rows):
    """A decode batch of 37 rows (its GEMMs on decode_tiling's one Triton tiling) and one past CUBLAS_MIN_ROWS
    (cuBLAS calls; nanojax.runner), and their prefills (37 x 11 and 131 x 11 tokens: cuBLAS calls), give HF's greedy
    tokens, float32; rows are independent, so three of them are checked against HF one by one."""
    import torch

    hf = random_hf_model("qwen3-0.6b", "float32")
    prompts = np.random.default_rng(5).integers(0, 10000, (rows, 11)).tolist()
    checked = [0, rows // 2, rows - 1]
    with torch.no_grad():
        expected = [hf.generate(torch.tensor([prompts[i]], device=hf.device), max_new_tokens=6, min_new_tokens=6,
                                do_sample=False)[0, 11:].tolist() for i in checked]
    loaded = loaded_model(hf, "float32")
    del hf
    llm = LLM(loaded, dtype="float32", kernels="pallas", max_model_len=64, max_num_seqs=rows, decode_steps=4,
              warmup=False)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    batch = Program(rows, 4)  # max_num_seqs is the largest decode bucket
    assert batch in llm.runner._compiled
    assert llm.runner.compiler_options(batch) == (CUBLAS_GEMMS if rows >= CUBLAS_MIN_ROWS else decode_tiling(rows))
    assert [outs[i].token_ids for i in checked] == expected


@requires_gpu
def test_close_gives_the_device_memory_back_and_a_new_llm_the_same_pool():
    """Build, close, build again, then del: the second LLM sizes the same KV pool as the first, and the device's
    bytes in use come back to where they were before each (within 1%)."""
    import gc

    import jax

    loaded = loaded_model(random_hf_model("qwen3-0.6b", "bfloat16", device="cpu"), "bfloat16")
    in_use = lambda: jax.local_devices()[0].memory_stats()["bytes_in_use"]  # noqa: E731
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    gc.collect()
    base, pools = in_use(), []
    for ending in ("close", "del"):
        llm = LLM(loaded, max_model_len=512, warmup=False)
        pools.append(llm.page_manager.num_pages)
        llm.generate([[1, 2, 3]], greedy, use_tqdm=False)
        if ending == "close":
            llm.close()
        del llm
        gc.collect()
        assert abs(in_use() - base) <= 0.01 * base + (64 << 20), (ending, in_use(), base)
    assert pools[0] == pools[1] and pools[0] > 1000


@requires_gpu
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_decoding_gives_hf_greedy_tokens_with_the_kernels(method, tmp_path):
    """The verifying forwards (k + 1 query tokens per row through the Pallas kernels) in float32: HF's tokens, with
    proposals found (prompts that repeat a span) and accepted; draft_model: the model as its own draft, so that every
    proposal is right."""
    import torch

    hf = random_hf_model("qwen3-0.6b", "float32")
    rng = np.random.default_rng(1)
    spans = [rng.integers(0, 10000, n).tolist() for n in (7, 20, 33)]
    prompts = [spans[0] * 4, spans[1] + spans[2] + spans[1], spans[2] * 2 + spans[0][:3]]
    with torch.no_grad():
        expected = [hf.generate(torch.tensor([p], device=hf.device), max_new_tokens=24, min_new_tokens=24,
                                do_sample=False)[0, len(p):].tolist() for p in prompts]
    loaded = loaded_model(hf, "float32")
    spec = {"method": method, "num_speculative_tokens": 4}
    if method == "draft_model":
        hf.save_pretrained(tmp_path)
        spec["model"] = str(tmp_path)
    del hf
    with LLM(loaded, dtype="float32", kernels="pallas", max_model_len=256, max_num_seqs=4, decode_steps=8,
             num_pages=128, warmup=False, speculative_config=spec) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
        assert [o.token_ids for o in outs] == expected
        forwards, verifying, tokens = llm.speculation_stats()
        if method == "draft_model":  # 5 then 3 tokens a dispatch of 8
            assert tokens >= 3.5 * verifying, (forwards, verifying, tokens)
        assert verifying > 0 and tokens > verifying
