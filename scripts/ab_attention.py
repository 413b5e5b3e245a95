"""Experiment (perf note 17): builds of paged attention (--builds NAME=ROOT, each a copy of the tree; the first is
the baseline of the ratios) and JAX's paged_attention, in one process, rounds alternating; bench_kernels' inputs and
timing loop.

    PYTHONPATH=$PWD python3 scripts/ab_attention.py --builds old=.old new=. --out $OUT/ab_attention.json
"""
import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))
from bench_kernels import (  # noqa: E402
    QWEN3_06B,
    decode_kv_bytes,
    decode_sets,
    jax_layout,
    jax_pallas_decode,
    kernel_time_per_call,
    num_calls,
    paged_inputs,
    profile_kwargs,
    timing,
)

POINTS = [(1, 128), (1, 1024), (1, 4096), (1, 16384), (8, 128), (8, 1024), (8, 4096), (64, 128), (64, 1024),
          (64, 4096), (64, 16384), (256, 1024)]


def load_build(name, root):
    spec = importlib.util.spec_from_file_location(f"{name}_paged_attention", f"{root}/pallas_kernels/paged_attention.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compiled_loop(fn, arg_sets, kw):
    """time_per_call's loop, compiled once: -> a function timing one run, seconds per call."""
    calls = num_calls(arg_sets, kw["work_seconds"], kw["calls"], kw["target_seconds"])
    rounds, dep = calls // len(arg_sets), kw["dep_arg"]

    @jax.jit
    def run(arg_sets):
        def body(_, token):
            for args in arg_sets:
                args = list(args)
                args[dep] = args[dep] + token.astype(args[dep].dtype)
                token = jnp.where(jnp.isnan(fn(*args)).any(), 1.0, 0.0)
            return token
        return jax.lax.fori_loop(0, rounds, body, jnp.float32(0))

    jax.block_until_ready(run(arg_sets))

    def timed():
        start = time.perf_counter()
        jax.block_until_ready(run(arg_sets))
        return (time.perf_counter() - start) / calls
    return timed


def ab_point(impls, sets_by_impl, kw, rounds, profile):
    loops = {name: compiled_loop(fn, sets_by_impl[name], kw) for name, fn in impls.items()}
    times = {name: [] for name in impls}
    for _ in range(rounds):
        for name, timed in loops.items():
            times[name].append(statistics.median(timed() for _ in range(3)) * 1e6)
    row = {name: [round(t, 2) for t in ts] for name, ts in times.items()}
    if profile:
        for name in impls:
            if name == "jax":
                continue
            kernel, total = kernel_time_per_call(impls[name], sets_by_impl[name], "paged_attention",
                                                 **profile_kwargs(kw))
            row[f"{name}_kernel_us"], row[f"{name}_all_kernels_us"] = round(kernel * 1e6, 2), round(total * 1e6, 2)
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--builds", nargs="+", required=True, help="NAME=ROOT")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--points", nargs="+", help="BATCH:CONTEXT decode points (default: POINTS)")
    p.add_argument("--out")
    args = p.parse_args()
    args.max_rotations, args.calls, args.target_ms, args.repeats = 64, None, 50.0, 3
    builds = {name: load_build(name, root) for name, root in (b.split("=") for b in args.builds)}
    base = next(iter(builds))
    model, rng = QWEN3_06B, np.random.default_rng(0)
    scale = model["head_dim"] ** -0.5
    rows = []
    points = [tuple(map(int, p.split(":"))) for p in args.points] if args.points else POINTS
    for batch, ctx in points:
        sets = decode_sets(args, rng, model, batch, ctx, page_size=16)
        impls = {name: (lambda q, k, v, t, s, mod=mod: mod.paged_decode_attention(q, k, v, t, s, scale=scale))
                 for name, mod in builds.items()}
        a = np.asarray(impls[base](*sets[0]), np.float32)
        for name in impls:
            b = np.asarray(impls[name](*sets[0]), np.float32)
            assert np.isfinite(b).all() and np.abs(a - b).max() < 2e-2, (name, batch, ctx, np.abs(a - b).max())
        impls["jax"] = jax_pallas_decode(False)
        kw = timing(args, decode_kv_bytes(model, batch, ctx) / 2.83e12, dep_arg=4)
        row = {"point": f"B={batch} ctx={ctx}", **ab_point(
            impls, {**{n: sets for n in builds}, "jax": jax_layout(sets)}, kw, args.rounds, batch <= 8)}
        print(json.dumps(row), flush=True)
        rows.append(row)
        del sets
    q, k, v, table, lens = paged_inputs(rng, 1, 2048, 2048, model, 16)
    impls = {name: (lambda q, k, v, t, s, mod=mod: mod.paged_prefill_attention(q, k, v, t, s, s, scale=scale))
             for name, mod in builds.items()}
    kw = timing(args, 2 * 2 * 2048 * 1024 * 16 * 128 / 700e12)
    row = {"point": "prefill B=1 T=2048", **ab_point(
        impls, {n: [(q, k, v, table, lens)] for n in impls}, kw, args.rounds, True)}
    print(json.dumps(row), flush=True)
    rows.append(row)
    names = list(builds) + ["jax"]
    print(f"\n{'point':<20} " + " ".join(f"{n + ' us':>9}" for n in names) + "   ratios to " + base
          + ", jax / best build; kernels alone us")
    for r in rows:
        med = {n: statistics.median(r[n]) for n in names if n in r}
        best = min(med[n] for n in builds)
        ratios = " ".join(f"{med[n] / med[base]:.3f}" for n in builds)
        jax_ratio = f"{med['jax'] / best:.2f}" if "jax" in med else "-"
        kern = " ".join(str(r.get(f"{n}_kernel_us", "")) for n in builds)
        print(f"{r['point']:<20} " + " ".join(f"{med[n]:>9.2f}" if n in med else f"{'-':>9}" for n in names)
              + f"   {ratios}  {jax_ratio}  {kern}")
    if args.out:
        Path(args.out).write_text(json.dumps({"jax": jax.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
