"""Sweep decode attention's KV splits (and block_k) per batch and context, Qwen3-0.6B heads, with JAX's Pallas
paged_attention in the same command; the automatic rule (`paged_attention._kv_tiling`) comes from this sweep
and earlier ones (docs/perf_notes.md, "Decode attention: splits and tile sizes").

    PYTHONPATH=$PWD python3 scripts/tune_decode_attention.py --out $OUT/tune_decode.json

Prints one JSON line per point: us per call for each `bk{block_k}/s{k_splits}` variant, for the automatic choice
("auto") and for JAX's kernel. Timing and inputs are bench_kernels' (the same harness as its decode table).
"""
import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))
from bench_kernels import (  # noqa: E402
    QWEN3_06B,
    decode_kv_bytes,
    decode_sets,
    jax_layout,
    jax_pallas_decode,
    time_per_call,
    timing,
)

from pallas_kernels.paged_attention import DECODE_CONFIG, paged_decode_attention  # noqa: E402

# (batch, context): the (block_k, k_splits) variants tried there.
GRID = {
    (1, 128): [(64, 1), (64, 2), (32, 2), (32, 4), (16, 8)],
    (1, 1024): [(64, 2), (64, 4), (64, 8), (32, 8), (32, 16)],
    (1, 16384): [(64, 33), (64, 64), (64, 128)],
    (8, 128): [(64, 2), (32, 4), (16, 8)],
    (8, 1024): [(64, 4), (64, 8)],
    (8, 4096): [(64, 4), (64, 8), (64, 16), (64, 32)],
    (8, 16384): [(64, 4), (64, 8), (64, 16), (64, 32)],
    (64, 1024): [(64, 1), (64, 2), (64, 4)],
    (64, 4096): [(64, 1), (64, 2), (64, 3), (64, 4), (32, 1), (128, 1)],
    (64, 16384): [(64, 1), (64, 2), (64, 3), (64, 4), (128, 1)],
    (256, 1024): [(64, 1), (64, 2)],
}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    args.max_rotations, args.calls, args.target_ms = 64, None, 50.0  # bench_kernels' defaults
    model, rng = QWEN3_06B, np.random.default_rng(0)
    scale, rows = model["head_dim"] ** -0.5, []
    for (batch, ctx), variants in GRID.items():
        sets = decode_sets(args, rng, model, batch, ctx, page_size=16)
        kw = timing(args, decode_kv_bytes(model, batch, ctx) / 2.83e12, dep_arg=4)
        row = {"point": f"B={batch} ctx={ctx}"}
        for label, config in [("auto", None)] + [(f"bk{bk}/s{splits}", dataclasses.replace(
                DECODE_CONFIG, block_k=bk, k_splits=splits)) for bk, splits in variants]:
            def ours(q, k, v, t, s, config=config):
                return paged_decode_attention(q, k, v, t, s, scale=scale, config=config)
            row[label] = round(time_per_call(ours, sets, **kw) * 1e6, 2)
        jax_sets = jax_layout(sets)
        del sets
        row["jax"] = round(time_per_call(jax_pallas_decode(False), jax_sets, **kw) * 1e6, 2)
        del jax_sets
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
