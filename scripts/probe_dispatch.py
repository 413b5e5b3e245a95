"""Where a dispatch's host time goes: building and packing the step's host arrays, their copy to the device, the
compiled program's call (until it returns), and the wait for its tokens; then the copy of the same arrays as a
tuple against one buffer.

    PYTHONPATH=$PWD python3 scripts/probe_dispatch.py [--max-num-seqs 64]

Qwen3-0.6B (or `--model`), random weights and KV, Pallas kernels: a decode of batch 64 x 8 steps at context 512,
a prefill of 256 tokens, and a mixed step (the 256 prompt tokens with the 64 rows' decode step in one forward; its
program has `--max-num-seqs` decode rows). Medians of 20 calls, ms. The runner's functions are wrapped with timers
(jax's device_put too, for this process).
"""
import argparse
import collections
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_decode import PAGE, make_runner, random_cache, shared_tables, variant_params  # noqa: E402
from random_model import model_config  # noqa: E402

import nanojax.runner as runner_module  # noqa: E402
from nanojax.runner import greedy_sampling  # noqa: E402

BATCH, CONTEXT, STEPS, PROMPT = 64, 512, 8, 256
TIMES = collections.defaultdict(list)


def timed(name, fn):
    def wrapper(*args, **kw):
        start = time.perf_counter()
        out = fn(*args, **kw)
        TIMES[name].append(time.perf_counter() - start)
        return out
    return wrapper


def median_ms(xs) -> float:
    return 1e3 * float(np.median(xs)) if xs else 0.0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-num-seqs", type=int, default=256, help="the runner's rows (a mixed step's decode rows)")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--kernels", default="pallas", choices=["pallas", "reference"], help="reference: a CPU smoke run")
    args = ap.parse_args()
    c = model_config(args.model)
    params, _ = variant_params(args.model, c, None, "none", 0)
    pps = -(-(CONTEXT + PROMPT + STEPS) // PAGE)
    r = make_runner(c, params, None, args.kernels, batch=args.max_num_seqs, num_pages=BATCH * pps + 64,
                    pages_per_seq=pps, prefill=2048, steps=STEPS)
    random_cache(r, jax.random.key(0))
    tables, _ = shared_tables(r, BATCH, 0, 1, CONTEXT + PROMPT, STEPS)
    put, pack = jax.device_put, runner_module.pack
    runner_module.jax.device_put = timed("device_put", put)
    runner_module.pack = timed("pack", pack)
    inputs, program = runner_module.ModelRunner._inputs, runner_module.ModelRunner._program
    runner_module.ModelRunner._inputs = timed("inputs", inputs)
    runner_module.ModelRunner._program = lambda self, p: timed("call", program(self, p))
    sampling = greedy_sampling(BATCH, r.tables.neutral)
    tokens = np.random.default_rng(0).integers(0, 1000, BATCH).tolist()
    prompt = np.random.default_rng(1).integers(0, 1000, PROMPT).tolist()
    chunk = (prompt, tables[0][:-(-PROMPT // PAGE)], PROMPT, {k: v[0] for k, v in sampling.items()})
    cases = {
        f"decode {BATCH} x {STEPS}": lambda: r.decode(tokens, tables, [CONTEXT] * BATCH, sampling, num_steps=STEPS),
        f"prefill {PROMPT}": lambda: r.prefill([chunk])[0][0],
        f"mixed {PROMPT} + {BATCH}": lambda: r.prefill([chunk], decodes=(tokens, tables, [CONTEXT] * BATCH,
                                                                         sampling))[0][0],
    }
    for name, run in cases.items():
        for _ in range(3):
            run().tokens()
        TIMES.clear()
        for _ in range(args.calls):
            start = time.perf_counter()
            pending = run()
            TIMES["dispatch"].append(time.perf_counter() - start)
            pending.tokens()
            TIMES["wall"].append(time.perf_counter() - start)
        print(f"{name:<16} wall {median_ms(TIMES['wall']):7.3f} | dispatch {median_ms(TIMES['dispatch']):7.3f} "
              f"(inputs {median_ms(TIMES['inputs']):.3f}, pack {median_ms(TIMES['pack']):.3f}, device_put "
              f"{median_ms(TIMES['device_put']):.3f}, call {median_ms(TIMES['call']):.3f})", flush=True)
    host = (np.zeros(BATCH, np.int32), *inputs(r, runner_module.Program(BATCH, STEPS), r._page_table(BATCH, tables),
                                              [CONTEXT] * BATCH, [1] * BATCH, sampling), np.zeros(BATCH, np.int32))
    flat = pack(host)[0]
    for label, x in (("tuple", host), ("one buffer", flat)):
        times = []
        for _ in range(30):
            start = time.perf_counter()
            jax.block_until_ready(put(x))
            times.append(time.perf_counter() - start)
        print(f"device_put of a decode's host arrays as {label}: {len(jax.tree.leaves(x))} arrays, {flat.nbytes} "
              f"bytes, {median_ms(times):.3f} ms")


if __name__ == "__main__":
    main()
