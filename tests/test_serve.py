"""The OpenAI-compatible server (nanojax.serve) through the official `openai` client, on a free 127.0.0.1 port.

The tiny random qwen3 with the in-memory byte tokenizer (and a one-line chat template) stands in for a real model:
outputs are checked against the same engine's offline `LLM.generate`, prompts are token ids. The embedded default
model answering a real question is the test at the end.
"""
import asyncio
import dataclasses
import json
import math
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from conftest import random_prompts
from test_sampling import byte_tokenizer

from nanojax import LLM, SamplingParams, serve
from nanojax.engine_io import RequestStream
from nanojax.loader import load_model
from nanojax.serve import BackgroundServer, ServerLimits, build_app, engine_options, parse_args, served_names

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
LIMITS = ServerLimits(max_body_bytes=32 << 10, max_n=4, max_tokens=200, max_prompts=8)


@pytest.fixture(scope="module")
def llm(hf_model_dir):
    folder, _ = hf_model_dir("qwen3")
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    model = dataclasses.replace(load_model(str(folder), "float32"), tokenizer=tokenizer)
    return LLM(model, dtype="float32", page_size=4, max_model_len=256, max_num_seqs=32)


@pytest.fixture(scope="module")
def server(llm):
    server = BackgroundServer(build_app(llm, "tiny", api_key=KEY, limits=LIMITS))
    yield server
    server.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, ignore_eos=True, **kw)


def offline(llm, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


def test_completions_whole_and_streamed_equal_offline_generate(llm, client):
    prompts = random_prompts(97, [5, 13], seed=1)
    want = offline(llm, prompts, greedy(max_tokens=20))
    got = client.completions.create(model="tiny", prompt=prompts, max_tokens=20, temperature=0,
                                    extra_body={"ignore_eos": True, "return_token_ids": True})
    assert got.object == "text_completion" and got.model == "tiny" and len(got.choices) == 2
    for choice, out in zip(got.choices, want):
        assert choice.text == out.text and choice.finish_reason == "length"
        assert choice.token_ids == out.token_ids
    assert (got.usage.prompt_tokens, got.usage.completion_tokens, got.usage.total_tokens) == (18, 40, 58)
    # generate ran the same prompts: their full pages (4 of 5 tokens, 12 of 13) come from the prefix cache
    assert got.usage.prompt_tokens_details.cached_tokens == 16

    chunks = list(client.completions.create(model="tiny", prompt=prompts[1], max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want[1].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == 13 and chunks[-1].usage.prompt_tokens_details.cached_tokens == 12


def test_chat_whole_and_streamed(llm, client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text",
                                                                                          "text": "hi"}]}]
    ids = llm.apply_chat_template([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    want = offline(llm, [ids], greedy(max_tokens=12))[0]
    got = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=12, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert got.object == "chat.completion"
    assert got.choices[0].message.role == "assistant" and got.choices[0].message.content == want.text
    assert got.usage.prompt_tokens == len(ids) and got.usage.completion_tokens == 12
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True}))
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_32_concurrent_clients_equal_offline_generate(llm, server):
    prompts = random_prompts(97, [3 + (7 * i) % 40 for i in range(32)], seed=2)
    max_tokens = [8 + (5 * i) % 25 for i in range(32)]
    want = offline(llm, prompts, [greedy(max_tokens=m) for m in max_tokens])
    assert concurrent_clients(server, prompts, max_tokens) == [out.text for out in want]


def concurrent_clients(server, prompts, max_tokens) -> list[str]:
    """One client per prompt at once, every other one streamed -> their greedy texts."""
    async def one(client, prompt, m, stream):
        kw = dict(model="tiny", prompt=prompt, max_tokens=m, temperature=0, extra_body={"ignore_eos": True})
        if not stream:
            return (await client.completions.create(**kw)).choices[0].text
        return "".join([c.choices[0].text async for c in await client.completions.create(stream=True, **kw)])

    async def all_clients():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120) as c:
            return await asyncio.gather(*(one(c, p, m, i % 2) for i, (p, m) in enumerate(zip(prompts, max_tokens))))

    return asyncio.run(all_clients())


