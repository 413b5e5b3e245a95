"""Where an empty-cache start's compiling goes, program by program, and what an XLA flag costs in step time.

    NANOJAX_CACHE=$(mktemp -d) PYTHONPATH=$PWD python3 scripts/profile_compile.py --model qwen3-0.6b --mode serial \\
        --steps
    NANOJAX_CACHE=$(mktemp -d) XLA_FLAGS=--xla_gpu_autotune_level=0 PYTHONPATH=$PWD python3 \\
        scripts/profile_compile.py --mode compile_all --timings

A random-weight model saved as an HF folder, `LLM(folder, warmup=False)`, then every program of
`runner.programs()`: `serial` traces, lowers and compiles each in turn (seconds, and CPU seconds with ptxas's, per
program); `pool` lowers all, then compiles them on --threads threads; both compile each program with the engine's XLA
options for it (`ModelRunner.compiler_options`) updated by --compiler-options, and keep what they compiled as the
engine's programs. `compile_all` runs the engine's own (nanojax.compilation.compile_all: lowering one by one,
compiling on a thread per core, shares of the programs in --workers compile workers; CPU seconds this process's and
its children's: the workers, ptxas). JAX's persistent compilation cache is off in the first two and empty in the
third (give a fresh NANOJAX_CACHE). `--timings` then times, on the programs just compiled, decode at batch 1 and 64
(256 tokens over 32-token prompts, a 1-token run subtracted), prefill (256 prompts of 100 tokens; one of 4,000) and
nano-vllm's workload (bench_throughput's, in the 8,192 pages given here: prefills mixed with decodes); `--steps` each
decode and prefill program's own step, run on the runner (to compare options program by program, run it once per
tree).
"""
import argparse
import concurrent.futures
import itertools
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))


def cpu_seconds(who=(resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)) -> float:
    """CPU seconds of this process and of its waited-for children (XLA runs ptxas as a child process; the compile
    workers are children too)."""
    return sum(u.ru_utime + u.ru_stime for u in map(resource.getrusage, who))


def options_for(runner, p, compiler_options: dict) -> dict:
    """The engine's XLA options for program p, updated by compiler_options."""
    return {**runner.compiler_options(p), **compiler_options}


def serial(runner, compiler_options: dict) -> dict:
    """Each program traced, lowered and compiled in turn with the engine's options for it updated by
    compiler_options, and kept as the runner's (so that --timings runs these)."""
    rows = []
    for p in runner.programs():
        t0 = time.perf_counter()
        traced = runner.trace(p)
        t1 = time.perf_counter()
        lowered = traced.lower()
        t2, c0 = time.perf_counter(), cpu_seconds()
        runner.install(p, lowered.compile(compiler_options=options_for(runner, p, compiler_options)))
        rows.append({"program": str(p), "trace_s": t1 - t0, "lower_s": t2 - t1, "compile_s": time.perf_counter() - t2,
                     "compile_cpu_s": cpu_seconds() - c0})
        print(json.dumps(rows[-1]), flush=True)
    return {"programs": rows, **{f"{k}_total": sum(r[k] for r in rows)
                                 for k in ("trace_s", "lower_s", "compile_s", "compile_cpu_s")}}


def pool(runner, threads: int, compiler_options: dict) -> dict:
    """Every program lowered, then compiled on `threads` threads (options as in `serial`), kept as the runner's."""
    t0 = time.perf_counter()
    programs = runner.programs()
    lowered = [runner.lower(p) for p in programs]
    t1, c0 = time.perf_counter(), cpu_seconds()
    with concurrent.futures.ThreadPoolExecutor(threads) as executor:
        compiled = list(executor.map(lambda p, x: x.compile(compiler_options=options_for(runner, p, compiler_options)),
                                     programs, lowered))
    for p, executable in zip(programs, compiled):
        runner.install(p, executable)
    return {"programs": len(lowered), "lower_s": t1 - t0, "compile_s": time.perf_counter() - t1,
            "compile_cpu_s": cpu_seconds() - c0, "threads": threads}


