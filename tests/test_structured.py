"""Structured outputs: constrained greedy tokens equal HF's greedy decode under the same llguidance masks, alone, in a
batch beside unconstrained rows (where tokens drawn after the masked one are kept as far as the grammar allows them)
and with speculation; sampled tokens equal alone and in a batch; outputs of the default model follow their schemas."""
import json

import jsonschema
import llguidance
import llguidance.hf
import numpy as np
import pytest
import torch
from conftest import TINY, build_hf_model, requires_gpu
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from nanojax import LLM, SamplingParams
from nanojax import output as output_module
from nanojax.default_model import default_checkpoint
from nanojax.loader import load_hf_tokenizer
from nanojax.structured import Grammars, MaskFeed, StructuredOutputs

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
          "required": ["name", "age"], "additionalProperties": False}
CONSTRAINTS = [StructuredOutputs(json=PERSON), StructuredOutputs(regex=r"(yes|no), [0-9]{1,3}"),
               StructuredOutputs(choice=["red", "green", "blue"]),
               StructuredOutputs(grammar='start: "x=" NUM ("," NUM)*\nNUM: /[0-9]{1,2}/')]


@pytest.fixture(scope="module")
def tokenizer():
    return load_hf_tokenizer(default_checkpoint())


@pytest.fixture(scope="module")
def tiny(tokenizer, tmp_path_factory):
    """(folder, HF model): a tiny random Llama over the default model's tokenizer and vocabulary."""
    hf = build_hf_model({**TINY["llama"], "vocab_size": len(tokenizer)})
    folder = tmp_path_factory.mktemp("tiny_structured")
    hf.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, hf


def masked_greedy(hf, tokenizer, prompt: list[int], constraint: StructuredOutputs, max_tokens: int) -> list[int]:
    """The oracle: HF's greedy tokens, each drawn among those the grammar allows next."""
    ll = llguidance.hf.from_tokenizer(tokenizer)
    matcher, ids, out = llguidance.LLMatcher(ll, constraint.grammar_text), list(prompt), []
    with torch.no_grad():
        while len(out) < max_tokens and not matcher.is_stopped():
            logits = hf(torch.tensor([ids])).logits[0, -1].numpy()
            words = llguidance.numpy.allocate_token_bitmask(1, ll.vocab_size)
            llguidance.numpy.fill_next_token_bitmask(matcher, words)
            allowed = np.unpackbits(words.view(np.uint8), bitorder="little")[:logits.shape[0]].astype(bool)
            token = int(np.argmax(np.where(allowed, logits, -np.inf)))
            assert matcher.consume_token(token)
            ids.append(token)
            out.append(token)
    return out


def test_bad_constraints_are_refused_naming_the_field():
    for kw, message in [({}, "exactly one"), ({"json": {"type": "nope"}}, "json is not valid"),
                        ({"regex": "[a-"}, "regex is not valid"), ({"choice": []}, "choice must be"),
                        ({"json": "{x"}, "json is not JSON"), ({"grammar": "start: nothing"}, "grammar is not valid"),
                        ({"regex": "a", "choice": ["a"]}, "exactly one")]:
        with pytest.raises(ValueError, match=message):
            StructuredOutputs(**kw)
    with pytest.raises(ValueError, match="unknown keys"):
        SamplingParams(structured_outputs={"schema": {}})


def test_a_grammars_live_requests_are_dealt_over_its_compiled_copies(tokenizer):
    """A grammar is compiled up to `roots` times (copies of one compiled matcher fill their masks one at a time) for
    requests that run at once, each new one given the copy fewest use: every copy gives the same masks; requests one
    after another share one; the cache keeps MAX_CACHED compiled ones."""
    grammars = Grammars(tokenizer, roots=2)
    constraint = StructuredOutputs(json=PERSON)
    for _ in range(3):  # one after another
        grammars.release(grammars.matcher(constraint))
    assert len(grammars._compiled[constraint.grammar_text]) == 1
    matchers = [grammars.matcher(constraint) for _ in range(5)]
    assert [live for _, live in grammars._compiled[constraint.grammar_text]] == [3, 2]
    grammars.release(matchers[0]), grammars.release(matchers[0]), grammars.release(matchers[2])  # (twice: once)
    assert [live for _, live in grammars._compiled[constraint.grammar_text]] == [1, 2]
    matchers[0] = grammars.matcher(constraint)
    assert [live for _, live in grammars._compiled[constraint.grammar_text]] == [2, 2]
    for token in tokenizer.encode('{"name": "Ann", "age": 41}', add_special_tokens=False):
        masks = grammars.masks(matchers)
        assert (masks == masks[0]).all()
        assert all(m.consume_token(token) for m in matchers)
    assert all(m.is_accepting() for m in matchers)
    grammars.MAX_CACHED = 3
    for c in CONSTRAINTS[1:]:
        grammars.matcher(c)
    assert sum(map(len, grammars._compiled.values())) == 3 and constraint.grammar_text not in grammars._compiled


