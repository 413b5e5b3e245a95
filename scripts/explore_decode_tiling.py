"""Experiment (perf note 18): decode attention tilings (block_k, k_splits) per point against JAX's paged_attention,
and the fastest reads of the bytes behind the targets still missed (the QKV weight at M = 1, the KV at B=64
ctx=16384), in one process, with bench_kernels' inputs and timing loop.

    PYTHONPATH=$PWD python3 scripts/explore_decode_tiling.py --out $OUT/explore.json
    PYTHONPATH=$PWD python3 scripts/explore_decode_tiling.py --tiny --interpret   # CPU smoke test
"""
import argparse
import functools
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))
from bench_kernels import (  # noqa: E402
    QWEN3_06B,
    TINY,
    decode_kv_bytes,
    decode_sets,
    jax_layout,
    jax_pallas_decode,
    kernel_times_by_kind,
    normal,
    num_calls,
    profile_kwargs,
    rotations,
    timing,
)
from pallas_kernels._compat import load, store, triton_params  # noqa: E402
from pallas_kernels import paged_attention  # noqa: E402

# (batch, ctx): the (block_k, k_splits) tilings to time besides the automatic one.
TILINGS = {
    (64, 4096): [(128, 1, 8, 5), (128, 1, 4, 4), (128, 1, 8, 3)],
    (64, 16384): [(128, 1, 8, 5), (128, 1, 4, 4), (128, 1, 8, 3), (128, 2, 8, 5)],
}
TINY_TILINGS = {(1, 40): [(16, 2), (16, 4, 2, 3), (32, 1)]}
# Pure reads: (block_r, block_c, splits, num_warps, num_stages) of a [R, C] array.
WEIGHT_READS = [(128, 64, 2, 4, 4), (64, 128, 4, 4, 4), (32, 256, 8, 4, 4), (16, 512, 16, 4, 4),
                (16, 1024, 32, 4, 3), (16, 4096, 64, 8, 2), (64, 64, 4, 4, 4), (32, 128, 8, 4, 4),
                (16, 256, 16, 4, 4)]
KV_READS = [(8, 2048, 512, 4, 3), (16, 2048, 512, 8, 3), (16, 1024, 512, 4, 4), (32, 512, 512, 4, 4),
            (16, 2048, 1024, 8, 2), (32, 1024, 256, 8, 3)]


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
                nan = [jnp.isnan(out).any() for out in jax.tree.leaves(fn(*args))]
                token = jnp.where(functools.reduce(jnp.logical_or, nan), 1.0, 0.0)
            return token
        return jax.lax.fori_loop(0, rounds, body, jnp.float32(0))

    jax.block_until_ready(run(arg_sets))

    def timed():
        start = time.perf_counter()
        jax.block_until_ready(run(arg_sets))
        return (time.perf_counter() - start) / calls
    return timed


def alternate(impls, sets_by_impl, kw, rounds):
    """-> {name: [us per call of each round]}, implementations alternating within every round."""
    loops = {name: compiled_loop(fn, sets_by_impl[name], kw) for name, fn in impls.items()}
    times = {name: [] for name in impls}
    for _ in range(rounds):
        for name, timed in loops.items():
            times[name].append(round(statistics.median(timed() for _ in range(3)) * 1e6, 2))
    return times


def kernels_us(fn, sets, kw, args):
    if not args.profile:
        return None
    return {kind: round(t * 1e6, 2) for kind, t in kernel_times_by_kind(fn, sets, **profile_kwargs(kw)).items()}


