"""The LLM API around the engine loop: pinned prefixes, multi-turn prefix reuse, streaming, and streams closed
early. Greedy tokens are checked against HF (conftest.hf_greedy) wherever cached pages are reused."""
import pytest
from conftest import hf_greedy, random_prompts
from test_page_manager import check_invariants
from test_sampling import byte_tokenizer  # the tiny in-memory tokenizer, for text and stop strings

from nanojax import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen3(hf_model_dir):
    folder, model = hf_model_dir("qwen3")
    return str(folder), model


def pressure(llm: LLM, seed: int) -> None:
    """Unrelated traffic that allocates many more fresh pages than the pool has (6 requests x 7 pages), so every
    page that is not pinned or in use is reused, evicting what it cached."""
    outs = llm.generate(random_prompts(97, [17] * 6, seed=seed), GREEDY, use_tqdm=False)
    assert all(o.num_cached_tokens == 0 for o in outs)


def test_pinned_prefix_survives_pressure_until_unpinned(qwen3):
    folder, model = qwen3
    llm = LLM(folder, dtype="float32", page_size=4, max_model_len=96, num_pages=20, max_num_seqs=2)
    bm = llm.page_manager
    system = random_prompts(97, [26], seed=30)[0]  # 6 full pages + 2 tokens
    user = [system + q for q in random_prompts(97, [5, 3], seed=31)] + [system]
    expected = [hf_greedy(model, p, GREEDY.max_tokens) for p in user]

    handle = llm.pin_prefix(system)
    assert bm.num_pinned_pages == 6 and bm.num_free_pages == 20 - 6
    for round_, prompt in enumerate(user):
        pressure(llm, seed=40 + round_)
        out = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
        assert out.num_cached_tokens == 24 and out.token_ids == expected[round_]
    both = llm.generate(user[:2], GREEDY, use_tqdm=False)  # two requests share the pinned pages at once
    assert [o.num_cached_tokens for o in both] == [24, 24] and [o.token_ids for o in both] == expected[:2]
    check_invariants(bm)

    llm.unpin(handle)
    assert bm.num_pinned_pages == 0 and bm.num_free_pages == bm.num_pages
    out = llm.generate([system + [7, 7, 7]], GREEDY, use_tqdm=False)[0]  # unpinning does not clear the pages
    assert out.num_cached_tokens == 24
    pressure(llm, seed=50)  # now the pressure evicts them like any other page
    out = llm.generate([user[1]], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0 and out.token_ids == expected[1]
    check_invariants(bm)
    assert bm.num_free_pages == bm.num_pages


def test_pins_are_independent_and_bad_calls_are_rejected(qwen3):
    folder, _ = qwen3
    llm = LLM(folder, dtype="float32", page_size=4, max_model_len=32)
    system = random_prompts(97, [10], seed=32)[0]  # 2 full pages; the 2 tokens after them are not pinned
    a, b = llm.pin_prefix(system), llm.pin_prefix(system + [1, 2, 3, 4, 5])  # the second adds a third page
    assert a != b and llm.page_manager.num_pinned_pages == 3
    llm.unpin(b)
    assert llm.page_manager.num_pinned_pages == 2  # the shared pages stay pinned by `a`
    with pytest.raises(ValueError, match="unknown pin handle"):
        llm.unpin(b)  # twice
    with pytest.raises(ValueError, match="unknown pin handle"):
        llm.unpin(12345)
    llm.unpin(a)
    assert llm.page_manager.num_pinned_pages == 0
    with pytest.raises(ValueError, match="less than one KV page"):
        llm.pin_prefix([1, 2, 3])
    with pytest.raises(ValueError, match="max_model_len=32"):
        llm.pin_prefix(list(range(40)))
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.pin_prefix("a system prompt")
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 97\)"):
        llm.pin_prefix([5] * 8 + [97])
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        llm.generate([system], SamplingParams(stop="x"), use_tqdm=False)
    assert not llm.scheduler.has_unfinished() and llm.page_manager.num_free_pages == llm.page_manager.num_pages