def test_greedy_constrained_tokens_equal_hf_under_the_same_masks(tiny, tokenizer):
    folder, hf = tiny
    prompt = tokenizer.encode("Answer:")
    refs = [masked_greedy(hf, tokenizer, prompt, c, 40) for c in CONSTRAINTS]
    greedy = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=c) for c in CONSTRAINTS]
    free = [SamplingParams(temperature=0, max_tokens=40), SamplingParams(temperature=0, max_tokens=40,
                                                                         presence_penalty=1.0)]
    with LLM(str(folder), dtype="float32", page_size=4, max_model_len=128) as llm:
        free_alone = [o.token_ids for o in llm.generate([prompt] * 2, free, use_tqdm=False)]
        alone = [llm.generate([prompt], p, use_tqdm=False)[0] for p in greedy]
        # beside unconstrained rows: multi-step dispatches, the constrained rows' later draws checked by the grammar
        mixed = llm.generate([prompt] * 6, greedy + free, use_tqdm=False)
    assert [o.token_ids for o in alone] == refs
    assert [o.token_ids for o in mixed[:4]] == refs and [o.token_ids for o in mixed[4:]] == free_alone
    assert alone[2].text in ("red", "green", "blue") and alone[2].finish_reason == "stop"


def test_a_stop_string_ends_a_constrained_row_alone(tiny, tokenizer):
    """Alone, a constrained row's texts and events follow the next dispatch: a stop string still ends it where it
    occurs, its streamed deltas add up to its text, the engine goes on, and the ended requests' matchers go back."""
    folder, hf = tiny
    prompt = tokenizer.encode("Answer:")
    regex = StructuredOutputs(regex=r"(yes|no), [0-9]{1,3}")
    want = tokenizer.decode(masked_greedy(hf, tokenizer, prompt, regex, 40)).split(",")[0]
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=regex, stop=[","])
    with LLM(str(folder), dtype="float32", page_size=4, max_model_len=128) as llm:
        events = list(llm.stream([prompt], params))
        again = llm.generate([prompt], params, use_tqdm=False)[0]
        grammars = llm.core.output.grammars  # both requests gave their matchers back: one compiled copy served them
        assert not grammars._live and [live for _, live in grammars._compiled[regex.grammar_text]] == [0]
    assert (events[-1].text, events[-1].finish_reason) == (want, "stop")
    assert "".join(e.delta for e in events) == want and again.text == want


def test_constrained_rows_alone_running_ahead_keep_their_tokens(tiny, tokenizer, monkeypatch):
    """Alone, a row whose model has kept to its grammar takes the multi-step dispatch, its later draws kept while the
    grammar allows them: greedy, HF's tokens under the same masks; seeded sampling, the one-step path's tokens."""
    folder, hf = tiny
    prompt = tokenizer.encode("Answer:")
    refs = [masked_greedy(hf, tokenizer, prompt, c, 40) for c in CONSTRAINTS]
    greedy = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=c) for c in CONSTRAINTS]
    sampled = SamplingParams(temperature=1.0, seed=5, max_tokens=30, structured_outputs=StructuredOutputs(json=PERSON))
    with LLM(str(folder), dtype="float32", page_size=4, max_model_len=128) as llm:
        one_step = llm.generate([prompt], sampled, use_tqdm=False)[0]
        dispatches = []
        decode = llm.runner.decode
        monkeypatch.setattr(llm.runner, "decode", lambda *a, **k: dispatches.append(a[4]) or decode(*a, **k))
        monkeypatch.setattr(output_module, "RUN_AHEAD_AFTER", 0)
        ahead = [llm.generate([prompt], p, use_tqdm=False)[0] for p in greedy]
        ahead_sampled = llm.generate([prompt], sampled, use_tqdm=False)[0]
    assert [o.token_ids for o in ahead] == refs
    assert ahead_sampled.token_ids == one_step.token_ids
    assert max(dispatches) == llm.runner.decode_steps  # (a random model seldom keeps a run: no fewer dispatches)