def load_build(name, root):
    spec = importlib.util.spec_from_file_location(f"{name}_paged_attention", f"{root}/pallas_kernels/paged_attention.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def decode_tilings(args, model, rng):
    """The automatic tiling of each build in --builds, and this tree's kernel at TILINGS' other tilings."""
    scale = model["head_dim"] ** -0.5
    builds = {name: load_build(name, root) for name, root in (b.split("=") for b in args.builds)}
    rows = []
    grid = TINY_TILINGS if args.tiny else TILINGS
    if args.points:
        grid = {tuple(map(int, p.split(":"))): [] for p in args.points}
    for (batch, ctx), tilings in grid.items():
        sets = decode_sets(args, rng, model, batch, ctx, page_size=16 if not args.tiny else 8)
        configs = {f"{name}:auto": (mod, None) for name, mod in {**builds, "new": paged_attention}.items()}
        configs.update({"k{}s{}w{}st{}".format(*t): (paged_attention, paged_attention.PagedAttentionConfig(
            block_m=16, block_k=t[0], k_splits=t[1], num_warps=t[2], num_stages=t[3]))
            for t in (tuple(t) + (4, 5)[len(t) - 2:] for t in tilings)})
        impls = {name: functools.partial(_decode, module=mod, scale=scale, config=c, interpret=args.interpret)
                 for name, (mod, c) in configs.items()}
        ref = np.asarray(impls["new:auto"](*sets[0]), np.float32)
        for name, fn in impls.items():
            out = np.asarray(fn(*sets[0]), np.float32)
            assert np.isfinite(out).all() and np.abs(out - ref).max() < 2e-2, (batch, ctx, name)
        kw = timing(args, decode_kv_bytes(model, batch, ctx) / 2.83e12, dep_arg=4)
        sets_by = {name: sets for name in impls}
        if not args.interpret:
            impls["jax"] = jax_pallas_decode(False)
            sets_by["jax"] = jax_layout(sets)
        row = {"point": f"B={batch} ctx={ctx}", "us": alternate(impls, sets_by, kw, args.rounds)}
        if batch <= 2:
            row["kernels_us"] = {name: kernels_us(impls[name], sets, kw, args) for name in configs}
        print(json.dumps(row), flush=True)
        rows.append(row)
        del sets, sets_by
    return rows


def _decode(q, k, v, table, lens, *, module, scale, config, interpret):
    return module.paged_decode_attention(q, k, v, table, lens, scale=scale, config=config, interpret=interpret)


def _read_kernel(offset_ref, x_ref, o_ref, *, block_r, block_c, rows_per_split):
    # offset_ref: [1] f32 (the timing loop's dependency); x_ref: [R, C]; o_ref: [splits, C] f32 column sums
    cols = pl.program_id(0) * block_c + jnp.arange(block_c)
    first = pl.program_id(1) * rows_per_split

    def body(i, acc):
        rows = first + i * block_r + jnp.arange(block_r)
        return acc + load(x_ref.at[rows[:, None], cols[None, :]]).astype(jnp.float32).sum(axis=0)

    acc = jax.lax.fori_loop(0, rows_per_split // block_r, body, jnp.zeros((block_c,), jnp.float32))
    store(o_ref.at[pl.program_id(1), cols], acc + offset_ref[0])


@functools.partial(jax.jit, static_argnames=("tiling", "interpret"))
def pallas_read(offset, x, *, tiling, interpret=False):
    """Every element of x [R, C] read once: column sums per split -> [splits, C] f32."""
    block_r, block_c, splits, num_warps, num_stages = tiling
    rows, cols = x.shape
    assert rows % (splits * block_r) == 0 and cols % block_c == 0, (x.shape, tiling)
    return pl.pallas_call(
        functools.partial(_read_kernel, block_r=block_r, block_c=block_c, rows_per_split=rows // splits),
        grid=(cols // block_c, splits),
        out_shape=jax.ShapeDtypeStruct((splits, cols), jnp.float32),
        compiler_params=triton_params(num_warps, num_stages),
        interpret=interpret,
        name="pallas_read",
    )(offset, x)


def reads(args, name, arrays_sets, tilings):
    """arrays_sets: [(x [R, C],...)] rotations of the bytes to read. -> a row: per call and kernel alone (us) of
    XLA's row sums (the loop's offset fused into the read) and of pallas_read at each tiling."""
    nbytes = sum(a.nbytes for a in arrays_sets[0])
    offset = jnp.zeros((1,), jnp.float32)
    sets = [(offset, *arrays) for arrays in arrays_sets]
    xla = jax.jit(lambda _, x: jnp.sum(x, axis=1, dtype=jnp.float32))
    impls = {"xla_row_sums": (xla, dict(timing(args, nbytes / 2.83e12, dep_arg=1)))}
    x0 = arrays_sets[0][0]
    for t in tilings:
        if all(x.shape[0] % (t[2] * t[0]) == 0 and x.shape[1] % t[1] == 0 for x in arrays_sets[0]):
            fn = functools.partial(pallas_read, tiling=t, interpret=args.interpret)
            got = np.asarray(pallas_read(offset, x0, tiling=t, interpret=args.interpret)).sum(axis=0)
            want = np.asarray(x0, np.float32).sum(axis=0) if x0.size < 2 ** 28 else got
            assert np.allclose(got, want, rtol=1e-3, atol=1e-1), (name, t)
            impls["r{}x{}s{}w{}st{}".format(*t)] = (fn, timing(args, nbytes / 2.83e12, dep_arg=0))
    row = {"point": name, "bytes": nbytes, "us": {}, "kernel_us": {}}
    for label, (fn, kw) in impls.items():
        row["us"][label] = alternate({label: fn}, {label: sets}, kw, 1)[label][0]
        by_kind = kernels_us(fn, sets, kw, args)
        if by_kind:  # the longest kind is the read (the others: the loop's offset add and NaN check)
            row["kernel_us"][label] = max(by_kind.values())
    print(json.dumps(row), flush=True)
    return row


def read_probes(args, model, rng):
    if args.tiny:
        return [reads(args, "tiny [64, 256]", [(normal(rng, (64, 256)),)], [(16, 64, 2, 4, 2)])]
    k, n = model["hidden"], (model["num_q_heads"] + 2 * model["num_kv_heads"]) * model["head_dim"]
    rows = [reads(args, f"QKV weight [{k}, {n}]", [(normal(rng, (k, n)),) for _ in range(rotations(args, k * n * 2))],
                  WEIGHT_READS)]
    pages, hkv, d = 64 * 16384 // 16, model["num_kv_heads"], model["head_dim"]
    kv = normal(rng, (2 * pages * hkv, 16 * d))  # the K and V pools of B=64 ctx=16384, as one [R, C]
    rows.append(reads(args, "KV B=64 ctx=16384", [(kv,)], KV_READS))
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--interpret", action="store_true")
    p.add_argument("--no-profile", dest="profile", action="store_false")
    p.add_argument("--sections", nargs="+", default=["reads", "decode"])
    p.add_argument("--builds", nargs="*", default=[], help="NAME=ROOT: other trees' kernels, at their own tiling")
    p.add_argument("--points", nargs="+", help="BATCH:CONTEXT: these points, automatic tilings only")
    p.add_argument("--out")
    args = p.parse_args()
    args.max_rotations, args.calls, args.target_ms, args.repeats = 64, None, 50.0, 3
    if args.tiny:
        args.max_rotations, args.calls, args.rounds = 2, 2, 1
    model, rng = (TINY if args.tiny else QWEN3_06B), np.random.default_rng(0)
    rows = []
    if "reads" in args.sections:
        rows += read_probes(args, model, rng)
    if "decode" in args.sections:
        rows += decode_tilings(args, model, rng)
    print("\npoint: us per call (median of rounds) [kernel alone]")
    for r in rows:
        parts = []
        for name, us in r["us"].items():
            med = statistics.median(us) if isinstance(us, list) else us
            kern = (r.get("kernel_us") or {}).get(name)
            kerns = (r.get("kernels_us") or {}).get(name)
            total = ""
            if kerns:
                kern = max(v for kk, v in kerns.items() if "paged_attention" in kk)
                total = f" / {sum(kerns.values()):.2f} in {len([v for v in kerns.values() if v > 0.1])}"
            parts.append(f"{name} {med:.2f}" + (f" [{kern:.2f}{total}]" if kern else ""))
        print(f"{r['point']}: " + ", ".join(parts))
    if args.out:
        Path(args.out).write_text(json.dumps({"jax": jax.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
