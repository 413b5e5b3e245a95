"""Experiment: the fused RMSNorm's statistic as a second tensor-core dot.

The RMSNorm scale is folded into w's rows (as convert/ would do once), and the kernel accumulates, in the same
pipelined loop, acc += x @ w and gram += x @ x^T ([block_m, block_m], both operands the x tile already in shared
memory). After the loop the sum of squares is gram's diagonal, and rstd scales the f32 accumulator: no pre-pass over x
before the first weight tile, no per-tile scale gather, no per-iteration row reduction (perf notes 12-14).

    python3 scripts/explore_norm_dot.py --out explore.json          # GPU
    python3 scripts/explore_norm_dot.py --interpret --tiny          # CPU check of the kernel
"""
import argparse
import dataclasses
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernels import kernel_times_by_kind, normal, time_per_call  # noqa: E402
from pallas_kernels._compat import load, store, triton_params  # noqa: E402
from pallas_kernels.rmsnorm_matmul import (  # noqa: E402
    RmsNormMatmulConfig, _block_m, _default_config, _epilogue, _k_slice, rmsnorm_matmul, rmsnorm_matmul_reference)

EPS = 1e-6


def _kernel(x_ref, w_ref, o_ref, *ssq_refs, eps, norm, silu_mul, block_m, block_n, block_k, n_out,
            k_blocks_per_split, partial, stat):
    m, k = x_ref.shape
    rows = pl.program_id(0) * block_m + jnp.arange(block_m)
    cols_n = pl.program_id(1) * block_n + jnp.arange(block_n)
    row_ok, n_ok = rows < m, cols_n < n_out
    first_kb = pl.program_id(2) * k_blocks_per_split
    num_kb = jnp.minimum(pl.cdiv(k, block_k) - first_kb, k_blocks_per_split)
    col_groups = (cols_n, cols_n + n_out) if silu_mul else (cols_n,)

    if norm and stat == "late":  # the whole rows, loaded before the loop, reduced after it
        rows_x = [load(x_ref.at[rows[:, None], _k_slice(kb, block_k, k)[0][None, :]],
                       mask=row_ok[:, None] & _k_slice(kb, block_k, k)[1][None, :], other=0.0)
                  for kb in range(pl.cdiv(k, block_k))]

    def body(i, carry):
        accs, gram = carry
        cols_k, k_ok = _k_slice(first_kb + i, block_k, k)
        x = load(x_ref.at[rows[:, None], cols_k[None, :]], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        ws = [load(w_ref.at[cols_k[:, None], cols[None, :]], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
              for cols in col_groups]
        accs = tuple(acc + lax.dot(x, w, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
                     for acc, w in zip(accs, ws))
        if norm and stat == "gram":
            gram = gram + lax.dot_general(x, x, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST,
                                          preferred_element_type=jnp.float32)
        return accs, gram

    zeros = jnp.zeros((block_m, block_n), jnp.float32)
    gram0 = jnp.zeros((block_m, block_m), jnp.float32) if norm and stat == "gram" else None
    accs, gram = lax.fori_loop(0, num_kb, body, (tuple(zeros for _ in col_groups), gram0))
    if norm and stat == "gram":
        diag = jnp.arange(block_m)[:, None] == jnp.arange(block_m)[None, :]
        sum_sq = jnp.where(diag, gram, 0.0).sum(axis=1)
    if norm and stat == "late":
        sum_sq = sum(jnp.square(t.astype(jnp.float32)).sum(axis=1) for t in rows_x)
        accs = tuple(acc * lax.rsqrt(sum_sq / k + eps)[:, None] for acc in accs)
    if partial:
        for acc, cols in zip(accs, col_groups):
            store(o_ref.at[pl.program_id(2), rows[:, None], cols[None, :]], acc, mask=row_ok[:, None] & n_ok[None, :])
        if norm and stat == "gram":
            (ssq_ref,) = ssq_refs
            store(ssq_ref.at[pl.program_id(2), rows], sum_sq, mask=row_ok & (pl.program_id(1) == 0))
        return
    if norm and stat == "gram":
        rstd = lax.rsqrt(sum_sq / k + eps)
        accs = tuple(acc * rstd[:, None] for acc in accs)
    tile_mask = row_ok[:, None] & n_ok[None, :]
    store(o_ref.at[rows[:, None], cols_n[None, :]], _epilogue(accs, None, None, o_ref.dtype), mask=tile_mask)


@functools.partial(jax.jit, static_argnames=("norm", "activation", "config", "interpret", "stat"))
def norm_dot_matmul(x, w, *, norm=True, activation=None, config=None, interpret=False, stat="gram"):
    """rms_norm(x) @ w_unfolded == rstd * (x @ w) with w's rows pre-scaled; [-> silu_mul]."""
    m, k = x.shape
    silu_mul = activation == "silu_mul"
    n_out = w.shape[1] // 2 if silu_mul else w.shape[1]
    config = config or _default_config(m, k, n_out, x.dtype, silu_mul=silu_mul)
    block_m = _block_m(config, m)
    k_blocks = pl.cdiv(k, config.block_k)
    k_splits = min(config.k_splits, k_blocks)
    partial = k_splits > 1
    kernel = functools.partial(_kernel, eps=EPS, norm=norm, silu_mul=silu_mul, block_m=block_m,
                               block_n=config.block_n, block_k=config.block_k, n_out=n_out,
                               k_blocks_per_split=pl.cdiv(k_blocks, k_splits), partial=partial, stat=stat)
    out_shape = [jax.ShapeDtypeStruct((k_splits, m, w.shape[1]), jnp.float32)] if partial else [
        jax.ShapeDtypeStruct((m, n_out), x.dtype)]
    if partial and norm and stat == "gram":
        out_shape.append(jax.ShapeDtypeStruct((k_splits, m), jnp.float32))
    outs = pl.pallas_call(
        kernel, grid=(pl.cdiv(m, block_m), pl.cdiv(n_out, config.block_n), k_splits), out_shape=out_shape,
        compiler_params=triton_params(config.num_warps, config.num_stages), interpret=interpret,
        name="norm_dot_matmul")(x, w)
    if not partial:
        return outs[0]
    acc = outs[0].sum(axis=0)
    if norm and stat == "gram":
        acc = acc * lax.rsqrt(outs[1].sum(axis=0) / k + EPS)[:, None]
    return _epilogue(jnp.split(acc, 2 if silu_mul else 1, axis=1), None, None, x.dtype)


def folded_reference(x, w_folded, activation=None):
    xf = x.astype(jnp.float32)
    h = (xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + EPS)).astype(x.dtype)
    return rmsnorm_matmul_reference(h, None, w_folded, activation=activation)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--interpret", action="store_true")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--out")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--m", type=int, nargs="+", default=[1, 8, 16, 32, 64])
    args = p.parse_args()
    rng = np.random.default_rng(0)
    hidden, qkv_n, inter = (64, 128, 96) if args.tiny else (1024, 4096, 3072)
    shapes = {"qkv": (hidden, qkv_n, None), "gate_up": (hidden, 2 * inter, "silu_mul")}
    cfg = lambda **kw: RmsNormMatmulConfig(**{"block_m": 64, "block_n": 64, "block_k": 128, "num_warps": 4,
                                              "num_stages": 4, **kw})
    rows, kernels = [], {}
    for name, (k, n, act) in shapes.items():
        for m in args.m:
            sets = []
            n_sets = 2 if args.tiny else max(1, int(np.ceil(150e6 / (k * n * 2))))
            for _ in range(n_sets):
                x, s, w = normal(rng, (m, k)), 1 + normal(rng, (k,), 0.1), normal(rng, (k, n), k ** -0.5)
                sets.append((x, s, w, (s.astype(jnp.float32)[:, None] * w.astype(jnp.float32)).astype(w.dtype)))
            impls = {
                "cur": (lambda x, s, w, wf: rmsnorm_matmul(x, s, w, eps=EPS, activation=act,
                                                           interpret=args.interpret), 1),
                "xla": (jax.jit(lambda x, s, w, wf: rmsnorm_matmul_reference(x, s, w, eps=EPS, activation=act)), 0),
            }
            bm = min(64, max(16, pl.next_power_of_2(m)))
            variants = {"nonorm_k64s2": (cfg(block_m=bm, block_k=64, k_splits=2), "none"),
                        "gram_k64s2": (cfg(block_m=bm, block_k=64, k_splits=2), "gram")}
            if bm <= 16:
                variants.update({"late_k64s2": (cfg(block_m=bm, block_k=64, k_splits=2), "late"),
                                 "late_k128s2": (cfg(block_m=bm, block_k=128, k_splits=2), "late"),
                                 "late_k64s2w8": (cfg(block_m=bm, block_k=64, k_splits=2, num_warps=8), "late"),
                                 "late_k64s4": (cfg(block_m=bm, block_k=64, k_splits=4, block_n=128), "late"),
                                 "gram_k32s2": (cfg(block_m=bm, block_k=32, k_splits=2, num_stages=6), "gram")})
            else:
                variants.update({"gram_n32s1": (cfg(block_m=bm, block_n=32, k_splits=1), "gram"),
                                 "gram_n32s1k64": (cfg(block_m=bm, block_n=32, block_k=64, k_splits=1), "gram"),
                                 "gram_n32s1w8": (cfg(block_m=bm, block_n=32, k_splits=1, num_warps=8), "gram"),
                                 "gram_n64s1k64w8": (cfg(block_m=bm, block_n=64, block_k=64, k_splits=1,
                                                         num_warps=8), "gram")})
            for label, (c, stat) in variants.items():
                impls[label] = (lambda x, s, w, wf, c=c, stat=stat: norm_dot_matmul(
                    x, wf, norm=stat != "none", activation=act, config=c, interpret=args.interpret,
                    stat="gram" if stat == "none" else stat), 0)
            x, s, w, wf = sets[0]
            want = np.asarray(rmsnorm_matmul_reference(x.astype(jnp.float32), s.astype(jnp.float32),
                                                       w.astype(jnp.float32), eps=EPS, activation=act))
            for label, (fn, dep) in impls.items():
                got = np.asarray(fn(*sets[0]).astype(jnp.float32))
                err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
                if args.interpret:
                    print(f"{name} M={m} {label}: rel err {err:.2e}")
                    continue
                t = time_per_call(fn, sets, work_seconds=k * n * 2 / 2.83e12, repeats=args.repeats, dep_arg=dep)
                by_kind = kernel_times_by_kind(fn, sets, work_seconds=k * n * 2 / 2.83e12, dep_arg=dep)
                r = {"shape": name, "m": m, "impl": label, "per_call_us": t * 1e6, "rel_err": err,
                     "kernels_us": {kind: v * 1e6 for kind, v in by_kind.items()}}
                rows.append(r)
                print(r, flush=True)
    if args.interpret:
        return
    print(f"\n{'shape':<8} {'M':>3} {'impl':<14} {'call us':>8} {'x xla':>6} {'pallas us':>9} {'%HBM':>5} "
          "  other kernels (us)")
    for r in rows:
        xla = next(q["per_call_us"] for q in rows if q["shape"] == r["shape"] and q["m"] == r["m"]
                   and q["impl"] == "xla")
        k, n, _ = shapes[r["shape"]]
        pallas = sum(v for kind, v in r["kernels_us"].items() if "matmul" in kind)
        pct = f"{100 * k * n * 2 / (pallas * 1e-6) / 2.83e12:.0f}" if pallas else "-"
        other = " ".join(f"{kind}={v:.2f}" for kind, v in r["kernels_us"].items() if "matmul" not in kind and v > .2)
        print(f"{r['shape']:<8} {r['m']:>3} {r['impl']:<14} {r['per_call_us']:>8.2f} {xla / r['per_call_us']:>6.2f} "
              f"{pallas:>9.2f} {pct:>5}   {other}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"jax": jax.__version__, "device": jax.devices()[0].device_kind, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
