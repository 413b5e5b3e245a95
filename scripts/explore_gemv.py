"""Scratch: M = 1 projection layouts on the GPU. Kernel time from the profiler, not the harness."""
import functools
import glob
import itertools
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))
from bench_kernels import normal, time_per_call  # noqa: E402

from pallas_kernels._compat import load, store, triton_params  # noqa: E402
from pallas_kernels.rmsnorm_matmul import rmsnorm_matmul  # noqa: E402

INTERPRET = "--interpret" in sys.argv


def gemv_nk_kernel(x_ref, w_ref, o_ref, *, bn, bk, kb_per_split):
    # x_ref [1, K]; w_ref [N, K]; o_ref [splits, 1, N] f32
    n, k = w_ref.shape
    rows = pl.program_id(0) * bn + jnp.arange(bn)
    n_ok = rows < n
    first = pl.program_id(1) * kb_per_split
    zero = jnp.zeros((1, 1), jnp.int32)

    def body(i, acc):
        cols = (first + i) * bk + jnp.arange(bk)
        k_ok = cols < k
        xv = load(x_ref.at[zero, cols[None, :]], mask=k_ok[None, :], other=0.0)
        w = load(w_ref.at[rows[:, None], cols[None, :]], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        return acc + w.astype(jnp.float32) * xv.astype(jnp.float32)

    num = jnp.minimum(pl.cdiv(k, bk) - first, kb_per_split)
    acc = lax.fori_loop(0, num, body, jnp.zeros((bn, bk), jnp.float32))
    store(o_ref.at[pl.program_id(1), zero[0], rows], acc.sum(axis=1), mask=n_ok)


def gemv_kn_kernel(x_ref, w_ref, o_ref, *, bn, bk, kb_per_split):
    # x_ref [1, K]; w_ref [K, N]; o_ref [splits, 1, N] f32
    k, n = w_ref.shape
    cols_n = pl.program_id(0) * bn + jnp.arange(bn)
    n_ok = cols_n < n
    first = pl.program_id(1) * kb_per_split
    zero = jnp.zeros((1, 1), jnp.int32)

    def body(i, acc):
        rows_k = (first + i) * bk + jnp.arange(bk)
        k_ok = rows_k < k
        xv = load(x_ref.at[jnp.zeros((bk, 1), jnp.int32), rows_k[:, None]], mask=k_ok[:, None], other=0.0)
        w = load(w_ref.at[rows_k[:, None], cols_n[None, :]], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        return acc + w.astype(jnp.float32) * xv.astype(jnp.float32)

    num = jnp.minimum(pl.cdiv(k, bk) - first, kb_per_split)
    acc = lax.fori_loop(0, num, body, jnp.zeros((bk, bn), jnp.float32))
    store(o_ref.at[pl.program_id(1), zero[0], cols_n], acc.sum(axis=0), mask=n_ok)


@functools.partial(jax.jit, static_argnames=("layout", "bn", "bk", "splits", "warps", "stages"))
def gemv(x, w, *, layout, bn, bk, splits, warps, stages):
    n = w.shape[0] if layout == "nk" else w.shape[1]
    k = x.shape[1]
    kb = pl.cdiv(k, bk)
    kernel = gemv_nk_kernel if layout == "nk" else gemv_kn_kernel
    out = pl.pallas_call(
        functools.partial(kernel, bn=bn, bk=bk, kb_per_split=pl.cdiv(kb, splits)),
        grid=(pl.cdiv(n, bn), splits),
        out_shape=jax.ShapeDtypeStruct((splits, 1, n), jnp.float32),
        compiler_params=triton_params(warps, stages), interpret=INTERPRET, name=f"gemv_{layout}")(x, w)
    return out.sum(axis=0).astype(x.dtype)


def kernel_us(fn, sets, calls):
    """GPU kernel microseconds per call by kernel kind (profiler), for `calls` back-to-back calls."""
    from profile_decode import kernel_kind, trace_events
    d = tempfile.mkdtemp()
    time_per_call(fn, sets, work_seconds=1e-6, repeats=1, dep_arg=0, calls=calls)
    with jax.profiler.trace(d):
        time_per_call(fn, sets, work_seconds=1e-6, repeats=1, dep_arg=0, calls=calls)
    kernels, _ = trace_events(d)
    by = {}
    for name, s, e in kernels:
        by[kernel_kind(name)] = by.get(kernel_kind(name), 0) + (e - s) / 1e3
    # two timed runs (warm-up + 1 repeat) are traced
    return {k: v / (2 * calls) for k, v in sorted(by.items(), key=lambda kv: -kv[1])}


SHAPES = {"qkv": (1024, 4096), "down": (3072, 1024)}


def main():
    rng = np.random.default_rng(0)
    rows = []
    shapes = {"tiny": (256, 128)} if INTERPRET else SHAPES
    for name, (k, n) in shapes.items():
        nsets = 1 if INTERPRET else max(1, int(150e6 // (k * n * 2)))
        sets_kn = [(normal(rng, (1, k)), normal(rng, (k, n), k ** -0.5)) for _ in range(nsets)]
        sets_nk = [(x, w.T.copy()) for x, w in sets_kn]
        ref = np.asarray(jnp.dot(sets_kn[0][0].astype(jnp.float32), sets_kn[0][1].astype(jnp.float32)))
        calls = 2 if INTERPRET else 20 * nsets
        wbytes = k * n * 2
        cands = [("current", None, lambda x, w: rmsnorm_matmul(x, None, w, interpret=INTERPRET), sets_kn)]
        cands.append(("xla", None, jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32)
                                           .astype(x.dtype)), sets_kn))
        grid = [("nk", bn, bk, sp, wp, st) for bn, bk, sp, wp, st in itertools.product(
            (4, 8, 16), (256, 512), (1, 2), (4, 8), (1, 3))]
        grid += [("kn", bn, bk, sp, wp, st) for bn, bk, sp, wp, st in itertools.product(
            (64, 128), (32, 64), (1, 2, 4), (4,), (3,))]
        if INTERPRET:
            grid = [("nk", 4, 64, 2, 4, 1), ("kn", 32, 32, 2, 4, 1)]
        for layout, bn, bk, sp, wp, st in grid:
            if sp * bk > k * 2 or (layout == "nk" and n // bn * sp > 2048):
                continue
            f = functools.partial(gemv, layout=layout, bn=bn, bk=bk, splits=sp, warps=wp, stages=st)
            cands.append((f"{layout} bn{bn} bk{bk} s{sp} w{wp} st{st}", None, f,
                          sets_nk if layout == "nk" else sets_kn))
        for label, _, f, sets in cands:
            try:
                out = np.asarray(f(*sets[0]), np.float32)
                err = float(np.abs(out - ref).max())
                if not np.isfinite(out).all() or err > 5e-2:
                    print(f"{name} {label}: WRONG err {err}", flush=True)
                    continue
                if INTERPRET:
                    print(f"{name} {label}: ok err {err:.2e}")
                    continue
                t = time_per_call(f, sets, work_seconds=wbytes / 2.83e12, repeats=2, dep_arg=0)
                rows.append((name, label, t * 1e6, 100 * wbytes / t / 2.83e12))
            except Exception as e:  # noqa: BLE001
                print(f"{name} {label}: {type(e).__name__} {str(e)[:100]}", flush=True)
        if INTERPRET:
            continue
        mine = sorted([r for r in rows if r[0] == name], key=lambda r: r[2])
        for r in mine[:6] + [r for r in mine if r[1] in ("current", "xla")]:
            print(f"{r[0]:<8} {r[1]:<28} harness {r[2]:7.2f} us {r[3]:5.1f}%", flush=True)
        # kernel time for the best nk / kn and current
        for label in dict.fromkeys([mine[0][1], "current", "xla"] +
                                   [next(r[1] for r in mine if r[1].startswith(p)) for p in ("nk", "kn")]):
            _, _, f, sets = next(c for c in cands if c[0] == label)
            ku = kernel_us(f, sets, calls)
            tot = sum(ku.values())
            main_k = max(ku.values())
            print(f"  profile {name} {label}: total {tot:.2f} us/call, biggest kernel {main_k:.2f} us "
                  f"({100 * wbytes / (main_k * 1e-6) / 2.83e12:.0f}% HBM): " +
                  ", ".join(f"{kk} {v:.2f}" for kk, v in list(ku.items())[:4]), flush=True)
    floor = jax.jit(lambda x, w: x * 2)
    x0 = normal(rng, (1, 1024))
    print(f"harness floor (x*2): {time_per_call(floor, [(x0, x0)], work_seconds=1e-6, repeats=3) * 1e6:.2f} us")


if __name__ == "__main__":
    main()
