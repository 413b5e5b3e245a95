"""Every way of reading FP8 weights tried for the FP8 projections, on Qwen3-8B's projection shapes: which reads E4M3 fastest?

    PYTHONPATH=$PWD python3 scripts/probe_fp8_readers.py --m 1 8 64 [--shapes qkv o gate_up down] [--only xla_deq ...]

Variants (x @ w for x [M, K] bf16, w [K, N] E4M3 with one f32 scale per column, or bf16 as the peer; "T": the
weight held as [N, K], a row per output channel, the layout convert.quantize stores):
- kern_bf16 / kern_fp8: the fused projection kernel (pallas_kernels.rmsnorm_matmul) on bf16 weights / on the [N, K]
  E4M3 weight (swap AB, x in f16: c41ab5d), its default tiles. (An FP8 path on [K, N] E4M3 tiles read them at 23-55%
  of the copy ceiling here; it went with the [N, K] layout.)
- xla_bf16 / xla_deq / xla_deqT: XLA's dot on bf16 weights / on `w.astype(bf16)` (XLA fuses the upcast into the
  GEMM's operand load) / the same on [N, K]; _pad2 / _pad8: one row padded to 2 / 8. xla_deqT_f16x: x times 2^-4
  and the weight in f16 (E4M3 -> f16 is one hardware conversion).
- swapab_{fp8,f16x,bf16} / swapabT_f16x: a Pallas dot with the weight tile as the left operand ([bn, bk] @ x^T: its
  upcast in registers, x's rows the narrow side) on [N, K] E4M3 (x bf16, or f16 so that the upcast is one hardware
  conversion), on [N, K] bf16, or on [K, N] E4M3 contracted over its first axis.
- nkT_f16x (M > 16): swapab_f16x with x as the left operand, [bm, bk] @ the upcast [bn, bk] tile^T.
- gemv_fp8 / gemv_bf16: a GEMV without tensor cores (multiply-add on the upcast tile, one reduction at the end).
- u8dot: the fused kernel's dot with the upcast done by integer bit operations (E4M3 subnormals flushed to zero).
- xla_deq_materialized: the upcast weight written out, then XLA's bf16 GEMM; xla_w8a8: XLA's FP8 x FP8 dot on rows
  of x quantized to E4M3 (both for prefill-sized M).
- w8a8: each row of x quantized to E4M3, an FP8 x FP8 tensor-core dot.
bench_kernels' timing loop, weights rotated past L2; %HBM = bytes read / time / 2.83 TB/s; relerr: max abs error over
max abs value against the f32 product of the dequantized weight. On a CPU the kernels run interpreted on a tiny
shape, untimed (a check that each variant computes the product). Results: docs/benchmarks.md, "FP8 weights".
"""
import argparse
import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))
from bench_kernels import normal, time_per_call  # noqa: E402

from convert.quantize import quantize_weight  # noqa: E402
from pallas_kernels._compat import dot, load, num_sms, store, triton_params  # noqa: E402
from pallas_kernels.rmsnorm_matmul import rmsnorm_matmul  # noqa: E402

BW = 2.83e12
PEAK_FLOPS = 777e12  # bf16 dense matmul, measured (../shared/DEVICE.md)
SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 24576), "down": (12288, 4096)}


def gemv_kernel(x_ref, w_ref, o_ref, *, bk, bn, kb_per_split):
    # x_ref [1, K]; w_ref [K, N]; o_ref [splits, 1, N] f32: multiply-add on the upcast tile, one reduction at the end
    cols = pl.program_id(0) * bn + jnp.arange(bn)
    first = pl.program_id(1) * kb_per_split

    def body(i, acc):
        ks = (first + i) * bk + jnp.arange(bk)
        x = load(x_ref.at[0, ks]).astype(jnp.float32)
        w = load(w_ref.at[ks[:, None], cols[None, :]]).astype(jnp.float32)
        return acc + x[:, None] * w

    acc = lax.fori_loop(0, kb_per_split, body, jnp.zeros((bk, bn), jnp.float32))
    store(o_ref.at[pl.program_id(1), 0, cols], acc.sum(axis=0))


