"""Compiling the programs ahead (nanojax.compilation) and its workers (nanojax.compile_workers): processes that lower
and compile shares of the programs beside the engine's own share, store them in the executable cache, and leave the
tokens as they were."""
import logging
import threading
import time

import jax
import pytest
from conftest import random_prompts

from nanojax import LLM, SamplingParams, compilation, compile_workers
from nanojax.runner import Program

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
SMALL = dict(dtype="float32", page_size=4, max_model_len=32, max_num_seqs=2, max_num_batched_tokens=64,
             kernels="reference", warmup=False)


@pytest.fixture(autouse=True)
def no_persistent_cache():
    """On the CPU executables are stored only while JAX's persistent cache is off (nanojax.executable_cache)."""
    before = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    yield
    jax.config.update("jax_enable_compilation_cache", before)


def _compile_with_workers(folder, directory, monkeypatch):
    """-> (LLM whose runner compiled everything with 2 workers, the programs its own process lowered)."""
    llm = LLM(folder, **SMALL)
    runner = llm.runner
    runner.executable_dir = directory
    lowered_here, lower = [], runner.lower
    monkeypatch.setattr(runner, "lower", lambda p: lowered_here.append(p) or lower(p))
    compilation.compile_all(runner, progress=False, workers=2)
    return llm, lowered_here


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe"])
def test_workers_compile_their_shares_with_the_same_tokens(hf_model_dir, tmp_path, monkeypatch, name):
    folder, model = hf_model_dir(name)
    llm, lowered_here = _compile_with_workers(folder, tmp_path, monkeypatch)
    runner = llm.runner
    shares = compilation.shares(runner.programs(), 3)
    assert lowered_here == shares[0] and all(shares[1:])  # the engine lowered its own share only
    assert runner.compiles == len(runner.programs()) and runner.loaded == 0
    assert len(runner.worker_seconds) == 2  # each worker's times, from its spawn
    assert all(0 < w["ready"] <= w["job"] <= w["done"] and 0 < w["lowering"] < w["done"] - w["job"]
               for w in runner.worker_seconds)
    prompts = random_prompts(model.config.vocab_size, [3, 21, 9], seed=4)
    expected = [o.token_ids for o in LLM(folder, **SMALL).generate(prompts, GREEDY, use_tqdm=False)]
    assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
    assert runner.compiles == len(runner.programs())  # nothing compiled on the way


def test_a_cascade_decode_is_dealt_and_compiled_after_its_twin(hf_model_dir, tmp_path, monkeypatch):
    """Its GEMMs are its twin's: compiled after it, in the same process, they find XLA's tuning of them."""
    folder, _ = hf_model_dir("qwen3")
    runner = LLM(folder, **{**SMALL, "max_num_seqs": 16}).runner
    programs = runner.programs()
    cascades = [p for p in programs if isinstance(p, Program) and p.cascade]
    assert len(cascades) == 2
    for n in (1, 2, 3, 5):
        shares = compilation.shares(programs, n)
        assert sorted(map(str, sum(shares, []))) == sorted(map(str, programs))
        for p in cascades:
            share = next(s for s in shares if p in s)
            assert share[share.index(p) - 1] == compilation.twin(p)
    spans, lock = {}, threading.Lock()

    def compile_and_store(directory, key, lowered, options):
        start = time.perf_counter()
        time.sleep(0.05)
        with lock:
            spans[lowered] = (start, time.perf_counter())

    monkeypatch.setattr(runner, "lower", lambda p: p)  # the "lowered" program is the program itself
    monkeypatch.setattr("nanojax.executable_cache.compile_and_store", compile_and_store)
    compilation.compile_programs(runner, programs, dict.fromkeys(programs, "key"), threads=8)
    assert len(spans) == len(programs)
    for p in cascades:
        assert spans[p][0] >= spans[compilation.twin(p)][1]


def test_a_failed_worker_leaves_its_programs_to_the_engine(hf_model_dir, tmp_path, monkeypatch, caplog):
    folder, _ = hf_model_dir("qwen3")
    monkeypatch.setattr(compile_workers.sys, "executable", "false")  # each worker exits 1 at once
    with caplog.at_level(logging.WARNING, logger="nanojax.compile_workers"):
        llm, lowered_here = _compile_with_workers(folder, tmp_path, monkeypatch)
    assert sum("compile worker exited with 1" in r.message for r in caplog.records) == 2
    assert llm.runner.worker_seconds == []  # no times from a failed worker
    assert sorted(map(str, lowered_here)) == sorted(map(str, llm.runner.programs()))  # all compiled here
    assert llm.runner.compiles == len(llm.runner.programs())
    prompts = random_prompts(97, [5, 12], seed=8)
    expected = [o.token_ids for o in LLM(folder, **SMALL).generate(prompts, GREEDY, use_tqdm=False)]
    assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected


