"""Do the engine's programs (Pallas Triton custom calls included) survive nanojax/executable_cache.py, and how fast
is a start that loads them?

    PYTHONPATH=$PWD python3 scripts/check_executable_cache.py [--model qwen3-0.6b] [--out $OUT/executable_cache.json]

A random-weight model of the real architecture (scripts/configs) is saved as an HF folder; each phase runs in a
fresh Python process with one NANOJAX_CACHE:
- cold: every program lowered one by one and compiled on a thread pool (as ModelRunner.compile_all), each
  serialized into the executable cache; greedy tokens of a few prompts;
- warm: every program loaded from the executable cache (no tracing, no lowering), the same greedy tokens, which
  must equal cold's, and no compile while generating;
- baseline (unless --no-baseline): today's warm start, LLM(folder) with the persistent compilation cache filled
  by cold.
The programs are keyed here by the runner's state (program, config, ops, shapes of params / cache / tables);
inside the runner the key comes from each program's own arguments.
"""
import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

START = time.perf_counter()
sys.path.insert(0, str(Path(__file__).parent))


def child_llm(args, warmup: bool):
    from nanojax import LLM

    kw = {k: v for k, v in (("max_num_seqs", args.max_num_seqs),
                            ("max_num_batched_tokens", args.max_num_batched_tokens)) if v}
    return LLM(args.folder, warmup=warmup, progress=False, **kw)


def program_keys(runner) -> dict:
    from nanojax import executable_cache as ec

    state = ec.signature((runner.params, runner.cache, runner.tables))
    return {p: ec.program_key(p, runner.config, runner.ops, runner.vocab_limit, runner.pages_per_seq, state)
            for p in runner.programs()}


def greedy_tokens(llm, vocab: int) -> list[list[int]]:
    """Greedy continuations of prompts of several lengths (several prefill buckets, a batched multi-step decode)."""
    import numpy as np

    from nanojax import SamplingParams

    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, min(vocab, 10000), n).tolist() for n in (7, 100, 333, 1000, 2049)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    return [out.token_ids for out in llm.generate(prompts, params, use_tqdm=False)]


def cold(args) -> dict:
    """Lowers and compiles every program as compile_all does, each stored by the thread that compiled it."""
    from nanojax import executable_cache as ec

    llm = child_llm(args, warmup=False)
    runner, directory = llm.runner, ec.default_directory()
    started = time.perf_counter()
    keys, lowering, futures = program_keys(runner), 0.0, {}
    with concurrent.futures.ThreadPoolExecutor(os.cpu_count()) as pool:
        for p in keys:
            t = time.perf_counter()
            lowered = runner._lower(p)
            lowering += time.perf_counter() - t
            futures[pool.submit(ec.compile_and_store, directory, keys[p], lowered)] = p
        for f in concurrent.futures.as_completed(futures):
            runner._compiled[futures[f]] = f.result()
    compiled = time.perf_counter() - started
    files = list(directory.rglob(f"*{ec.SUFFIX}"))
    return {"programs": len(keys), "stored": len(files), "lowering_s": lowering, "compile_all_s": compiled,
            "megabytes": sum(f.stat().st_size for f in files) / 1e6,
            "tokens": greedy_tokens(llm, llm.config.vocab_size)}


def warm(args) -> dict:
    """Loads every program from the executable cache on a thread pool; nothing is traced."""
    from nanojax import executable_cache as ec

    llm = child_llm(args, warmup=False)
    runner, directory = llm.runner, ec.default_directory()
    built = time.perf_counter()
    keys = program_keys(runner)
    with concurrent.futures.ThreadPoolExecutor(os.cpu_count()) as pool:
        loaded = dict(zip(keys, pool.map(lambda p: ec.load(directory, keys[p]), keys)))
    runner._compiled.update({p: c for p, c in loaded.items() if c is not None})
    done = time.perf_counter()
    tokens = greedy_tokens(llm, llm.config.vocab_size)
    return {"programs": len(keys), "hits": sum(c is not None for c in loaded.values()), "load_s": done - built,
            "start_s": done - START, "llm_s": built - START, "compiles_while_generating": runner.compiles,
            "tokens": tokens}


def baseline(args) -> dict:
    """Today's warm start: LLM(folder) compiling everything, answered by the persistent compilation cache."""
    llm = child_llm(args, warmup=True)
    return {"start_s": time.perf_counter() - START, **{f"{k}_s": v for k, v in llm.runner.compile_seconds.items()},
            "tokens": greedy_tokens(llm, llm.config.vocab_size)}


def run_child(args, phase: str, folder: Path, cache: Path) -> dict:
    env = dict(os.environ, NANOJAX_CACHE=str(cache))
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    cmd = [sys.executable, __file__, "--child", phase, "--folder", str(folder)]
    for flag in ("max_num_seqs", "max_num_batched_tokens"):
        if getattr(args, flag):
            cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    out = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{phase}: {' '.join(cmd)} failed ({out.returncode}):\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def report(results: dict) -> None:
    c, w, b = results["cold"], results["warm"], results.get("baseline")
    rows = [("programs (stored / loaded)", f"{c['stored']}/{c['programs']} / {w['hits']}"),
            ("cold: lowering, serial (s)", c["lowering_s"]),
            ("cold: compile_all, serialize + write included (s)", c["compile_all_s"]), ("files (MB)", c["megabytes"]),
            ("warm: LLM(warmup=False) from process start (s)", w["llm_s"]),
            ("warm: load all programs (s)", w["load_s"]), ("warm: process start to all loaded (s)", w["start_s"]),
            ("warm: compiles while generating", w["compiles_while_generating"]),
            ("greedy tokens: warm == cold", w["tokens"] == c["tokens"])]
    if b:
        rows += [("baseline: LLM() start, XLA cache filled (s)", b["start_s"]),
                 ("baseline: of which lowering / compile_all (s)", f"{b['lowering_s']:.1f} / {b['total_s']:.1f}"),
                 ("greedy tokens: baseline == cold", b["tokens"] == c["tokens"])]
    print(f"\n{results['model']} on {results['device']}")
    for name, value in rows:
        print(f"{name:<50} {value:>12.3g}" if isinstance(value, float) else f"{name:<50} {value!s:>12}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="LLM's max_num_seqs (default: LLM's)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--no-baseline", action="store_true", help="skip today's warm start (saves ~45 s on the H100)")
    ap.add_argument("--out", default="executable_cache.json")
    ap.add_argument("--child", choices=("cold", "warm", "baseline"), help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps({"cold": cold, "warm": warm, "baseline": baseline}[args.child](args)))
        return
    from random_model import random_hf_model

    results = {"model": args.model}
    with tempfile.TemporaryDirectory() as tmp:
        folder, cache = Path(tmp) / args.model, Path(tmp) / "cache"
        random_hf_model(args.model, "bfloat16").save_pretrained(folder)
        for phase in ("cold", "warm") + (() if args.no_baseline else ("baseline",)):
            results[phase] = run_child(args, phase, folder, cache)
    import jax

    results["device"] = str(jax.devices()[0])
    Path(args.out).write_text(json.dumps(results, indent=2))
    report(results)
    if results["warm"]["tokens"] != results["cold"]["tokens"] or results["warm"]["hits"] != results["cold"]["stored"]:
        raise SystemExit("FAILED: the loaded programs differ from the compiled ones (see the table)")


if __name__ == "__main__":
    main()