def metric(server, name: str) -> float:
    line = next((x for x in httpx.get(f"{server.url}/metrics").text.splitlines() if x.startswith(name + " ")), None)
    return float(line.split()[-1]) if line else 0.0


def test_client_that_disconnects_mid_stream_gets_its_request_aborted(llm, server, client, monkeypatch):
    decode = llm.runner.decode

    def slow_decode(*args, **kw):  # the tiny model would finish 200 tokens before the server sees the client go
        time.sleep(0.02)
        return decode(*args, **kw)

    monkeypatch.setattr(llm.runner, "decode", slow_decode)
    aborted = metric(server, "nanojax_requests_aborted_total")
    stream = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=200, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))
    stream.close()
    deadline = time.time() + 30
    while llm.scheduler.running or llm.page_manager.num_free_pages != llm.page_manager.num_pages:
        assert time.time() < deadline, "the disconnected client's request still holds KV pages"
        time.sleep(0.02)
    assert metric(server, "nanojax_requests_aborted_total") == aborted + 1
    # the same without streaming: a client that times out
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=0.3,
                   json={"prompt": [5, 6, 7], "max_tokens": 200, "temperature": 0, "ignore_eos": True})
    while llm.scheduler.running or llm.page_manager.num_free_pages != llm.page_manager.num_pages:
        assert time.time() < deadline, "the timed-out client's request still holds KV pages"
        time.sleep(0.02)
    assert metric(server, "nanojax_requests_aborted_total") == aborted + 2