def test_decode_steps_default_per_platform_and_rejected_below_one(qwen3):
    folder, _ = qwen3
    assert LLM(folder, dtype="float32", max_model_len=32).decode_steps == 8  # CPU: nanojax.config's defaults
    with pytest.raises(ValueError, match="decode_steps must be >= 1, got 0"):
        LLM(folder, dtype="float32", max_model_len=32, decode_steps=0)


def test_pins_that_leave_no_room_fail_clearly_and_the_engine_recovers(qwen3):
    folder, model = qwen3
    llm = LLM(folder, dtype="float32", page_size=4, max_model_len=32, num_pages=6)
    handle = llm.pin_prefix(random_prompts(97, [20], seed=37)[0])  # 5 of the 6 pages
    prompt = random_prompts(97, [9], seed=38)[0]  # needs 3 pages
    with pytest.raises(RuntimeError, match="5 pinned"):
        llm.generate([prompt], GREEDY, use_tqdm=False)
    assert not llm.scheduler.has_unfinished()  # the failed request is gone, not left to run in the next call
    llm.unpin(handle)
    assert llm.generate([prompt], GREEDY, use_tqdm=False)[0].token_ids == hf_greedy(model, prompt, GREEDY.max_tokens)


def test_multi_turn_chat_reuses_the_previous_turns_pages(qwen3):
    folder, model = qwen3
    llm = LLM(folder, dtype="float32", page_size=4, max_model_len=96)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompt = random_prompts(97, [21], seed=33)[0]
    reply = llm.generate([prompt], params, use_tqdm=False)[0]
    assert reply.token_ids == hf_greedy(model, prompt, 10)
    for new in random_prompts(97, [5, 6], seed=34):
        history = prompt + reply.token_ids  # 31, then 46 tokens
        previous_prompt_pages = len(prompt) // 4 * 4
        prompt = history + new
        reply = llm.generate([prompt], params, use_tqdm=False)[0]
        # The KV of every token of the history but the last (sampled, never fed back) was computed in the last
        # turn, generated tokens included; their full pages are reused: all of them, as len(history) % 4 != 0.
        assert len(history) % 4 and reply.num_cached_tokens == len(history) // 4 * 4
        assert reply.num_cached_tokens >= previous_prompt_pages + 8  # the reply's pages count
        assert reply.token_ids == hf_greedy(model, prompt, 10)


@pytest.fixture(scope="module")
def llm_with_text(hf_model_dir):
    """The tiny qwen3 with the in-memory byte tokenizer of test_sampling (the tiny models have none)."""
    import dataclasses

    from nanojax.loader import load_model

    folder, _ = hf_model_dir("qwen3")
    loaded = dataclasses.replace(load_model(str(folder), "float32"), tokenizer=byte_tokenizer())
    return LLM(loaded, dtype="float32", page_size=4, max_model_len=96, decode_steps=8)  # several dispatches


def stream_events(llm: LLM, prompts, params) -> list[list]:
    events = [[] for _ in prompts]
    for event in llm.stream(prompts, params):
        events[event.index].append(event)
    return events


def check_stream(events: list, final) -> None:
    """The events of one request add up to its final output (from LLM.generate)."""
    last = events[-1]
    assert [e.finish_reason for e in events] == [None] * (len(events) - 1) + [final.finish_reason]
    assert "".join(e.delta for e in events) == last.text == final.text
    assert last.token_ids == final.token_ids
    assert all(e.delta for e in events[:-1])  # an event per text change, never an empty one mid-stream
    for k, e in enumerate(events):  # each event: the text so far (its deltas) and a prefix of the final tokens
        assert e.text == "".join(d.delta for d in events[:k + 1])
        assert e.token_ids == last.token_ids[:len(e.token_ids)]


