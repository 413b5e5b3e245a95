"""On-device sampling (nanojax.sampling.sample) against numpy references of the documented semantics, and the
engine's seeded / stop-string behaviour end to end.

The distribution tests draw thousands of tokens in one batched call (same logits, same seed, counters 0..N-1)
and compare the counts with the exact filtered, renormalised softmax by a chi-square test at p = 1e-6; each also
checks that the same counts reject the nearest wrong distribution (an off-by-one filter, a missing
renormalisation or adjustment), so a pass cannot be an accident of a loose bound.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import random_prompts
from scipy import stats

from nanojax import LLM, SamplingParams
from nanojax.loader import load_model
from nanojax.ops import Ops
from nanojax.runner import sampling_batch
from nanojax.sampling import BANNED, PROMPT, TokenTables, _adjust, sample

V = 8
N = 20000  # draws per distribution test
# Probabilities well away from every top-p / min-p boundary used below, shuffled so that the sorted order is not
# the id order (the filter must map ranks back to token ids).
PROBS = np.array([0.09, 0.30, 0.02, 0.16, 0.06, 0.22, 0.03, 0.12])
LOGITS = np.log(PROBS).astype(np.float32) + 1.5  # logits are only defined up to a constant


@jax.jit
def _sample(logits, batch, tables, step):
    return sample(logits, batch, tables, step, ops=Ops()).tokens


def batch_and_tables(b, bias=None, seen=None, banned=None, vocab_limit=V, allowed=None, **rows):
    """A SamplingBatch of b rows with the given per-row fields (a scalar is broadcast to every row), and token
    tables with one slot per row: bias {token: value}, seen {token: count in the output; 0 = prompt only} and
    banned [token ids] per row (a single dict or list is broadcast); the bias -inf from vocab_limit on, in every
    row (as ModelRunner writes it); allowed: the token ids every row's mask allows (None: all)."""
    fields = {k: np.broadcast_to(np.asarray(v), (b,)).tolist() for k, v in rows.items()}
    counts, flags, biases = (np.zeros((b + 1, V), dt) for dt in (np.int32, np.int8, np.float32))
    for name, per_row in (("bias", bias), ("seen", seen), ("banned", banned)):
        if per_row is None or isinstance(per_row, dict) or (per_row and isinstance(per_row[0], int)):
            per_row = [per_row] * b
        for i, entry in enumerate(per_row):
            for t in entry or ():
                if name == "bias":
                    biases[i, t] = entry[t]
                elif name == "seen":
                    counts[i, t] = entry[t]
                    flags[i, t] |= PROMPT if entry[t] == 0 else 0
                else:
                    flags[i, t] |= BANNED
    biases[:, vocab_limit:] = -np.inf
    bits = np.ones((b + 1, -(-V // 32) * 32), bool)
    if allowed is not None:
        bits[:b] = False
        bits[:b, list(allowed)] = True
    words = np.packbits(bits, axis=1, bitorder="little").view(np.int32)
    tables = TokenTables(jnp.asarray(counts), jnp.asarray(flags), jnp.asarray(biases), jnp.asarray(words))
    batch = sampling_batch({**fields, "slots": list(range(b))}, b, tables.neutral)
    return jax.tree.map(jnp.asarray, batch), tables


def draw(logits, step=0, vocab_limit=V, **rows) -> np.ndarray:
    """sample() on a batch built by batch_and_tables(**rows). logits: [V] (broadcast) or [B, V]."""
    logits = np.asarray(logits, np.float32)
    b = len(rows["counters"]) if "counters" in rows else (logits.shape[0] if logits.ndim == 2 else 1)
    batch, tables = batch_and_tables(b, vocab_limit=vocab_limit, **rows)
    logits = np.broadcast_to(logits, (b, logits.shape[-1]))
    return np.asarray(_sample(jnp.asarray(logits), batch, tables, step))


def draws(logits=LOGITS, seed=1234, step=0, vocab_limit=V, **params) -> np.ndarray:
    """N draws from one row's parameters: same seed, counters 0..N-1, as one batched call."""
    return draw(logits, step, vocab_limit, seeds=seed, counters=np.arange(N), **params)


def reference(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    """The documented semantics in numpy: softmax(logits / T); keep the top_k; of those, the smallest set of
    top tokens whose renormalised mass reaches top_p; of those, the tokens with p >= min_p * p_max; renormalise."""
    z = np.asarray(logits, np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = np.zeros(len(p), bool)
    ranked = order[:top_k] if top_k > 0 else order
    q = p[ranked] / p[ranked].sum()
    before = np.cumsum(q) - q
    ranked = ranked[(before < top_p) | (top_p >= 1)]  # 1 disables it (the cumsum may reach 1 early)
    keep[ranked[p[ranked] >= min_p * p.max()]] = True
    out = np.where(keep, p, 0.0)
    return out / out.sum()


def chi2(tokens: np.ndarray, expected: np.ndarray) -> float:
    """Pearson's statistic over the tokens of nonzero expected probability (zero ones are checked separately)."""
    counts = np.bincount(tokens, minlength=len(expected))
    support = expected > 0
    want = expected[support] * len(tokens)
    return float(((counts[support] - want) ** 2 / want).sum())


def assert_matches(tokens: np.ndarray, expected: np.ndarray, wrong: np.ndarray) -> None:
    support = expected > 0
    assert set(np.unique(tokens)) <= set(np.flatnonzero(support)), "a filtered-out token was drawn"
    bound = stats.chi2.isf(1e-6, max(1, support.sum() - 1))
    assert chi2(tokens, expected) < bound
    # Power: the same draws reject the nearest wrong answer by far: it gives the never-drawn tokens a mass that
    # N draws would surely have hit, or it gives a drawn token no mass, or its statistic is way off.
    never_hit = wrong[~support].sum() * len(tokens) > 50
    assert never_hit or (wrong[tokens] == 0).any() or chi2(tokens, wrong) > 3 * bound


# ---------------------------------------------------------------- (a) reproducibility


def test_same_seed_and_counter_give_the_same_token_in_any_batch():
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 1.5, (6, V)).astype(np.float32)
    rows = dict(temperature=[1.0, 0.7, 1.3, 1.0, 0.5, 1.0], top_k=[0, 3, 0, 0, 5, 2],
                top_p=[1.0, 1.0, 0.8, 1.0, 0.9, 1.0], min_p=[0.0, 0.0, 0.0, 0.1, 0.0, 0.0],
                seeds=[7, 7, 2**32 - 1, 0, 99, 12345], counters=[0, 5, 3, 1000, 0, 17])
    alone = [draw(logits[i], **{k: [v[i]] for k, v in rows.items()})[0] for i in range(6)]
    perm = [4, 1, 5, 0, 3, 2]
    batched = draw(logits[perm], **{k: np.asarray(v)[perm] for k, v in rows.items()})
    assert [alone[i] for i in perm] == batched.tolist()
    # A bigger batch with extra greedy and penalised rows (the `adjusted` mode) around the same rows.
    extra = np.concatenate([logits, rng.normal(0, 1.5, (3, V))]).astype(np.float32)
    big = {k: list(v) + [0.0 if k == "temperature" else (1 if k == "top_p" else 0)] * 3 for k, v in rows.items()}
    big["seen"] = [{}] * 6 + [{1: 1, 2: 2}, {3: 3}, {0: 0, 7: 1}]
    big["repetition_penalty"] = [1.0] * 6 + [1.5, 2.0, 1.2]
    assert draw(extra, **big)[:6].tolist() == alone
    # Step j of a multi-step dispatch draws what a single step at counter + j draws.
    multi = draw(logits, step=3, **rows)
    assert multi.tolist() == draw(logits, **{**rows, "counters": np.asarray(rows["counters"]) + 3}).tolist()
    # ... and the draws do depend on the seed and the counter.
    assert len(set(draws(seed=1, temperature=1.0)[:64].tolist())) > 3
    assert (draws(seed=1, temperature=1.0)[:256] != draws(seed=2, temperature=1.0)[:256]).mean() > 0.3


def test_unfiltered_row_draws_the_same_in_a_filtered_batch():
    plain = draws(temperature=1.0)[:512]
    # the same rows, in a batch where another row filters (the sorted path)
    mixed = draws(temperature=1.0, top_p=np.where(np.arange(N) == N - 1, 0.5, 1.0))[:512]
    assert plain.tolist() == mixed.tolist()
    assert draws(temperature=1.0, logprobs=3)[:512].tolist() == plain.tolist()  # logprobs take the sorted path too


# ---------------------------------------------------------------- (b) distributions


@pytest.mark.parametrize("params, wrong", [
    (dict(temperature=1.0), dict(temperature=0.8)),
    (dict(temperature=0.6), dict(temperature=1.0)),
    (dict(temperature=1.7), dict(temperature=1.3)),
    (dict(top_k=3), dict(top_k=4)),
    (dict(top_k=1, temperature=2.0), dict(top_k=2, temperature=2.0)),
    (dict(top_p=0.75), dict(top_p=0.85)),  # keeps .30 .22 .16 .12 (mass before the last: .68)
    (dict(top_p=0.5), dict(top_p=0.6)),
    (dict(min_p=0.25), dict(min_p=0.35)),  # p >= .075
    # top-p over the top-k renormalised (4 tokens; over the whole distribution it would keep 5)
    (dict(top_k=5, top_p=0.8, temperature=1.3), dict(top_p=0.8, temperature=1.3)),
    (dict(top_k=6, top_p=0.9, min_p=0.3, temperature=0.8), dict(top_k=6, top_p=0.9, min_p=0.2, temperature=0.8)),
], ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
def test_filtered_distribution_matches_numpy(params, wrong):
    params, wrong = dict(dict(temperature=1.0), **params), dict(dict(temperature=1.0), **wrong)
    expected, alternative = reference(LOGITS, **params), reference(LOGITS, **wrong)
    assert not np.allclose(expected, alternative)
    assert_matches(draws(**params), expected, alternative)
    if len(params) == 1:  # the sorted path (taken for logprobs) with filters off draws from the same distribution
        assert_matches(draws(**params, logprobs=1), expected, alternative)


def test_greedy_rows_and_temperature_zero():
    rng = np.random.default_rng(1)
    logits = rng.normal(0, 2, (32, V)).astype(np.float32)
    want = logits.argmax(-1)
    assert draw(logits).tolist() == want.tolist()
    # temperature-0 rows are greedy in a random, filtered batch too, whatever their seed and counter
    temperature = np.where(np.arange(32) % 2, 0.0, 1.0)
    got = draw(logits, temperature=temperature, top_p=0.9, seeds=np.arange(32), counters=np.arange(32))
    assert got[1::2].tolist() == want[1::2].tolist()


# ---------------------------------------------------------------- (c) logit bias and penalties


def adjust_reference(logits, bias, seen, repetition=1.0, presence=0.0, frequency=0.0) -> np.ndarray:
    """The documented formulas: logit_bias is added; then for every token seen in prompt or output, HF's
    repetition penalty (positive logits divided, negative multiplied) and OpenAI's penalties
    (- frequency * count - presence * [count > 0], count = occurrences in the output)."""
    out = np.asarray(logits, np.float64).copy()
    for t, b in bias.items():
        out[t] += b
    for t, count in seen.items():
        x = out[t] / repetition if out[t] > 0 else out[t] * repetition
        out[t] = x - frequency * count - presence * (count > 0)
    return out


ADJUST_ROWS = [  # (logit_bias, seen {token: count in the output; 0 = prompt only}, rep, presence, frequency)
    ({}, {}, 1.0, 0.0, 0.0),
    ({3: 5.0, 0: -100.0}, {}, 1.0, 0.0, 0.0),
    ({}, {1: 0, 5: 2, 3: 1}, 1.8, 0.0, 0.0),
    ({}, {1: 3, 6: 1, 2: 0}, 1.0, 0.7, 0.0),
    ({}, {1: 3, 6: 1, 2: 0}, 1.0, 0.0, 0.4),
    ({5: 1.0, 7: -2.0}, {5: 2, 7: 1, 0: 0, 4: 1}, 1.3, -0.5, 0.6),
]


def adjust_rows(rows_) -> dict:
    return dict(bias=[r[0] for r in rows_], seen=[r[1] for r in rows_], repetition_penalty=[r[2] for r in rows_],
                presence_penalty=[r[3] for r in rows_], frequency_penalty=[r[4] for r in rows_])


def test_logit_bias_and_penalties_match_numpy():
    rng = np.random.default_rng(2)
    logits = rng.normal(0, 2, (len(ADJUST_ROWS), V)).astype(np.float32)
    logits[:, 1], logits[:, 2] = 2.5, -1.5  # a seen token with a positive and one with a negative logit
    want = np.stack([adjust_reference(x, *r) for x, r in zip(logits, ADJUST_ROWS)])
    s, tables = batch_and_tables(len(ADJUST_ROWS), **adjust_rows(ADJUST_ROWS))
    got = np.asarray(_adjust(jnp.asarray(logits), s, tables, 0))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)
    assert not np.allclose(got[1:], logits[1:])  # every row but the first is really adjusted
    # Through sample(): greedy picks the adjusted argmax ...
    greedy = draw(logits, **adjust_rows(ADJUST_ROWS))
    assert greedy.tolist() == want.argmax(-1).tolist()
    assert (want.argmax(-1) != logits.argmax(-1)).sum() >= 3
    # ... and temperature sampling draws from softmax(adjusted / T).
    bias, seen, rep, pres, freq = ADJUST_ROWS[-1]
    tokens = draws(temperature=0.9, bias=bias, seen=seen, repetition_penalty=rep, presence_penalty=pres,
                   frequency_penalty=freq)
    expected = reference(adjust_reference(LOGITS, bias, seen, rep, pres, freq), temperature=0.9)
    assert_matches(tokens, expected, reference(adjust_reference(LOGITS, bias, seen, rep, 0.0, 0.0), 0.9))


# ---------------------------------------------------------------- (d) vocab_limit, (e) banned ids


@pytest.mark.parametrize("params", [
    dict(),
    dict(temperature=1.0),
    dict(temperature=1.0, top_k=7, top_p=0.99),
    dict(temperature=1.0, bias={6: 50.0, 7: 50.0}),
], ids=["greedy", "random", "filtered", "biased"])
def test_tokens_past_vocab_limit_are_never_drawn(params):
    logits = LOGITS.copy()
    logits[6:] = 20.0  # embedding padding with the largest logits
    tokens = draws(logits=logits, vocab_limit=6, **params)
    assert tokens.max() < 6
    if not params:
        assert set(tokens.tolist()) == {int(np.argmax(logits[:6]))}
    else:
        assert_matches(tokens, reference(np.where(np.arange(V) < 6, logits, -np.inf)),
                       reference(np.where(np.arange(V) < 5, logits, -np.inf)))


def test_ids_past_the_tokenizer_are_never_drawn_nor_ranked(hf_model_dir):
    """Through the engine, a tokenizer shorter than the embedding (85 of 97 rows): its length is data in the token
    tables, not a compiled constant, and no row draws or ranks the ids past it: greedy, random, biased towards them
    (a request's own bias row), nor the top logprobs of the output and of the prompt."""
    folder, _ = hf_model_dir("qwen3")
    loaded = dataclasses.replace(load_model(str(folder), "float32"), tokenizer=byte_tokenizer(85))
    llm = LLM(loaded, page_size=4, max_model_len=64, max_num_seqs=4)
    assert llm.runner.vocab_limit == 85
    padding = {t: 100.0 for t in range(85, 97)}
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=5, prompt_logprobs=5),
              SamplingParams(temperature=2.0, max_tokens=10, ignore_eos=True, seed=1),
              SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, seed=2, logit_bias=padding),
              SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logit_bias=padding, logprobs=5)]
    outs = llm.generate(random_prompts(85, [5, 9, 3, 6], seed=3), params, use_tqdm=False)
    assert all(len(o.token_ids) == 10 and max(o.token_ids) < 85 for o in outs)
    ranked = [t for o in (outs[0], outs[3]) for _, top in o.logprobs for t in top]
    ranked += [t for entry in outs[0].prompt_logprobs[1:] for t in entry[1]]
    assert len(ranked) == 5 * (10 + 10 + 4) and max(ranked) < 85


