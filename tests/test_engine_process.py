"""The engine in a process of its own (nanojax.engine_process), directly and behind the server: the same greedy
tokens as the in-process engine, requests refused at once in the caller, aborts that free the child's KV pages,
metrics asked of the child, a child that splits the model over two devices, and a hung or dead child reported by
/health and /metrics while the server goes on answering."""
import dataclasses
import gc
import os
import re
import signal
import time

import httpx
import openai
import pytest
from conftest import random_prompts
from test_sampling import byte_tokenizer
from test_serve import CHAT_TEMPLATE, KEY, LIMITS, concurrent_clients, greedy, metric, wait_for_health

from nanojax import LLM, SamplingParams
from nanojax.engine_process import EngineProcess
from nanojax.loader import load_model
from nanojax.serve import BackgroundServer, build_app

ENGINE = dict(dtype="float32", page_size=4, max_model_len=256, max_num_seqs=32)


@pytest.fixture(scope="module")
def model(hf_model_dir):
    folder, _ = hf_model_dir("qwen3")
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    return dataclasses.replace(load_model(str(folder), "float32").resolved(), tokenizer=tokenizer)


@pytest.fixture(scope="module")
def llm(model):
    return LLM(model, **ENGINE)


@pytest.fixture(scope="module")
def engine(model):
    engine = EngineProcess(model, **ENGINE)  # the LoadedModel (numpy weights, the tokenizer) pickled to the child
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def server(engine):
    server = BackgroundServer(build_app(engine, "tiny", api_key=KEY, limits=LIMITS))
    yield server
    server.stop()


def test_requests_equal_the_in_process_engine(llm, engine):
    prompts = random_prompts(97, [5, 13, 30], seed=3)
    params = [greedy(max_tokens=9), SamplingParams(temperature=0.8, seed=7, max_tokens=11, logprobs=2),
              greedy(max_tokens=14, n=2)]
    want = llm.generate(prompts, params, use_tqdm=False)
    streams = [engine.add_request(p, sp, index=i) for i, (p, sp) in enumerate(zip(prompts, params))]
    got = [[e for e in s if e.finish_reason is not None] for s in streams]
    for out, finals in zip(want, got):
        assert finals[0].token_ids == out.token_ids and finals[0].text == out.text
        assert finals[0].prompt_token_ids == out.prompt_token_ids and finals[0].finish_reason == "length"
    # (the child admits requests as they come down the pipe, so its batches may differ: float32 rounding)
    for (logprob, top), (want_logprob, want_top) in zip(got[1][0].logprobs, want[1].logprobs, strict=True):
        assert logprob == pytest.approx(want_logprob) and top == pytest.approx(want_top)
    assert len(got[2]) == 2  # both choices of n=2
    assert engine.stats().kv_pages_used == 0 and engine.stats().running == 0


def test_bad_requests_fail_in_the_caller(engine):
    with pytest.raises(ValueError, match="max_model_len=256"):
        engine.add_request([1] * 256, greedy(max_tokens=2))
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 97\)"):
        engine.add_request([1, 97], greedy(max_tokens=2))
    with pytest.raises(ValueError, match="logit_bias"):
        engine.add_request([1], SamplingParams(max_tokens=2, logit_bias={99: 1.0}))
    assert [e.token_ids for e in engine.add_request([1, 2], greedy(max_tokens=3))][-1]  # and it goes on


def _slow_decode(llm, seconds: float):
    """In the child: each decode dispatch sleeps first (the tiny model would finish before a client went away)."""
    decode = type(llm.runner).decode

    def slow(*args, **kw):
        time.sleep(seconds)
        return decode(llm.runner, *args, **kw)

    llm.runner.decode = slow


def _plain_decode(llm):
    del llm.runner.decode


def test_abort_and_a_disconnected_client_free_the_childs_pages(engine, server):
    engine.call(_slow_decode, 0.02)
    try:
        stream = engine.add_request([5, 6, 7], greedy(max_tokens=200), request_id="to-abort")
        first = next(iter(stream))
        engine.abort("to-abort")
        assert [e for e in stream][-1].finish_reason == "abort" and first.finish_reason is None
        aborted = metric(server, "nanojax_requests_aborted_total")
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)
        chunks = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=200, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        next(iter(chunks))
        chunks.close()
        deadline = time.time() + 30
        while (stats := engine.stats()).running or stats.kv_pages_used:
            assert time.time() < deadline, "the disconnected client's request still holds the child's KV pages"
            time.sleep(0.05)
        assert metric(server, "nanojax_requests_aborted_total") == aborted + 1
    finally:
        engine.call(_plain_decode)


def _heap_frozen(llm) -> int:
    return gc.get_freeze_count()


def test_the_child_freezes_its_start_up_heap(engine):
    # its full collections would otherwise walk JAX's and the model's objects, a pause of the loop each time
    assert engine.call(_heap_frozen) > 10_000


