"""Reading a jax.profiler trace back: the GPU's kernels and the host's events (scripts/profile_decode.py,
scripts/bench_kernels.py --profile)."""
import glob
import re


def trace_events(trace_dir: str):
    """([(name, start_ns, end_ns)] of every kernel on the first GPU's plane, [(name, start_ns, end_ns)] of host events).
    With several GPUs (tensor parallelism) the others run the same program, so the first one stands for all."""
    from jax.profiler import ProfileData

    (path,) = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
    kernels, host, seen = [], [], []
    for plane in ProfileData.from_file(path).planes:
        seen.append((plane.name, [line.name for line in plane.lines]))
        if plane.name.startswith("/host"):
            host += [(ev.name, ev.start_ns, ev.end_ns) for line in plane.lines for ev in line.events]
        if "gpu" not in plane.name.lower() or re.search(r":\d+$", plane.name) and not plane.name.endswith(":0"):
            continue
        for line in plane.lines:
            # Streams ('Stream #14(Compute,MemcpyD2D)'; collectives may run on a stream of their own), not the
            # derived lines ('XLA Ops') that repeat them, nor copy-only streams.
            kinds = line.name.lower().partition("(")[2]
            if not line.name.startswith("Stream") or kinds and "compute" not in kinds and "memcpy" in kinds:
                continue
            kernels += [(ev.name, ev.start_ns, ev.end_ns) for ev in line.events]
    if not kernels:
        raise SystemExit(f"no GPU kernel events; planes and lines in the trace: {seen}")
    return sorted(kernels, key=lambda k: k[1]), host


def kernel_kind(name: str) -> str:
    """Collapse per-instance suffixes (fusion.123, loop_add_fusion_4) so kinds aggregate."""
    return re.sub(r"[._]\d+$", "", re.sub(r"(\.\d+)+$", "", name))[:60]
