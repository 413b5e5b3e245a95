"""A one-step dispatch's host cost, taken apart: the compiled program's call against its buffers' addresses (XLA
re-records a program's CUDA graph when an argument's or result's address changed since its last run), against its
number of array arguments, and the packed host buffer handed to the program against `jax.device_put` first.

    PYTHONPATH=$PWD python3 scripts/probe_call_cost.py --tokenizer DIR

Qwen3-0.6B with random weights, the masked one-step decode of one row (a constrained row alone); medians, ms a token
(host: until the call returns; total: until its results are ready).
"""
import argparse
import functools
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from random_model import loaded_model, random_hf_model  # noqa: E402

from nanojax import LLM  # noqa: E402
from nanojax import runner as R  # noqa: E402


def timed(fn, calls=60, skip=10) -> tuple[float, float]:
    """fn() -> (seconds until the call returned, its results) -> (host ms, total ms), medians."""
    host, total = [], []
    for _ in range(calls):
        start = time.perf_counter()
        seconds, results = fn()
        jax.block_until_ready(results)
        host.append(seconds)
        total.append(time.perf_counter() - start)
    return np.median(host[skip:]) * 1e3, np.median(total[skip:]) * 1e3


def address_cases(r) -> dict:
    """The masked one-step program called directly, its buffers' addresses kept or changed from call to call."""
    table, sampling = [list(range(4))], R.greedy_sampling(1, r.neutral_slot)
    masks = ([0], np.full((1, r.tables.allowed.shape[1]), -1, np.int32))
    p = R.Program(1, 1, masked=True)
    packed, layout = R.pack((R._padded([5], 1), *r._inputs(p, R._stacked(table, 1, r.pages_per_seq), [40], [1],
                                                            sampling, None), R._padded([1], 1), R._padded((), 1, -1),
                             r._mask_rows(1, *masks)))
    fn, args, kw = r._call(p)
    # The same program with its last tokens not donated: called again and again on one `last`.
    keep = jax.jit(R.packed_step.__wrapped__, static_argnames=("step", "layout", "static"), donate_argnums=(1, 2))
    kept_last = keep.trace(*args[:4], jax.ShapeDtypeStruct(packed.shape, jnp.uint8), step=fn, layout=layout,
                           static=tuple(sorted(kw.items()))).lower().compile(compiler_options=r.compiler_options(p))
    on_device, last, held = jax.device_put(packed), r.last + 0, []

    def call(program, last_tokens, inputs, hold=False):
        start = time.perf_counter()
        *outs, new_last, r.cache, r.tables = program(r.params, r.cache, r.tables, last_tokens, inputs)
        seconds = time.perf_counter() - start
        if hold:  # kept until after the next call, as the engine held a step's results before 6e0a64f
            held[:] = [outs]
        return seconds, (outs, new_last)

    def runner():
        start = time.perf_counter()
        pending = r.decode([5], table, [40], sampling, 1, masks=masks)
        return time.perf_counter() - start, pending._out

    def chained(inputs):
        seconds, (outs, r.last) = call(r._program(p), r.last, inputs)
        return seconds, outs

    return {"runner.decode": runner,
            "every address as before": lambda: call(kept_last, last, on_device),
            "previous results held": lambda: call(kept_last, last, on_device, hold=True),
            "a fresh device_put": lambda: call(kept_last, last, jax.device_put(packed)),
            "last donated, numpy buffer": lambda: chained(packed),
            "last donated, device_put": lambda: chained(jax.device_put(packed))}


def leaf_cases() -> dict:
    """A trivial program called with n arrays (unused but kept) beside a small state."""
    cases = {}
    for n in (1, 10, 50, 170, 400):
        params = {f"w{i}": jnp.full((256, 1024), i, jnp.bfloat16) for i in range(n)}
        program = jax.jit(lambda params, state, host: (state + host[0], host.sum()), keep_unused=True).lower(
            params, jnp.zeros(1024), np.zeros(4096, np.float32)).compile()
        state = [jnp.zeros(1024)]

        def call(program=program, params=params, state=state):
            start = time.perf_counter()
            state[0], total = program(params, state[0], np.zeros(4096, np.float32))
            return time.perf_counter() - start, total
        cases[f"{n} array arguments"] = call
    return cases


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--calls", type=int, default=60)
    args = ap.parse_args()
    from transformers import PreTrainedTokenizerFast
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(Path(args.tokenizer) / "tokenizer.json"),
                                        eos_token="<|im_end|>")
    loaded = loaded_model(random_hf_model(args.model, torch_dtype="bfloat16"))
    llm = LLM(type(loaded)(loaded.config, loaded.params, tokenizer), dtype="bfloat16", max_num_seqs=8,
              max_model_len=1024)
    cases = {**address_cases(llm.runner), **leaf_cases()}
    rows = [(label, *timed(run, args.calls, min(10, args.calls // 2))) for _ in range(2) for label, run in cases.items()]
    print(f"{'case':<30} {'host ms':>8} {'total ms':>9}")
    for label, host, total in rows:
        print(f"{label:<30} {host:8.3f} {total:9.3f}")


if __name__ == "__main__":
    main()