def test_stream_deltas_add_up_to_the_final_output(llm_with_text):
    llm = llm_with_text
    prompts = random_prompts(97, [9, 14, 5, 20], seed=35)
    free = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (30, 12, 25)]
    free.append(SamplingParams(temperature=0.8, max_tokens=30, ignore_eos=True, seed=3))
    events = stream_events(llm, prompts, free)
    for evs, out in zip(events, llm.generate(prompts, free, use_tqdm=False)):
        check_stream(evs, out)
        assert len(evs) >= 3  # the prefill's token, then a few multi-step dispatches
    # Stop strings that start with the last character of an event's text: the stream must hold that character
    # back until it knows whether the stop string completes (it does; the final text ends before it).
    params = list(free)
    for i in (0, 3):
        text = events[i][-1].text
        starts = [len(e.text) - 1 for e in events[i][1:-1]]
        stop = next(text[b:b + 4] for b in starts if "\ufffd" not in text[b:b + 4] and text.find(text[b:b + 4]) == b)
        params[i] = SamplingParams(temperature=free[i].temperature, max_tokens=30, ignore_eos=True,
                                   seed=free[i].seed, stop=("zzzz", stop))
    # And a stop string longer than an early event's text, starting at the very beginning: nothing may be
    # streamed before it completes (the final text is empty).
    text, short = next((evs[-1].text, e) for evs in events[1:3] for e in evs[:-1] if len(e.text) >= 2)
    assert len(text) >= len(short.text) + 2 and "\ufffd" not in text[:len(short.text) + 2]
    params[short.index] = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                         stop=text[:len(short.text) + 2])
    expected = llm.generate(prompts, params, use_tqdm=False)
    assert [o.finish_reason for o in expected] == ["stop" if i in (0, short.index, 3) else "length" for i in range(4)]
    assert expected[short.index].text == ""
    for evs, out in zip(stream_events(llm, prompts, params), expected):
        check_stream(evs, out)


def test_closing_a_stream_early_aborts_its_requests_and_others_run_meanwhile(qwen3):
    folder, model = qwen3
    # 4 steps per dispatch: request 0 (3 tokens) finishes while the others still run.
    llm = LLM(folder, dtype="float32", page_size=4, max_model_len=96, decode_steps=4)
    prompts = random_prompts(97, [9, 14, 5], seed=36)
    lengths = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 20, 20)]
    stream = llm.stream(prompts, lengths)
    first = next(e for e in stream if e.finish_reason)  # (no tokenizer: events carry the new token ids)
    assert (first.index, first.finish_reason) == (0, "length")
    # The engine takes other callers' requests meanwhile.
    assert llm.generate(prompts[:1], GREEDY, use_tqdm=False)[0].token_ids == hf_greedy(model, prompts[0], 8)
    stream.close()
    assert not llm.scheduler.has_unfinished()
    assert llm.page_manager.num_free_pages == llm.page_manager.num_pages
    outs = llm.generate(prompts[::-1], GREEDY, use_tqdm=False)  # the aborted requests do not come back
    assert [o.token_ids for o in outs] == [hf_greedy(model, p, GREEDY.max_tokens) for p in prompts[::-1]]


def test_the_kv_pool_is_sized_from_what_the_weights_leave(qwen3, monkeypatch):
    """The pool gets memory_fraction of the device less what it held before the weights and the weights' own bytes,
    which the config gives before they are read: a first start sizes it while they convert (compile workers start
    from it) and every start computes the same size, so a later start finds the executables stored."""
    from nanojax import llm as llm_module
    from nanojax.llm import _bytes, _placed_shapes

    seen = []
    num_pages = llm_module._num_pages

    def spy(engine, config, param_bytes, *rest):
        seen.append(param_bytes)
        return num_pages(engine, config, param_bytes, *rest)

    monkeypatch.setattr(llm_module, "_num_pages", spy)
    llm = LLM(qwen3[0], warmup=False, progress=False)
    weights = _bytes(llm.runner.params)
    assert seen == [weights] and weights == _bytes(_placed_shapes(llm.config, llm.runner.params["embed"].dtype))