def _grammars_ready(llm) -> bool:
    return llm.core.output.grammars._ll_tokenizer is not None


def test_the_child_prepares_structured_outputs_before_the_first_constraint(engine):
    assert not engine.call(_grammars_ready)
    engine.prepare_structured_outputs()  # (the server's start)
    assert engine.call(_grammars_ready)
    # (no bytes the grammar forces: llguidance tokenizes those, and this test tokenizer's words are whole words)
    params = SamplingParams(temperature=0, max_tokens=8, structured_outputs={"regex": "[ab]{4}"})
    final = [e for e in engine.add_request("x", params) if e.finish_reason is not None]
    assert re.fullmatch("[ab]{4}", final[0].text) and final[0].finish_reason == "stop"


def test_served_32_concurrent_clients_equal_offline_generate(llm, engine, server):
    prompts = random_prompts(97, [3 + (7 * i) % 40 for i in range(32)], seed=4)
    max_tokens = [8 + (5 * i) % 25 for i in range(32)]
    want = llm.generate(prompts, [greedy(max_tokens=m) for m in max_tokens], use_tqdm=False)
    assert concurrent_clients(server, prompts, max_tokens) == [out.text for out in want]
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                          temperature=0)
    ids = llm.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat.choices[0].message.content == llm.generate([ids], greedy(max_tokens=5), use_tqdm=False)[0].text
    assert httpx.post(f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"prompt": [1], "top_p": 0}).json()["error"]["param"] == "top_p"
    assert metric(server, "nanojax_kv_pages_total") == engine.limits.num_pages


def test_a_hung_then_dead_engine_process_answers_503_and_the_server_goes_on(model):
    engine = EngineProcess(model, **ENGINE)
    limits = dataclasses.replace(LIMITS, stats_timeout_s=0.5)
    server = BackgroundServer(build_app(engine, "tiny", api_key=KEY, limits=limits))
    pid = engine._process.pid
    try:
        assert httpx.get(f"{server.url}/health").status_code == 200
        os.kill(pid, signal.SIGSTOP)  # hung: it answers nothing
        start = time.perf_counter()
        assert "stats query" in wait_for_health(server, 503, seconds=5).json()["error"]["message"]
        assert time.perf_counter() - start < 2
        assert metric(server, "nanojax_engine_up") == 0
        os.kill(pid, signal.SIGCONT)
        wait_for_health(server, 200)
        assert metric(server, "nanojax_engine_up") == 1

        engine._process.kill()
        wait_for_health(server, 503)
        metrics = httpx.get(f"{server.url}/metrics")
        assert metrics.status_code == 200 and "\nnanojax_engine_up 0.0" in metrics.text
        assert metric(server, "nanojax_kv_pages_total") == engine.limits.num_pages  # as last read
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=30)
        with pytest.raises(openai.InternalServerError):
            client.completions.create(model="tiny", prompt=[1], max_tokens=2)
        assert client.models.list().data[0].id == "tiny"
    finally:
        if engine._process.is_alive():
            os.kill(pid, signal.SIGCONT)
        server.stop()
        engine.close()


def test_engine_process_splits_the_model_over_devices(model, llm, monkeypatch):
    """`nanojax.serve --tensor-parallel-size 2`'s engine: the child process, started with two host devices, runs the
    model split over both and gives the one-device engine's greedy tokens."""
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")  # read by the spawned child's jax
    engine = EngineProcess(model, tensor_parallel_size=2, **ENGINE)
    try:
        prompts = random_prompts(97, [7, 19], seed=4)
        want = [o.token_ids for o in llm.generate(prompts, greedy(max_tokens=8), use_tqdm=False)]
        streams = [engine.add_request(p, greedy(max_tokens=8), index=i) for i, p in enumerate(prompts)]
        assert [[e for e in s if e.finish_reason is not None][0].token_ids for s in streams] == want
    finally:
        engine.close()


def test_a_mixture_of_experts_served_from_a_child_process_equals_the_in_process_engine(hf_model_dir):
    """Qwen3-MoE (top 2 of 8) in the engine's own process behind the server: the same greedy tokens as in-process."""
    folder, hf = hf_model_dir("qwen3_moe")
    moe = dataclasses.replace(load_model(str(folder), "float32").resolved(), tokenizer=byte_tokenizer())
    prompts = random_prompts(hf.config.vocab_size, [5, 13, 30], seed=3)
    want = LLM(moe, **ENGINE).generate(prompts, greedy(max_tokens=12), use_tqdm=False)
    engine = EngineProcess(moe, **ENGINE)
    server = BackgroundServer(build_app(engine, "tiny-moe", api_key=KEY, limits=LIMITS))
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)
        got = client.completions.create(model="tiny-moe", prompt=prompts, max_tokens=12, temperature=0,
                                        extra_body={"ignore_eos": True, "return_token_ids": True})
        assert [choice.token_ids for choice in got.choices] == [out.token_ids for out in want]
    finally:
        server.stop()
        engine.close()