BAD = [  # (body of a completions request, status, the field named)
    ({"prompt": 3}, 400, "prompt"),
    ({"prompt": [[1, 2], "x"]}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": [1, 500]}, 400, "prompt"),
    ({"prompt": [-1]}, 400, "prompt"),
    ({"prompt": [1] * 256}, 400, "prompt"),  # no room left under max_model_len
    ({"prompt": [1], "temperature": -1}, 400, "temperature"),
    ({"prompt": [1], "temperature": "hot"}, 400, "temperature"),
    ({"prompt": [1], "temperature": "0.5"}, 400, "temperature"),  # numbers are not coerced from strings
    ({"prompt": [1], "max_tokens": "4"}, 400, "max_tokens"),
    ({"prompt": [1], "max_tokens": 4.0}, 400, "max_tokens"),
    ({"prompt": [1], "n": True}, 400, "n"),  # nor from booleans
    ({"prompt": [1], "top_p": 0}, 400, "top_p"),
    ({"prompt": [1], "top_k": -2}, 400, "top_k"),
    ({"prompt": [1], "min_p": 2}, 400, "min_p"),
    ({"prompt": [1], "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": [1], "max_tokens": 201}, 400, "max_tokens"),  # over the server's limit
    ({"prompt": [1], "min_tokens": 50, "max_tokens": 10}, 400, "min_tokens"),
    ({"prompt": [1], "n": 0}, 400, "n"),
    ({"prompt": [1], "n": 5}, 400, "n"),  # over the server's limit
    ({"prompt": [[1]] * 9}, 400, "prompt"),  # more prompts than the server allows
    ({"prompt": [1], "seed": -1}, 400, "seed"),
    ({"prompt": [1], "stop": [""]}, 400, "stop"),
    ({"prompt": [1], "stop_token_ids": [-3]}, 400, "stop_token_ids"),
    ({"prompt": [1], "presence_penalty": 3}, 400, "presence_penalty"),
    ({"prompt": [1], "frequency_penalty": -3}, 400, "frequency_penalty"),
    ({"prompt": [1], "repetition_penalty": 0}, 400, "repetition_penalty"),
    ({"prompt": [1], "logprobs": 21}, 400, "logprobs"),
    ({"prompt": [1], "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ({"prompt": [1], "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ({"prompt": [1], "logit_bias": {"97": 1}}, 400, "logit_bias"),  # past the vocabulary
    ({"prompt": [1], "stream_options": {"include_usage": "maybe"}}, 400, "stream_options"),
    ({"prompt": [1], "suffix": "x"}, 400, "suffix"),  # not supported: said so, not ignored
    ({"prompt": [1], "model": "gpt-4"}, 404, "model"),
]


@pytest.mark.parametrize("body,status,param", BAD)
def test_bad_completions_request_names_the_field_and_the_server_goes_on(server, body, status, param):
    r = httpx.post(f"{server.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"] and error["type"]
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_bad_chat_requests_and_bodies(server, client):
    auth = {"Authorization": f"Bearer {KEY}"}
    cases = [({"messages": []}, "messages"), ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
             ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages"),
             ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, None),  # without logprobs
             ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
              "top_logprobs"),
             ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
              "max_completion_tokens"),
             ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 201},  # past the limit
              "max_completion_tokens"),
             ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 201}, "max_tokens"),
             ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "web_search"}]}, "tools")]
    for body, param in cases:
        r = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=auth)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    r = httpx.post(f"{server.url}/v1/completions", content=b'{"prompt": [1', headers={
        **auth, "Content-Type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": [1] * 20000}, headers=auth)
    assert r.status_code == 413 and "bytes" in r.json()["error"]["message"]

    def chunked():  # no content-length: the limit is found while the body streams in
        yield b'{"prompt": [1'
        for _ in range(20000):
            yield b", 1"
        yield b"]}"

    r = httpx.post(f"{server.url}/v1/completions", content=chunked(), headers={**auth,
                                                                                "Content-Type": "application/json"})
    assert r.status_code == 413
    assert httpx.get(f"{server.url}/nowhere").json()["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    assert client.completions.create(model="tiny", prompt=[1], max_tokens=2).choices[0].finish_reason


def test_api_key_refused_when_missing_or_wrong(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": [1]}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{server.url}/v1/models", headers=headers).status_code == 401
        for path, body in (("/tokenize", {"messages": [{"role": "user", "content": "hi"}]}),
                           ("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [5]})):
            assert httpx.post(f"{server.url}{path}", json=body, headers=headers).status_code == 401, path
    wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    # probes and scrapers need no key
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/metrics").status_code == 200


def test_logprobs_and_echo(llm, client):
    prompt = random_prompts(97, [7], seed=3)[0]
    want = offline(llm, [prompt], greedy(max_tokens=6, logprobs=3, prompt_logprobs=3))[0]
    got = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0, logprobs=3, echo=True,
                                    extra_body={"ignore_eos": True})
    choice = got.choices[0]
    prompt_text = llm.tokenizer.decode(prompt)
    assert choice.text == prompt_text + want.text
    lp = choice.logprobs
    # the prompt's tokens with their logprobs (the first has none: nothing precedes it)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:7] == pytest.approx([x for x, _ in want.prompt_logprobs[1:]], abs=1e-5)
    for top, (_, want_top) in zip(lp.top_logprobs[1:7], want.prompt_logprobs[1:]):
        assert sorted(top.values()) == pytest.approx(sorted(want_top.values()), abs=1e-5)
    assert lp.token_logprobs[7:] == pytest.approx([x for x, _ in want.logprobs], abs=1e-5)
    for top, (x, want_top) in zip(lp.top_logprobs[7:], want.logprobs):
        assert len(top) <= 3 and max(top.values()) == pytest.approx(x, abs=1e-5)  # greedy: the top one
        assert sorted(top.values()) == pytest.approx(sorted(want_top.values()), abs=1e-5)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    streamed = [c.choices[0] for c in client.completions.create(
        model="tiny", prompt=prompt, max_tokens=6, temperature=0, logprobs=3, stream=True,
        extra_body={"ignore_eos": True})]
    assert sum((c.logprobs.token_logprobs for c in streamed), []) == pytest.approx(
        [x for x, _ in want.logprobs], abs=1e-5)

    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "q"}], max_tokens=5,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for item in content:
        assert len(item.top_logprobs) == 2 and item.top_logprobs[0].logprob == pytest.approx(item.logprob)
        assert bytes(item.bytes).decode() == item.token