def test_weights_handed_over_on_the_device_are_not_counted_twice(qwen3, monkeypatch):
    """A LoadedModel whose params are already on the device: the memory in use before the LLM excludes them, or the
    pool would lose their bytes twice (a 30B model's weights left it no pages on an H200)."""
    import jax

    from nanojax import llm as llm_module
    from nanojax.llm import _bytes
    from nanojax.loader import load_model

    loaded = load_model(qwen3[0], "float32", place=jax.device_put)
    monkeypatch.setattr(llm_module, "_bytes_in_use", lambda: _bytes(loaded.params) + 123)
    seen = []
    num_pages = llm_module._num_pages

    def spy(engine, config, param_bytes, kv_heads, in_use, *rest):
        seen.append(in_use)
        return num_pages(engine, config, param_bytes, kv_heads, in_use, *rest)

    monkeypatch.setattr(llm_module, "_num_pages", spy)
    LLM(loaded, dtype="float32", warmup=False, progress=False).close()
    assert seen == [123]


def test_a_generate_calls_requests_reach_the_engine_together(qwen3, monkeypatch):
    """The engine loop's first step sees every request of a generate call however slowly they are prepared, so a
    call's batches (and preemptions, and bf16 rounding) do not depend on the loop thread's timing."""
    import time

    folder, _ = qwen3
    llm = LLM(folder, dtype="float32", page_size=4, max_model_len=96)
    sequence, schedule, seen = llm.core.output._sequence, llm.scheduler.schedule, []

    def slow_sequence(*args):
        time.sleep(0.05)  # the loop thread would run steps meanwhile if each request went in on its own
        return sequence(*args)

    def recording_schedule(**kw):
        seen.append(len(llm.scheduler.waiting) + len(llm.scheduler.running))
        return schedule(**kw)

    monkeypatch.setattr(llm.core.output, "_sequence", slow_sequence)
    monkeypatch.setattr(llm.scheduler, "schedule", recording_schedule)
    llm.generate(random_prompts(97, [5, 9, 3, 7], seed=8), GREEDY, use_tqdm=False)
    assert seen[0] == 4


def test_the_process_exits_cleanly_with_a_request_running(tmp_path):
    """At exit the engine loop stops after its current step and is waited for (a daemon thread inside a JAX call
    while the interpreter finalizes would abort the process), even with requests still running."""
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    script = tmp_path / "exit.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(root / 'scripts')!r})\n"
        "from random_model import random_params\n"
        "from nanojax import LLM, SamplingParams\n"
        "llm = LLM(random_params('tiny-llama'), decode_steps=2, max_model_len=4096)\n"
        "stream = llm.add_request([1, 2, 3], SamplingParams(max_tokens=4000, ignore_eos=True))\n"
        "next(iter(stream))\n"
        "print('exiting', flush=True)\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "PYTHONPATH": str(root)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "exiting" in done.stdout


def test_the_loop_waits_for_work_without_holding_the_llm(qwen3, monkeypatch):
    """An idle loop's thread waits a while for the next request (a new thread per request cost ~0.5 ms of each
    first token) holding the LLM only weakly: the next request reuses it, an unused LLM is freed at once, and the
    thread ends when the wait runs out."""
    import gc
    import threading
    import time
    import weakref

    from nanojax import engine

    monkeypatch.setattr(engine, "LINGER_S", 1.0)
    folder, model = qwen3
    llm = LLM(folder, dtype="float32", page_size=4, max_model_len=96)
    prompts = random_prompts(97, [5, 9], seed=12)
    expected = hf_greedy(model, prompts[1], 8)
    others = {t for t in threading.enumerate() if t.name == engine.LOOP_THREAD}  # other tests' LLMs' loops

    def loop_thread():
        loops = [t for t in threading.enumerate() if t.name == engine.LOOP_THREAD and t not in others]
        assert len(loops) == 1
        return loops[0]

    first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)[0]
    thread = loop_thread()
    second = llm.generate(prompts[1:], GREEDY, use_tqdm=False)[0]
    assert loop_thread() is thread  # still waiting when the second request came
    assert second.token_ids == expected
    thread.join(timeout=5)
    assert not thread.is_alive() and not llm.core._running  # the wait ran out
    monkeypatch.setattr(engine, "LINGER_S", 60.0)
    assert llm.generate(prompts[:1], GREEDY, use_tqdm=False)[0].token_ids == first.token_ids  # a new thread
    ref, thread = weakref.ref(llm), loop_thread()
    del llm
    deadline = time.monotonic() + 10  # (the loop may still be finishing its last step when generate returns)
    while gc.collect() is not None and ref() is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ref() is None  # freed while its loop waits (60 s); the thread then ends without waiting out the time
    thread.join(timeout=0.3)
    assert not thread.is_alive()


