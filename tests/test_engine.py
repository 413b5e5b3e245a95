"""The engine: greedy outputs are identical across batching, prefix-cache hits, chunked prefill, preemption and
multi-step decode, and equal to HF, for a dense model and a mixture of experts; bad requests get clear errors; steady
state does not recompile."""
import numpy as np
import pytest
from conftest import hf_greedy, random_prompts
from test_page_manager import check_invariants

from nanojax import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def model_case(hf_model_dir, name: str):
    """-> (folder, prompts, HF's greedy tokens for each): five prompts, then two over a shared 26-token prefix."""
    folder, model = hf_model_dir(name)
    vocab = model.config.vocab_size
    prompts = random_prompts(vocab, [3, 21, 9, 40, 16], seed=5)
    shared = random_prompts(vocab, [26], seed=6)[0]  # a shared "system prompt" over several pages
    prompts += [shared + p for p in random_prompts(vocab, [4, 11], seed=7)]
    expected = [hf_greedy(model, p, GREEDY.max_tokens) for p in prompts]
    return str(folder), prompts, expected


@pytest.fixture(scope="module")
def qwen3(hf_model_dir):
    return model_case(hf_model_dir, "qwen3")


@pytest.mark.parametrize("engine_args", [
    dict(),  # whole prompts, 8 decode steps per dispatch
    dict(decode_steps=1),
    dict(chunk_size=5, max_num_batched_tokens=12, max_num_seqs=4),  # chunked prefill mixed with decodes
    dict(num_pages=18, max_num_seqs=4),  # a tiny pool: preemption by recompute
    dict(max_num_seqs=1),  # one at a time
], ids=["default", "k1", "chunked", "preempt", "serial"])
def test_greedy_equal_to_hf_under_every_engine_path(qwen3, engine_args):
    folder, prompts, expected = qwen3
    llm = LLM(folder, dtype="float32", page_size=4, max_model_len=96, **engine_args)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == expected
    if "num_pages" in engine_args:
        assert llm.scheduler.num_preemptions > 0
    check_invariants(llm.page_manager)
    assert llm.page_manager.num_free_pages == llm.page_manager.num_pages


@pytest.mark.parametrize("engine_args", [
    dict(chunk_size=5, max_num_batched_tokens=12, max_num_seqs=4),
    dict(num_pages=18, max_num_seqs=4),
], ids=["chunked", "preempt"])
def test_moe_greedy_equal_to_hf_under_chunked_prefill_preemption_and_prefix_hits(hf_model_dir, engine_args):
    """A mixture of experts (Qwen3-MoE, top 2 of 8) through the same paths: prefill chunks mixed with decodes (the
    experts grouped for a chunk, gathered for up to E / k decode rows), preemption by recompute, then the prompts
    again over their cached pages."""
    folder, prompts, expected = model_case(hf_model_dir, "qwen3_moe")
    llm = LLM(folder, dtype="float32", page_size=4, max_model_len=96, **engine_args)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
    if "num_pages" in engine_args:
        assert llm.scheduler.num_preemptions > 0
    again = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in again] == expected
    assert sum(o.num_cached_tokens for o in again) > 0
    check_invariants(llm.page_manager)


def test_mixed_and_row_limited_steps_are_one_dispatch_each(qwen3, monkeypatch):
    """A step with prompt chunks and decodes runs them in one forward (the prefill program with decode rows); a
    decode-only step where rows have different room (max_model_len, free pages) runs once with each row's own
    steps, never a one-step program: HF's tokens either way."""
    folder, prompts, expected = qwen3
    llm = LLM(folder, dtype="float32", page_size=4, max_model_len=96, chunk_size=5, max_num_batched_tokens=12,
              max_num_seqs=4, num_pages=20)
    calls = {"mixed": 0, "row_limited": 0}
    prefill, decode = llm.runner.prefill, llm.runner.decode

    def counting_prefill(chunks, decodes=None, sources=None):
        calls["mixed"] += decodes is not None
        return prefill(chunks, decodes, sources)

    def counting_decode(last_tokens, page_tables, seq_lens, sampling, num_steps, row_steps, sources, masks):
        calls["row_limited"] += len(set(row_steps)) > 1
        return decode(last_tokens, page_tables, seq_lens, sampling, num_steps, row_steps, sources, masks)

    monkeypatch.setattr(llm.runner, "prefill", counting_prefill)
    monkeypatch.setattr(llm.runner, "decode", counting_decode)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == expected
    assert calls["mixed"] > 0 and calls["row_limited"] > 0
    assert all(p in ("prompt", "set_slot") or p.num_steps in (0, llm.decode_steps) for p in llm.runner._compiled)