@pytest.mark.parametrize("mode", ["greedy", "random", "filtered"])
def test_banned_ids_are_not_drawn_while_ban_steps_last(mode):
    logits = LOGITS.copy()
    logits[2], logits[6] = 6.0, 6.5  # the banned ids are by far the likeliest
    rows = dict(temperature=0.0 if mode == "greedy" else 1.0, top_p=0.999 if mode == "filtered" else 1.0,
                banned=[[2, 6] if i % 2 else [6] for i in range(N)], ban_steps=3)
    for step in range(3):  # steps of a multi-step dispatch: the ban holds for ban_steps of them
        tokens = draws(logits=logits, step=step, **rows)
        assert 6 not in tokens.tolist() and 2 not in tokens[1::2].tolist()
        assert 2 in tokens[0::2].tolist()  # a row that bans only 6 still draws 2
        if mode != "greedy":
            assert_matches(tokens[1::2], reference(np.where(np.isin(np.arange(V), [2, 6]), -np.inf, logits)),
                           reference(np.where(np.arange(V) == 6, -np.inf, logits)))
    released = draws(logits=logits, step=3, **rows)
    assert 6 in released.tolist() and (mode == "greedy" or 2 in released.tolist())  # the ban is over


def test_a_constraint_mask_holds_for_mask_steps_before_the_filters():
    allowed = [0, 2, 3, 4, 6]  # not 1 and 5, the likeliest
    masked = np.where(np.isin(np.arange(V), allowed), LOGITS, -np.inf)
    rows = dict(allowed=allowed, mask_steps=2, top_p=0.6, temperature=1.0)
    for step in range(2):
        assert_matches(draws(step=step, **rows), reference(masked, top_p=0.6),  # masked, then filtered
                       reference(np.where(reference(LOGITS, top_p=0.6) > 0, masked, -np.inf)))
    assert 1 in draws(step=2, **rows).tolist()  # its steps are over
    batch, tables = batch_and_tables(1, allowed=allowed, mask_steps=1, temperature=0.0)
    out = jax.jit(lambda *a: sample(*a, ops=Ops()))(jnp.asarray(LOGITS[None]), batch, tables, 0)
    model = LOGITS - np.log(np.exp(LOGITS.astype(np.float64)).sum())
    assert int(out.tokens[0]) == 3 and float(out.logprobs[0]) == pytest.approx(model[3], abs=1e-5)  # the model's