def test_n_choices_and_seeds(client):
    kw = dict(model="tiny", prompt=[[3, 4, 5], [9, 8]], max_tokens=10, n=2, extra_body={"ignore_eos": True})
    a = client.completions.create(temperature=1.0, seed=7, **kw)
    b = client.completions.create(temperature=1.0, seed=7, **kw)
    assert [c.index for c in a.choices] == [0, 1, 2, 3]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # a seed makes it reproducible
    assert a.choices[0].text != a.choices[1].text  # the choices differ (seed + choice)
    assert a.usage.prompt_tokens == 5 and a.usage.completion_tokens == 40
    greedy_n = client.completions.create(temperature=0, **kw)
    assert greedy_n.choices[0].text == greedy_n.choices[1].text
    streamed = client.completions.create(temperature=1.0, seed=7, stream=True, **kw)
    texts = ["", "", "", ""]
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in a.choices]


def test_stop_strings_and_stop_token_ids(llm, client):
    prompt = random_prompts(97, [6], seed=4)[0]
    full = offline(llm, [prompt], greedy(max_tokens=30))[0]
    stop = next(full.text[k:k + 2] for k in range(6, len(full.text)) if "\ufffd" not in full.text[k:k + 2])
    cut = full.text.find(stop)
    for stream in (False, True):
        got = client.completions.create(model="tiny", prompt=prompt, max_tokens=30, temperature=0, stop=stop,
                                        stream=stream, extra_body={"ignore_eos": True})
        choices = [c.choices[0] for c in got] if stream else got.choices
        assert "".join(c.text for c in choices) == full.text[:cut]
        assert choices[-1].finish_reason == "stop"
    got = client.completions.create(model="tiny", prompt=prompt, max_tokens=30, temperature=0,
                                    extra_body={"stop_token_ids": [full.token_ids[4]], "return_token_ids": True})
    assert got.choices[0].finish_reason == "stop"
    assert got.choices[0].token_ids == full.token_ids[:full.token_ids.index(full.token_ids[4]) + 1]


def test_models_health_metrics_tokenize(llm, server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    assert httpx.get(f"{server.url}/health").status_code == 200
    llm.core.dead = RuntimeError("the device state is lost")  # what the engine sets when a step lost it
    try:
        assert httpx.get(f"{server.url}/health").status_code == 503
        with pytest.raises(openai.InternalServerError):
            client.completions.create(model="tiny", prompt=[1], max_tokens=2)
    finally:
        llm.core.dead = None
    ids = [5, 6, 7, 60]
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": ids}, headers=AUTH).json()["prompt"]
    assert text == llm.tokenizer.decode(ids)
    r = httpx.post(f"{server.url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]},
                   headers=AUTH).json()
    assert r["tokens"] == llm.apply_chat_template([{"role": "user", "content": "hi"}]) and r["count"] == len(
        r["tokens"])
    chat = {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"enable_thinking": False}}
    assert httpx.post(f"{server.url}/tokenize", json=chat, headers=AUTH).status_code == 200  # vLLM's template variables
    chat["chat_template_kwargs"] = {"tokenize": False}
    r = httpx.post(f"{server.url}/tokenize", json=chat, headers=AUTH)
    assert r.status_code == 400 and "chat_template_kwargs may not set ['tokenize']" in r.text
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": "the ab"}, headers=AUTH).json()
    assert r["tokens"] == llm.tokenizer.encode("the ab")
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": [97]}, headers=AUTH).status_code == 400
    assert httpx.post(f"{server.url}/tokenize", json={}, headers=AUTH).status_code == 400
    metrics = httpx.get(f"{server.url}/metrics").text
    for name in ("nanojax_requests_running", "nanojax_requests_waiting", "nanojax_kv_pages_used",
                 "nanojax_prefix_cache_hit_rate", "nanojax_prompt_tokens_total", "nanojax_generation_tokens_total",
                 "nanojax_time_to_first_token_seconds_bucket", "nanojax_inter_token_latency_seconds_bucket"):
        assert f"\n{name}" in metrics, name
    assert "\nnanojax_engine_up 1.0" in metrics


