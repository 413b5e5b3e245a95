"""Experiment (perf note 19): the targets still missed, probed in one process with bench_kernels' inputs and timing
loop, implementations alternating within every round:
- cache hints on the streamed loads (eviction_policy="evict_first", cache_modifier=".cg") in decode attention's K/V
  loads and the fused projection's weight loads, as patched copies of this tree's kernels;
- split counts that balance the long-context grids (B=8 and B=64 at 16384 tokens), and one 128-token tile against
  the automatic tiling over 128-token tables (B=1, 8, 16, 64);
- reads of the missed targets' bytes through TMA (a Mosaic GPU pipeline), next to XLA's row sums and the fastest
  Triton read of stop 15.

    PYTHONPATH=$PWD python3 scripts/explore_load_hints.py --sections decode --points 1:128 8:128 --out $OUT/x.json
    PYTHONPATH=$PWD python3 scripts/explore_load_hints.py --tiny --interpret   # CPU smoke test (no TMA reads)
"""
import argparse
import functools
import importlib.util
import json
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(ROOT))
from bench_kernels import (
    EPS,
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

from pallas_kernels._compat import load, store, triton_params

# Patched copies of a kernel file: name -> (file, [(text, replacement)]).
_KV_LOADS = "return load(k_ref.at[idx], **k_mask), load(v_ref.at[idx], **v_mask)"
_W_LOAD = "ws = [load(w_ref.at[cols_k[:, None], cols[None, :]], "
VARIANTS = {
    "attn_evict_first": ("paged_attention", [(_KV_LOADS, _KV_LOADS.replace("**", 'eviction_policy="evict_first", **'))]),
    "attn_cg": ("paged_attention", [(_KV_LOADS, _KV_LOADS.replace("**", 'cache_modifier=".cg", **'))]),
    "proj_evict_first": ("rmsnorm_matmul", [(_W_LOAD, _W_LOAD + 'eviction_policy="evict_first", ')]),
    "proj_cg": ("rmsnorm_matmul", [(_W_LOAD, _W_LOAD + 'cache_modifier=".cg", ')]),
}
# (batch, ctx) -> extra (block_k, k_splits) tilings of this tree's kernel.
DECODE_POINTS = {
    (1, 128): [(128, 1)],
    (1, 4096): [],
    (8, 128): [(128, 1)],
    (16, 128): [(128, 1)],
    (64, 128): [(128, 1)],
    (8, 16384): [(64, 4), (128, 2), (128, 4), (64, 3)],
    (64, 4096): [],
    (64, 16384): [(128, 33), (128, 3), (64, 33)],
}
TINY_POINTS = {(1, 40): [(16, 3)], (3, 40): []}
# TMA reads: (block_rows, programs, max_concurrent_steps) of a [R, 128] bf16 array.
WEIGHT_TMA = [(128, 128, 2), (128, 64, 3), (128, 32, 3), (64, 128, 4), (64, 256, 2), (256, 128, 1), (32, 256, 4)]
KV_TMA = [(128, 128, 3), (128, 256, 3), (128, 512, 2), (64, 512, 4)]


def load_module(name, variant=None):
    """pallas_kernels/<name>.py of this tree, with VARIANTS[variant]'s patches applied."""
    src = (ROOT / "pallas_kernels" / f"{name}.py").read_text()
    for old, new in VARIANTS[variant][1] if variant else []:
        assert src.count(old) == 1, (variant, old)
        src = src.replace(old, new)
    path = Path(tempfile.mkdtemp()) / f"{variant or name}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(f"explore_{variant or name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compiled_loop(fn, arg_sets, kw):
    """bench_kernels.time_per_call's loop, compiled once: -> a function timing one run, seconds per call."""
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


def _decode(q, k, v, table, lens, *, module, scale, config, interpret):
    return module.paged_decode_attention(q, k, v, table, lens, scale=scale, config=config, interpret=interpret)


def decode_points(args, model, rng):
    scale = model["head_dim"] ** -0.5
    base = load_module("paged_attention")
    modules = {"auto": base, **{v: load_module("paged_attention", v) for v in ("attn_evict_first", "attn_cg")}}
    rows = []
    points = TINY_POINTS if args.tiny else DECODE_POINTS
    if args.points:
        points = {p: points[p] for p in (tuple(map(int, s.split(":"))) for s in args.points)}
    for (batch, ctx), tilings in points.items():
        sets = decode_sets(args, rng, model, batch, ctx, page_size=8 if args.tiny else 16)
        configs = {name: (mod, None) for name, mod in modules.items()}
        configs.update({f"k{bk}s{s}": (base, base.PagedAttentionConfig(block_m=16, block_k=bk, k_splits=s,
                                                                       num_warps=4, num_stages=5))
                        for bk, s in tilings})
        impls = {name: functools.partial(_decode, module=mod, scale=scale, config=c, interpret=args.interpret)
                 for name, (mod, c) in configs.items()}
        ref = np.asarray(impls["auto"](*sets[0]), np.float32)
        errors = {}
        for name, fn in list(impls.items()):
            try:
                out = np.asarray(fn(*sets[0]), np.float32)
                assert np.isfinite(out).all() and np.abs(out - ref).max() < 2e-2, (batch, ctx, name)
            except Exception as e:  # noqa: BLE001 - a variant that does not lower is reported, not fatal
                errors[name] = f"{type(e).__name__}: {str(e)[:600]}"
                del impls[name], configs[name]
        kw = timing(args, decode_kv_bytes(model, batch, ctx) / 2.83e12, dep_arg=4)
        sets_by = {name: sets for name in impls}
        if not args.interpret:
            impls["jax"] = jax_pallas_decode(False)
            sets_by["jax"] = jax_layout(sets)
        row = {"point": f"B={batch} ctx={ctx}", "us": alternate(impls, sets_by, kw, args.rounds),
               "kernels_us": {name: kernels_us(impls[name], sets, kw, args) for name in configs}, "errors": errors}
        print(json.dumps(row), flush=True)
        rows.append(row)
        del sets, sets_by
    return rows


def projection_points(args, model, rng):
    """The fused RMSNorm + QKV at M = 1 and 8, this tree's kernel and its hinted copies, against XLA's pair."""
    from convert.keys import fold_norm_scale
    from pallas_kernels.rmsnorm_matmul import rms_norm, rmsnorm_matmul_reference
    k, n = model["hidden"], (model["num_q_heads"] + 2 * model["num_kv_heads"]) * model["head_dim"]
    modules = {"proj": load_module("rmsnorm_matmul"),
               **{v: load_module("rmsnorm_matmul", v) for v in ("proj_evict_first", "proj_cg")}}
    impls = {name: (lambda x, s, w, wf, mod=mod: mod.rmsnorm_matmul(x, wf, norm_eps=EPS, interpret=args.interpret))
             for name, mod in modules.items()}
    impls["xla"] = jax.jit(lambda x, s, w, wf: rmsnorm_matmul_reference(rms_norm(x, s, EPS), w))
    rows = []
    for m in (1, 8):
        sets = []
        for _ in range(rotations(args, k * n * 2)):
            x, w, s = normal(rng, (m, k)), normal(rng, (k, n), k ** -0.5), 1 + normal(rng, (k,), 0.1)
            sets.append((x, s, w, jnp.asarray(fold_norm_scale(np.asarray(s), np.asarray(w)), x.dtype)))
        ref = np.asarray(impls["xla"](*sets[0]), np.float32)
        errors = {}
        for name, fn in list(impls.items()):
            try:
                assert np.abs(np.asarray(fn(*sets[0]), np.float32) - ref).max() < 5e-2, (m, name)
            except Exception as e:  # noqa: BLE001 - a variant that does not lower is reported, not fatal
                errors[name] = f"{type(e).__name__}: {str(e)[:600]}"
                del impls[name]
        kw = timing(args, k * n * 2 / 2.83e12, dep_arg=0)
        row = {"point": f"QKV M={m}", "us": alternate(impls, {name: sets for name in impls}, kw, args.rounds),
               "kernels_us": {name: kernels_us(fn, sets, kw, args) for name, fn in impls.items()}, "errors": errors}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def _triton_read_kernel(offset_ref, x_ref, o_ref, *, block_r, block_c, rows_per_split):
    # offset_ref: [1] f32 (the timing loop's dependency); x_ref: [R, C]; o_ref: [splits, C] f32 column sums
    cols = pl.program_id(0) * block_c + jnp.arange(block_c)
    first = pl.program_id(1) * rows_per_split

    def body(i, acc):
        rows = first + i * block_r + jnp.arange(block_r)
        return acc + load(x_ref.at[rows[:, None], cols[None, :]]).astype(jnp.float32).sum(axis=0)

    acc = jax.lax.fori_loop(0, rows_per_split // block_r, body, jnp.zeros((block_c,), jnp.float32))
    store(o_ref.at[pl.program_id(1), cols], acc + offset_ref[0])


@functools.partial(jax.jit, static_argnames=("tiling",))
def triton_read(offset, x, *, tiling):
    """Stop 15's fastest Pallas (Triton) read of x [R, C]: column sums per split -> [splits, C] f32."""
    block_r, block_c, splits, num_warps, num_stages = tiling
    rows, cols = x.shape
    return pl.pallas_call(
        functools.partial(_triton_read_kernel, block_r=block_r, block_c=block_c, rows_per_split=rows // splits),
        grid=(cols // block_c, splits),
        out_shape=jax.ShapeDtypeStruct((splits, cols), jnp.float32),
        compiler_params=triton_params(num_warps, num_stages),
        name="pallas_read",
    )(offset, x)


@functools.partial(jax.jit, static_argnames=("tiling",))
def tma_read(offset, x, *, tiling):
    """x [R, 128] read through a Mosaic GPU pipeline of TMA copies: `programs` programs, each streaming its share of
    [block_rows, 128] blocks with up to `concurrent` copies in flight, keeping its last block -> [programs *
    block_rows, 128], and offset [128] f32 (the timing loop's dependency) copied through."""
    # jax 0.11 lowers pl.pallas_call through Triton only; this shim builds plgpu.kernel + emit_pipeline from a grid
    from jax._src.pallas.mosaic_gpu.pallas_call import pallas_call as mosaic_gpu_pallas_call
    from jax.experimental.pallas import mosaic_gpu as plmgpu
    block_rows, programs, concurrent = tiling
    rows, cols = x.shape
    steps = rows // (block_rows * programs)

    def kernel(offset_ref, x_ref, o_ref, offset_out_ref):
        o_ref[...] = x_ref[...]
        offset_out_ref[...] = offset_ref[...]

    return mosaic_gpu_pallas_call(
        kernel,
        grid=(programs, steps),
        in_specs=[pl.BlockSpec((cols,), lambda i, j: (0,)),
                  pl.BlockSpec((block_rows, cols), lambda i, j: (i * steps + j, 0))],
        out_specs=[pl.BlockSpec((block_rows, cols), lambda i, j: (i, 0)), pl.BlockSpec((cols,), lambda i, j: (0,))],
        out_shape=[jax.ShapeDtypeStruct((programs * block_rows, cols), x.dtype),
                   jax.ShapeDtypeStruct((cols,), jnp.float32)],
        compiler_params=plmgpu.CompilerParams(dimension_semantics=("parallel", "sequential"),
                                              max_concurrent_steps=min(concurrent, steps)),
    )(offset, x)


def reads(args, name, x_sets, triton_tiling, tma_tilings):
    """x_sets: [x [R, 128]] rotations of the bytes to read. -> per call and kernel alone (us) of XLA's row sums, the
    Triton read (x viewed as [1024, R * 128 / 1024]) and the TMA reads."""
    nbytes = x_sets[0].nbytes
    view = lambda x: x.reshape(1024, -1) if triton_tiling[1] > 128 else x
    zero = lambda size: jnp.zeros((size,), jnp.float32)
    impls = {"xla_row_sums": (jax.jit(lambda _, x: jnp.sum(x, axis=1, dtype=jnp.float32)),
                              [(zero(1), x) for x in x_sets], 1, None)}
    impls["triton_r{}x{}s{}w{}st{}".format(*triton_tiling)] = (
        functools.partial(triton_read, tiling=triton_tiling), [(zero(1), view(x)) for x in x_sets], 0, None)
    for t in tma_tilings:
        impls["tma_b{}p{}c{}".format(*t)] = (functools.partial(tma_read, tiling=t), [(zero(128), x) for x in x_sets],
                                             0, t)
    row = {"point": name, "bytes": nbytes, "us": {}, "kernel_us": {}, "errors": {}}
    for label, (fn, sets, dep, tma_tiling) in impls.items():
        kw = timing(args, nbytes / 2.83e12, dep_arg=dep)
        try:
            if tma_tiling:  # every program keeps its last block: check those against x
                block_rows, programs, _ = tma_tiling
                blocks = np.asarray(sets[0][1], np.float32).reshape(programs, -1, block_rows, 128)
                got = np.asarray(fn(*sets[0])[0], np.float32).reshape(programs, block_rows, 128)
                kept = [j for j in range(blocks.shape[1]) if np.array_equal(got, blocks[:, j])]
                row.setdefault("tma_kept_block", {})[label] = f"{kept} of {blocks.shape[1]}"
            row["us"][label] = alternate({label: fn}, {label: sets}, kw, 1)[label][0]
            # the profiler's loop checks one output for NaN: the TMA read's kept blocks
            by_kind = kernels_us((lambda *a, fn=fn: fn(*a)[0]) if tma_tiling else fn, sets, kw, args)
            if by_kind:  # the longest kind is the read (the others: the loop's offset add and NaN check)
                row["kernel_us"][label] = max(by_kind.values())
        except Exception as e:  # noqa: BLE001 - a probe that does not lower is reported, not fatal
            where = traceback.extract_tb(e.__traceback__)[-2:]
            row["errors"][label] = f"{type(e).__name__}: {str(e)[:600]} at {[f'{f.filename}:{f.lineno} {f.line}' for f in where]}"
    print(json.dumps(row), flush=True)
    return row


def read_probes(args, model, rng):
    k, n = model["hidden"], (model["num_q_heads"] + 2 * model["num_kv_heads"]) * model["head_dim"]
    weights = [normal(rng, (k * n // 128, 128)) for _ in range(rotations(args, k * n * 2))]
    rows = [reads(args, f"QKV weight [{k}, {n}]", weights, (16, 1024, 32, 4, 3), WEIGHT_TMA)]
    del weights
    kv_rows = 2 * (64 * 16384 // 16) * model["num_kv_heads"] * 16 * model["head_dim"] // 128
    rows.append(reads(args, "KV B=64 ctx=16384", [normal(rng, (kv_rows, 128))], (16, 2048, 1024, 8, 2), KV_TMA))
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--interpret", action="store_true")
    p.add_argument("--no-profile", dest="profile", action="store_false")
    p.add_argument("--sections", nargs="+", default=["reads", "projections", "decode"])
    p.add_argument("--points", nargs="+", help="decode points as B:ctx (default: all)")
    p.add_argument("--out")
    args = p.parse_args()
    args.max_rotations, args.calls, args.target_ms, args.repeats = 64, None, 50.0, 3
    if args.tiny:
        args.max_rotations, args.calls, args.rounds, args.profile = 2, 2, 1, False
    model, rng = (TINY if args.tiny else QWEN3_06B), np.random.default_rng(0)
    rows = []
    if "reads" in args.sections and not args.tiny:
        rows += read_probes(args, model, rng)
    if "projections" in args.sections:
        rows += projection_points(args, model, rng)
    if "decode" in args.sections:
        rows += decode_points(args, model, rng)
    print("\npoint: us per call (median of rounds) [kernel alone / all kernels]")
    for r in rows:
        parts = []
        for name, us in r["us"].items():
            med = statistics.median(us) if isinstance(us, list) else us
            kern = (r.get("kernel_us") or {}).get(name)
            kerns = (r.get("kernels_us") or {}).get(name)
            extra = f" [{kern:.2f}]" if kern else ""
            if kerns:
                main_kind = max(kerns, key=kerns.get)
                extra = f" [{kerns[main_kind]:.2f} / {sum(kerns.values()):.2f}]"
            parts.append(f"{name} {med:.2f}{extra}")
        print(f"{r['point']}: " + ", ".join(parts) + (f"  errors: {list(r['errors'])}" if r.get("errors") else ""))
    if args.out:
        Path(args.out).write_text(json.dumps({"jax": jax.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