def test_close_gives_back_the_device_buffers_threads_and_requests(qwen3):
    """Three LLMs built and closed in one process leave no device buffer behind (`with`, close() with a request
    still running, and a plain del); a closed LLM refuses requests and closes again as a no-op. A caller's
    LoadedModel of device arrays keeps them."""
    import gc
    import time

    import jax

    from nanojax.loader import LoadedModel, load_model

    folder, model = qwen3
    gc.collect()
    before = {id(x) for x in jax.live_arrays()}
    prompt = random_prompts(97, [9], seed=60)[0]
    with LLM(folder, dtype="float32", page_size=4, max_model_len=96) as llm:
        assert llm.generate([prompt], GREEDY, use_tqdm=False)[0].token_ids == hf_greedy(model, prompt, 8)
    assert llm.closed and not llm.core._thread.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        llm.add_request(prompt, GREEDY)
    llm.close()

    llm = LLM(folder, dtype="float32", page_size=4, max_model_len=96)
    stream = llm.add_request(prompt, SamplingParams(max_tokens=80, ignore_eos=True))
    llm.close()
    assert list(stream)[-1].finish_reason in ("abort", "length")
    assert llm.page_manager.num_free_pages == llm.page_manager.num_pages

    llm = LLM(folder, dtype="float32", page_size=4, max_model_len=96)
    llm.generate([prompt], GREEDY, use_tqdm=False)
    del llm, stream
    deadline = time.monotonic() + 10  # (the loop may still be finishing its last step when generate returns)
    while gc.collect() is not None and not {id(x) for x in jax.live_arrays()} <= before:
        assert time.monotonic() < deadline, "an LLM deleted and collected left device buffers behind"
        time.sleep(0.05)

    loaded = load_model(folder, "float32")
    loaded = LoadedModel(loaded.config, jax.device_put(loaded.params), None)  # device arrays a caller holds
    LLM(loaded, dtype="float32", page_size=4, max_model_len=96).close()
    assert not any(x.is_deleted() for x in jax.tree.leaves(loaded.params))


def test_a_pool_too_small_for_one_sequence_is_an_error_naming_the_knobs(qwen3, monkeypatch):
    from nanojax import llm as llm_module

    monkeypatch.setattr(llm_module, "_device_limit", lambda: 1 << 16)  # a 64 KiB device
    with pytest.raises(ValueError, match=r"one sequence of max_model_len=96 needs 24.*memory_fraction.*num_pages"):
        LLM(qwen3[0], dtype="float32", page_size=4, max_model_len=96)



def test_chat_template_variables_reach_the_template(llm_with_text):
    tokenizer, chat = llm_with_text.tokenizer, [{"role": "user", "content": "the"}]
    before, tokenizer.chat_template = tokenizer.chat_template, (
        "{{ messages[0]['content'] }}{% if enable_thinking is false %}ab{% endif %}")
    try:
        assert llm_with_text.apply_chat_template(chat) == tokenizer.encode("the")
        assert llm_with_text.apply_chat_template(chat, template_kwargs={"enable_thinking": False}) == tokenizer.encode(
            "theab")
        with pytest.raises(ValueError, match=r"chat_template_kwargs may not set \['tools'\]"):
            llm_with_text.apply_chat_template(chat, template_kwargs={"tools": []})
    finally:
        tokenizer.chat_template = before
