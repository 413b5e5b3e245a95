"""Several processes, one model (nanojax.distributed): two processes on 127.0.0.1, each with two CPU devices, run one
tensor-parallel model of size 4. Process 0's engine gives HF's float32 greedy tokens through prefix-cache hits,
chunked prefill and preemption, and the single-device engine's tokens and logprobs with penalties and logit bias
(token-table writes, which leave the same tables on both processes); process 1 follows until process 0 closes, and
both exit cleanly. README's launch command does the same through the CLI.

This file is also the worker each process runs: `python tests/test_distributed.py FOLDER COORDINATOR ID IO`."""
import contextlib
import hashlib
import json
import os
import re
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from nanojax import LLM, SamplingParams, distributed
from nanojax.sharding import TensorParallel

PROCESSES, DEVICES_PER_PROCESS = 2, 2
# 8 query heads, 2 KV heads (replicated over the 4 devices), an odd vocabulary (padded to 104 over the shards).
SPEC = dict(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=2, vocab_size=101, tie_word_embeddings=False, max_position_embeddings=256)
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
ADJUSTED = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, repetition_penalty=1.5,
                          logit_bias={3: 2.0, 7: -100.0}, logprobs=2)
TIMEOUT_S = 240  # for the whole job (~30 s on 2 idle cores): a hang fails the test instead of the CI run


def engine(folder: str) -> LLM:
    """A small pool (preemption), a small step budget (chunked prefill); one decode step per dispatch, so that
    fewer programs compile (the launch-command test runs multi-step decodes)."""
    return LLM(folder, dtype="float32", page_size=4, max_model_len=64, num_pages=16, max_num_seqs=4,
               max_num_batched_tokens=16, decode_steps=1, progress=False)


def adjusted(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[float], list[list[int]]]]:
    """Penalties and bias (token-table writes: set_slot), logprobs: each output's (tokens, their logprobs, top 2)."""
    outs = llm.generate(prompts[:2], ADJUSTED, use_tqdm=False)
    return [(o.token_ids, [lp for lp, _ in o.logprobs], [list(top) for _, top in o.logprobs]) for o in outs]


def worker(folder: str, coordinator: str, process_id: int, io: str) -> None:
    distributed.initialize(coordinator, PROCESSES, process_id)
    assert (jax.device_count(), jax.local_device_count()) == (PROCESSES * DEVICES_PER_PROCESS, DEVICES_PER_PROCESS)
    assert distributed.min_over_processes(10 + process_id) == 10
    llm = engine(folder)  # every device of every process: tensor-parallel size 4
    assert llm.runner.cache.k[0].sharding.mesh.size == 4
    with pytest.raises(ValueError, match="a job of 2 processes splits the model over all its 4 devices"):
        TensorParallel.create(llm.config, 2)
    if process_id:
        llm.follow()
        write_tables(llm, io, process_id)
    else:
        drive(llm, io)


def write_tables(llm: LLM, io: str, process_id: int) -> None:
    """The replicated token tables, as this process holds them (before close() frees them)."""
    with open(f"{io}/tables{process_id}.txt", "w") as f:
        f.write(hashlib.sha256(b"".join(np.asarray(x.addressable_data(0)).tobytes()
                                        for x in jax.tree.leaves(llm.runner.tables))).hexdigest())


