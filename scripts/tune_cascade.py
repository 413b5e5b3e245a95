"""Sweep the cascade kernel's tiling and the planner's items per wave: ms per multi-step decode step of a batch over
one shared prefix (16 tokens of each row's own), the whole step as the engine runs it (bench_decode's shared-prefix
point: the median of 5 dispatches). CASCADE_CONFIG and the
runner's two waves (nanojax/runner.py) come from this sweep (docs/perf_notes.md, "Cascade attention").

    PYTHONPATH=$PWD python3 scripts/tune_cascade.py --model qwen3-0.6b --batch 64 --prefixes 4000 16000

A variant is BLOCK_M,BLOCK_K,NUM_WARPS,NUM_STAGES,WAVES: the kernel preset (pallas_kernels.cascade_attention.
CASCADE_CONFIG, swapped per variant; programs are traced again) and the planner's items as that many times the SMs
over the KV heads. Random weights and KV (bench_decode's), one process; prints a line per variant, a summary last.
"""
import argparse
import json
import sys
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))
from bench_decode import PAGE, make_runner, random_cache, shared_point  # noqa: E402
from random_model import model_config, random_params  # noqa: E402

import pallas_kernels.cascade_attention as cascade_attention  # noqa: E402

OWN_TOKENS = 16  # each row's own tokens after the shared prefix
VARIANTS = ["128,64,8,3,1", "128,32,8,3,1", "128,64,4,3,1", "128,64,8,2,1", "128,64,8,4,1", "128,128,8,2,1",
            "128,64,8,3,2", "64,64,4,3,1", "64,64,4,3,2", "64,128,4,2,1", "64,64,8,3,1", "32,64,4,3,1"]


def step_ms(config, params, prefix: int, variant: tuple, args) -> tuple[float, int]:
    """-> (ms per step, cascade dispatches) of the multi-step decode over `prefix` shared tokens."""
    block_m, block_k, warps, stages, waves = variant
    jax.clear_caches()  # the kernel reads the preset while tracing
    cascade_attention.CASCADE_CONFIG = cascade_attention.CascadeConfig(block_m, block_k, warps, stages)
    own_pages = -(-(OWN_TOKENS + args.steps) // PAGE)
    runner = make_runner(config, params, None, args.kernels, batch=args.batch, prefill=16, steps=args.steps,
                         num_pages=prefix // PAGE + args.batch * own_pages, pages_per_seq=prefix // PAGE + own_pages,
                         cascade=True)
    runner.cascade_wave = runner.cascade_wave // 2 * waves  # the runner's rule: two waves
    random_cache(runner, jax.random.key(0))
    return shared_point(runner, args.batch, prefix, 1, OWN_TOKENS, args.steps)["ms_per_step"], runner.cascade_dispatches


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prefixes", type=int, nargs="+", default=[4000, 16000])
    ap.add_argument("--variants", nargs="+", default=VARIANTS, help="BLOCK_M,BLOCK_K,NUM_WARPS,NUM_STAGES,WAVES")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--kernels", default="pallas")
    ap.add_argument("--out", default="tune_cascade.json")
    args = ap.parse_args()
    config, params = model_config(args.model), random_params(args.model).params
    rows = []
    for text in args.variants:
        variant = tuple(int(v) for v in text.split(","))
        times = {prefix: step_ms(config, params, prefix, variant, args) for prefix in args.prefixes}
        rows.append({"variant": text, **{str(p): ms for p, (ms, _) in times.items()},
                     "cascade_dispatches": {str(p): n for p, (_, n) in times.items()}})
        print(json.dumps(rows[-1]), flush=True)
    Path(args.out).write_text(json.dumps({"model": args.model, "batch": args.batch, "device": str(jax.devices()[0]),
                                          "rows": rows}, indent=2))
    print(f"\nms per step, batch {args.batch}; variant BLOCK_M,BLOCK_K,NUM_WARPS,NUM_STAGES,WAVES")
    print(f"{'variant':<16}" + "".join(f"{p:>10}" for p in args.prefixes))
    for row in sorted(rows, key=lambda r: r[str(args.prefixes[0])]):
        print(f"{row['variant']:<16}" + "".join(f"{row[str(p)]:>10.3f}" for p in args.prefixes))


if __name__ == "__main__":
    main()