# ---------------------------------------------------------------- end to end through LLM


@pytest.fixture(scope="module")
def qwen3_llm(hf_model_dir):
    folder, _ = hf_model_dir("qwen3")
    return LLM(str(folder), dtype="float32", page_size=4, max_model_len=96)


def test_seeded_request_is_the_same_alone_and_batched(qwen3_llm):
    prompts = random_prompts(97, [13, 7, 22, 30], seed=11)
    plain = SamplingParams(temperature=0.9, max_tokens=20, ignore_eos=True, seed=42)
    filtered = SamplingParams(temperature=1.2, top_p=0.9, top_k=20, max_tokens=20, ignore_eos=True, seed=7)
    neighbours = [SamplingParams(temperature=1.0, max_tokens=9, ignore_eos=True),  # unseeded, finishes early
                  SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True, seed=42),  # same seed, other prompt
                  # penalised and biased: its token tables are on the device, updated inside the multi-step loop
                  SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True, repetition_penalty=1.3,
                                 frequency_penalty=0.5, logit_bias={3: 2.0})]
    for params in (plain, filtered):
        alone = qwen3_llm.generate([prompts[0]], params, use_tqdm=False)[0]
        outs = qwen3_llm.generate(prompts, [params] + neighbours, use_tqdm=False)
        assert outs[0].token_ids == alone.token_ids
        assert outs[2].token_ids != alone.token_ids  # the same seed on another prompt is another stream
    # The filtered request in another row, beside the unfiltered seeded one (the converse: the test below).
    outs = qwen3_llm.generate([prompts[2], prompts[0]], [plain, filtered], use_tqdm=False)
    assert outs[1].token_ids == alone.token_ids


