"""Where a decode step's time goes: GPU kernels per step, their summed time, and the gaps between them.

    PYTHONPATH=$PWD python3 scripts/profile_decode.py --model qwen3-0.6b --batch 1 --context 512

Traces the compiled multi-step decode with jax.profiler and reads the GPU plane back (jax.profiler.ProfileData):
kernels are grouped by name, so the table shows how many launches and how many microseconds each kind costs per
decode step. Wall time per step minus summed kernel time is launch and idle overhead.
"""
import argparse
import collections
import glob
import re
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_decode import PAGE, random_cache  # noqa: E402
from random_model import loaded_model, random_hf_model  # noqa: E402

from nanojax.ops import get_ops  # noqa: E402
from nanojax.runner import ModelRunner, greedy_sampling  # noqa: E402


def gpu_kernel_events(trace_dir: str):
    """[(name, duration_us)] of every kernel on the GPU plane of the trace."""
    from jax.profiler import ProfileData

    (path,) = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
    events, seen = [], []
    for plane in ProfileData.from_file(path).planes:
        seen.append((plane.name, [line.name for line in plane.lines]))
        if "gpu" not in plane.name.lower():
            continue
        for line in plane.lines:
            if "compute" not in line.name.lower():  # e.g. 'Stream #14(Compute,MemcpyD2D)'; skip copy-only streams
                continue
            events += [(ev.name, ev.duration_ns / 1e3) for ev in line.events]
    if not events:
        raise SystemExit(f"no GPU kernel events; planes and lines in the trace: {seen}")
    return events


def kernel_kind(name: str) -> str:
    """Collapse per-instance suffixes (fusion.123, loop_add_fusion_4) so kinds aggregate."""
    return re.sub(r"[._]\d+$", "", re.sub(r"(\.\d+)+$", "", name))[:60]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--kernels", default="pallas", choices=["pallas", "reference"])
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()

    loaded = loaded_model(random_hf_model(args.model, "bfloat16"), "bfloat16")
    c, params = loaded.config, jax.tree.map(jnp.asarray, loaded.params)
    pps = -(-(args.context + args.steps) // PAGE)
    runner = ModelRunner(c, params, num_pages=args.batch * pps, page_size=PAGE, pages_per_seq=pps,
                         dtype=jnp.bfloat16, ops=get_ops(args.kernels, c), vocab_limit=c.vocab_size,
                         max_num_seqs=args.batch, max_tokens_per_row=16)
    random_cache(runner, jax.random.key(0))
    tables = [list(range(b * pps, (b + 1) * pps)) for b in range(args.batch)]
    tokens = np.random.default_rng(0).integers(0, 1000, args.batch).tolist()
    samp, mode = greedy_sampling(args.batch)
    run = lambda: runner.decode(tokens, tables, [args.context] * args.batch, samp, mode, num_steps=args.steps)  # noqa
    run()
    run()
    t0 = time.perf_counter()
    reps = 5
    for _ in range(reps):
        run()
    wall_ms = (time.perf_counter() - t0) / reps / args.steps * 1e3

    trace_dir = tempfile.mkdtemp()
    with jax.profiler.trace(trace_dir):
        for _ in range(reps):
            run()
    events = gpu_kernel_events(trace_dir)
    steps = reps * args.steps
    by_kind = collections.defaultdict(lambda: [0, 0.0])
    for name, us in events:
        by_kind[kernel_kind(name)][0] += 1
        by_kind[kernel_kind(name)][1] += us
    total_us = sum(us for _, us in events) / steps
    print(f"\n{args.model} batch {args.batch} context {args.context} kernels {args.kernels}: "
          f"{wall_ms:.3f} ms/step wall, {total_us / 1e3:.3f} ms/step in {len(events) / steps:.0f} kernels "
          f"({100 * total_us / 1e3 / wall_ms:.0f}% of wall busy)")
    print(f"{'kernel':<60} {'per step':>8} {'us/step':>9} {'us each':>8}")
    for kind, (n, us) in sorted(by_kind.items(), key=lambda kv: -kv[1][1])[:args.top]:
        print(f"{kind:<60} {n / steps:>8.1f} {us / steps:>9.1f} {us / n:>8.2f}")


if __name__ == "__main__":
    main()