def drive(llm: LLM, io: str) -> None:
    with open(f"{io}/prompts.json") as f:
        prompts = json.load(f)
    first = llm.generate([prompts[0]], GREEDY, use_tqdm=False)[0]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)  # the shared prefix now cached
    result = dict(greedy=[first.token_ids] + [o.token_ids for o in outs], adjusted=adjusted(llm, prompts),
                  cached=outs[0].num_cached_tokens, preemptions=llm.scheduler.num_preemptions)
    write_tables(llm, io, 0)
    llm.close()
    with open(f"{io}/result.json", "w") as f:
        json.dump(result, f)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(command, io) -> list[tuple[int, str, str]]:
    """Runs command(coordinator, process_id) as each process of a job on 127.0.0.1 to the end (killing the others
    once one fails, and all past TIMEOUT_S); -> each one's (return code, stdout, stderr)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the processes import nanojax from here
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count="
           f"{DEVICES_PER_PROCESS}", "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    coordinator = f"127.0.0.1:{_free_port()}"
    logs = [(io / f"out{i}.txt", io / f"err{i}.txt") for i in range(PROCESSES)]
    with contextlib.ExitStack() as files:
        procs = [subprocess.Popen(command(coordinator, i), env=env, stdout=files.enter_context(open(out, "w")),
                                  stderr=files.enter_context(open(err, "w"))) for i, (out, err) in enumerate(logs)]
        deadline = time.monotonic() + TIMEOUT_S
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline or any(p.returncode for p in procs):
                for p in procs:
                    if p.poll() is None:
                        p.kill()
            time.sleep(0.2)
    return [(p.returncode, out.read_text(), err.read_text()) for p, (out, err) in zip(procs, logs)]


def _check_exits(finished) -> None:
    for i, (code, _, err) in enumerate(finished):
        assert code == 0, f"process {i} ended with {code}:\n{err[-4000:]}"


def test_two_processes_run_one_model(tmp_path):
    from conftest import build_hf_model, hf_greedy, random_prompts

    model = build_hf_model(SPEC)
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    prefix = random_prompts(SPEC["vocab_size"], [9], seed=5)[0]
    rest = random_prompts(SPEC["vocab_size"], [6, 3, 23, 1], seed=6)
    prompts = [prefix + rest[0], prefix + rest[1], rest[2], prefix + rest[3]]
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))

    _check_exits(_launch(lambda coordinator, i: [sys.executable, __file__, str(folder), coordinator, str(i),
                                                 str(tmp_path)], tmp_path))
    result = json.loads((tmp_path / "result.json").read_text())
    expected = [hf_greedy(model, p, GREEDY.max_tokens) for p in prompts]
    assert result["greedy"] == expected[:1] + expected
    assert result["cached"] > 0 and result["preemptions"] > 0
    for (tokens, logprobs, top), want in zip(result["adjusted"], adjusted(engine(str(folder)), prompts)):
        assert (tokens, top) == (want[0], want[2])
        np.testing.assert_allclose(logprobs, want[1], rtol=1e-5, atol=1e-6)  # float32 sums in another order
    assert (tmp_path / "tables0.txt").read_text() == (tmp_path / "tables1.txt").read_text()


def test_the_launch_command(tmp_path):
    """README's command, run on each process: process 0 prints HF's greedy reply, process 1 prints nothing."""
    from conftest import build_hf_model, hf_greedy
    from test_sampling import byte_tokenizer

    model, tokenizer = build_hf_model(SPEC), byte_tokenizer(SPEC["vocab_size"])
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    finished = _launch(lambda coordinator, i: [
        sys.executable, "-m", "nanojax.generate", "--model", str(folder), "--prompt", "the", "--raw", "--max-tokens",
        "8", "--dtype", "float32", "--coordinator", coordinator, "--num-processes", str(PROCESSES),
        "--process-id", str(i)], tmp_path)
    _check_exits(finished)
    reply = hf_greedy(model, tokenizer.encode("the"), 8)
    printed = [_without_gloo(out) for _, out, _ in finished]
    assert printed == [tokenizer.decode(reply, skip_special_tokens=True), ""]


# gloo's start-up lines (CPU collectives only), written by several threads at once in pieces (the numbers apart from
# the words), so a line can hold any mix of pieces of several lines: "3" alone, or "[Gloo] Rank 1[Gloo] Rank 0".
_GLOO_LINE = "[Gloo] Rank 0 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3"
_GLOO_PIECE = re.compile("|".join(re.escape(w) for w in _GLOO_LINE.split() if not w.isdigit()) + r"|\d+|\s")


def _without_gloo(out: str) -> str:
    """A process's stdout without the lines made only of pieces of gloo's start-up lines."""
    return "".join(line for line in out.splitlines(True) if _GLOO_PIECE.sub("", line))


def test_bad_settings_are_refused(monkeypatch):
    with pytest.raises(ValueError, match="go together"):
        distributed.initialize("127.0.0.1:1234")
    with pytest.raises(ValueError, match="'host:port'"):
        distributed.initialize("127.0.0.1", 2, 0)
    with pytest.raises(ValueError, match=r"process_id must be in \[0, num_processes\)"):
        distributed.initialize("127.0.0.1:1234", 2, 2)
    monkeypatch.setenv(distributed.ENV_NUM_PROCESSES, "two")
    with pytest.raises(ValueError, match="NANOJAX_NUM_PROCESSES"):
        distributed.initialize("127.0.0.1:1234", None, 0)


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