def test_unfiltered_seeded_request_is_the_same_beside_a_top_p_request(qwen3_llm):
    prompts = random_prompts(97, [13, 7], seed=11)
    seeded = SamplingParams(temperature=0.9, max_tokens=20, ignore_eos=True, seed=42)
    alone = qwen3_llm.generate([prompts[0]], seeded, use_tqdm=False)[0].token_ids
    top_p = SamplingParams(temperature=1.0, top_p=0.8, max_tokens=20, ignore_eos=True)
    assert qwen3_llm.generate(prompts, [seeded, top_p], use_tqdm=False)[0].token_ids == alone


def test_kernel_and_reference_samplers_agree_through_llm(hf_model_dir):
    """The sampling filters kernel (interpreted, with the model's other kernels) and the sorting reference, through
    LLM on the same weights: the same tokens, logprobs and top logprobs for a batch that mixes seeded top-p, top-k +
    min-p, greedy-with-logprobs and plain seeded rows."""
    folder, _ = hf_model_dir("qwen3")
    prompts = random_prompts(97, [13, 7, 22, 30], seed=12)
    params = [SamplingParams(temperature=1.1, top_p=0.8, max_tokens=12, ignore_eos=True, seed=1, logprobs=3),
              SamplingParams(temperature=0.8, top_k=5, min_p=0.05, max_tokens=12, ignore_eos=True, seed=2),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=20),
              SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=3)]
    outs = [LLM(str(folder), dtype="float32", page_size=4, max_model_len=96, kernels=kernels).generate(
        prompts, params, use_tqdm=False) for kernels in ("reference", "interpret")]
    for want, got in zip(*outs):
        assert got.token_ids == want.token_ids
        assert (got.logprobs is None) == (want.logprobs is None)
        assert len(got.logprobs or []) == len(want.logprobs or [])
        for (chosen, top), (chosen_want, top_want) in zip(got.logprobs or [], want.logprobs or []):
            assert list(top) == list(top_want)
            np.testing.assert_allclose([chosen, *top.values()], [chosen_want, *top_want.values()], atol=1e-4)


