"""Speculative decoding: the n-gram proposer against a plain Python lookup, and the engine's tokens with speculation on
(n-grams or a draft model) against speculation off and HF."""
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY, build_hf_model, hf_greedy, random_prompts
from test_page_manager import check_invariants

from nanojax import LLM, SamplingParams
from nanojax.cascade import CascadeRules
from nanojax.config import SpeculativeConfig
from nanojax.speculative import ngram_proposals


def lookup(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    """The reference: for n from hi down to lo, among the earlier occurrences of the last n tokens that some token
    follows, the one most tokens follow (up to k), the latest of those; up to k of the tokens after it."""
    last = len(tokens) - 1
    for n in range(min(hi, len(tokens)), lo - 1, -1):
        suffix = tokens[-n:]
        ends = [end for end in range(last - 1, n - 2, -1) if tokens[end - n + 1:end + 1] == suffix]
        if ends:
            end = max(ends, key=lambda e: (min(last - e, k), e))
            return tokens[end + 1:end + 1 + k]
    return []


@pytest.mark.parametrize("lo,hi,k", [(1, 4, 4), (2, 3, 2), (1, 1, 5), (3, 5, 3)])
def test_ngram_proposals_match_the_reference(lo, hi, k):
    rng = np.random.default_rng(lo * 100 + hi * 10 + k)
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=k, prompt_lookup_min=lo, prompt_lookup_max=hi)
    rows = [rng.integers(0, vocab, n).tolist() for vocab, n in
            [(3, 1), (3, 2), (4, 17), (2, 40), (50, 30), (5, 64), (7, 3), (3, 63)]]
    rows.append([5, 6, 7, 8, 5, 6])  # the suffix [5, 6] occurs at the start
    rows.append([9] * 7)  # a run: the latest occurrence has one follower, an earlier one k
    width = 64
    hist = np.full((len(rows), width), -1, np.int32)
    for b, row in enumerate(rows):
        hist[b, :len(row)] = row
    base = np.array([len(row) - 1 for row in rows], np.int32)
    proposals, counts = ngram_proposals(jnp.asarray(hist), jnp.asarray(base), spec)
    for b, row in enumerate(rows):
        want = lookup(row, k, lo, hi)
        assert int(counts[b]) == len(want), (row, want)
        assert np.asarray(proposals[b, :len(want)]).tolist() == want, (row, want)


@pytest.mark.parametrize("bad,field", [
    (dict(method="eagle"), "method"),
    (dict(num_speculative_tokens=0), "num_speculative_tokens"),
    (dict(num_speculative_tokens=65), "num_speculative_tokens"),
    (dict(prompt_lookup_min=0), "prompt_lookup_min"),
    (dict(prompt_lookup_min=3, prompt_lookup_max=2), "prompt_lookup_max"),
    (dict(num_speculative_tokens="4"), "num_speculative_tokens"),
    (dict(method="draft_model"), "model"),
    (dict(model="Qwen/Qwen3-0.6B"), "model"),
])
def test_bad_speculative_configs_name_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig(**{"method": "ngram", **bad})