@functools.partial(jax.jit, static_argnames=("bk", "bn", "splits", "warps", "stages", "interpret"))
def gemv(x, w, scale, *, bk, bn, splits, warps, stages, interpret=False):
    """x: [1, K]; w: [K, N] (FP8 with scale [N], or bf16 with scale None) -> [1, N]; split K summed by XLA."""
    k, n = w.shape
    out = pl.pallas_call(
        functools.partial(gemv_kernel, bk=bk, bn=bn, kb_per_split=k // bk // splits),
        grid=(n // bn, splits), out_shape=jax.ShapeDtypeStruct((splits, 1, n), jnp.float32),
        compiler_params=triton_params(warps, stages), name="gemv", interpret=interpret)(x, w)
    out = out.sum(0)
    if scale is not None:
        out = out * scale
    return out.astype(x.dtype)


def dot_u8_kernel(x_ref, w_ref, o_ref, *, bm, bk, bn, kb_per_split):
    # x_ref [M, K] bf16; w_ref [K, N] uint8 (E4M3 bits, upcast to bf16 with integer operations); o_ref [splits, M, N]
    m = x_ref.shape[0]
    rows = jnp.arange(bm)
    cols = pl.program_id(0) * bn + jnp.arange(bn)
    first = pl.program_id(1) * kb_per_split

    def body(i, acc):
        ks = (first + i) * bk + jnp.arange(bk)
        x = load(x_ref.at[rows[:, None], ks[None, :]], mask=(rows < m)[:, None], other=0.0)
        u = load(w_ref.at[ks[:, None], cols[None, :]]).astype(jnp.uint16)
        mag = u & 0x7F
        bits = jnp.where(mag >= 8, (mag << 4) + (120 << 7), 0).astype(jnp.uint16) | ((u & 0x80) << 8)
        # subnormal E4M3 (exponent 0) flushed to zero here: a bound on what the trick costs, not exact
        w = lax.bitcast_convert_type(bits, jnp.bfloat16)
        return acc + dot(x, w)

    acc = lax.fori_loop(0, kb_per_split, body, jnp.zeros((bm, bn), jnp.float32))
    store(o_ref.at[pl.program_id(1), rows[:, None], cols[None, :]], acc, mask=(rows < m)[:, None])


@functools.partial(jax.jit, static_argnames=("bk", "bn", "splits", "warps", "stages", "interpret"))
def dot_u8(x, w_u8, scale, *, bk, bn, splits, warps, stages, interpret=False):
    """x: [M, K]; w_u8: [K, N] the E4M3 bytes; scale [N] -> [M, N]."""
    m, (k, n) = x.shape[0], w_u8.shape
    bm = max(16, pl.next_power_of_2(m)) if m <= 64 else 64
    out = pl.pallas_call(
        functools.partial(dot_u8_kernel, bm=bm, bk=bk, bn=bn, kb_per_split=k // bk // splits),
        grid=(n // bn, splits), out_shape=jax.ShapeDtypeStruct((splits, m, n), jnp.float32),
        compiler_params=triton_params(warps, stages), name="dot_u8", interpret=interpret)(x, w_u8)
    return (out.sum(0) * scale).astype(x.dtype)


def quantize_rows(x):
    """x: [M, K] -> (E4M3 [M, K], f32 scales [M]): each row over its largest magnitude / 448."""
    xs = jnp.maximum(jnp.max(jnp.abs(x.astype(jnp.float32)), axis=1), 1e-12) / 448.0
    return (x.astype(jnp.float32) / xs[:, None]).astype(jnp.float8_e4m3fn), xs


def program_tile(bm, bn, kb_per_split):
    """-> (the x rows [bm], the output columns [bn] and the first K block of a program of grid (N / bn, splits,
    M / bm))."""
    return (pl.program_id(2) * bm + jnp.arange(bm), pl.program_id(0) * bn + jnp.arange(bn),
            pl.program_id(1) * kb_per_split)


def x_block(x_ref, rows, ks):
    """x_ref [M, K] -> its [rows, ks] block, zeros past M."""
    return load(x_ref.at[rows[:, None], ks[None, :]], mask=(rows < x_ref.shape[0])[:, None], other=0.0)


def w8a8_kernel(x_ref, w_ref, o_ref, *, bm, bk, bn, kb_per_split):
    # x_ref [M, K] float8_e4m3fn (rows quantized, scales outside); w_ref [K, N] float8_e4m3fn; o_ref [splits, M, N]
    m = x_ref.shape[0]
    rows, cols, first = program_tile(bm, bn, kb_per_split)

    def body(i, acc):
        ks = (first + i) * bk + jnp.arange(bk)
        x = x_block(x_ref, rows, ks)
        w = load(w_ref.at[ks[:, None], cols[None, :]])
        return acc + lax.dot_general(x, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, kb_per_split, body, jnp.zeros((bm, bn), jnp.float32))
    store(o_ref.at[pl.program_id(1), rows[:, None], cols[None, :]], acc, mask=(rows < m)[:, None])


@functools.partial(jax.jit, static_argnames=("bm", "bk", "bn", "splits", "warps", "stages", "interpret"))
def w8a8(x, w8, scale, *, bm, bk, bn, splits, warps, stages, interpret=False):
    """x: [M, K] bf16 quantized per row to E4M3 (amax / 448), then an FP8 x FP8 dot."""
    m, (k, n) = x.shape[0], w8.shape
    xq, xs = quantize_rows(x)
    out = pl.pallas_call(
        functools.partial(w8a8_kernel, bm=bm, bk=bk, bn=bn, kb_per_split=k // bk // splits),
        grid=(n // bn, splits, pl.cdiv(m, bm)), out_shape=jax.ShapeDtypeStruct((splits, m, n), jnp.float32),
        compiler_params=triton_params(warps, stages), name="w8a8", interpret=interpret)(xq, w8)
    return (out.sum(0) * xs[:, None] * scale).astype(x.dtype)


def swapab_kernel(x_ref, w_ref, o_ref, *, bm, bk, bn, kb_per_split, w_kn, swap=True):
    # x_ref [M, K] (bf16 or f16); w_ref [N, K] (E4M3 or bf16; K contiguous, HF's layout); o_ref [splits, M, N] f32.
    # The weight tile is the dot's left operand, [bn, bk] @ x^T [bk, bm]: its upcast can stay in registers (a
    # tensor-core dot takes its left operand from registers, its right one from shared memory), x's rows the narrow
    # side.
    m = x_ref.shape[0]
    rows, cols, first = program_tile(bm, bn, kb_per_split)

    def body(i, acc):
        ks = (first + i) * bk + jnp.arange(bk)
        x = x_block(x_ref, rows, ks)
        if w_kn:  # w_ref [K, N]: the [bk, bn] tile contracted over its first axis
            w = load(w_ref.at[ks[:, None], cols[None, :]]).astype(x.dtype)
            return acc + lax.dot_general(w, x, (((0,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        w = load(w_ref.at[cols[:, None], ks[None, :]]).astype(x.dtype)
        return acc + (dot(w, x, trans_b=True) if swap else dot(x, w, trans_b=True))

    if not swap:  # x [bm, bk] @ the upcast tile^T, accumulators [bm, bn]: for batched rows
        acc = lax.fori_loop(0, kb_per_split, body, jnp.zeros((bm, bn), jnp.float32))
        store(o_ref.at[pl.program_id(1), rows[:, None], cols[None, :]], acc, mask=(rows < m)[:, None])
        return
    acc = lax.fori_loop(0, kb_per_split, body, jnp.zeros((bn, bm), jnp.float32))
    store(o_ref.at[pl.program_id(1), rows[None, :], cols[:, None]], acc, mask=(rows < m)[None, :])


@functools.partial(jax.jit, static_argnames=("bm", "bk", "bn", "splits", "warps", "stages", "f16", "w_kn", "swap",
                                             "interpret"))
def swapab(x, wt, scale, *, bm, bk, bn, splits, warps, stages, f16=False, w_kn=False, swap=True, interpret=False):
    """x: [M, K] bf16 (cast to f16 with f16: E4M3 -> f16 is one hardware conversion); wt: [N, K] E4M3 with scale
    [N], or bf16 with scale None -> [M, N]; split K summed by XLA. swap=False: x the dot's left operand."""
    m, (n, k) = x.shape[0], wt.shape[::-1] if w_kn else wt.shape
    xin = x.astype(jnp.float16) if f16 else x
    out = pl.pallas_call(
        functools.partial(swapab_kernel, bm=bm, bk=bk, bn=bn, kb_per_split=k // bk // splits, w_kn=w_kn,
                          swap=swap),
        grid=(n // bn, splits, pl.cdiv(m, bm)), out_shape=jax.ShapeDtypeStruct((splits, m, n), jnp.float32),
        compiler_params=triton_params(warps, stages), name="swapab", interpret=interpret)(xin, wt)
    out = out.sum(0)
    if scale is not None:
        out = out * scale
    return out.astype(x.dtype)


def xla_deq(pad: int, transposed: bool = False, f16: bool = False):
    """XLA's dot on the upcast weight, x padded with `pad` zero rows (the result sliced back); transposed: the weight
    held as [N, K]; f16: x (times 2^-4) and the weight meet in f16."""
    def fn(x, w8, s, wb, u8, wt):
        rows = x.shape[0]
        xp = jnp.pad(x, ((0, pad), (0, 0)))
        if transposed:
            dt, xs = (jnp.float16, 2.0 ** -4) if f16 else (x.dtype, 1.0)
            out = lax.dot_general((xp * xs).astype(dt), wt[0].astype(dt), (((1,), (1,)), ((), ())),
                                  preferred_element_type=jnp.float32) * (s / xs)
        else:
            out = (xp @ w8.astype(x.dtype)).astype(jnp.float32) * s
        return out.astype(x.dtype)[:rows]
    return jax.jit(fn)


@jax.jit
def xla_deq_materialized(x, w8, s, wb, u8, wt):
    """The upcast weight written out first (an optimization barrier keeps XLA from fusing it), then a bf16 GEMM."""
    w = lax.optimization_barrier(w8.astype(x.dtype))
    return ((x @ w).astype(jnp.float32) * s).astype(x.dtype)


@jax.jit
def xla_w8a8(x, w8, s, wb, u8, wt):
    """x quantized per row to E4M3, then XLA's FP8 x FP8 dot (cuBLASLt on Hopper), both scales in the epilogue."""
    xq, xs = quantize_rows(x)
    out = lax.dot_general(xq, w8, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return (out * xs[:, None] * s).astype(x.dtype)


def variants(m, k, n, interpret) -> dict:
    """name -> (fn(x, w8, scale, w_bf16, w_u8), bytes it reads)."""
    fp8_bytes, bf16_bytes = k * n + 4 * n, 2 * k * n
    out = {
        "kern_bf16": (lambda x, w8, s, wb, u8, wt: rmsnorm_matmul(x, wb, interpret=interpret), bf16_bytes),
        "kern_fp8": (lambda x, w8, s, wb, u8, wt: rmsnorm_matmul(x, wt[0], w_scale=s, interpret=interpret), fp8_bytes),
        "xla_bf16": (jax.jit(lambda x, w8, s, wb, u8, wt: x @ wb), bf16_bytes),
        "xla_deq": (xla_deq(0), fp8_bytes),
        "xla_deq_materialized": (xla_deq_materialized, fp8_bytes),
        "xla_w8a8": (xla_w8a8, fp8_bytes),
        "xla_deq_pad2": (xla_deq(1), fp8_bytes),
        "xla_deq_pad8": (xla_deq(7), fp8_bytes),
        "xla_deqT": (xla_deq(0, transposed=True), fp8_bytes),
        "xla_deqT_pad2": (xla_deq(1, transposed=True), fp8_bytes),
        "xla_deqT_f16x": (xla_deq(0, transposed=True, f16=True), fp8_bytes),
        "xla_deqT_f16x_pad2": (xla_deq(1, transposed=True, f16=True), fp8_bytes),
    }
    for bn, bk, warps in ((128, 64, 4), (256, 32, 4), (256, 64, 8), (512, 32, 8)):
        if n % bn or k % bk:
            continue
        splits = split_k(n // bn, k // bk, 2 * num_sms())
        kw = dict(bk=bk, bn=bn, splits=splits, warps=warps, stages=3, interpret=interpret)
        out[f"u8dot_bn{bn}_bk{bk}_w{warps}_s{splits}"] = (lambda x, w8, s, wb, u8, wt, kw=kw: dot_u8(x, u8, s, **kw),
                                                         fp8_bytes)
        if m == 1:
            out[f"gemv_fp8_bn{bn}_bk{bk}_w{warps}_s{splits}"] = (
                lambda x, w8, s, wb, u8, wt, kw=kw: gemv(x, w8, s, **kw), fp8_bytes)
            out[f"gemv_bf16_bn{bn}_bk{bk}_w{warps}_s{splits}"] = (
                lambda x, w8, s, wb, u8, wt, kw=kw: gemv(x, wb, None, **kw), bf16_bytes)
    for bm, bn, bk, warps in ((16, 64, 128, 4), (64, 64, 128, 4), (64, 128, 128, 4), (64, 64, 256, 4)):
        if n % bn or k % bk:
            continue
        splits = split_k(n // bn * -(-m // bm), k // bk, num_sms())
        kw = dict(bm=bm, bk=bk, bn=bn, splits=splits, warps=warps, stages=4, interpret=interpret)
        out[f"w8a8_bm{bm}_bn{bn}_bk{bk}_s{splits}"] = (lambda x, w8, s, wb, u8, wt, kw=kw: w8a8(x, w8, s, **kw),
                                                      fp8_bytes)
    bm = 16 if m <= 16 else 64
    for bn, bk, warps, stages in ((64, 128, 4, 4), (64, 256, 4, 3), (128, 128, 4, 4), (128, 128, 8, 4),
                                  (128, 256, 8, 3), (256, 64, 8, 4), (64, 512, 4, 2), (32, 256, 4, 3)):
        if n % bn or k % bk:
            continue
        for programs in (num_sms(), 2 * num_sms()):
            splits = split_k(n // bn * -(-m // bm), k // bk, programs)
            kw = dict(bm=bm, bk=bk, bn=bn, splits=splits, warps=warps, stages=stages, interpret=interpret)
            tag = f"bn{bn}_bk{bk}_w{warps}_st{stages}_s{splits}"
            out[f"swapab_fp8_{tag}"] = (lambda x, w8, s, wb, u8, wt, kw=kw: swapab(x, wt[0], s, **kw), fp8_bytes)
            out[f"swapab_f16x_{tag}"] = (lambda x, w8, s, wb, u8, wt, kw=kw: swapab(x, wt[0], s, f16=True, **kw),
                                         fp8_bytes)
            out[f"swapabT_f16x_{tag}"] = (lambda x, w8, s, wb, u8, wt, kw=kw: swapab(x, w8, s, f16=True, w_kn=True,
                                                                                      **kw), fp8_bytes)
            out[f"swapab_bf16_{tag}"] = (lambda x, w8, s, wb, u8, wt, kw=kw: swapab(x, wt[1], None, **kw),
                                         bf16_bytes)
    if m > 16:  # batched rows: x as the left operand, [64, bk] @ the upcast [bn, bk] tile^T
        for bn, bk, warps, stages in ((64, 128, 4, 4), (128, 128, 4, 4), (128, 128, 8, 3), (128, 64, 4, 4),
                                      (256, 64, 8, 3), (128, 256, 8, 3)):
            if n % bn or k % bk:
                continue
            for programs in (num_sms(), 2 * num_sms()):
                splits = split_k(n // bn * -(-m // 64), k // bk, programs)
                kw = dict(bm=64, bk=bk, bn=bn, splits=splits, warps=warps, stages=stages, interpret=interpret)
                out[f"nkT_f16x_bn{bn}_bk{bk}_w{warps}_st{stages}_s{splits}"] = (
                    lambda x, w8, s, wb, u8, wt, kw=kw: swapab(x, wt[0], s, f16=True, swap=False, **kw), fp8_bytes)
    return out


def split_k(tiles: int, k_blocks: int, programs: int) -> int:
    """K splits, doubled while the grid stays within `programs` and every split keeps at least two K blocks."""
    splits = 1
    while tiles * splits * 2 <= programs and k_blocks // (splits * 2) >= 2:
        splits *= 2
    return splits


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--only", nargs="+", help="variants whose names contain one of these")
    args = ap.parse_args()
    interpret = jax.default_backend() != "gpu"
    shapes = {"tiny": (512, 1024)} if interpret else {name: SHAPES[name] for name in args.shapes}
    rng = np.random.default_rng(0)
    rows = []
    for name, (k, n) in shapes.items():
        copies = 1 if interpret else max(1, -(-int(150e6) // (k * n + 4 * n)))  # FP8 copies past L2 three times
        weights = []
        for _ in range(copies):
            w32 = normal(rng, (k, n), k ** -0.5).astype(jnp.float32)
            q = quantize_weight(w32)
            wb = w32.astype(jnp.bfloat16)
            w8 = jnp.transpose(q["w_t"])  # [K, N]
            weights.append((w8, q["scale"], wb, lax.bitcast_convert_type(w8, jnp.uint8), (q["w_t"], jnp.transpose(wb))))
        for m in args.m:
            sets = [(normal(rng, (m, k)), *ws) for ws in weights]
            x, w8, scale = sets[0][:3]
            ref = x.astype(jnp.float32) @ (w8.astype(jnp.float32) * scale)
            for v, (fn, nbytes) in variants(m, k, n, interpret).items():
                if args.only and not any(o in v for o in args.only):
                    continue
                try:
                    out = jax.block_until_ready(fn(*sets[0]))
                    err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref)) / (jnp.max(jnp.abs(ref)) + 1e-9))
                    work = max(nbytes / BW, 2 * m * k * n / PEAK_FLOPS)  # the larger of the two ceilings
                    t = 0.0 if interpret else time_per_call(fn, sets, work_seconds=work, repeats=5)
                except Exception as e:  # noqa: BLE001 - a variant that does not compile is reported, not fatal
                    print(f"{v} {name} M={m}: {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
                    continue
                rows.append((name, m, v, t * 1e6, 100 * nbytes / max(t, 1e-12) / BW, err))
                print(f"ROW {name:8} M={m:<3} {v:34} {t * 1e6:9.2f} us err {err:.3g}", flush=True)
    print(f"\n{'shape':<8} {'M':<3} {'variant':<38} {'us':>8} {'%HBM':>5}  relerr")
    for r in rows:
        timed = f"{r[3]:8.2f} {r[4]:5.0f}" if r[3] else f"{'-':>8} {'-':>5}"
        print(f"{r[0]:<8} {r[1]:<3} {r[2]:<38} {timed}  {r[5]:.2g}")


if __name__ == "__main__":
    main()
