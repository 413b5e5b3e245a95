"""The sampling step alone on the GPU: ms per step of `nanojax.sampling.sample` over random logits (fixed seed) for
mixes of sampling parameters, and the sampling_filters kernel alone per FilterConfig (the tuning behind its default;
docs/perf_notes.md, "Sampling").

    PYTHONPATH=$PWD python3 scripts/bench_sampling.py --batch 64
    PYTHONPATH=$PWD python3 scripts/bench_sampling.py --batch 64 --configs 32,512,4,3 16,1024,4,3 1,4096,16,3

Logits are N(0, 3) over Qwen3's vocabulary (151,936), temperature 0.7; a timed call runs 8 steps in a fori_loop, as
the decode loop does; each figure is the median of 20 calls, per step. Rows: none filtered, one row with top_p 0.9,
every row, one row with 5 logprobs, one row with top_k 50 and top_p 0.9, every row with 5 logprobs. A config is
SPLITS,BLOCK,NUM_WARPS,NUM_STAGES (pallas_kernels.sampling_filters.FilterConfig).
"""
import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).parents[1]))
from nanojax.ops import Ops  # noqa: E402
from nanojax.runner import sampling_batch  # noqa: E402
from nanojax.sampling import TokenTables, sample  # noqa: E402
from pallas_kernels.sampling_filters import FilterConfig, sampling_filters  # noqa: E402

VOCAB, STEPS = 151936, 8


def mixes(batch: int) -> dict[str, dict]:
    """name -> per-row sampling fields."""
    def rows(filtered=0, logprob_rows=0, top_k=0):
        return {"temperature": [0.7] * batch, "top_k": [top_k] * filtered + [0] * (batch - filtered),
                "top_p": [0.9] * filtered + [1.0] * (batch - filtered), "min_p": [0.0] * batch,
                "seeds": list(range(batch)), "counters": [0] * batch,
                "logprobs": [5] * logprob_rows + [0] * (batch - logprob_rows), "slots": [batch] * batch}
    return {"none": rows(), "one top-p": rows(1), "all top-p": rows(batch), "one logprobs": rows(0, 1),
            "one top-k+p": rows(1, 0, 50), "all logprobs": rows(0, batch)}


def median_ms(fn, *args) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(20):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times)) / STEPS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--configs", nargs="*", default=[], help="also time the kernel alone per FilterConfig")
    args = parser.parse_args()
    b = args.batch
    logits = jnp.asarray(np.random.default_rng(0).normal(0, 3, (b, VOCAB)).astype(np.float32))
    tables = TokenTables.create(b, VOCAB, VOCAB)
    batches = {name: jax.tree.map(jnp.asarray, sampling_batch(rows, b, b)) for name, rows in mixes(b).items()}

    @jax.jit
    def steps(x, s):  # the logits depend on the previous step's tokens, so that no step is hoisted
        def body(i, acc):
            return acc + sample(x + acc[:, None] * 0.0, s, tables, i, ops=Ops(pallas=True)).tokens
        return jax.lax.fori_loop(0, STEPS, body, jnp.zeros((b,), jnp.int32))

    print(f"sample(), batch {b}, ms a step")
    for name, s in batches.items():
        print(f"  {name:<14} {median_ms(steps, logits, s):8.3f}", flush=True)
    for text in args.configs:
        config = FilterConfig(*map(int, text.split(",")))

        @jax.jit
        def kernel_steps(x, s, config=config):
            def body(i, acc):
                out = sampling_filters(x + acc[:, None] * 0.0, s.temperature, s.top_k, s.top_p, s.min_p,
                                       s.logprobs, num_top=20, config=config)
                return acc + out[0] + out[2][:, 0]
            return jax.lax.fori_loop(0, STEPS, body, jnp.zeros((b,), jnp.int32))

        times = "  ".join(f"{name} {median_ms(kernel_steps, logits, s):.3f}" for name, s in batches.items())
        print(f"sampling_filters {text}: {times}", flush=True)


if __name__ == "__main__":
    main()