def test_request_latency_is_observed_once_per_request(server, client):
    before = metric(server, "nanojax_request_latency_seconds_count")
    client.completions.create(model="tiny", prompt=[[1, 2], [3]], max_tokens=3, n=2)  # one request, four choices
    list(client.completions.create(model="tiny", prompt=[4, 5], max_tokens=3, stream=True))
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert metric(server, "nanojax_request_latency_seconds_count") == before + 3
    assert metric(server, "nanojax_request_latency_seconds_sum") > 0


def _strict_json(text: str):
    """json.loads refusing NaN and Infinity, as JSON parsers other than Python's do."""
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


class _NonFiniteLogprobs(RequestStream):
    """The engine's events with NaN logprobs and -inf top logprobs (what a degenerate distribution gives)."""

    def put(self, event, error=None):
        if event.logprobs:
            event = dataclasses.replace(event, logprobs=[(math.nan, dict.fromkeys(top, -math.inf))
                                                         for _, top in event.logprobs])
        super().put(event, error)


def test_logprobs_stay_json_numbers_when_nan_or_infinite(server, monkeypatch):
    monkeypatch.setattr(serve, "RequestStream", _NonFiniteLogprobs)
    for path, body in (("/v1/completions", {"prompt": [5, 6], "logprobs": 2}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                                                 "top_logprobs": 2})):
        for stream in (False, True):
            r = httpx.post(f"{server.url}{path}", json={**body, "max_tokens": 3, "stream": stream}, headers=AUTH,
                           timeout=120)
            assert r.status_code == 200, r.text
            docs = [_strict_json(line[len("data: "):]) for line in r.text.splitlines()
                    if line.startswith("data: {")] if stream else [_strict_json(r.text)]
            assert docs and not any("error" in doc for doc in docs), r.text
            assert "-9999.0" in r.text  # vLLM's stand-in for -inf


RAW_BAD = [  # (route, body as Python's json writes it: what httpx's json= refuses to send, the field named)
    ("/v1/completions", {"prompt": [1], "temperature": math.inf}, "temperature"),
    ("/v1/completions", {"prompt": [1], "top_p": math.nan}, "top_p"),
    ("/v1/completions", {"prompt": "a\ud800b"}, "prompt"),  # a lone surrogate
    ("/v1/completions", {"prompt": ["ok", "\udc00"]}, "prompt"),
    ("/v1/completions", {"prompt": [1], "stop": "\ud800"}, "stop"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\ud800b"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
     "messages"),
    ("/tokenize", {"prompt": "a\ud800b"}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "a\ud800b"}]}, "messages"),
]


