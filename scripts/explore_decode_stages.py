"""Experiment: decode attention's pipeline depth (num_stages), warps and tile against the automatic tiling and JAX's
paged_attention, with bench_kernels' inputs and timing loop, implementations alternating within every round.

    PYTHONPATH=$PWD python3 scripts/explore_decode_stages.py --out $OUT/stages.json
    PYTHONPATH=$PWD python3 scripts/explore_decode_stages.py --tiny --interpret   # CPU smoke test

A point is B:ctx or B:ctx:table (sequences of ctx tokens in page tables of `table` tokens, as the engine's
max_model_len-wide tables).
"""
import argparse
import dataclasses
import functools
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
from bench_kernels import QWEN3_06B, TINY, decode_kv_bytes, jax_layout, jax_pallas_decode, num_calls, paged_inputs, \
    rotations, timing

from pallas_kernels.paged_attention import DECODE_CONFIG, paged_attention_reference, paged_decode_attention

POINTS = ["1:64", "1:128", "8:64", "8:128", "16:128", "2:512", "1:1024", "64:128", "1:4096"]
# name -> DECODE_CONFIG fields replaced (k_splits stays automatic)
VARIANTS = {"st1": {"num_stages": 1}, "st2": {"num_stages": 2}, "st3": {"num_stages": 3}, "st4": {"num_stages": 4}}


def compiled_loop(fn, arg_sets, kw):
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


def check_ragged(args, model):
    """Each variant against the reference on ragged lengths (0, 1, page +- 1, long) in 4096-token tables."""
    rng = np.random.default_rng(1)
    scale = model["head_dim"] ** -0.5
    lens = [0, 1, 15, 16, 17, 1000, 4095, 4096, 333, 64, 65]
    q, k, v, table, _ = paged_inputs(rng, len(lens), 64 if args.tiny else 4096, 1, model, 16)
    seq_lens = jnp.asarray(lens if not args.tiny else [min(n, 64) for n in lens], jnp.int32)
    ref = np.asarray(paged_attention_reference(q, k, v, table, seq_lens, jnp.minimum(seq_lens, 1), scale=scale)[:, 0],
                     np.float32)
    errors = {}
    for name, fields in VARIANTS.items():
        config = dataclasses.replace(DECODE_CONFIG, **fields)
        out = np.asarray(paged_decode_attention(q[:, 0], k, v, table, seq_lens, scale=scale, config=config,
                                                interpret=args.interpret), np.float32)
        errors[name] = float(np.abs(out - ref).max()) if np.isfinite(out).all() else float("nan")
    print("ragged check, max abs error:", errors, flush=True)
    return errors


def point(args, model, spec, rng):
    batch, ctx, table_ctx = (list(map(int, spec.split(":"))) + [None])[:3]
    table_ctx = table_ctx or ctx
    scale = model["head_dim"] ** -0.5
    sets = []
    for _ in range(rotations(args, decode_kv_bytes(model, batch, table_ctx))):
        q, k, v, t, _ = paged_inputs(rng, batch, table_ctx, 1, model, 8 if args.tiny else 16)
        sets.append((q[:, 0], k, v, t, jnp.full((batch,), ctx, jnp.int32)))
    impls = {"auto": functools.partial(paged_decode_attention, scale=scale, interpret=args.interpret)}
    for name, fields in VARIANTS.items():
        config = dataclasses.replace(DECODE_CONFIG, **fields)
        impls[name] = functools.partial(paged_decode_attention, scale=scale, config=config, interpret=args.interpret)
    ref = np.asarray(impls["auto"](*sets[0]), np.float32)
    errors = {}
    for name, fn in impls.items():
        err = float(np.abs(np.asarray(fn(*sets[0]), np.float32) - ref).max())
        if not err < 2e-2:
            errors[name] = err
    sets_by = {name: sets for name in impls}
    if not args.interpret:
        impls["jax"] = jax_pallas_decode(False)
        sets_by["jax"] = jax_layout(sets)
    kw = timing(args, decode_kv_bytes(model, batch, ctx) / 2.83e12, dep_arg=4)
    loops = {name: compiled_loop(fn, sets_by[name], kw) for name, fn in impls.items()}
    times = {name: [] for name in impls}
    for _ in range(args.rounds):
        for name, timed in loops.items():
            times[name].append(round(statistics.median(timed() for _ in range(3)) * 1e6, 2))
    row = {"point": spec, "us": times, "errors_vs_auto": errors}
    print(json.dumps(row), flush=True)
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--points", nargs="+", default=POINTS)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--interpret", action="store_true")
    p.add_argument("--out")
    args = p.parse_args()
    args.max_rotations, args.calls, args.target_ms, args.repeats = 64, None, 50.0, 3
    model = QWEN3_06B
    if args.tiny:
        model, args.points, args.max_rotations, args.calls, args.rounds = TINY, ["1:40", "3:40:64"], 2, 2, 1
    result = {"jax": jax.__version__, "ragged_errors": check_ragged(args, model), "rows": []}
    rng = np.random.default_rng(0)
    for spec in args.points:
        result["rows"].append(point(args, model, spec, rng))
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))
    print("\npoint: us per call, median of rounds (JAX / ours)")
    for r in result["rows"]:
        med = {name: statistics.median(us) for name, us in r["us"].items()}
        jax_us = med.get("jax")
        print(f"{r['point']:>12}: " + ", ".join(
            f"{name} {us:.2f}" + (f" (x{jax_us / us:.3f})" if jax_us and name != "jax" else "")
            for name, us in med.items()) + (f"  ERRORS {r['errors_vs_auto']}" if r["errors_vs_auto"] else ""))


if __name__ == "__main__":
    main()