def byte_tokenizer(vocab_size: int = 97):
    """A tokenizer for the tiny random models, built in memory: byte-level pieces (single characters, a few
    multi-character words, and bare bytes of 2- and 3-byte UTF-8 characters, so the text of a prefix can end in
    an incomplete character) decoded by concatenation, like GPT-2's."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    byte_chars = dict(zip(chars, map(chr, chars)))
    byte_chars.update((b, chr(256 + i)) for i, b in enumerate(b for b in range(256) if b not in byte_chars))
    words = ["the", " the", "ab", "ba", "ing", "é", "€", " a", "st", "op", "top", ". ", "\n"]
    pieces = [bytes([b]) for b in b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,!?"]
    pieces += [b"\xc3", b"\xa9", b"\xe2", b"\x82", b"\xac"] + [w.encode() for w in words]
    pieces += [f"<{i}>".encode() for i in range(vocab_size - len(pieces))]
    vocab = {"".join(byte_chars[b] for b in p): i for i, p in enumerate(pieces)}
    assert len(vocab) == vocab_size
    tok = Tokenizer(models.WordLevel(vocab, unk_token=next(iter(vocab))))
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False)


@pytest.fixture(scope="module")
def qwen3_with_tokenizer(hf_model_dir):
    """The tiny qwen3 weights with byte_tokenizer: stop strings need text, and the tiny models have no tokenizer.
    (The embedded SmolLM2 would be the real thing, but it is a download plus minutes of CPU; the engine's stop
    string logic is tokenizer-agnostic, it only calls tokenizer.decode.)"""
    folder, _ = hf_model_dir("qwen3")
    return dataclasses.replace(load_model(str(folder), "float32"), tokenizer=byte_tokenizer())


@pytest.mark.parametrize("decode_steps", [1, 8])
def test_stop_strings_cut_the_text_and_finish_with_stop(qwen3_with_tokenizer, decode_steps):
    llm = LLM(qwen3_with_tokenizer, dtype="float32", page_size=4, max_model_len=96, decode_steps=decode_steps)
    tok = llm.tokenizer
    prompts = random_prompts(97, [9, 14], seed=21)
    free = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    full = llm.generate(prompts, free, use_tqdm=False)
    for prompt, out in zip(prompts, full):
        assert out.text == tok.decode(out.token_ids) and out.finish_reason == "length"
        # A 3-character stop string starting at the last character of the first 9 tokens' text (so it spans a
        # token boundary; moved on past any incomplete character), and a longer one starting at the same place
        # (it would complete later: the first one wins).
        start = len(tok.decode(out.token_ids[:9])) - 1
        stop = next(out.text[k:k + 3] for k in range(start, len(out.text)) if "\ufffd" not in out.text[k:k + 3])
        assert len(stop) == 3
        cut = out.text.find(stop)
        ends = [n for n in range(1, 31) if stop in tok.decode(out.token_ids[:n])][0]  # the completing token
        params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=(out.text[cut:cut + 40], stop))
        got = llm.generate([prompt], params, use_tqdm=False)[0]
        assert got.finish_reason == "stop"
        assert got.text == out.text[:cut]
        assert got.token_ids == out.token_ids[:ends]  # nothing past the token that completed the stop string
        # a stop string the text never contains changes nothing
        never = llm.generate([prompt], dataclasses.replace(free, stop="zzzzzzz"), use_tqdm=False)[0]
        assert (never.text, never.token_ids, never.finish_reason) == (out.text, out.token_ids, "length")
