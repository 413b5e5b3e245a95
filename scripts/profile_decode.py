"""Where a decode step's time goes: GPU kernels per step, their summed time, and the gaps between them.

    PYTHONPATH=$PWD python3 scripts/profile_decode.py --model qwen3-0.6b --batch 1 --context 512

Traces the compiled multi-step decode with jax.profiler and reads the GPU plane back (jax.profiler.ProfileData):
kernels are grouped by name, so the table shows how many launches and how many microseconds each kind costs per
decode step. Wall time per step minus summed kernel time is launch and idle overhead: the largest idle gaps
between kernels are listed with their neighbours, and the host events by total time. `--prefill N` profiles a
prefill of N tokens (time to first token) instead. `--tensor-parallel-size N` profiles the model split over N GPUs
(the first GPU's kernels are read) and prints the all-reduce time per layer. `--shared-prefix N` puts every row's
first N tokens on the same pages: the cascade path's kernels (or, with `--no-cascade`, the plain path's).
`--quantization fp8` profiles the FP8 weights bench_decode times (LM head in bf16).
"""
import argparse
import collections
import re
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_decode import PAGE, make_runner, random_cache, shared_tables, variant_params  # noqa: E402
from gpu_trace import kernel_kind, trace_events  # noqa: E402
from random_model import model_config  # noqa: E402

from nanojax.runner import greedy_sampling  # noqa: E402


def print_gaps(kernels, top: int) -> None:
    """The GPU's idle gaps between consecutive kernels: where launch latency or host waits show."""
    gaps = [(b[1] - a[2], a[0], b[0]) for a, b in zip(kernels, kernels[1:])]
    for lo in (5e3, 50e3, 500e3):
        big = [g for g in gaps if g[0] > lo]
        print(f"gaps > {lo / 1e3:>5.0f} us: {len(big):>5}, {sum(g[0] for g in big) / 1e6:8.3f} ms in all")
    print(f"{'gap us':>9}  previous kernel -> next kernel")
    for ns, before, after in sorted(gaps, reverse=True)[:top]:
        print(f"{ns / 1e3:>9.1f}  {kernel_kind(before)} -> {kernel_kind(after)}")


def print_host(host, top: int) -> None:
    by_name = collections.defaultdict(lambda: [0, 0])
    for name, start, end in host:
        by_name[name[:70]][0] += 1
        by_name[name[:70]][1] += end - start
    print(f"{'host event':<70} {'count':>6} {'ms':>9}")
    for name, (n, ns) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"{name:<70} {n:>6} {ns / 1e6:>9.3f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--kernels", default="pallas", choices=["pallas", "reference"])
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--prefill", type=int, default=0, help="profile a prefill of this many tokens instead")
    ap.add_argument("--tensor-parallel-size", type=int, default=0, help="split over this many GPUs (0: one, unsharded)")
    ap.add_argument("--shared-prefix", type=int, default=0,
                    help="the rows' first N tokens (whole pages) on the same pages; --context counts them")
    ap.add_argument("--no-cascade", action="store_true", help="with --shared-prefix: the non-cascade path")
    ap.add_argument("--quantization", default="none", choices=["none", "fp8"], help="fp8: weights as bench_decode's")
    args = ap.parse_args()

    c = model_config(args.model)
    params, tp = variant_params(args.model, c, None, args.quantization, args.tensor_parallel_size)
    shared = args.shared_prefix // PAGE * PAGE  # whole pages that every row's table starts with
    if args.context < shared:
        raise SystemExit(f"--context {args.context} must count the {shared} shared tokens")
    own = max(args.context, args.prefill) - shared  # each row's own tokens, in pages of its own
    pps = -(-(shared + own + args.steps) // PAGE)
    runner = make_runner(c, params, tp, args.kernels, batch=args.batch, prefill=max(16, args.prefill),
                         num_pages=shared // PAGE + args.batch * -(-(own + args.steps) // PAGE), pages_per_seq=pps,
                         steps=args.steps, cascade=bool(shared) and not args.no_cascade)
    random_cache(runner, jax.random.key(0))
    tables, _ = shared_tables(runner, args.batch, shared, 1, own, args.steps)
    tokens = np.random.default_rng(0).integers(0, 1000, args.batch).tolist()
    samp = greedy_sampling(args.batch, runner.tables.neutral)
    if args.prefill:  # one call is one "step": TTFT
        prompt = np.random.default_rng(1).integers(0, 1000, args.prefill).tolist()
        args.steps = 1
        fields = {k: v[0] for k, v in samp.items()}
        run = lambda: runner.prefill([(prompt, tables[0], args.prefill, fields)])[0][0].tokens()  # noqa: E731
    else:
        run = lambda: runner.decode(tokens, tables, [args.context] * args.batch, samp,  # noqa: E731
                                    num_steps=args.steps).tokens()
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
    kernels, host = trace_events(trace_dir)
    events = [(name, (end - start) / 1e3) for name, start, end in kernels]
    steps = reps * args.steps
    by_kind = collections.defaultdict(lambda: [0, 0.0])
    for name, us in events:
        by_kind[kernel_kind(name)][0] += 1
        by_kind[kernel_kind(name)][1] += us
    total_us = sum(us for _, us in events) / steps
    print(f"\n{args.model} batch {args.batch} context {args.context} shared {shared} "
          f"(cascade dispatches {runner.cascade_dispatches}) kernels {args.kernels}: "
          f"{wall_ms:.3f} ms/step wall, {total_us / 1e3:.3f} ms/step in {len(events) / steps:.0f} kernels "
          f"({100 * total_us / 1e3 / wall_ms:.0f}% of wall busy)")
    print(f"{'kernel':<60} {'per step':>8} {'us/step':>9} {'us each':>8}")
    for kind, (n, us) in sorted(by_kind.items(), key=lambda kv: -kv[1][1])[:args.top]:
        print(f"{kind:<60} {n / steps:>8.1f} {us / steps:>9.1f} {us / n:>8.2f}")
    # XLA names its own all-reduce kernels after the psum (psum_524_0_fusion); NCCL's are ncclDevKernel_*.
    collectives = [(n, us) for n, us in events if re.search("psum|all.?reduce|all.?gather|nccl", n, re.I)]
    if collectives:
        us = sum(us for _, us in collectives) / steps
        print(f"\ncollective kernels: {len(collectives) / steps:.1f} per step, {us:.1f} us per step, "
              f"{us / c.num_layers:.2f} us per layer ({100 * us / 1e3 / wall_ms:.1f}% of the step)")
    print(f"\nGPU span of the {reps} traced calls: {(kernels[-1][2] - kernels[0][1]) / 1e6:.3f} ms")
    print_gaps(kernels, args.top // 2)
    print_host(host, args.top // 2)


if __name__ == "__main__":
    main()