@pytest.mark.parametrize("path,body,param", RAW_BAD)
def test_infinities_and_lone_surrogates_refused_naming_the_field(server, path, body, param):
    r = httpx.post(f"{server.url}{path}", content=json.dumps(body),
                   headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error"


def test_integers_accepted_for_float_fields(client):
    got = client.completions.create(model="tiny", prompt=[1], max_tokens=2, temperature=1, top_p=1,
                                    extra_body={"repetition_penalty": 1})
    assert got.usage.completion_tokens == 2


def test_unexpected_error_answers_500_in_openai_shape(server, monkeypatch):
    def broken(*args):
        raise KeyError("a bug")

    monkeypatch.setattr(serve, "_completion_prompts", broken)
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": [1]}, headers=AUTH)
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error", r.text
    assert httpx.get(f"{server.url}/health").status_code == 200


def _held(fn, started: threading.Event, release: threading.Event):
    """fn that, called, says so and waits for release (a tokenizer busy on a long text)."""
    def held(*args, **kw):
        started.set()
        release.wait(60)
        return fn(*args, **kw)

    return held


def test_health_answers_while_a_large_request_tokenizes(llm, monkeypatch):
    started, release = threading.Event(), threading.Event()
    monkeypatch.setattr(llm.tokenizer, "encode", _held(llm.tokenizer.encode, started, release))
    monkeypatch.setattr(llm, "apply_chat_template", _held(llm.apply_chat_template, started, release))
    text = "ab " * (1 << 20)
    server = BackgroundServer(build_app(llm, "tiny", limits=ServerLimits(max_body_bytes=16 << 20)))
    try:
        for path, body in (("/tokenize", {"prompt": text}), ("/v1/completions", {"prompt": text, "max_tokens": 1}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}],
                                                     "max_tokens": 1})):
            started.clear()
            release.clear()
            with ThreadPoolExecutor(1) as pool:
                reply = pool.submit(httpx.post, f"{server.url}{path}", json=body, timeout=120)
                assert started.wait(60), path
                start = time.perf_counter()
                assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
                assert time.perf_counter() - start < 1, path
                release.set()
                assert reply.result().status_code == 200, path
    finally:
        release.set()
        server.stop()


def wait_for_health(server, status: int, seconds: float = 30) -> httpx.Response:
    """/health's first answer with `status` (each within the few seconds /health may take)."""
    deadline = time.time() + seconds
    while (r := httpx.get(f"{server.url}/health", timeout=5)).status_code != status:
        assert time.time() < deadline, f"/health did not answer {status}"
        time.sleep(0.05)
    return r


def test_health_answers_503_while_the_engine_stalls_with_work(llm, monkeypatch):
    server = BackgroundServer(build_app(llm, "tiny", limits=ServerLimits(stall_timeout_s=0.5)))
    decode = llm.runner.decode
    monkeypatch.setattr(llm.runner, "decode", lambda *a, **k: time.sleep(2) or decode(*a, **k))
    try:
        wait_for_health(server, 200)
        with ThreadPoolExecutor(1) as pool:
            reply = pool.submit(httpx.post, f"{server.url}/v1/completions", timeout=120,
                                json={"prompt": [1, 2], "max_tokens": 4, "ignore_eos": True})
            assert "no new turn" in wait_for_health(server, 503).json()["error"]["message"]
            assert reply.result().status_code == 200
        wait_for_health(server, 200)  # the engine steps again
    finally:
        server.stop()


def test_served_under_the_model_path_as_given_and_its_folder_name(llm, hf_model_dir):
    folder, _ = hf_model_dir("qwen3")
    names = served_names(str(folder))
    assert names == (str(folder), folder.name)
    assert served_names(str(folder), "mine") == ("mine",) and served_names("org/name") == ("org/name",)
    server = BackgroundServer(build_app(llm, names[0], aliases=names[1:]))
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == [str(folder)]
        for name in names:
            assert client.completions.create(model=name, prompt=[1], max_tokens=1).model == str(folder)
            assert httpx.get(f"{server.url}/v1/models/{name}").json()["id"] == str(folder)
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="other", prompt=[1], max_tokens=1)
    finally:
        server.stop()