def test_mask_feed_takes_each_token_and_gives_the_next_mask(tokenizer):
    """MaskFeed (a hosted decode's host side): each step's token taken and the next step's mask given, but after the
    dispatch's last step; a grammar that completes, refuses a token or fails, recorded in `stops`, zeros after."""
    grammars, text = Grammars(tokenizer), "yes, certainly"
    grammars.prepare()
    feed, ids, choice = MaskFeed(grammars, 3 + -(-len(tokenizer) // 32)), tokenizer.encode(text), [text, "no"]
    allowed = lambda mask, token: bool(mask[0, token // 32] >> (token % 32) & 1)
    feed.start(grammars.matcher(StructuredOutputs(choice=choice)), len(ids))
    masks = [feed(np.array([t]), np.int32(i)) for i, t in enumerate(ids)]
    assert len(ids) > 2 and all(allowed(m, t) for m, t in zip(masks, ids[1:])) and not masks[-1].any()
    assert feed.stops == {0: (len(ids), None)}
    feed.start(grammars.matcher(StructuredOutputs(choice=choice)), 1)  # the row's one step of the program's three
    assert not any(feed(np.array([t]), np.int32(i)).any() for i, t in enumerate([ids[0], 13, 13])) and not feed.stops
    assert feed.matcher.validate_tokens(ids[1:]) == len(ids) - 1  # (it took the row's token alone)
    feed.start(grammars.matcher(StructuredOutputs(choice=choice)), 4)
    assert not feed(np.array([tokenizer.encode(" maybe")[0]]), np.int32(0)).any()
    assert feed.stops[0][0] == 0 and "rejects token" in feed.stops[0][1]
    feed.start(None, 4)  # a grammar that raises: recorded, not raised (it would fail the program)
    assert not feed(np.array([ids[0]]), np.int32(0)).any() and "AttributeError" in feed.stops[0][1]


@pytest.mark.parametrize("hosted", [False, True])
def test_run_ahead_follows_the_models_agreement(tiny, tokenizer, hosted):
    """A request's agreement: masked draws its model would have made unmasked, counted from the masked program (one
    step a dispatch, or the hosted decode's steps); the default model, answering in JSON, runs ahead after
    RUN_AHEAD_AFTER of them and keeps its tokens."""
    with LLM(max_model_len=512, max_num_seqs=2, hosted_masks=hosted) as llm:
        llm.prepare_structured_outputs()
        chat = llm.apply_chat_template([{"role": "user", "content": "Describe a person as JSON with a name and an age."}])
        params = SamplingParams(temperature=0, max_tokens=60, structured_outputs={"json": PERSON})
        steps = []  # (steps, masks in the dispatch)
        decode = llm.runner.decode
        llm.runner.decode = lambda *a, **k: steps.append((a[4], a[7] is not None)) or decode(*a, **k)
        out = llm.generate([chat], params, use_tqdm=False)[0]
        alone, n = list(steps), llm.runner.decode_steps
        mixed = llm.generate([chat, chat], [params, SamplingParams(temperature=0, max_tokens=60)], use_tqdm=False)
    first = [(n, True)] if hosted else [(1, True)] * output_module.RUN_AHEAD_AFTER
    assert alone[:len(first) + 1] == [*first, (n, False)]  # masked, then ran ahead
    assert out.token_ids == mixed[0].token_ids
    jsonschema.validate(json.loads(out.text), PERSON)


def test_hosted_masks_give_the_one_step_tokens(tiny, tokenizer):
    """EngineConfig.hosted_masks: a constrained row alone takes several steps a dispatch, each step's mask from the host
    between steps (its program compiled on a thread meanwhile): greedy, HF's tokens under the same masks; sampled
    (filters, penalties), the one-step path's tokens, alone and (one step a dispatch) three at once."""
    folder, hf = tiny
    prompt = tokenizer.encode("Answer:")
    refs = [masked_greedy(hf, tokenizer, prompt, c, 40) for c in CONSTRAINTS]
    greedy = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=c) for c in CONSTRAINTS]
    person = StructuredOutputs(json=PERSON)
    sampled = [SamplingParams(temperature=1.0, seed=s, max_tokens=30, structured_outputs=person, **filters)
               for s, filters in ((1, {}), (2, {"top_p": 0.9}), (3, {"presence_penalty": 1.0}))]
    with LLM(str(folder), dtype="float32", page_size=4, max_model_len=128) as llm:
        one_step = [llm.generate([prompt], p, use_tqdm=False)[0].token_ids for p in sampled]
    with LLM(str(folder), dtype="float32", page_size=4, max_model_len=128, hosted_masks=True) as llm:
        llm.prepare_structured_outputs()  # (the hosted decode compiled)
        steps = []
        decode = llm.runner.decode
        llm.runner.decode = lambda *a, **k: steps.append(a[4]) or decode(*a, **k)
        alone = [llm.generate([prompt], p, use_tqdm=False)[0].token_ids for p in greedy]
        sampled_alone = [llm.generate([prompt], p, use_tqdm=False)[0].token_ids for p in sampled]
        assert set(steps) == {llm.runner.decode_steps}
        together = [o.token_ids for o in llm.generate([prompt] * 3, sampled, use_tqdm=False)]
        assert not llm.core.output.grammars._live
    assert alone == refs
    assert sampled_alone == one_step and together == one_step


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer of 256 byte tokens and an EOS, built here (a machine without any model's)."""
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))} | {"<eos>": 256}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer, backend.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>")


