"""Benchmark nanojax's Pallas kernels against XLA and JAX's own Pallas GPU ops (Qwen3-0.6B shapes, bf16).

    python scripts/bench_kernels.py --check --out bench.json      # on the GPU
    python scripts/bench_kernels.py --interpret --tiny --check    # CPU smoke test of this script

Timing: one jitted function runs `calls` back-to-back invocations (so Python dispatch is paid once per timed run,
not per call), the timed runs come after a compile + warm-up run, and the result is the median over `--repeats` runs
divided by `calls`. A timed run lasts ~`--target-ms` (50): one run's fixed cost (dispatch, and waking up the host
when it ends: ~0.3-0.5 ms on the H100) is then ~1% of it. Inputs rotate over enough copies that each call reads its
data from HBM, not from the 50 MB L2, and each call's input depends on the previous call's whole output (see
time_per_call), so that XLA can neither merge nor trim the repeated calls. Bandwidth is the bytes a kernel must read
(KV cache, or the weight) over the time, against 2.83 TB/s.
"""
import argparse
import contextlib
import functools
import json
import math
import os
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pallas_kernels.paged_attention import paged_attention_reference, paged_decode_attention, paged_prefill_attention
from pallas_kernels.rms_norm import rms_norm
from pallas_kernels.rmsnorm_matmul import rmsnorm_matmul, rmsnorm_matmul_reference

L2_BYTES = 50e6
EPS = 1e-6
DTYPE = jnp.bfloat16
QWEN3_06B = {"num_q_heads": 16, "num_kv_heads": 8, "head_dim": 128, "hidden": 1024}
TINY = {"num_q_heads": 4, "num_kv_heads": 2, "head_dim": 64, "hidden": 64}


# ------------------------------------------------------------------------------------------------------------ timing
def time_per_call(fn, arg_sets, *, work_seconds, repeats, dep_arg=0, fuse_offset=False, calls=None,
                  target_seconds=50e-3, trace_dir=None):
    """Median seconds per call of fn(*args), args cycling over arg_sets. work_seconds: a rough lower bound on one
    call (bytes / bandwidth), used to pick enough calls (unless given) that a timed run lasts ~target_seconds.
    trace_dir: run the timed runs (not the compile) under jax.profiler.trace, writing there.

    The calls run in a fori_loop, and each call's input `dep_arg` (pick a small one) is offset by a value computed
    from the previous call's whole output (always zero, but not to the compiler), so XLA can neither merge the calls
    nor hoist them out of the loop, nor compute only part of an output (a split-K epilogue for one element): every
    call really runs, one after the other, in full. The offset is a kernel of its own before every implementation:
    an optimization barrier keeps XLA from fusing it into an XLA implementation's first fusion, as it cannot into a
    Pallas call (docs/perf_notes.md, "Measuring kernels: bench_kernels' timing loop"). fuse_offset lets it fuse,
    for a read of the offset input itself.
    """
    calls = num_calls(arg_sets, work_seconds, calls, target_seconds)
    rounds = calls // len(arg_sets)

    def one_call(args, token):
        args = list(args)
        offset = args[dep_arg] + token.astype(args[dep_arg].dtype)
        args[dep_arg] = offset if fuse_offset else jax.lax.optimization_barrier(offset)
        out = fn(*args)
        return jnp.where(jnp.isnan(out).any(), 1.0, 0.0)

    @jax.jit
    def run(arg_sets):
        def body(_, token):  # one call per input set; a fixed trip count, so no host round trip per iteration
            for args in arg_sets:
                token = one_call(args, token)
            return token

        return jax.lax.fori_loop(0, rounds, body, jnp.float32(0))

    jax.block_until_ready(run(arg_sets))  # compile and warm up
    times = []
    with jax.profiler.trace(trace_dir) if trace_dir else contextlib.nullcontext():
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(run(arg_sets))
            times.append(time.perf_counter() - start)
    return statistics.median(times) / calls


