"""64 constrained rows' next-token masks (the 30-field schema of bench_structured.py, each row drawing uniformly among
its allowed tokens) filled by llguidance's executor with 1 to 16 threads, and one by one: from copies of one compiled
matcher (which share its lexer under one lock) and from independently compiled ones. ms a step, medians.

    PYTHONPATH=$PWD python3 scripts/probe_mask_threads.py --tokenizer DIR
"""
import argparse
import sys
import time
from pathlib import Path

import llguidance
import llguidance.numpy
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_structured import schema  # noqa: E402
from random_model import saved_tokenizer  # noqa: E402

from nanojax.structured import Grammars, StructuredOutputs  # noqa: E402


def step_times(matchers, vocab: int, steps: int, threads=(1, 4, 8, 12, 16)) -> dict:
    """{method: [ms a step]}: each method fills fresh copies of the rows' matchers at the same state."""
    rng, times = np.random.default_rng(0), {}
    executors = {n: llguidance.LLExecutor(n) for n in threads}
    for _ in range(steps):
        live = [m for m in matchers if not m.is_stopped()]
        masks = llguidance.numpy.allocate_token_bitmask(len(live), vocab)
        for n, executor in executors.items():
            copies = [m.deep_copy() for m in live]
            start = time.perf_counter()
            llguidance.numpy.fill_next_token_bitmask_par(executor, list(zip(copies, range(len(live)))), masks)
            times.setdefault(f"{n} threads", []).append(time.perf_counter() - start)
        copies = [m.deep_copy() for m in live]
        start = time.perf_counter()
        for i, m in enumerate(copies):
            llguidance.numpy.fill_next_token_bitmask(m, masks, i)
        times.setdefault("one by one", []).append(time.perf_counter() - start)
        bits = np.unpackbits(masks.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
        for i, m in enumerate(live):
            m.consume_token(int(rng.choice(np.flatnonzero(bits[i]))))
    return times


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()
    tokenizer = saved_tokenizer(args.tokenizer)
    constraint = StructuredOutputs(json=schema())
    copies, independent = Grammars(tokenizer, roots=1), Grammars(tokenizer, roots=args.rows)
    cases = {"copies of one compiled matcher": [copies.matcher(constraint) for _ in range(args.rows)],
             "independently compiled": [independent.matcher(constraint) for _ in range(args.rows)]}
    for label, matchers in cases.items():
        times = step_times(matchers, len(tokenizer), args.steps)
        print(f"{label}: " + "  ".join(f"{k} {np.median(v) * 1e3:.2f}" for k, v in times.items()), flush=True)


if __name__ == "__main__":
    main()