def test_model_without_tokenizer_streams_token_ids(hf_model_dir, monkeypatch):
    folder, _ = hf_model_dir("qwen3")
    llm = LLM(str(folder), dtype="float32", page_size=4, max_model_len=256, max_num_seqs=32)
    server = BackgroundServer(build_app(llm, "bare"))
    try:
        prompt = random_prompts(97, [11], seed=6)[0]
        want = offline(llm, [prompt], greedy(max_tokens=20))[0]
        # The server merges the events that came while its loop was busy (serve._events): dispatches spaced out
        # well beyond the loop's latency on a loaded machine, so that each comes as an event of its own.
        decode = llm.runner.decode
        monkeypatch.setattr(llm.runner, "decode", lambda *a, **k: time.sleep(0.2) or decode(*a, **k))
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
        chunks = [c.choices[0] for c in client.completions.create(
            model="bare", prompt=prompt, max_tokens=20, temperature=0, stream=True,
            extra_body={"ignore_eos": True, "return_token_ids": True})]
        assert sum((c.token_ids for c in chunks), []) == want.token_ids
        assert sum(bool(c.token_ids) for c in chunks) >= 20 // llm.decode_steps  # an event per dispatch
        assert all(c.text == "" and c.logprobs is None for c in chunks)
        for body, param in [({"prompt": "text"}, "prompt"), ({"prompt": [1], "echo": True}, "echo"),
                            ({"prompt": [1], "stop": "x"}, "stop")]:
            r = httpx.post(f"{server.url}/v1/completions", json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    finally:
        server.stop()


def test_serving_benchmark_client_against_the_server(server):
    sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
    from bench_serving import arrival_offsets, random_prompts as bench_prompts, run_requests, summarize

    prompts = bench_prompts(6, 9, 97, seed=5)
    offsets = arrival_offsets(6, 50.0, 0.5, seed=5)
    assert offsets[0] == 0 and (offsets[1:] >= offsets[:-1]).all()
    results, seconds = asyncio.run(run_requests(server.url, "tiny", prompts, 7, offsets, 3, KEY))
    m = summarize(results, seconds, 9)
    assert (m["completed"], m["failed"], m["total_output_tokens"]) == (6, 0, 42), m["errors"]
    assert 0 < m["median_ttft_ms"] <= m["median_e2el_ms"] and m["p99_itl_ms"] is not None


def test_default_model_answers_through_chat_completions():
    """The launch command as a user runs it (the engine in a process of its own), with the embedded default model."""
    import signal
    import socket
    import subprocess

    from convert.cache import MODEL_NAME
    from nanojax.default_model import default_checkpoint

    default_checkpoint()  # converted here, not in the server's child (kept in the cache for both)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "nanojax.serve", "--port", str(port), "--dtype", "float32",
                               "--max-model-len", "256", "--max-num-seqs", "2", "--log-level", "warning"],
                              cwd=Path(__file__).parents[1])
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 300
        while True:  # the port opens once the engine is built
            assert server.poll() is None, "the server exited"
            assert time.time() < deadline, "the server did not answer /health"
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
        reply = client.chat.completions.create(model=MODEL_NAME, temperature=0, max_tokens=24, messages=[
            {"role": "user", "content": "What is the capital of France?"}])
        assert "Paris" in reply.choices[0].message.content
    finally:
        server.terminate()  # uvicorn shuts down (stopping the engine's process), then re-raises the signal
        assert server.wait(60) in (0, -signal.SIGTERM)


def test_command_line_options_reach_the_engine():
    """Every engine option of `python -m nanojax.serve` is an LLM keyword, passed through as given."""
    import inspect

    from nanojax import LLM

    args = parse_args(["--quantization", "fp8", "--tensor-parallel-size", "2", "--decode-steps", "4",
                       "--max-model-len", "512", "--kernels", "reference"])
    options = engine_options(args)
    assert "config" in inspect.signature(LLM).parameters
    assert options.quantization == "fp8" and options.tensor_parallel_size == 2
    assert options.decode_steps == 4 and options.max_model_len == 512 and options.kernels == "reference"
    defaults = engine_options(parse_args([]))
    assert defaults.quantization is None and defaults.tensor_parallel_size is None