def test_prefix_cache_hits_give_the_same_tokens(qwen3):
    folder, prompts, expected = qwen3
    llm = LLM(folder, dtype="float32", page_size=4, max_model_len=96)
    first = llm.generate(prompts, GREEDY, use_tqdm=False)
    again = llm.generate(prompts, GREEDY, use_tqdm=False)  # every prompt's full pages are cached now
    assert [o.token_ids for o in again] == [o.token_ids for o in first] == expected
    assert [o.num_cached_tokens for o in again] == [(len(p) - 1) // 4 * 4 for p in prompts]


def test_shared_prefix_is_computed_once(qwen3):
    folder, prompts, expected = qwen3
    llm = LLM(folder, dtype="float32", page_size=4, max_model_len=96)
    first = llm.generate([prompts[-2]], GREEDY, use_tqdm=False)[0]
    second = llm.generate([prompts[-1]], GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 24  # the shared 26-token prefix: 6 full pages of 4
    assert [first.token_ids, second.token_ids] == expected[-2:]


def test_no_compiles_after_warmup_for_any_request_mix(qwen3):
    """After warmup() no mix of sampling parameters, prompt lengths up to max_model_len or batch sizes up to
    max_num_seqs compiles anything."""
    folder, prompts, _ = qwen3
    llm = LLM(folder, dtype="float32", page_size=4, max_model_len=96, max_num_seqs=8, max_num_batched_tokens=64)
    llm.warmup(progress=False)
    compiled = llm.runner.compiles
    # decode 1..8 rows x 8 steps and x 1 step, the cascade decode at 8 rows, prefill 1 row alone and with 8 decode rows
    # (a mixed step), prompt logprobs, the token tables and their masks for 1..8 rows
    assert compiled == len(llm.runner.programs()) == 4 + 4 + 1 + 2 + 1 + 1 + 4
    mix = [GREEDY, SamplingParams(temperature=0.7, top_p=0.9, max_tokens=9, seed=1),
           SamplingParams(temperature=1.0, top_k=5, max_tokens=5), SamplingParams(temperature=0.5, min_p=0.1),
           SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.3, max_tokens=12),
           SamplingParams(temperature=0.9, repetition_penalty=1.3, logit_bias={3: 2.0, 7: -5.0}, max_tokens=6),
           SamplingParams(temperature=0, min_tokens=4, max_tokens=8, logprobs=5),
           SamplingParams(temperature=0.8, n=3, max_tokens=4, logprobs=0),
           SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2)]
    long_prompts = random_prompts(97, [1, 2, 63, 64, 65, 90], seed=9)
    for batch in (1, 3, 8, len(prompts) + len(long_prompts)):
        chosen = (prompts + long_prompts)[:batch]
        llm.generate(chosen, [mix[i % len(mix)] for i in range(batch)], use_tqdm=False)
    assert llm.runner.compiles == compiled


def test_bad_requests_are_rejected_clearly(qwen3):
    folder, prompts, _ = qwen3
    llm = LLM(folder, dtype="float32", page_size=4, max_model_len=32)
    with pytest.raises(ValueError, match="max_model_len=32"):
        llm.generate([list(range(40))], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 97\)"):
        llm.generate([[5, 97]], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate(["a string prompt"], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    for field, value in [("temperature", float("inf")), ("temperature", 1e308), ("top_k", 1 << 40),
                         ("repetition_penalty", 1e-300), ("presence_penalty", float("nan")), ("max_tokens", "4"),
                         ("seed", 1 << 32), ("n", True), ("logprobs", 21)]:
        with pytest.raises(ValueError, match=f"^{field} must be"):
            SamplingParams(**{field: value})
    with pytest.raises(ValueError, match="logit_bias values"):
        SamplingParams(logit_bias={3: float("-inf")})
    with pytest.raises(ValueError, match="top_k must be <= vocab_size=97"):
        llm.generate([prompts[0]], SamplingParams(top_k=98), use_tqdm=False)
    small_pool = LLM(folder, dtype="float32", page_size=4, max_model_len=96, num_pages=6)
    with pytest.raises(ValueError, match="KV pages"):
        small_pool.generate([prompts[0]], SamplingParams(max_tokens=40), use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len=100000"):
        LLM(folder, max_model_len=100000)


def test_stop_tokens_max_tokens_and_finish_reasons(qwen3):
    folder, prompts, expected = qwen3
    llm = LLM(folder, dtype="float32", page_size=4, max_model_len=96)
    stop_at = expected[1][5]
    out = llm.generate([prompts[1]], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_at]),
                       use_tqdm=False)[0]
    cut = expected[1].index(stop_at) + 1
    assert out.token_ids == expected[1][:cut] and out.finish_reason == "stop"
    out = llm.generate([prompts[1]], SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.token_ids == expected[1][:7] and out.finish_reason == "length"
    banned_early = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_at], min_tokens=cut + 1)
    out = llm.generate([prompts[1]], banned_early, use_tqdm=False)[0]
    assert stop_at not in out.token_ids[:cut + 1]