def num_calls(arg_sets, work_seconds, calls=None, target_seconds=50e-3):
    """Calls per timed run: `calls`, or enough for ~target_seconds (at most 2,000); a multiple of len(arg_sets)."""
    calls = calls or max(len(arg_sets), 4, min(2000, math.ceil(target_seconds / max(work_seconds, 1e-6))))
    return -(-calls // len(arg_sets)) * len(arg_sets)


def kernel_times_by_kind(fn, arg_sets, *, work_seconds, dep_arg=0, fuse_offset=False, calls=None,
                         target_seconds=50e-3):
    """The profiler's view of one call: {kernel kind (gpu_trace.kernel_kind): GPU seconds per call}, for every GPU
    kernel of the timing loop (fn's kernels, and the loop's own add and NaN check), without the launch gaps that
    time_per_call includes."""
    from gpu_trace import kernel_kind, trace_events
    repeats = 2
    with tempfile.TemporaryDirectory() as trace_dir:
        time_per_call(fn, arg_sets, work_seconds=work_seconds, repeats=repeats, dep_arg=dep_arg,
                      fuse_offset=fuse_offset, calls=calls, target_seconds=target_seconds, trace_dir=trace_dir)
        kernels, _ = trace_events(trace_dir)
    per_call = 1e-9 / (repeats * num_calls(arg_sets, work_seconds, calls, target_seconds))
    by_kind = {}
    for name, start, end in kernels:
        by_kind[kernel_kind(name)] = by_kind.get(kernel_kind(name), 0.0) + (end - start) * per_call
    return by_kind


def kernel_time_per_call(fn, arg_sets, name, **kw):
    """-> (GPU seconds per call of the kernels named `name` (the Pallas kernel), of all GPU kernels (the kernel, XLA
    epilogues such as a split-K sum, and the timing loop's own add and NaN check)); see kernel_times_by_kind."""
    by_kind = kernel_times_by_kind(fn, arg_sets, **kw)
    return sum(t for kind, t in by_kind.items() if name in kind), sum(by_kind.values())


def rotations(args, bytes_per_set):
    """Copies of the inputs so that cycling through them overflows L2 three times over."""
    return int(min(args.max_rotations, max(1, math.ceil(3 * L2_BYTES / bytes_per_set))))


def try_time(name, fn, arg_sets, **kw):
    """time_per_call, or None (printed as n/a) when the implementation rejects the shape or the platform."""
    try:
        return time_per_call(fn, arg_sets, **kw)
    except Exception as e:  # noqa: BLE001 - a peer that cannot run this point is reported, not fatal
        print(f"    {name}: n/a ({type(e).__name__}: {str(e).splitlines()[0][:120]})")
        return None


# ------------------------------------------------------------------------------------------------------------ inputs
def normal(rng, shape, std=1.0):
    """Random DTYPE array made on the device by one fused kernel (the largest KV pools, 8.6 GB each, would not fit
    in host memory, nor next to an f32 intermediate)."""
    return _normal(jax.random.key(rng.integers(2 ** 31)), shape, std)


@functools.partial(jax.jit, static_argnums=(1,))
def _normal(key, shape, std):
    return (std * jax.random.normal(key, shape, jnp.float32)).astype(DTYPE)


def paged_inputs(rng, batch, ctx, q_tokens, model, page_size):
    """Random q [B, q_tokens, Hq, D] and a KV pool holding `batch` sequences of `ctx` tokens on shuffled pages."""
    hkv, d = model["num_kv_heads"], model["head_dim"]
    pages_per_seq = -(-ctx // page_size)
    num_pages = batch * pages_per_seq
    table = jnp.asarray(rng.permutation(num_pages).reshape(batch, pages_per_seq), jnp.int32)
    q = normal(rng, (batch, q_tokens, model["num_q_heads"], d))
    k, v = (normal(rng, (num_pages, hkv, page_size, d)) for _ in range(2))
    return q, k, v, table, jnp.full((batch,), ctx, jnp.int32)


def assert_close(name, out, ref, tol=2e-2):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(out).all(), f"{name}: non-finite output"
    np.testing.assert_allclose(out, ref, rtol=tol, atol=tol, err_msg=name)
    print(f"    check {name}: ok (max abs err {np.abs(out - ref).max():.2e})")


def assert_as_accurate(name, out, peer, exact):
    """For two implementations that round in different orders (the fused projection scales its f32 dot by rstd; the
    unfused pair rounds the normalized x first): ours errs from the f32 evaluation of the same inputs by no more than
    the peer does (plus a quarter of a bf16 step of the largest value), and its error norm stays within 1%."""
    out, peer, exact = (np.asarray(a, np.float64) for a in (out, peer, exact))
    assert np.isfinite(out).all(), f"{name}: non-finite output"
    err, peer_err = np.abs(out - exact).max(), np.abs(peer - exact).max()
    rel = np.linalg.norm(out - exact) / np.linalg.norm(exact)
    assert err <= peer_err + 2 ** -9 * np.abs(exact).max() and rel <= 1e-2, (name, err, peer_err, rel)
    print(f"    check {name}: ok (max abs err {err:.2e}, the unfused pair's {peer_err:.2e}; relative {rel:.1e})")


# ------------------------------------------------------------------------------------------------------------ decode
def jax_pallas_decode(interpret):
    """JAX's Pallas paged_attention on its own layout [Hkv, pages, S, D]; tries a few tilings it may accept."""
    from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged

    def fn(q, k_t, v_t, table, lens):
        for k_splits, pages_per_block in ((16, 8), (4, 4), (1, 1)):
            try:
                return jax_paged.paged_attention(q, k_t, v_t, table, lens, k_splits=k_splits,
                                                 pages_per_compute_block=pages_per_block, interpret=interpret)
            except (AssertionError, ValueError):
                continue
        raise ValueError("no accepted tiling")
    return fn


def decode_kv_bytes(model, batch, ctx):
    """Bytes of K and V (bf16) that one decode call reads for `batch` sequences of `ctx` tokens."""
    return 2 * batch * ctx * model["num_kv_heads"] * model["head_dim"] * 2


def decode_sets(args, rng, model, batch, ctx, page_size):
    """Enough (q [B, Hq, D], k_pages, v_pages, page_table, seq_lens) sets to rotate through (see rotations)."""
    sets = [paged_inputs(rng, batch, ctx, 1, model, page_size)
            for _ in range(rotations(args, decode_kv_bytes(model, batch, ctx)))]
    return [(q[:, 0], k, v, t, s) for q, k, v, t, s in sets]


def jax_layout(sets):
    """decode_sets in the KV layout of JAX's paged_attention: pages [Hkv, num_pages, S, D]."""
    return [(q, k.transpose(1, 0, 2, 3), v.transpose(1, 0, 2, 3), t, s) for q, k, v, t, s in sets]


def bench_decode(args, model, grid, page_size, rng):
    scale = model["head_dim"] ** -0.5
    ours = lambda q, k, v, t, s: paged_decode_attention(q, k, v, t, s, scale=scale, interpret=args.interpret)
    xla = jax.jit(lambda q, k, v, t, s: paged_attention_reference(q[:, None], k, v, t, s, jnp.ones_like(s),
                                                                  scale=scale)[:, 0])
    theirs = jax_pallas_decode(args.interpret)
    rows = []
    for batch, ctx in grid:
        kv_bytes = decode_kv_bytes(model, batch, ctx)
        if kv_bytes > args.max_kv_bytes:
            print(f"  decode B={batch} ctx={ctx}: skipped, {kv_bytes / 1e9:.1f} GB of KV")
            continue
        sets = decode_sets(args, rng, model, batch, ctx, page_size)
        # The XLA reference gathers K and V to f32 and transposes them: budget 4x the KV bytes.
        xla_fits = 4 * kv_bytes <= args.max_kv_bytes
        if args.check and xla_fits:
            assert_close(f"decode B={batch} ctx={ctx}", ours(*sets[0]), xla(*sets[0]))
        kw = timing(args, kv_bytes / args.hbm_bw, dep_arg=4)
        t_ours, kernel_times = time_ours(args, ours, sets, "paged_attention", kw)
        t_xla = try_time("xla", xla, sets, **kw) if xla_fits else None
        t_sets = jax_layout(sets)
        del sets
        t_theirs = try_time("jax_pallas_paged_attention", theirs, t_sets, **kw)
        rows.append(row("decode_attention", f"B={batch} ctx={ctx}", t_ours,
                        {"xla_reference": t_xla, "jax_pallas_paged_attention": t_theirs}, kv_bytes, args.hbm_bw,
                        kernel_times))
        if args.profile and t_theirs is not None:  # JAX's kernel alone too: both Pallas, both pay the loop's add
            rows[-1]["kernels_us"] = {"jax_pallas_paged_attention": {
                kind: t * 1e6 for kind, t in kernel_times_by_kind(theirs, t_sets, **profile_kwargs(kw)).items()}}
        del t_sets
    return rows


# ----------------------------------------------------------------------------------------------- rmsnorm + matmul
def bench_rmsnorm_matmul(args, model, m_values, rng):
    """Each projection of a decoder layer as one fused rmsnorm_matmul, against its jitted reference (XLA): qkv and
    gate/up with the norm, o_proj and down_proj with the residual add, gate/up with SiLU-and-mul. The normed ones run
    on the weight with the norm's scale folded in (as convert/ stores it), and their peers are the unfused pair in
    HF's order: XLA's RMSNorm (with its scale) then XLA's dot, and for QKV JAX's Pallas RMSNorm then XLA's dot.
    %HBM counts the weight bytes."""
    from jax.experimental.pallas.ops.gpu import rms_norm as jax_rms_norm

    from convert.keys import fold_norm_scale
    hidden, q_size = model["hidden"], model["num_q_heads"] * model["head_dim"]
    qkv_n = (model["num_q_heads"] + 2 * model["num_kv_heads"]) * model["head_dim"]
    inter = model.get("intermediate", 3 * hidden)  # Qwen3-0.6B: 3072
    # row name: (K, N of w, fused options, role). Every fn takes (x, second, w, w2): with a norm second is its scale
    # and w2 the folded weight; with a residual second is the residual and w2 is w.
    projections = {
        "rmsnorm_qkv": (hidden, qkv_n, {}, "norm"),
        "o_proj_residual": (q_size, hidden, {}, "residual"),
        "norm_gate_up_silu": (hidden, 2 * inter, {"activation": "silu_mul"}, "norm"),
        "down_residual": (inter, hidden, {}, "residual"),
    }

    def jax_pallas(x, s, w, wf):  # JAX's Pallas RMSNorm (it wants [B, T, K] and a bias) followed by an XLA dot
        normed = jax_rms_norm.rms_norm(x[None], s, jnp.zeros_like(s), None, 3, EPS, "triton", args.interpret)[0]
        return jnp.dot(normed, w, preferred_element_type=jnp.float32).astype(x.dtype)

    rows = []
    for name, (k, n, opts, role) in projections.items():
        n_out = n // 2 if opts.get("activation") == "silu_mul" else n
        if role == "norm":  # the timing dependency goes through x
            ours = lambda x, s, w, wf, opts=opts: rmsnorm_matmul(x, wf, norm_eps=EPS, interpret=args.interpret,
                                                                 **opts)
            xla = jax.jit(lambda x, s, w, wf, opts=opts: rmsnorm_matmul_reference(rms_norm(x, s, EPS), w, **opts))
            dep_arg = 0
        else:  # the timing dependency goes through the residual
            ours = lambda x, r, w, _, opts=opts: rmsnorm_matmul(x, w, residual=r, interpret=args.interpret, **opts)
            xla = jax.jit(lambda x, r, w, _, opts=opts: rmsnorm_matmul_reference(x, w, residual=r, **opts))
            dep_arg = 1
        for m in m_values:
            w_bytes = k * n * 2
            sets = []
            for _ in range(rotations(args, w_bytes + m * k * 2)):
                x, w = normal(rng, (m, k)), normal(rng, (k, n), k ** -0.5)
                if role == "norm":
                    s = 1 + normal(rng, (k,), 0.1)
                    sets.append((x, s, w, jnp.asarray(fold_norm_scale(np.asarray(s), np.asarray(w)), DTYPE)))
                else:
                    sets.append((x, normal(rng, (m, n_out)), w, w))
            if args.check:
                f32 = [a.astype(jnp.float32) for a in sets[0]]
                assert_as_accurate(f"{name} M={m}", ours(*sets[0]), xla(*sets[0]), xla(*f32))
            kw = timing(args, w_bytes / args.hbm_bw, dep_arg=dep_arg)
            t_ours, kernel_times = time_ours(args, ours, sets, "rmsnorm_matmul", kw)
            peers = {"xla_reference": try_time("xla", xla, sets, **kw)}
            if name == "rmsnorm_qkv":
                peers["jax_pallas_rms_norm+xla_dot"] = try_time("jax_pallas_rms_norm", jax_pallas, sets, **kw)
            rows.append(row(name, f"M={m} K={k} N={n}", t_ours, peers, w_bytes, args.hbm_bw, kernel_times))
            if args.profile:  # where each implementation's GPU time goes, the timing loop's own kernels included
                rows[-1]["kernels_us"] = {label: {kind: t * 1e6 for kind, t in kernel_times_by_kind(
                    fn, sets, **profile_kwargs(kw)).items()} for label, fn in (("ours", ours), ("xla_reference", xla))}
            if m == 1 and args.profile:
                rows.append(weight_read_row(args, name, sets, kw))
            del sets
    return rows


def weight_read_row(args, name, sets, kw):
    """What one XLA kernel does at this size: the row sums of w (every weight byte read once, rows contiguous,
    nothing else), timed like the projections; its "kernel alone" is the longest kernel kind of a call (the
    reduction, not the timing loop's NaN check)."""
    k, n = sets[0][2].shape
    read_w = jax.jit(lambda x, s, w, _: jnp.sum(w, axis=1, dtype=jnp.float32))
    # The loop's offset goes into w itself, so the read cannot be hoisted, and fuses into the read (isolated, it
    # would be a copy of w).
    read_kw = dict(kw, dep_arg=2, fuse_offset=True)
    t = time_per_call(read_w, sets, **read_kw)
    by_kind = kernel_times_by_kind(read_w, sets, **profile_kwargs(read_kw))
    return row(f"{name}_weight_read", f"K={k} N={n}", t, {}, k * n * 2, args.hbm_bw,
               (max(by_kind.values()), sum(by_kind.values())))


# -------------------------------------------------------------------------------------------------------- prefill
def bench_prefill(args, model, tokens, page_size, rng):
    scale = model["head_dim"] ** -0.5
    q, k, v, table, lens = paged_inputs(rng, 1, tokens, tokens, model, page_size)
    ours = lambda q, k, v, t, s: paged_prefill_attention(q, k, v, t, s, s, scale=scale, interpret=args.interpret)
    if args.check:
        assert_close(f"prefill T={tokens}", ours(q, k, v, table, lens),
                     paged_attention_reference(q, k, v, table, lens, lens, scale=scale))
    # The same sequence as contiguous [1, T, H, D] K/V for jax.nn.dot_product_attention.
    contiguous = [a[table[0]].transpose(0, 2, 1, 3).reshape(1, -1, model["num_kv_heads"], model["head_dim"])
                  for a in (k, v)]
    flops = 2 * 2 * tokens * tokens // 2 * model["num_q_heads"] * model["head_dim"]  # QK^T and PV, causal half
    # q is perturbed for every implementation alike (an elementwise pass over q, small next to attention).
    kw = timing(args, flops / 700e12)
    t_ours, kernel_times = time_ours(args, ours, [(q, k, v, table, lens)], "paged_attention", kw)
    peers = {}
    for impl in (None, "xla", "cudnn"):
        dpa = lambda q, k, v, impl=impl: jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True,
                                                                      implementation=impl)
        peers[f"dot_product_attention[{impl or 'default'}]"] = try_time(f"dpa {impl}", dpa, [(q, *contiguous)], **kw)
    r = row("prefill_attention", f"B=1 T={tokens}", t_ours, peers, None, args.hbm_bw, kernel_times)
    r["ours_tflops"] = flops / t_ours / 1e12
    return [r]


# ---------------------------------------------------------------------------------------------------------- report
def timing(args, work_seconds, dep_arg=0):
    """time_per_call's keyword arguments for one benchmark point."""
    return {"work_seconds": work_seconds, "repeats": args.repeats, "calls": args.calls,
            "target_seconds": args.target_ms / 1e3, "dep_arg": dep_arg}


def time_ours(args, fn, arg_sets, kernel_name, kw):
    """-> (time_per_call, and with --profile kernel_time_per_call's (Pallas kernel, all kernels) seconds, else None)."""
    t = time_per_call(fn, arg_sets, **kw)
    if not args.profile:
        return t, None
    return t, kernel_time_per_call(fn, arg_sets, kernel_name, **profile_kwargs(kw))


def profile_kwargs(kw):
    """timing()'s keyword arguments for the profiler's functions, which set their own repeats."""
    return {a: b for a, b in kw.items() if a != "repeats"}


def row(kernel, shape, t_ours, peers, bytes_read, hbm_bw, kernel_times=None):
    r = {"kernel": kernel, "shape": shape, "ours_ms": t_ours * 1e3,
         "peers_ms": {name: None if t is None else t * 1e3 for name, t in peers.items()},
         "speedup_vs_peer": {name: None if t is None else t / t_ours for name, t in peers.items()}}
    if kernel_times is not None:
        r["ours_kernel_ms"], r["ours_all_kernels_ms"] = (t * 1e3 for t in kernel_times)
    if bytes_read is not None:
        r["bytes_read"] = bytes_read
        r["ours_hbm_pct"] = 100 * bytes_read / t_ours / hbm_bw
        if kernel_times is not None:
            r["kernel_hbm_pct"] = 100 * bytes_read / kernel_times[0] / hbm_bw
    print(f"  {kernel} {shape}: ours {t_ours * 1e3:.4f} ms" + "".join(
        f", {name} {'n/a' if t is None else f'{t * 1e3:.4f} ms'}" for name, t in peers.items()))
    return r


def print_table(rows):
    """ours ms / %HBM: per call in the timing loop; kernel ms / %HBM: the Pallas kernel alone (--profile), and in
    brackets all GPU kernels of a call (epilogues and the loop's own ops included)."""
    print(f"\n{'kernel':<26} {'shape':<26} {'ours ms':>9} {'%HBM':>6} {'kernel ms':>18} {'%HBM':>5}  "
          "peers: ms (peer / ours)")
    for r in rows:
        pct = f"{r['ours_hbm_pct']:.0f}%" if "ours_hbm_pct" in r else f"{r.get('ours_tflops', 0):.0f}TF"
        kernel = f"{r['ours_kernel_ms']:.4f} ({r['ours_all_kernels_ms']:.4f})" if "ours_kernel_ms" in r else "-"
        kernel_pct = f"{r['kernel_hbm_pct']:.0f}%" if "kernel_hbm_pct" in r else "-"
        peers = "  ".join(f"{name} " + ("n/a" if ms is None else f"{ms:.4f} (x{r['speedup_vs_peer'][name]:.2f})")
                          for name, ms in r["peers_ms"].items())
        print(f"{r['kernel']:<26} {r['shape']:<26} {r['ours_ms']:>9.4f} {pct:>6} {kernel:>18} {kernel_pct:>5}  "
              f"{peers}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--check", action="store_true", help="assert each kernel matches its reference before timing")
    p.add_argument("--interpret", action="store_true", help="run the Pallas kernels in interpret mode (CPU)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes, for a smoke test of this script")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--hbm-bw", type=float, default=2.83e12, help="bytes/s that %%HBM is relative to")
    p.add_argument("--max-kv-bytes", type=float, default=20e9, help="skip decode points with more KV than this")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--calls", type=int, help="calls per timed run (default: enough for --target-ms)")
    p.add_argument("--target-ms", type=float, default=50.0, help="length of one timed run")
    p.add_argument("--profile", action="store_true", help="also time our kernels alone with the profiler (GPU)")
    p.add_argument("--sections", nargs="+", default=["projections", "prefill", "decode"],
                   choices=["projections", "prefill", "decode"])
    p.add_argument("--m", type=int, nargs="+", default=[1, 8, 64, 2048], help="rows of the projection points")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256], help="batches of the decode points")
    p.add_argument("--contexts", type=int, nargs="+", default=[128, 1024, 4096, 16384],
                   help="contexts of the decode points")
    args = p.parse_args()
    args.max_rotations = 64

    rng = np.random.default_rng(0)
    if args.tiny:
        model, decode_grid, m_values, prefill_tokens = TINY, [(1, 16), (3, 40)], [1, 8], 32
        args.repeats, args.calls, args.max_rotations = min(args.repeats, 2), args.calls or 2, 2
    else:
        model, m_values, prefill_tokens = QWEN3_06B, args.m, 2048
        decode_grid = [(b, c) for b in args.batches for c in args.contexts]
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; model {model}")
    rows = []
    if "projections" in args.sections:
        print("fused projections (RMSNorm + QKV, o_proj + residual, RMSNorm + gate/up + SiLU-and-mul, "
              "down + residual):")
        rows += bench_rmsnorm_matmul(args, model, m_values, rng)
    if "prefill" in args.sections:
        print("prefill attention:")
        rows += bench_prefill(args, model, prefill_tokens, args.page_size, rng)
    if "decode" in args.sections:
        print("decode attention:")
        rows += bench_decode(args, model, decode_grid, args.page_size, rng)
    print_table(rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"jax": jax.__version__, "device": jax.devices()[0].device_kind, "model": model,
                       "hbm_bw": args.hbm_bw, "rows": rows}, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
