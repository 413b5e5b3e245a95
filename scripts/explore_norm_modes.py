"""Experiment (stop 10, removed in the next commit): where the fused RMSNorm + QKV kernel's time goes at M = 1, 8,
64, and decode attention's warps / stages at three points it misses 1.3x JAX. The kernel's `norm_mode` (this commit
only) selects how the norm is applied:

    prepass     today's kernel: sum of squares over all of K first, then x * rstd * scale on every x tile
    peel        the same, with the first w tile's load issued before the sum of squares
    inloop      no pre-pass: sum of squares accumulated in the main loop, rstd applied to the f32 accumulator
    scale1d     prepass, with norm_scale loaded as a 1-D [block_k] vector instead of a [block_m, block_k] tile
    rstd_end    prepass, x * scale in the loop, rstd applied to the f32 accumulator at the end
    fold_floor  prepass, raw x in the loop, rstd at the end: the speed of a kernel whose w has the norm scale
                folded in at conversion (wrong numbers here: no such w)

    PYTHONPATH=$PWD python3 scripts/explore_norm_modes.py modes        # device call 1
    PYTHONPATH=$PWD python3 scripts/explore_norm_modes.py scale decode # device call 2
    PYTHONPATH=$PWD python3 scripts/explore_norm_modes.py factored     # device call 3
"""
import dataclasses
import json
import os
import sys

sys.path.insert(0, "scripts")
sys.path.insert(0, ".")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from bench_kernels import (EPS, QWEN3_06B, decode_kv_bytes, decode_sets, jax_layout, jax_pallas_decode,  # noqa: E402
                           kernel_time_per_call, normal, rotations, time_per_call, timing)

from pallas_kernels.paged_attention import DECODE_CONFIG, paged_decode_attention  # noqa: E402
from pallas_kernels.rmsnorm_matmul import _default_config, rmsnorm_matmul, rmsnorm_matmul_reference  # noqa: E402

OUT = os.environ.get("OUT", "/tmp")
BF16, F32 = jnp.bfloat16, jnp.float32


class Args:
    max_rotations, calls, target_ms, repeats = 64, None, 50.0, 3


def modes_variants(d, m):
    R = lambda **kw: dataclasses.replace(d, **kw)
    v = {"default": (d, BF16), "peel": (R(norm_mode="peel"), BF16),
         "pre s1 n32 k256": (R(k_splits=1, block_n=32, block_k=256), BF16),
         "peel s1 n32 k256": (R(k_splits=1, block_n=32, block_k=256, norm_mode="peel"), BF16)}
    for bn, bk, w, st in ((32, 256, 4, 4), (32, 128, 4, 6), (32, 256, 8, 4), (16, 256, 4, 4), (64, 128, 4, 4),
                          (64, 128, 8, 4), (32, 128, 8, 4)):
        v[f"in s1 n{bn} k{bk} w{w} st{st}"] = (R(k_splits=1, block_n=bn, block_k=bk, num_warps=w, num_stages=st,
                                                  norm_mode="inloop"), BF16)
    return v


def scale_variants(d, m):
    R = lambda **kw: dataclasses.replace(d, **kw)
    v = {"default": (d, BF16), "no norm": (d, None), "scale1d": (R(norm_mode="scale1d"), BF16),
         "scale1d f32": (R(norm_mode="scale1d"), F32)}
    if m == 64:
        for bn, bk, w, st, sp in ((128, 64, 8, 3, 1), (128, 64, 4, 4, 1), (64, 64, 4, 4, 2), (64, 128, 8, 3, 2),
                                  (32, 128, 4, 4, 1), (128, 128, 8, 3, 1)):
            for mode in ("prepass", "scale1d"):
                v[f"{mode} n{bn} k{bk} w{w} st{st} s{sp}"] = (
                    R(block_n=bn, block_k=bk, num_warps=w, num_stages=st, k_splits=sp, norm_mode=mode), BF16)
        v["no norm n128 k64 w8 st3 s1"] = (R(block_n=128, block_k=64, num_warps=8, num_stages=3, k_splits=1), None)
        v["m32 scale1d"] = (R(block_m=32, norm_mode="scale1d"), BF16)
    else:
        v["scale1d s1 n32 k256"] = (R(k_splits=1, block_n=32, block_k=256, norm_mode="scale1d"), BF16)
    return v


def factored_variants(d, m):
    R = lambda **kw: dataclasses.replace(d, **kw)
    v = {"default": (d, BF16), "no norm": (d, None)}
    for mode in ("rstd_end", "fold_floor"):
        v[mode] = (R(norm_mode=mode), BF16)
        if m == 64:
            v[f"m32 {mode}"] = (R(block_m=32, norm_mode=mode), BF16)
            v[f"m16 {mode}"] = (R(block_m=16, norm_mode=mode), BF16)
    if m == 64:
        v["m32 no norm"] = (R(block_m=32), None)
        v["m16 no norm"] = (R(block_m=16), None)
    return v


SECTIONS = {"modes": (modes_variants, (("qkv", 1024, 4096, None, (1, 8, 64)),
                                       ("gate_up", 1024, 6144, "silu_mul", (1, 64)))),
            "scale": (scale_variants, (("qkv", 1024, 4096, None, (1, 8, 64)),)),
            "factored": (factored_variants, (("qkv", 1024, 4096, None, (1, 8, 64)),
                                             ("gate_up", 1024, 6144, "silu_mul", (1, 8, 64))))}
