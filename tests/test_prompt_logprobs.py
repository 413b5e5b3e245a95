"""SamplingParams(prompt_logprobs=N): every prompt token's logprob and the top N at the position before it, equal to
HF's log-softmax of its float32 logits, through chunked prefill, packed rows, cached prefixes and n > 1."""
import numpy as np
import pytest
import torch
from conftest import random_prompts

from nanojax import LLM, SamplingParams


def hf_log_probs(model, prompt: list[int]) -> np.ndarray:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([prompt])).logits[0].double(), -1).numpy()


def check(out, prompt, ref, n):
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        logprob, top = out.prompt_logprobs[pos]
        np.testing.assert_allclose(logprob, ref[pos - 1, prompt[pos]], atol=2e-4)
        assert len(top) == n
        want = np.argsort(-ref[pos - 1])[:n]
        np.testing.assert_allclose(sorted(top.values(), reverse=True), ref[pos - 1, want], atol=2e-4)


@pytest.mark.parametrize("name,kernels", [("llama", "reference"), ("qwen3", "reference"), ("llama", "interpret")])
def test_prompt_logprobs_match_hf(hf_model_dir, name, kernels):
    folder, model = hf_model_dir(name)
    # A 16-token budget: a 70-token prompt in five chunks, the longer ones packed over two 64-token rows.
    llm = LLM(str(folder), dtype="float32", page_size=8, max_model_len=128, decode_steps=4, kernels=kernels,
              max_num_batched_tokens=80, chunk_size=16)
    prompts = random_prompts(llm.config.vocab_size, [70, 9, 1], seed=3)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=5)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        check(out, prompt, hf_log_probs(model, prompt), 5)
    # The prompt's pages are cached now: a second request computes them again for its logprobs, and its choices
    # (n = 2) share them; a request without prompt_logprobs hits the cache and has none.
    again = llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, n=2,
                                                      prompt_logprobs=2), use_tqdm=False)
    assert [o.num_cached_tokens for o in again] == [0, 64]
    for out in again:
        check(out, prompts[0], hf_log_probs(model, prompts[0]), 2)
    plain = llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert plain[0].prompt_logprobs is None and plain[0].num_cached_tokens == 64
    assert [o.token_ids for o in again] == [outs[0].token_ids] * 2 == [plain[0].token_ids] * 2


def test_prompt_logprobs_validated():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