def test_workers_need_the_executable_cache(hf_model_dir):
    folder, _ = hf_model_dir("qwen3")
    with pytest.raises(ValueError, match="executable_dir is None"):
        compilation.compile_all(LLM(folder, **SMALL).runner, progress=False, workers=2)


def test_an_error_in_the_engines_compile_stops_the_workers(hf_model_dir, tmp_path, monkeypatch):
    folder, _ = hf_model_dir("qwen3")
    runner = LLM(folder, **SMALL).runner
    runner.executable_dir = tmp_path
    started = []
    spawn = compile_workers.spawn
    monkeypatch.setattr(compile_workers, "spawn", lambda: started.append(spawn()) or started[-1])

    def fail(p):
        raise RuntimeError("lowering failed")

    monkeypatch.setattr(runner, "lower", fail)
    with pytest.raises(RuntimeError, match="lowering failed"):
        compilation.compile_all(runner, progress=False, workers=2)
    assert len(started) == 2 and all(w.process.returncode is not None for w in started)
    assert not any(tmp_path.rglob("*.jaxexe"))  # killed before they stored anything


def test_workers_spawned_ahead_take_the_shares_or_are_stopped(hf_model_dir, tmp_path, monkeypatch):
    """LLM spawns workers before it loads the weights on a build's first start; compile_all hands them their shares,
    and stops those it has none for (here all: the second runner finds every program in the cache)."""
    folder, _ = hf_model_dir("qwen3")
    first = LLM(folder, **SMALL).runner
    first.executable_dir = tmp_path
    ahead = [compile_workers.spawn() for _ in range(2)]
    compilation.compile_all(first, progress=False, workers=ahead)
    assert not ahead and first.compiles == len(first.programs()) and first.loaded == 0
    second = LLM(folder, **SMALL).runner
    second.executable_dir = tmp_path
    ahead = [compile_workers.spawn() for _ in range(2)]
    processes = [w.process for w in ahead]
    compilation.compile_all(second, progress=False, workers=ahead)
    assert not ahead and all(p.returncode is not None for p in processes)
    assert second.loaded == len(second.programs()) and second.compiles == 0


def test_a_worker_without_a_job_exits():
    worker = compile_workers.spawn()
    worker.process.stdin.close()
    assert worker.process.wait(timeout=120) == 0
    worker.out.seek(0)
    assert worker.out.read() == b""  # no times without a job
    worker.out.close()
    worker.log.close()


def _runner_from_shapes(runner, config=None, **changes):
    """The runner LLM builds from the params' shapes while the weights load, with `runner`'s arguments (and config,
    unless another is given)."""
    from nanojax.llm import _placed_shapes
    from nanojax.runner import ModelRunner

    config = config or runner.config
    shapes = _placed_shapes(config, runner.params["embed"].dtype)
    return ModelRunner(config, params=shapes, **{**runner.rebuild_kwargs, "executable_dir": runner.executable_dir,
                                                 **changes})


def test_a_runner_from_placed_shapes_has_the_programs_keys(hf_model_dir):
    """Keys computed before the weights exist (the params' shapes from the config, placed on the device) equal those
    of the runner built on the converted weights: what lets workers start compiling while the weights convert."""
    folder, _ = hf_model_dir("qwen3")
    runner = LLM(folder, **{**SMALL, "max_num_seqs": 16}).runner
    early = _runner_from_shapes(runner)
    assert compilation.program_keys(early, runner.programs()) == compilation.program_keys(runner, runner.programs())


def test_the_programs_keys_do_not_depend_on_the_tokenizer(hf_model_dir):
    """The vocabulary limit (the tokenizer's length) is data in the token tables: a runner built before the tokenizer
    is read computes the programs' keys of the runner that knows it, so that the hand-out need not wait for it."""
    folder, _ = hf_model_dir("qwen3")
    runner = LLM(folder, **SMALL).runner
    limited = _runner_from_shapes(runner, vocab_limit=50)
    assert limited.vocab_limit == 50 and runner.vocab_limit == runner.config.vocab_size
    assert compilation.program_keys(limited, runner.programs()) == compilation.program_keys(runner, runner.programs())


def test_programs_handed_out_before_the_weights_are_waited_for(hf_model_dir, tmp_path, monkeypatch):
    """hand_out (a runner from shapes, while the weights load) deals every program over the workers; the runner
    built on the weights waits for them and loads the programs: the same tokens."""
    folder, _ = hf_model_dir("qwen3")
    llm = LLM(folder, **SMALL)
    runner = llm.runner
    runner.executable_dir = tmp_path
    ahead = [compile_workers.spawn() for _ in range(2)]
    compilation.hand_out(_runner_from_shapes(runner), ahead)
    assert all(w.job for w in ahead)
    lowered_here, lower = [], runner.lower
    monkeypatch.setattr(runner, "lower", lambda p: lowered_here.append(p) or lower(p))
    compilation.compile_all(runner, progress=False, workers=ahead)
    assert not lowered_here
    assert runner.compiles == len(runner.programs()) and runner.loaded == 0
    prompts = random_prompts(97, [3, 21, 9], seed=4)
    expected = [o.token_ids for o in LLM(folder, **SMALL).generate(prompts, GREEDY, use_tqdm=False)]
    assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected


def test_programs_handed_out_for_another_config_are_compiled_anew(hf_model_dir, tmp_path, monkeypatch):
    """A worker handed programs for another config (LLM's hand-out from config.json as written, where it differs from
    transformers' normalized config) is of no use: it is stopped, a worker is spawned in its place, and the runner's
    own programs are compiled: the same tokens."""
    import dataclasses

    folder, _ = hf_model_dir("qwen3")
    llm = LLM(folder, **SMALL)
    runner = llm.runner
    runner.executable_dir = tmp_path
    ahead = [compile_workers.spawn()]
    stale = ahead[0].process
    other = dataclasses.replace(runner.config, eos_token_ids=(*runner.config.eos_token_ids, 3))
    compilation.hand_out(_runner_from_shapes(runner, config=other), ahead)
    spawned, spawn = [], compile_workers.spawn
    monkeypatch.setattr(compile_workers, "spawn", lambda: spawned.append(spawn()) or spawned[-1])
    compilation.compile_all(runner, progress=False, workers=ahead)
    assert stale.returncode is not None and not ahead and len(spawned) == 1
    assert runner.compiles == len(runner.programs()) and runner.loaded == 0
    prompts = random_prompts(97, [3, 21, 9], seed=5)
    expected = [o.token_ids for o in LLM(folder, **SMALL).generate(prompts, GREEDY, use_tqdm=False)]
    assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected


_FORKED = r"""
import os
import select
import sys
from nanojax import LLM, SamplingParams, compilation, compile_workers

folder, directory = sys.argv[1:]
import threading
other = threading.Thread(target=threading.Event().wait, args=(5,))
other.start()
assert compile_workers.fork_ahead(1) == []  # beside another Python thread
other.join()
held_r, held_w = os.pipe()  # a descriptor of this process's, which no worker may keep open
forked = compile_workers.fork_ahead(3)  # before this process starts a backend
assert len(forked) == 3, forked
os.close(held_w)
assert select.select([held_r], [], [], 60)[0] and os.read(held_r, 1) == b""
unstarted, idle, busy = forked
compile_workers.stop(unstarted)  # stopped while it waits for start: killed, nothing run
assert unstarted.process.returncode < 0
compile_workers.start([idle, busy])
idle.process.stdin.close()  # started without a job: exits cleanly, no times
assert compile_workers.wait(idle) is None and idle.process.returncode == 0
import jax
jax.config.update("jax_enable_compilation_cache", False)
llm = LLM(folder, dtype="float32", page_size=4, max_model_len=32, max_num_seqs=2, max_num_batched_tokens=64,
          kernels="reference", warmup=False)
assert compile_workers.fork_ahead(1) == []  # the backend is up now
runner = llm.runner
runner.executable_dir = directory
lowered_here, lower = [], runner.lower
runner.lower = lambda p: lowered_here.append(p) or lower(p)
compilation.compile_all(runner, progress=False, workers=[busy])
assert runner.compiles == len(runner.programs()) and busy.process.returncode == 0, runner.worker_seconds
assert len(runner.worker_seconds) == 1 and 0 < len(lowered_here) < len(runner.programs())
greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
print([o.token_ids for o in llm.generate([[1, 2, 3], [4, 5, 6, 7, 8]], greedy, use_tqdm=False)])
"""


def test_workers_forked_before_the_backend_compile_their_shares(hf_model_dir, tmp_path):
    """In a fresh process (a backend started here would not survive a fork): none is forked beside another thread;
    workers forked ahead hold none of its descriptors, and are stopped, or started and exit without a job, or compile
    a share as spawned ones do, giving the tokens of programs compiled here (this process's backend is up, so it forks
    no more)."""
    import subprocess
    import sys

    folder, _ = hf_model_dir("qwen3")
    out = subprocess.run([sys.executable, "-c", _FORKED, str(folder), str(tmp_path)], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    llm = LLM(folder, **SMALL)
    expected = [o.token_ids for o in llm.generate([[1, 2, 3], [4, 5, 6, 7, 8]], GREEDY, use_tqdm=False)]
    assert out.stdout.strip().splitlines()[-1] == str(expected)


def test_no_fork_once_a_backend_started():
    jax.devices()
    assert compile_workers.fork_ahead(2) == []
