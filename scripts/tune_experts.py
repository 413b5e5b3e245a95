"""Times a mixture-of-experts layer's experts (up, SwiGLU, down, the weighted sum and the residual; nanojax.moe.moe_mlp)
on the GPU over tilings of pallas_kernels/expert_matmul.py (decode sizes) and grouped_matmul.py (more rows), beside
XLA, at decode and prefill sizes of Qwen3-30B-A3B (128 experts, top 8, hidden 2048, expert width 768, bf16 or FP8).

    python scripts/tune_experts.py                 # on the GPU; a table of microseconds a layer and TB/s
    python scripts/tune_experts.py --tiny          # CPU smoke test (interpret mode)

A timed call runs the layer over --layers distinct weight sets (so weights come from HBM, not L2), each layer's input
the previous one's output; bandwidth is the bytes of the experts the rows choose over the time.
"""
import argparse
import functools
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from convert.quantize import quantize_weight
from nanojax.moe import moe_mlp
from pallas_kernels.expert_matmul import (ExpertMatmulConfig, expert_combine, expert_combine_reference, expert_swiglu,
                                          expert_swiglu_reference)
from pallas_kernels.grouped_matmul import GroupedMatmulConfig, grouped_matmul, grouped_matmul_reference

QWEN3_30B_A3B = dict(experts=128, top_k=8, hidden=2048, width=768)
TINY = dict(experts=8, top_k=2, hidden=64, width=32)
# (block_n, block_k, num_warps) of expert_swiglu and of expert_combine, for rows <= experts / top k (the K slices
# unrolled); None: their defaults, timed first and last (the spread between the two: noise)
ROW_TILINGS = [None, ((8, 256, 4), (8, 256, 4)), ((16, 256, 4), (16, 256, 8)), ((32, 256, 4), (16, 256, 4)),
               ((16, 512, 4), (8, 256, 2)), ((32, 256, 8), (32, 256, 8)), None]
# (block_n, block_k, num_warps, num_stages) of grouped_matmul, for more rows; None: its default
GROUPED_TILINGS = [None, (64, 128, 4, 3), (128, 64, 4, 3), (128, 128, 4, 3)]


def quantize_experts(w):
    """w [E, N, K] -> (w_t [E, N, K] float8_e4m3fn, scale [E, N]), as convert/quantize.py stores experts."""
    q = jax.lax.map(lambda e: quantize_weight(e.T), w)
    return q["w_t"], q["scale"]


def time_layers(fn, xs, layers, repeats):
    """Median seconds of fn over all layers, each layer's output the next one's input."""
    @jax.jit
    def run(x, layers):
        for w, ids in layers:
            x = x + fn(x, w, ids)
        return x

    run(xs, layers).block_until_ready()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        run(xs, layers).block_until_ready()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 512, 4096])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--fp8", action="store_true", help="FP8 experts (convert/quantize.py's layout), default tilings")
    args = p.parse_args()
    shape = TINY if args.tiny else QWEN3_30B_A3B
    interpret = jax.default_backend() != "gpu"
    e, k, h, i = (shape[n] for n in ("experts", "top_k", "hidden", "width"))
    key = jax.random.key(0)
    layers, rng = [], np.random.default_rng(0)
    for _ in range(args.layers):
        key, ku, kd = jax.random.split(key, 3)
        up, down = (jax.random.normal(ku, (e, 2 * i, h), jnp.bfloat16) * 0.02,
                    jax.random.normal(kd, (e, h, i), jnp.bfloat16) * 0.02)
        if args.fp8:
            up, down = quantize_experts(up), quantize_experts(down)
        else:
            up, down = (up, None), (down, None)
        layers.append((up, down))
    expert_bytes = (h * 2 * i + i * h) * (1 if args.fp8 else 2)
    rows = []
    for n in args.tokens:
        ids = [jnp.asarray(np.stack([rng.choice(e, k, replace=False) for _ in range(n)]), jnp.int32)
               for _ in layers]
        weights = jnp.full((n, k), 1.0 / k, jnp.float32)
        chosen = statistics.mean(len(np.unique(np.asarray(x))) for x in ids)
        x = jax.random.normal(key, (n, h), jnp.bfloat16)
        xla = (expert_swiglu_reference, expert_combine_reference, grouped_matmul_reference)
        variants = {"xla": xla}
        if n * k <= e:
            for tiling in ROW_TILINGS:
                if args.tiny and tiling is not None:  # the defaults alone fit the tiny shapes
                    continue
                up, down = tiling or (None, None)
                kernels = [functools.partial(fn, config=c and ExpertMatmulConfig(*c[:2], num_warps=c[2]),
                                             interpret=interpret) for fn, c in ((expert_swiglu, up), (expert_combine,
                                                                                                      down))]
                label = "row " + ("default" if tiling is None else " + ".join("/".join(map(str, c)) for c in tiling))
                variants[label + " again" * (label in variants)] = (*kernels, grouped_matmul_reference)
        else:
            for tiling in GROUPED_TILINGS[:1] if args.fp8 or args.tiny else GROUPED_TILINGS:
                config = tiling and GroupedMatmulConfig(*tiling)
                kernel = functools.partial(grouped_matmul, config=config, interpret=interpret)
                label = "default" if tiling is None else "/".join(map(str, tiling))
                variants["grouped " + label] = (*xla[:2], kernel)
        want = None
        for name, kernels in variants.items():
            def fn(x, w, ids, kernels=kernels):
                return moe_mlp(x, weights, ids, *w, None, kernels)

            got = jax.jit(fn)(x, layers[0], ids[0]).astype(jnp.float32)
            want = got if want is None else want  # XLA's, the first variant
            if not jnp.allclose(got, want, rtol=2e-2, atol=2e-2 * float(jnp.abs(want).max())):
                print(f"{n} {name}: differs from XLA by {float(jnp.abs(got - want).max()):.3g}", flush=True)

            try:
                t = time_layers(fn, x, list(zip(layers, ids)), args.repeats) / len(layers)
            except Exception as err:  # a tiling Triton refuses
                print(f"{n} {name}: {type(err).__name__}: {str(err)[:200]}", flush=True)
                continue
            rows.append((n, name, t * 1e6, chosen * expert_bytes / t / 1e12))
            print(f"{n:>5} {name:<28} {t * 1e6:9.1f} us {rows[-1][3]:6.2f} TB/s", flush=True)
    print("\ntokens  variant                         us/layer   TB/s   (best per size first)")
    for n in args.tokens:
        for r in sorted((r for r in rows if r[0] == n), key=lambda r: r[2])[:8]:
            print(f"{r[0]:>6}  {r[1]:<30} {r[2]:9.1f} {r[3]:6.2f}")


if __name__ == "__main__":
    main()