@requires_gpu
def test_hosted_decode_gives_hf_masked_greedy_tokens_on_the_gpu(tmp_path):
    """On a GPU (hosted masks on by default, the kernels where shapes allow): a constrained row alone takes HF's
    greedy tokens under the same masks, for each kind of constraint."""
    tokenizer = byte_tokenizer()
    hf = build_hf_model({**TINY["llama"], "vocab_size": len(tokenizer)})
    hf.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    prompt = tokenizer.encode("Answer:")
    with LLM(str(tmp_path), dtype="float32") as llm:
        llm.prepare_structured_outputs()
        assert llm.runner.hosted_ready()
        outs = [llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, structured_outputs=c),
                             use_tqdm=False)[0].token_ids for c in CONSTRAINTS]
    assert outs == [masked_greedy(hf, tokenizer, prompt, c, 40) for c in CONSTRAINTS]


@pytest.mark.parametrize("speculation", [None, {"method": "ngram", "num_speculative_tokens": 3}])
def test_sampled_constrained_tokens_equal_alone_and_in_a_batch(tiny, tokenizer, speculation):
    folder, _ = tiny
    prompt = tokenizer.encode("Person:")
    sampled = [SamplingParams(temperature=1.0, seed=s, max_tokens=30, structured_outputs=StructuredOutputs(json=PERSON),
                              **filters) for s, filters in ((1, {}), (2, {"top_p": 0.9}), (3, {"logprobs": 2}))]
    free = SamplingParams(temperature=1.0, seed=4, max_tokens=30)
    with LLM(str(folder), dtype="float32", page_size=4, max_model_len=128, speculative_config=speculation) as llm:
        alone = [llm.generate([prompt], p, use_tqdm=False)[0] for p in sampled]
        mixed = llm.generate([prompt] * 4, [*sampled, free], use_tqdm=False)
        assert llm.page_manager.num_free_pages == llm.page_manager.num_pages
    for a, m in zip(alone, mixed):
        assert a.token_ids == m.token_ids and a.finish_reason == m.finish_reason
        if a.logprobs:
            assert [e[0] for e in a.logprobs] == pytest.approx([e[0] for e in m.logprobs], abs=1e-5)
    for out in alone:
        if out.finish_reason == "stop":
            jsonschema.validate(json.loads(out.text), PERSON)


def test_default_model_answers_follow_their_schemas():
    schemas = [PERSON, {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                         "population": {"type": "integer", "minimum": 0}},
                        "required": ["city", "population"], "additionalProperties": False}]
    with LLM(max_model_len=512, max_num_seqs=4) as llm:
        chats = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in (
            "Describe a person as JSON with a name and an age.", "Give the largest city of France as JSON.")]
        params = [SamplingParams(temperature=0, max_tokens=80, structured_outputs={"json": s}) for s in schemas]
        alone = [llm.generate([c], p, use_tqdm=False)[0] for c, p in zip(chats, params)]
        mixed = llm.generate([*chats, chats[1]], [*params, SamplingParams(temperature=0, max_tokens=40)],
                             use_tqdm=False)
    for out, schema in zip(alone, schemas):
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), schema)
    assert [o.token_ids for o in mixed[:2]] == [o.token_ids for o in alone]


def test_a_model_without_tokenizer_refuses_constraints(hf_model_dir):
    folder, _ = hf_model_dir("llama")
    with LLM(str(folder), dtype="float32", max_model_len=64) as llm, pytest.raises(ValueError, match="tokenizer"):
        llm.generate([[1, 2, 3]], SamplingParams(structured_outputs={"regex": "a+"}), use_tqdm=False)