SPEC = dict(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def repeating_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a span (what n-gram lookup finds), of lengths that are not multiples of the page size."""
    rng = np.random.default_rng(seed)
    spans = [rng.integers(0, vocab, n).tolist() for n in (5, 9, 3)]
    return [spans[0] * 3, spans[1] + rng.integers(0, vocab, 7).tolist() + spans[1], spans[2] * 5 + spans[0],
            rng.integers(0, vocab, 11).tolist()]


@pytest.mark.parametrize("arch", [a for a in TINY if a not in ("mixtral", "qwen2_moe")])  # one MoE model of three
def test_greedy_with_speculation_equals_hf(arch, hf_model_dir):
    folder, model = hf_model_dir(arch)
    prompts = repeating_prompts(TINY[arch]["vocab_size"])
    expected = [hf_greedy(model, p, GREEDY.max_tokens) for p in prompts]
    with LLM(str(folder), dtype="float32", page_size=4, max_model_len=96, speculative_config=SPEC) as llm:
        assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
        forwards, verifying, tokens = llm.speculation_stats()
        assert verifying > 0 and tokens > verifying  # proposals were checked, and some were accepted
        assert llm.page_manager.num_free_pages == llm.page_manager.num_pages


@pytest.fixture(scope="module")
def qwen3(hf_model_dir):
    folder, model = hf_model_dir("qwen3")
    shared = repeating_prompts(97, seed=3)[0] * 2  # a shared "system prompt" over several pages
    prompts = repeating_prompts(97, seed=1) + [shared + p for p in repeating_prompts(97, seed=2)[:2]]
    return str(folder), prompts, [hf_greedy(model, p, GREEDY.max_tokens) for p in prompts]


@pytest.fixture(scope="module")
def drafts(hf_model_dir, tmp_path_factory):
    """Draft models of the tiny qwen3's vocabulary: "self" (the model itself: its proposals are all right) and
    "other" (one small layer of other weights: mostly wrong)."""
    other = tmp_path_factory.mktemp("draft")
    build_hf_model({**TINY["qwen3"], "num_hidden_layers": 1, "hidden_size": 32, "head_dim": 16}, seed=3
                   ).save_pretrained(other)
    return {"self": str(hf_model_dir("qwen3")[0]), "other": str(other)}


def draft_spec(model: str, k: int = 3) -> dict:
    return {"method": "draft_model", "model": model, "num_speculative_tokens": k}


@pytest.mark.parametrize("draft,engine_args", [
    ("self", {}),
    ("other", dict(chunk_size=5, max_num_batched_tokens=12, max_num_seqs=4)),
    ("other", dict(num_pages=22, max_num_seqs=4)),
    ("self", dict(max_num_seqs=1)),
], ids=["self", "other-chunked", "other-preempt", "self-serial"])
def test_greedy_with_a_draft_model_equals_hf(qwen3, drafts, draft, engine_args):
    """The draft is fed from its first stale slot (a new prompt, pages recomputed after preemption, a rejected
    proposal) and its proposals checked: the model's own tokens whatever it proposes; all accepted when it is the
    model itself."""
    folder, prompts, expected = qwen3
    with LLM(folder, dtype="float32", page_size=4, max_model_len=96, speculative_config=draft_spec(drafts[draft]),
             **engine_args) as llm:
        assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
        forwards, verifying, tokens = llm.speculation_stats()
        if draft == "self":  # k + 1 = 4 tokens a verifying forward, less where a dispatch's 8 steps run out
            assert tokens >= 3.5 * verifying > 0, (forwards, verifying, tokens)
        if "num_pages" in engine_args:
            assert llm.scheduler.num_preemptions > 0
        check_invariants(llm.page_manager)
        assert llm.page_manager.num_free_pages == llm.page_manager.num_pages


def test_a_draft_model_of_another_vocabulary_is_refused(qwen3, hf_model_dir):
    folder = qwen3[0]
    other_vocab = str(hf_model_dir("llama")[0])  # 101 tokens against 97
    with pytest.raises(ValueError, match="vocabulary of 101 tokens and the model one of 97"):
        LLM(folder, dtype="float32", max_model_len=96, speculative_config=draft_spec(other_vocab))


def test_speculation_beside_cascade_compiles_nothing_after_the_start(hf_model_dir):
    """With speculation on, the start compiles every program: a batch of 3 that speculates and one of 20 over a pinned
    shared prefix, above the speculating buckets, that runs the cascade decode, compile nothing more; HF's tokens."""
    folder, model = hf_model_dir("llama")
    rules = CascadeRules(min_shared_tokens=8, min_piece_tokens=4, min_saved_tokens=1, min_batch=32, num_items=8)
    with LLM(str(folder), dtype="float32", page_size=4, max_model_len=64, max_num_seqs=32, decode_steps=4,
             cascade=rules, speculative_config=SPEC, warmup=True, progress=False) as llm:
        compiled, vocab = llm.runner.compiles, llm.config.vocab_size
        shared = random_prompts(vocab, [18], seed=5)[0]
        questions = random_prompts(vocab, [1, 2, 3, 4, 5] * 4, seed=6)
        prompts = repeating_prompts(vocab)[:3] + [shared + q for q in questions]
        greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        outs = llm.generate(prompts[:3], greedy, use_tqdm=False)
        llm.pin_prefix(shared)
        outs += llm.generate(prompts[3:], greedy, use_tqdm=False)
        assert llm.runner.compiles == compiled
        assert llm.speculation_stats()[1] > 0 and llm.runner.cascade_dispatches > 0
    assert [o.token_ids for o in outs] == [hf_greedy(model, p, 8) for p in prompts]


@pytest.mark.parametrize("engine_args", [
    dict(decode_steps=1),
    dict(chunk_size=5, max_num_batched_tokens=12, max_num_seqs=4),  # chunked prefill mixed with decodes
    dict(num_pages=22, max_num_seqs=4),  # a tiny pool: preemption by recompute
    dict(max_num_seqs=1),  # one at a time: later prompts hit the shared prefix's cached pages
], ids=["k1", "chunked", "preempt", "serial"])
def test_greedy_with_speculation_under_every_engine_path(qwen3, engine_args):
    folder, prompts, expected = qwen3
    with LLM(folder, dtype="float32", page_size=4, max_model_len=96, speculative_config=SPEC, **engine_args) as llm:
        assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
        if "num_pages" in engine_args:
            assert llm.scheduler.num_preemptions > 0
        check_invariants(llm.page_manager)
        assert llm.page_manager.num_free_pages == llm.page_manager.num_pages


def test_sampled_tokens_and_logprobs_are_those_of_speculation_off(qwen3, drafts):
    """Each position draws as the plain decode draws it (same noise, adjustments and counts): seeded sampling with
    filters, penalties, bias, min_tokens, logprobs and n > 1 gives the same tokens, with n-grams or a draft model."""
    folder, prompts, _ = qwen3
    params = [SamplingParams(temperature=0.8, max_tokens=30, seed=7, logprobs=3, ignore_eos=True),
              SamplingParams(temperature=1.0, top_k=5, top_p=0.9, max_tokens=20, seed=1, n=2),
              SamplingParams(temperature=0.7, repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2,
                             min_tokens=6, logit_bias={3: 2.0, 4: -5.0}, max_tokens=25, seed=2, logprobs=2),
              SamplingParams(temperature=0, max_tokens=18, frequency_penalty=0.5, ignore_eos=True),
              SamplingParams(temperature=0.5, min_p=0.1, max_tokens=22, seed=3)]
    outs = []
    for spec in (None, SPEC, draft_spec(drafts["self"])):
        with LLM(folder, dtype="float32", page_size=4, max_model_len=96, speculative_config=spec) as llm:
            outs.append(llm.generate(prompts[:len(params)], params, use_tqdm=False))
            if spec:
                assert llm.speculation_stats()[1] > 0
    assert len(outs[0]) == len(params) + 1  # n = 2 gives two
    for on in outs[1:]:
        for off, out in zip(outs[0], on):
            assert out.token_ids == off.token_ids
            np.testing.assert_allclose(np.nan_to_num([lp for lp, _ in out.logprobs or []], neginf=-1e9),
                                       np.nan_to_num([lp for lp, _ in off.logprobs or []], neginf=-1e9), rtol=1e-4,
                                       atol=1e-4)


@pytest.mark.long
def test_sampled_distribution_is_the_models(hf_model_dir):
    """The third token's frequencies over many seeds against its exact distribution from HF's probabilities (summed
    over the first two tokens), where the n-gram proposals are often right: a chi-square test."""
    import torch

    folder, model = hf_model_dir("qwen3")
    rng = np.random.default_rng(0)
    body = rng.integers(0, 97, 12).tolist()
    prompt = body + hf_greedy(model, body, 40)  # a random model's greedy tokens repeat: proposals often right
    temperature, samples = 0.15, 1500

    def probs(seqs):
        with torch.no_grad():
            logits = model(torch.tensor(seqs)).logits[:, -1].double()
        return torch.softmax(logits / temperature, -1).numpy()

    p0 = probs([prompt])[0]
    firsts = [t for t in np.argsort(-p0) if p0[t] > 1e-6]
    p1 = probs([prompt + [t] for t in firsts])
    pairs = [(a, b, p0[a] * p1[i, b]) for i, a in enumerate(firsts) for b in range(97) if p0[a] * p1[i, b] > 1e-7]
    p2 = probs([prompt + [a, b] for a, b, _ in pairs])
    exact = sum(w * p2[i] for i, (_, _, w) in enumerate(pairs))
    params = [SamplingParams(temperature=temperature, max_tokens=3, seed=s, ignore_eos=True) for s in range(samples)]
    with LLM(folder, dtype="float32", page_size=4, max_model_len=96, max_num_seqs=16, speculative_config=SPEC,
             decode_steps=4) as llm:
        # in waves of the batch, so that the second and third tokens come from decode-only steps, which speculate
        outs = [o for i in range(0, samples, 16) for o in llm.generate([prompt] * len(params[i:i + 16]),
                                                                        params[i:i + 16], use_tqdm=False)]
        forwards, verifying, tokens = llm.speculation_stats()
    assert tokens - verifying > 20  # third tokens came from a verifying position
    counts = np.bincount([o.token_ids[2] for o in outs], minlength=97)
    expected = exact * samples * (1 - 1e-5)
    big = expected >= 5  # bins with fewer expected samples pooled into one
    observed = np.append(counts[big], counts[~big].sum())
    wanted = np.append(expected[big], samples - expected[big].sum())
    chi2 = float(np.sum((observed - wanted) ** 2 / np.maximum(wanted, 1e-9)))
    df = len(observed) - 1
    critical = df * (1 - 2 / (9 * df) + 3.72 * np.sqrt(2 / (9 * df))) ** 3  # Wilson-Hilferty, p = 1e-4
    assert chi2 < critical, (chi2, critical, observed, wanted)


def test_server_and_cli_take_the_speculative_config():
    from nanojax.generate import parse_args as generate_args
    from nanojax.serve import engine_options, parse_args as serve_args

    text = '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3}'
    want = SpeculativeConfig(num_speculative_tokens=5, prompt_lookup_max=3)
    assert engine_options(serve_args(["--speculative-config", text])).speculative_config == want
    assert generate_args(["--speculative-config", text, "--prompt", "hi"]).speculative_config == want
    with pytest.raises(SystemExit):
        serve_args(["--speculative-config", '{"method": "ngram", "k": 2}'])
    draft = '{"method": "draft_model", "model": "Qwen/Qwen3-0.6B", "num_speculative_tokens": 2}'
    assert generate_args(["--speculative-config", draft, "--prompt", "hi"]).speculative_config == SpeculativeConfig(
        method="draft_model", model="Qwen/Qwen3-0.6B", num_speculative_tokens=2)
