"""Cascade attention in the engine: requests over a shared system prompt and shared documents (two nested levels)
decode through the cascade path and give HF's float32 greedy tokens, the same as with cascade off."""
import pytest
from conftest import hf_greedy, random_prompts

from nanojax import LLM, SamplingParams
from nanojax.cascade import CascadeRules

# Thresholds small enough for a tiny model's prompts (page size 4): 2 pages make a segment, any saving pays.
RULES = CascadeRules(min_shared_tokens=8, min_piece_tokens=4, min_saved_tokens=1, min_batch=1, num_items=8)


def shared_prompts(vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    """-> (prefixes to pin, prompts): a system prompt of 18 tokens, two documents of 9 and 11 after it (no length a
    multiple of the page size), three questions on document A, two on B, one on the system prompt alone, one
    unrelated prompt."""
    system, doc_a, doc_b, *questions = random_prompts(vocab, [18, 9, 11, 1, 3, 5, 2, 4, 3, 6], seed=5)
    prompts = ([system + doc_a + q for q in questions[:3]] + [system + doc_b + q for q in questions[3:5]]
               + [system + questions[5], questions[6] * 4])
    return [system + doc_a, system + doc_b], prompts


@pytest.mark.parametrize("name,kernels", [("qwen3", "reference"), ("llama", "reference"), ("llama", "interpret"),
                                          ("qwen3_moe", "reference")])
def test_nested_shared_prefixes_match_hf(hf_model_dir, name, kernels):
    folder, model = hf_model_dir(name)
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outputs, plans = {}, []
    for cascade in (RULES, False):
        llm = LLM(str(folder), dtype="float32", page_size=4, max_model_len=64, decode_steps=4, kernels=kernels,
                  cascade=cascade)
        prefixes, prompts = shared_prompts(llm.config.vocab_size)
        for prefix in prefixes:
            llm.pin_prefix(prefix)
        if cascade:
            plan = llm.runner._plan
            llm.runner._plan = lambda *args: plans.append(plan(*args)) or plans[-1]
        outputs[bool(cascade)] = [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        if cascade:
            assert llm.runner.cascade_dispatches > 0 and llm.runner.cascade_saved_tokens > 0
        else:
            assert llm.runner.cascade_dispatches == 0 and not llm.runner.cascade_rows
    levels = {seg.level for p in plans if p.use_cascade for seg in p.segments}
    assert levels == {0, 1}, "the system prompt and the documents both read as shared segments"
    assert outputs[True] == outputs[False]
    for prompt, tokens in zip(prompts, outputs[True]):
        assert tokens == hf_greedy(model, prompt, 10)


def test_cascade_programs_compiled_at_start(hf_model_dir):
    """The cascade decodes are programs of their own, for the multi-step decode of batches >= min_batch, and
    compile_all compiles them: a shared-prefix batch then compiles nothing."""
    folder, _ = hf_model_dir("llama")
    rules = CascadeRules(min_shared_tokens=8, min_piece_tokens=4, min_saved_tokens=1, min_batch=4, num_items=8)
    llm = LLM(str(folder), dtype="float32", page_size=4, max_model_len=64, max_num_seqs=8, decode_steps=4,
              cascade=rules, warmup=True, progress=False)
    assert llm.runner.cascade_rows == (4, 8)
    compiled = llm.runner.compiles
    prefixes, prompts = shared_prompts(llm.config.vocab_size)
    llm.pin_prefix(prefixes[0])
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert llm.runner.cascade_dispatches > 0
    assert llm.runner.compiles == compiled


def test_rejects_bad_cascade_value(hf_model_dir):
    folder, _ = hf_model_dir("llama")
    with pytest.raises(ValueError, match="cascade must be"):
        LLM(str(folder), dtype="float32", cascade="yes")