def steps(runner, context: int = 512, reps: int = 5) -> list[dict]:
    """Each decode and prefill program's step run directly on the runner (greedy, the median of `reps` after one): a
    decode dispatch with every row at `context` tokens (ms a step), a prefill of its rows x PREFILL_ROW - 10 tokens
    in one chunk, a mixed one with 64 decode rows (ms). Cascade decodes are left out (they need shared prefixes). The
    rows take the pool's pages in turn: their KV values do not change the time."""
    from nanojax.runner import PREFILL_ROW, Program, greedy_sampling

    pages = itertools.cycle(range(1, runner.cache.num_pages))
    slot = runner.tables.neutral

    def table(tokens):
        return [next(pages) for _ in range(-(-tokens // runner.page_size))]

    def median_ms(call):
        call()
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        return 1e3 * sorted(times)[reps // 2]

    rows = []
    for p in runner.programs():
        if not isinstance(p, Program) or p.cascade:
            continue
        if p.num_steps:
            tables = [table(context + p.num_steps) for _ in range(p.rows)]
            ms = median_ms(lambda: runner.decode([5] * p.rows, tables, [context] * p.rows, greedy_sampling(
                p.rows, slot), p.num_steps).tokens()) / p.num_steps
        else:
            n = p.rows * PREFILL_ROW - 10
            chunk = ([7] * n, table(n), n, {k: v[0] for k, v in greedy_sampling(1, slot).items()})
            d = min(64, p.decode_rows)
            decodes = ([5] * d, [table(context + 1) for _ in range(d)], [context] * d, greedy_sampling(d, slot)
                       ) if d else None
            ms = median_ms(lambda: runner.prefill([chunk], decodes)[0][0].tokens())
        rows.append({"program": str(p), "step_ms": ms})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def timings(llm) -> dict:
    from bench_throughput import nano_vllm_workload

    from nanojax import SamplingParams

    vocab = min(10000, llm.config.vocab_size)
    prompts = [[(7 * i + 3 * j + 5) % vocab for j in range(100)] for i in range(256)]

    def seconds(batch, max_tokens):
        times = []
        for shift in range(3):  # other tokens each time: no prefix-cache hits; the median counts
            fresh = [[(t + 101 * shift) % vocab for t in p] for p in batch]
            start = time.perf_counter()
            llm.generate(fresh, SamplingParams(temperature=0, ignore_eos=True, max_tokens=max_tokens), use_tqdm=False)
            times.append(time.perf_counter() - start)
        return sorted(times)[1]

    step = {b: (seconds([p[:32] for p in prompts[:b]], 257) - seconds([p[:32] for p in prompts[:b]], 1)) / 256
            for b in (1, 64)}
    workload, max_tokens = nano_vllm_workload(256, 1024, 1024)  # prefills mixed with decodes
    start = time.perf_counter()
    llm.generate(workload, [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in max_tokens],
                 use_tqdm=False)
    return {"decode_b1_ms": 1e3 * step[1], "decode_b64_ms": 1e3 * step[64], "prefill_256x100_ms": 1e3 * seconds(
        prompts, 1), "prefill_1x4000_ms": 1e3 * seconds([sum(prompts, [])[:4000]], 1),
        "nano_vllm_tok_s": sum(max_tokens) / (time.perf_counter() - start)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--mode", default="serial", choices=["serial", "pool", "compile_all"])
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--timings", action="store_true")
    ap.add_argument("--steps", action="store_true", help="then time each decode and prefill program's step")
    ap.add_argument("--workers", type=int, default=None, help="compile_all: compile workers (default: the engine's)")
    ap.add_argument("--compiler-options", type=json.loads, default={},
                    help='serial and pool: XLA options over the engine\'s for every compile, as JSON '
                         '({"xla_gpu_autotune_level": 1})')
    ap.add_argument("--out", default="profile_compile.json")
    args = ap.parse_args()
    import jax
    from random_model import random_hf_model

    from nanojax import LLM, compilation

    with tempfile.TemporaryDirectory() as tmp:
        random_hf_model(args.model, "bfloat16").save_pretrained(tmp)
        llm = LLM(tmp, warmup=False, progress=False, num_pages=8192)
    if args.mode == "compile_all":
        own, children = (resource.RUSAGE_SELF,), (resource.RUSAGE_CHILDREN,)
        c0, w0 = cpu_seconds(own), cpu_seconds(children)
        compilation.compile_all(llm.runner, progress=False, workers=args.workers)
        result = {**llm.runner.compile_seconds, "cpu_s": cpu_seconds(own) - c0,
                  "workers_cpu_s": cpu_seconds(children) - w0, "programs": llm.runner.compiles}
    else:
        jax.config.update("jax_enable_compilation_cache", False)
        result = (serial(llm.runner, args.compiler_options) if args.mode == "serial"
                  else pool(llm.runner, args.threads, args.compiler_options))
    if args.steps:
        result["steps"] = steps(llm.runner)
    if args.timings:
        result.update(timings(llm))
    result.update(model=args.model, mode=args.mode, xla_flags=os.environ.get("XLA_FLAGS", ""),
                  compiler_options=args.compiler_options,
                  device=str(jax.devices()[0]))
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "programs"}))


if __name__ == "__main__":
    main()
