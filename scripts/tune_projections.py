"""Sweep rmsnorm_matmul tilings for a model's decode projections (M = 1, 8, ...) on the GPU; print the best per shape.

    PYTHONPATH=$PWD python3 scripts/tune_projections.py --model qwen3-0.6b --m 1 8 --out $OUT/tune.json

Each projection of a layer is timed in its fused form (RMSNorm + QKV, o_proj + residual, RMSNorm + gate/up +
SiLU-and-mul, down + residual) with bench_kernels' harness (back-to-back calls in one jit, inputs rotated past L2),
for every config of the grid and for the default that `_default_config` picks, beside XLA's path for the same step
(`nanojax.ops.Ops().project`: the reference, which the engine runs where the kernel does not). %HBM counts the weight
bytes. `--fp8`: the weights in FP8 (convert.quantize: E4M3 [N, K] and a scale per output channel); the grid then
also tries tiles 128 columns wide. `--block-n`, `--block-k`, `--k-splits`, `--num-stages` replace the grid's values.
"""
import argparse
import dataclasses
import functools
import itertools
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))
from bench_kernels import EPS, kernel_time_per_call, normal, rotations, time_per_call  # noqa: E402

from convert.quantize import is_quantized, quantize_weight  # noqa: E402
from nanojax.model import Projection  # noqa: E402
from nanojax.ops import Ops  # noqa: E402
from pallas_kernels.rmsnorm_matmul import _default_config, rmsnorm_matmul  # noqa: E402

GRID = {"block_n": (16, 32, 64), "block_k": (128, 256), "k_splits": (1, 2, 4, 8)}
GRID_KNOBS = ("block_n", "block_k", "k_splits", "num_stages")  # the config fields a command line may set


def projections(cfg: dict) -> dict:
    """name -> (K, N of w, activation, whether the second input is a norm scale or a residual)."""
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    return {"norm_qkv": (hidden, q + 2 * kv, None, "norm"), "o_proj_residual": (q, hidden, None, "residual"),
            "norm_gate_up_silu": (hidden, 2 * inter, "silu_mul", "norm"), "down_residual": (inter, hidden, None,
                                                                                            "residual")}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--m", type=int, nargs="+", default=[1])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--hbm-bw", type=float, default=2.83e12)
    ap.add_argument("--fp8", action="store_true", help="FP8 weights with per-channel scales")
    ap.add_argument("--out")
    for knob in GRID_KNOBS:
        ap.add_argument(f"--{knob.replace('_', '-')}", type=int, nargs="+", help=f"the grid's {knob} values")
    args = ap.parse_args()
    grid = dict(GRID, block_n=(32, 64, 128)) if args.fp8 else dict(GRID)
    grid.update({knob: tuple(v) for knob in GRID_KNOBS if (v := getattr(args, knob)) is not None})
    args.max_rotations = 16
    cfg = json.loads((Path(__file__).parent / "configs" / f"{args.model}.json").read_text())
    rng = np.random.default_rng(0)
    results = []
    for (name, (k, n, activation, role)), m in itertools.product(projections(cfg).items(), args.m):
        n_out = n // 2 if activation else n
        w_bytes = k * n + 4 * n if args.fp8 else k * n * 2
        weight = lambda: quantize_weight(normal(rng, (k, n), k ** -0.5)) if args.fp8 else {  # noqa: E731
            "w": normal(rng, (k, n), k ** -0.5)}
        sets = [(normal(rng, (m, k)), 1 + normal(rng, (k,), 0.1) if role == "norm" else normal(rng, (m, n_out)),
                 weight()) for _ in range(rotations(args, w_bytes))]
        dep_arg = 0 if role == "norm" else 1  # the timing loop's dependency: x, or the residual
        default = _default_config(m, k, n_out, sets[0][0].dtype, silu_mul=activation is not None, fp8=args.fp8)
        configs = [default] + [dataclasses.replace(default, **dict(zip(grid, values)))
                               for values in itertools.product(*grid.values())]

        def step_kw(second):  # with a norm, second is unused (its scale would be folded into w)
            return {"norm_eps": EPS} if role == "norm" else {"residual": second}

        def fn(x, second, p, config):
            w = p["w_t"] if is_quantized(p) else p["w"]
            return rmsnorm_matmul(x, w, w_scale=p.get("scale"), activation=activation, config=config,
                                  **step_kw(second))

        t_xla = time_per_call(lambda x, second, p: Ops().project(x, Projection(p), activation=activation, **step_kw(second)),
                              sets, work_seconds=w_bytes / args.hbm_bw, repeats=args.repeats, dep_arg=dep_arg)

        timings = []
        for config in dict.fromkeys(configs):
            try:
                t = time_per_call(functools.partial(fn, config=config), sets, work_seconds=w_bytes / args.hbm_bw,
                                  repeats=args.repeats, dep_arg=dep_arg)
            except Exception as e:  # noqa: BLE001 - a tiling that does not fit shared memory is skipped
                print(f"  {name} M={m} {config}: {type(e).__name__}")
                continue
            timings.append((t, config))
        t_default = next(t for t, c in timings if c == default)
        best_t, best = min(timings, key=lambda tc: tc[0])
        # The profiler's view: the kernel alone, and every kernel of a call (split-K's XLA epilogue included).
        kernel_us = {label: [t * 1e6 for t in kernel_time_per_call(
            functools.partial(fn, config=config), sets, "rmsnorm_matmul", work_seconds=w_bytes / args.hbm_bw,
            dep_arg=dep_arg)] for label, config in (("default", default), ("best", best))}
        row = {"projection": name, "m": m, "k": k, "n": n, "fp8": args.fp8, "xla_us": t_xla * 1e6,
               "default": dataclasses.asdict(default),
               "default_us": t_default * 1e6, "default_hbm_pct": 100 * w_bytes / t_default / args.hbm_bw,
               "best": dataclasses.asdict(best), "best_us": best_t * 1e6,
               "best_hbm_pct": 100 * w_bytes / best_t / args.hbm_bw,
               "kernel_us": kernel_us,
               "top5": [(t * 1e6, dataclasses.asdict(c)) for t, c in sorted(timings, key=lambda tc: tc[0])[:5]]}
        results.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"\n{'projection':<20} {'M':>4} {'XLA us':>7} {'default us':>10} {'%HBM':>5} {'best us':>8} {'%HBM':>5}  "
          f"{'kernel / all kernels us (default, best)':<40} best config")
    for r in results:
        b, k = r["best"], r["kernel_us"]
        kernel = f"{k['default'][0]:.2f}/{k['default'][1]:.2f}, {k['best'][0]:.2f}/{k['best'][1]:.2f}"
        print(f"{r['projection']:<20} {r['m']:>4} {r['xla_us']:>7.2f} {r['default_us']:>10.2f} "
              f"{r['default_hbm_pct']:>5.0f} {r['best_us']:>8.2f} {r['best_hbm_pct']:>5.0f}  {kernel:<40} "
              f"bn={b['block_n']} bk={b['block_k']} splits={b['k_splits']} stages={b['num_stages']} "
              f"warps={b['num_warps']}")


if __name__ == "__main__":
    main()
