"""Experiment (stop 10): the batch-1 decode step with and without split K in the fused projections.

    PYTHONPATH=$PWD python3 scripts/ab_projection_splits.py --out $OUT/ab_splits.json

In the kernel benchmark a split-K call's XLA epilogue fuses with the timing loop's NaN check, so it looks free; in
the model it is a kernel of its own after every split projection (98 per step, perf notes). This times the real
step (bench_decode's point: batch 1, context 512, 32 steps per dispatch, random KV) with `_default_config` swapped:
    splits      today's rule (k_splits up to 8 while the grid fits the SMs)
    norm_s1     k_splits = 1 where today's rule gives <= 2 (RMSNorm + QKV, RMSNorm + gate/up), block_n narrowed
                (64 -> 32 -> 16) until there are >= NUM_SMS / 2 tiles, block_k 256 where a stage fits
    all_s1      the same for every projection (o_proj and down_proj too)
"""
import argparse
import dataclasses
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

sys.path.insert(0, str(Path(__file__).parent))
from bench_decode import bench_point, random_cache  # noqa: E402
from random_model import loaded_model, random_hf_model  # noqa: E402

import pallas_kernels.rmsnorm_matmul as rmm  # noqa: E402
from nanojax.ops import get_ops  # noqa: E402
from nanojax.runner import ModelRunner  # noqa: E402

SPLITS = rmm._default_config


def no_split(m, k, n_out, dtype, *, silu_mul=False, only_narrow_splits):
    cfg = SPLITS(m, k, n_out, dtype, silu_mul=silu_mul)
    if m > 16 or cfg.k_splits == 1 or (only_narrow_splits and cfg.k_splits > 2):
        return cfg
    block_n = 64
    while block_n > 16 and pl.cdiv(n_out, block_n) < rmm.NUM_SMS // 2:
        block_n //= 2
    block_k, itemsize = 256, jnp.dtype(dtype).itemsize
    while block_k > 16 and rmm._stage_bytes(cfg.block_m, block_n, block_k, itemsize=itemsize,
                                            w_tiles=2 if silu_mul else 1) > rmm.STAGE_BYTES:
        block_k //= 2
    return dataclasses.replace(cfg, block_n=block_n, block_k=block_k, k_splits=1)


RULES = {"splits": SPLITS,
         "norm_s1": lambda *a, **kw: no_split(*a, **kw, only_narrow_splits=True),
         "all_s1": lambda *a, **kw: no_split(*a, **kw, only_narrow_splits=False)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["qwen3-0.6b", "llama-3.2-1b"])
    ap.add_argument("--order", nargs="+", default=["splits", "norm_s1", "all_s1", "splits", "norm_s1", "all_s1"])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--kernels", default="pallas", help="interpret: a CPU smoke test of this script")
    ap.add_argument("--out", default="ab_splits.json")
    args = ap.parse_args()
    rows = []
    for name in args.models:
        loaded = loaded_model(random_hf_model(name, "bfloat16"), "bfloat16")
        c, params = loaded.config, jax.tree.map(jnp.asarray, loaded.params)
        pps = -(-(args.context + 32) // 16)
        for rule in args.order:
            rmm._default_config = RULES[rule]
            jax.clear_caches()  # rmsnorm_matmul's jit and the step's trace must see the new rule
            runner = ModelRunner(c, params, num_pages=pps, page_size=16, pages_per_seq=pps, dtype=jnp.bfloat16,
                                 ops=get_ops(args.kernels, c), vocab_limit=c.vocab_size, max_num_seqs=1,
                                 max_tokens_per_row=16)
            random_cache(runner, jax.random.key(0))
            point = bench_point(runner, 1, args.context, 32)
            rows.append({"model": name, "rule": rule, **point})
            print(json.dumps(rows[-1]), flush=True)
            Path(args.out).write_text(json.dumps(rows, indent=1))
            del runner
    rmm._default_config = SPLITS
    print(f"\n{'model':<14} {'rule':<8} {'ms/step':>8} {'tok/s':>7}")
    for r in rows:
        print(f"{r['model']:<14} {r['rule']:<8} {r['ms_per_step']:>8.3f} {1e3 / r['ms_per_step']:>7.0f}")


if __name__ == "__main__":
    main()