def test_steps_are_dispatched_before_the_previous_step_is_read_back(qwen3, monkeypatch):
    """Decode rows take their last token from the step still in flight (on the device: a row's source is set only
    while its token is a placeholder, before that step is read back): HF's tokens, with requests that stop early
    (their row of the next step wasted), end at max_tokens inside a dispatch, or run to max_model_len."""
    folder, prompts, expected = qwen3
    llm = LLM(folder, dtype="float32", page_size=4, max_model_len=64, decode_steps=4)
    decode, chained = llm.runner.decode, []

    def recording_decode(last_tokens, page_tables, seq_lens, sampling, num_steps, row_steps, sources, masks):
        chained.append(sum(s >= 0 for s in sources))
        return decode(last_tokens, page_tables, seq_lens, sampling, num_steps, row_steps, sources, masks)

    monkeypatch.setattr(llm.runner, "decode", recording_decode)
    stop_at = expected[1][5]
    params = [GREEDY, SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_at]),
              SamplingParams(temperature=0, max_tokens=7, ignore_eos=True), GREEDY,
              SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)]
    outs = llm.generate(prompts[:5], params, use_tqdm=False)
    cut = expected[1].index(stop_at) + 1
    assert outs[1].token_ids == expected[1][:cut] and outs[1].finish_reason == "stop"
    assert outs[2].token_ids == expected[2][:7] and outs[2].finish_reason == "length"
    assert [outs[i].token_ids for i in (0, 3)] == [expected[0], expected[3]]
    assert len(prompts[4]) + len(outs[4].token_ids) == 64 and outs[4].token_ids[:24] == expected[4]
    assert sum(chained) > 0
    check_invariants(llm.page_manager)
    assert llm.page_manager.num_free_pages == llm.page_manager.num_pages


def test_a_row_fed_from_the_previous_dispatch_equals_its_token_sent_from_the_host(qwen3):
    """runner: a row whose source is r >= 0 feeds row r of the previous dispatch's last tokens (a prefill's last
    rows, a decode's rows at their own row_steps, a mixed step's decode rows) as if the host had sent that token:
    the same logits (logprobs of the top tokens), as the same tokens on this random model say little."""
    from nanojax.runner import greedy_sampling

    folder, prompts, _ = qwen3
    llms = [LLM(folder, dtype="float32", page_size=4, max_model_len=96, warmup=False) for _ in range(2)]
    chained, host = (llm.runner for llm in llms)  # (an LLM collected frees its runner's arrays)
    tables = [list(range(12)), list(range(12, 24)), list(range(24, 36))]
    # sampled with seeds: the tokens fed differ from row to row and step to step (greedy ones on this model repeat)
    one = {**{name: values[0] for name, values in greedy_sampling(1, host.tables.neutral).items()}, "logprobs": 5,
           "temperature": 1.0}
    two = {**greedy_sampling(2, host.tables.neutral), "logprobs": [5, 5], "temperature": [1.0, 1.0], "seeds": [5, 6]}
    lens = [len(prompts[0]) + 1, len(prompts[1]) + 1]

    def prefill(runner):
        return runner.prefill([(prompts[0], tables[0], len(prompts[0]), {**one, "seeds": 3}),
                               (prompts[1], tables[1], len(prompts[1]), {**one, "seeds": 4})])

    def same(a, b):
        return all(np.array_equal(x, y) for x, y in zip(a.logprobs(), b.logprobs()))

    rows = [row for _, row in prefill(chained)]
    firsts = [pending.tokens()[0, row] for pending, row in prefill(host)]
    a = chained.decode([0, 0], tables[:2], lens, two, 3, [3, 2], sources=rows)
    b = host.decode(firsts, tables[:2], lens, two, 3, [3, 2])
    assert firsts[0] != firsts[1] and same(a, b)
    # then a mixed step, its decode rows in the other order: row 0 feeds the previous dispatch's row 1
    decoded = b.tokens()
    lens, lasts = [lens[1] + 2, lens[0] + 3], [decoded[1, 1], decoded[2, 0]]
    mixed = (prompts[2], tables[2], len(prompts[2]), one)
    (a, _), *_ = chained.prefill([mixed], decodes=([0, 0], tables[1::-1], lens, two), sources=[1, 0])
    (b, _), *_ = host.prefill([mixed], decodes=(lasts, tables[1::-1], lens, two))
    assert lasts[0] != lasts[1] and decoded[2, 1] != lasts[0] and same(a, b)  # (row 1's step 3: past its steps)


class _Unfit(SamplingParams):
    """Parameters that pass their checks but whose step row does not fit the device's dtypes: a bug the engine's
    second line of defence must keep to its own request."""

    def device_values(self) -> dict:
        return {**super().device_values(), "top_k": 1 << 40}


def test_a_row_that_cannot_be_prepared_fails_only_its_request(qwen3):
    folder, prompts, expected = qwen3
    llm = LLM(folder, dtype="float32", page_size=4, max_model_len=96, decode_steps=2)
    victims = [llm.add_request(p, GREEDY) for p in prompts[:3]]
    bad = llm.add_request(prompts[3], _Unfit(temperature=0, max_tokens=24, ignore_eos=True))
    with pytest.raises(ValueError, match="top_k=1099511627776 does not fit"):
        list(bad)
    finals = [list(stream)[-1] for stream in victims]
    assert [o.token_ids for o in finals] == expected[:3] and {o.finish_reason for o in finals} == {"length"}
    assert llm.generate(prompts[3:4], GREEDY, use_tqdm=False)[0].token_ids == expected[3]
    check_invariants(llm.page_manager)
    assert llm.page_manager.num_free_pages == llm.page_manager.num_pages