DECODE_GRID = {  # (batch, ctx): (block_k, k_splits, num_warps, num_stages)
    (1, 128): [(64, 1, 4, 5), (64, 1, 8, 5), (32, 1, 4, 5), (128, 1, 4, 3), (64, 1, 4, 3), (64, 2, 4, 3)],
    (1, 1024): [(64, 8, 4, 5), (64, 8, 8, 5), (32, 8, 4, 6), (64, 4, 4, 6), (64, 8, 4, 3), (128, 4, 4, 4)],
    (64, 16384): [(64, 4, 4, 5), (64, 4, 8, 5), (64, 4, 4, 4), (64, 4, 4, 6), (128, 4, 4, 4), (128, 4, 8, 4),
                  (128, 2, 8, 4), (32, 4, 4, 6)]}


def projections(make_variants, shapes, args, rng, emit):
    for name, k, n, act, ms in shapes:
        n_out = n // 2 if act else n
        for m in ms:
            sets = [(normal(rng, (m, k)), 1 + normal(rng, (k,), 0.1), normal(rng, (k, n), k ** -0.5))
                    for _ in range(rotations(args, k * n * 2))]
            ref = rmsnorm_matmul_reference(*sets[0], eps=EPS, activation=act)
            kw = timing(args, k * n * 2 / 2.83e12, dep_arg=1)
            profile_kw = {a: b for a, b in kw.items() if a != "repeats"}
            xla = jax.jit(lambda x, s, w: rmsnorm_matmul_reference(x, s, w, eps=EPS, activation=act))
            emit({"proj": name, "m": m, "variant": "XLA", "us": time_per_call(xla, sets, **kw) * 1e6,
                  "all_kernels_us": kernel_time_per_call(xla, sets, "-", **profile_kw)[1] * 1e6})
            default = _default_config(m, k, n_out, BF16, silu_mul=act is not None)
            for label, (cfg, scale_dtype) in make_variants(default, m).items():
                if scale_dtype is None:  # no norm; the timing dependency still goes through the scale
                    fn = lambda x, s, w, cfg=cfg: rmsnorm_matmul(x, None, w, activation=act, config=cfg) + s[0]
                else:
                    fn = lambda x, s, w, cfg=cfg, sd=scale_dtype: rmsnorm_matmul(x, s.astype(sd), w, eps=EPS,
                                                                                 activation=act, config=cfg)
                try:
                    err = float(jnp.abs(fn(*sets[0]).astype(F32) - ref.astype(F32)).max())
                    t = time_per_call(fn, sets, **kw)
                    kt = kernel_time_per_call(fn, sets, "rmsnorm_matmul", **profile_kw)
                except Exception as e:  # noqa: BLE001 - a tiling that does not fit shared memory is reported
                    print(name, m, label, type(e).__name__, str(e)[:200])
                    continue
                emit({"proj": name, "m": m, "variant": label, "us": t * 1e6, "kernel_us": kt[0] * 1e6,
                      "all_kernels_us": kt[1] * 1e6, "max_err": err})
            del sets


def decode(args, rng, emit):
    model = QWEN3_06B
    scale = model["head_dim"] ** -0.5
    for (b, c), variants in DECODE_GRID.items():
        sets = decode_sets(args, rng, model, b, c, 16)
        kw = timing(args, decode_kv_bytes(model, b, c) / 2.83e12, dep_arg=4)
        for v in [None] + variants:
            cfg = None if v is None else dataclasses.replace(DECODE_CONFIG, block_k=v[0], k_splits=v[1],
                                                             num_warps=v[2], num_stages=v[3])
            fn = lambda q, k, v, t, s, cfg=cfg: paged_decode_attention(q, k, v, t, s, scale=scale, config=cfg)
            label = "auto" if v is None else "bk{} s{} w{} st{}".format(*v)
            emit({"decode": f"B={b} ctx={c}", "variant": label, "us": time_per_call(fn, sets, **kw) * 1e6})
        jax_sets = jax_layout(sets)
        del sets
        emit({"decode": f"B={b} ctx={c}", "variant": "JAX",
              "us": time_per_call(jax_pallas_decode(False), jax_sets, **kw) * 1e6})
        del jax_sets


def main():
    args, rng, results = Args(), np.random.default_rng(0), []

    def emit(r):
        results.append(r)
        print(json.dumps(r), flush=True)
        with open(f"{OUT}/explore.json", "w") as f:
            json.dump(results, f, indent=1)

    for section in sys.argv[1:]:
        if section == "decode":
            decode(args, rng, emit)
        else:
            projections(*SECTIONS[section], args, rng, emit)
    print("\n=== table")
    for r in results:
        if "proj" in r:
            print(f"{r['proj']:8} M={r['m']:<3} {r['variant']:28} {r['us']:8.2f} us  kernel "
                  f"{r.get('kernel_us', 0):6.2f}  all {r['all_kernels_us']:6.2f}  err {r.get('max_err', 0):.2e}")
        else:
            print(f"{r['decode']:14} {r['variant']:22} {r['us']:9.2f} us")


if __name__ == "__main__":
    main()
