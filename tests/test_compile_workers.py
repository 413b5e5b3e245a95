"""Compile workers (nanojax.compile_workers): processes that lower and compile the prefill programs beside the
engine's own compiles, store them in the executable cache, and leave the tokens as they were."""
import logging

import jax
import pytest
from conftest import random_prompts

from nanojax import LLM, SamplingParams, compile_workers
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
    lowered_here, lower = [], runner._lower
    monkeypatch.setattr(runner, "_lower", lambda p: lowered_here.append(p) or lower(p))
    runner.compile_all(progress=False, workers=2)
    return llm, lowered_here


def test_workers_compile_the_prefill_programs_with_the_same_tokens(hf_model_dir, tmp_path, monkeypatch):
    folder, _ = hf_model_dir("qwen3")
    llm, lowered_here = _compile_with_workers(folder, tmp_path, monkeypatch)
    runner = llm.runner
    prefills = [p for p in runner.programs() if isinstance(p, Program) and not p.num_steps]
    assert len(prefills) == 2 and not set(prefills) & set(lowered_here)  # each went to a worker of its own
    assert set(lowered_here) == set(runner.programs()) - set(prefills)
    assert runner.compiles == len(runner.programs()) and runner.loaded == 0
    prompts = random_prompts(97, [3, 21, 9], seed=4)
    expected = [o.token_ids for o in LLM(folder, **SMALL).generate(prompts, GREEDY, use_tqdm=False)]
    assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
    assert runner.compiles == len(runner.programs())  # nothing compiled on the way


def test_a_failed_worker_leaves_its_programs_to_the_engine(hf_model_dir, tmp_path, monkeypatch, caplog):
    folder, _ = hf_model_dir("qwen3")
    monkeypatch.setattr(compile_workers.sys, "executable", "false")  # each worker exits 1 at once
    with caplog.at_level(logging.WARNING, logger="nanojax.compile_workers"):
        llm, lowered_here = _compile_with_workers(folder, tmp_path, monkeypatch)
    assert sum("compile worker exited with 1" in r.message for r in caplog.records) == 2
    assert sorted(map(str, lowered_here)) == sorted(map(str, llm.runner.programs()))  # all compiled here
    assert llm.runner.compiles == len(llm.runner.programs())
    prompts = random_prompts(97, [5, 12], seed=8)
    expected = [o.token_ids for o in LLM(folder, **SMALL).generate(prompts, GREEDY, use_tqdm=False)]
    assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected


def test_workers_need_the_executable_cache(hf_model_dir):
    folder, _ = hf_model_dir("qwen3")
    with pytest.raises(ValueError, match="executable_dir is None"):
        LLM(folder, **SMALL).runner.compile_all(progress=False, workers=2)


def test_an_error_in_the_engines_compile_stops_the_workers(hf_model_dir, tmp_path, monkeypatch):
    folder, _ = hf_model_dir("qwen3")
    runner = LLM(folder, **SMALL).runner
    runner.executable_dir = tmp_path
    started = []
    start = compile_workers.start
    monkeypatch.setattr(compile_workers, "start", lambda job: started.append(start(job)) or started[-1])

    def fail(p):
        raise RuntimeError("lowering failed")

    monkeypatch.setattr(runner, "_lower", fail)
    with pytest.raises(RuntimeError, match="lowering failed"):
        runner.compile_all(progress=False, workers=2)
    assert len(started) == 2 and all(w.process.returncode is not None for w in started)
    assert not any(tmp_path.rglob("*.jaxexe"))  # killed before they stored anything
