"""What a user meets with no tuning: start-up in fresh processes (empty and filled compilation cache) and the first
calls of `LLM(folder)` with its defaults.

    PYTHONPATH=$PWD python3 scripts/bench_startup.py --model qwen3-0.6b --out $OUT/startup.json

A random-weight model of the real architecture (scripts/configs) is saved as an HF folder, as a user's download would
be. Each start runs in a fresh Python process with its own NANOJAX_CACHE: the first finds the compilation cache empty,
the second finds it filled by the first. Before them a throwaway process imports what a start imports (LLM(folder)
without warm-up, one short generate): where the installed packages carry no bytecode (a read-only site-packages
under PYTHONPYCACHEPREFIX), the first process to import a module compiles it, which a pip install does once at
install time, so no timed start pays it. The second process also runs, through the public API with default knobs:
nano-vllm's throughput workload twice (first and second `generate`), batch-64 greedy decode with and without one
penalized request or one top-p request (temperature 0.7, top_p 0.9: the sampling filters' work), alternating, three
times each, and 256 prompts of 100 tokens prefilled (`max_tokens=1`) against one prompt of 4,000; it counts the
programs compiled after `LLM()` returned. The empty start's CPU seconds, its own and its compile workers' (with the
ptxas runs they start), tell whether the compile work fills the cores; when the workers were ready (imports and
backend), handed their programs and done (the last of each) tell what the start waited for. The figures of the build
before this benchmark existed (`BEFORE`, same machine type) are printed beside.
"""
import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))
from convert.sources import ALL_TOKENIZER_FILES  # noqa: E402

BEFORE = {"start_empty_s": 109.6, "start_filled_s": 22.9, "first_generate_tok_s": 2481, "second_generate_tok_s": 9683,
          "compiles_after_start": "14-16", "penalized_vs_plain": 0.48, "prefill_256x100_ms": 891,
          "prefill_1x4000_ms": 12}


def child(args) -> dict:
    """One fresh process: LLM(folder) from start to compiled, then (with --workload) the first calls; or (--prime)
    the start's imports only."""
    t0 = time.perf_counter()
    from nanojax import LLM, SamplingParams

    if args.prime:  # two steps compiled lazily: JAX's lowering modules imported too
        llm = LLM(args.folder, warmup=False, tensor_parallel_size=args.tensor_parallel_size)
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
        return {"prime_s": time.perf_counter() - t0}

    llm = LLM(args.folder, max_num_seqs=args.max_num_seqs, tensor_parallel_size=args.tensor_parallel_size)
    # CPU seconds of this process, and of the compile workers (with their ptxas runs): children ended and waited for.
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    result = {"start_s": time.perf_counter() - t0, "programs": llm.runner.compiles, "loaded": llm.runner.loaded,
              "cpu_s": own.ru_utime + own.ru_stime, "workers_cpu_s": children.ru_utime + children.ru_stime,
              **{f"{k}_s": v for k, v in llm.runner.compile_seconds.items()},
              **{f"startup_{k}_s": v for k, v in llm.startup_seconds.items()}}
    spawned = llm.startup_seconds.get("workers_spawned", 0.0)  # each worker's times from LLM()'s start
    result["workers"] = [{k: v if k == "lowering" else spawned + v for k, v in w.items()}
                         for w in llm.runner.worker_seconds]
    # The same greedy tokens from programs compiled here and from programs loaded from the executable cache.
    check = [[(7 * i + 3 * j) % min(1000, llm.config.vocab_size) for j in range(40 + 9 * i)] for i in range(3)]
    result["check_tokens"] = [o.token_ids for o in llm.generate(
        check, SamplingParams(temperature=0, ignore_eos=True, max_tokens=24), use_tqdm=False)]
    if not args.workload:
        return result
    from bench_throughput import nano_vllm_workload

    compiled = llm.runner.compiles
    prompts, max_tokens = nano_vllm_workload(args.num_seqs, args.max_input_len, args.max_output_len)
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in max_tokens]
    for shift, key in ((0, "first_generate_tok_s"), (1, "second_generate_tok_s")):
        batch = [[(t + shift) % 10000 for t in p] for p in prompts]  # other tokens: no prefix-cache hits
        t = time.perf_counter()
        llm.generate(batch, params, use_tqdm=False)
        result[key] = sum(max_tokens) / (time.perf_counter() - t)
    short = [p[:32] for p in (prompts * 64)[:64]]
    greedy = SamplingParams(temperature=0, ignore_eos=True, max_tokens=128)
    penalized = [greedy] * 63 + [SamplingParams(temperature=0, ignore_eos=True, max_tokens=128, presence_penalty=0.5)]
    top_p = [greedy] * 63 + [SamplingParams(temperature=0.7, top_p=0.9, ignore_eos=True, max_tokens=128, seed=1)]
    llm.generate(short, greedy, use_tqdm=False)  # warm-up
    runs = {"plain_b64_tok_s": [], "penalized_b64_tok_s": [], "top_p_b64_tok_s": []}
    for _ in range(3):  # the mixes alternate, each figure the median of three (one run moved by ~5%)
        for key, ps in zip(runs, (greedy, penalized, top_p)):
            t = time.perf_counter()
            llm.generate(short, ps, use_tqdm=False)
            runs[key].append(64 * 128 / (time.perf_counter() - t))
    result.update({key: sorted(values)[1] for key, values in runs.items()})
    result["penalized_vs_plain"] = result["penalized_b64_tok_s"] / result["plain_b64_tok_s"]
    result["top_p_vs_plain"] = result["top_p_b64_tok_s"] / result["plain_b64_tok_s"]
    once = SamplingParams(temperature=0, ignore_eos=True, max_tokens=1)
    for key, batch in (("prefill_256x100_ms", [p[:100] for p in prompts[:256]]),
                       ("prefill_1x4000_ms", [(prompts[0] * 8)[:4000]])):
        times = []
        for i in range(3):  # fresh prompts each time: no prefix-cache hits
            fresh = [[(t + 17 * (i + 1)) % 10000 for t in p] for p in batch]
            t = time.perf_counter()
            llm.generate(fresh, once, use_tqdm=False)
            times.append(time.perf_counter() - t)
        result[key] = 1e3 * sorted(times)[1]
    result["compiles_after_start"] = llm.runner.compiles - compiled
    return result


def free_torch_cache() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_child(args, folder: Path, cache: Path, workload: bool = False, prime: bool = False) -> dict:
    env = dict(os.environ, NANOJAX_CACHE=str(cache))
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    cmd = [sys.executable, __file__, "--child", "--folder", str(folder), "--num-seqs", str(args.num_seqs),
           "--max-input-len", str(args.max_input_len), "--max-output-len", str(args.max_output_len)]
    cmd += ["--workload"] if workload else []
    cmd += ["--prime"] if prime else []
    cmd += ["--max-num-seqs", str(args.max_num_seqs)] if args.max_num_seqs else []
    cmd += ["--tensor-parallel-size", str(args.tensor_parallel_size)] if args.tensor_parallel_size else []
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    if "compile worker exited" in out.stderr:  # its programs compiled in the engine: a start-up that says why
        print(out.stderr[-3000:], file=sys.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="LLM's max_num_seqs (default: LLM's)")
    ap.add_argument("--tensor-parallel-size", type=int, default=None,
                    help="LLM's tensor_parallel_size: the model split over this many GPUs (default: one, unsharded)")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--max-input-len", type=int, default=1024)
    ap.add_argument("--max-output-len", type=int, default=1024)
    ap.add_argument("--tokenizer", help="a folder whose tokenizer files go into the model's folder, as a user's "
                    "download holds them (default: none, a weights-only folder)")
    ap.add_argument("--out", default="startup.json")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--workload", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--prime", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    from random_model import random_hf_model

    with tempfile.TemporaryDirectory() as tmp:
        folder, cache = Path(tmp) / args.model, Path(tmp) / "cache"
        random_hf_model(args.model, "bfloat16").save_pretrained(folder)
        free_torch_cache()  # the model was drawn on the GPU: its memory goes back before the starts measured
        for name in ALL_TOKENIZER_FILES if args.tokenizer else ():
            if (Path(args.tokenizer) / name).is_file():
                shutil.copy(Path(args.tokenizer) / name, folder / name)
        primed = run_child(args, folder, Path(tmp) / "prime_cache", prime=True)
        empty = run_child(args, folder, cache)
        filled = run_child(args, folder, cache, workload=True)
    import jax

    results = {"model": args.model, "tokenizer": args.tokenizer, "device": str(jax.devices()[0]),
               "prime_s": primed["prime_s"], "empty_cache": empty, "filled_cache": filled,
               "before": BEFORE}
    Path(args.out).write_text(json.dumps(results, indent=2))
    rows = [("start-up to compiled, empty cache (s)", empty["start_s"], BEFORE["start_empty_s"]),
            ("greedy tokens equal, compiled / loaded programs", empty["check_tokens"] == filled["check_tokens"], ""),
            ("  of which lowering / compiling all (s)", f"{empty['lowering_s']:.1f} / {empty['total_s']:.1f}", ""),
            ("  of which weights read / placed with the KV (s)",
             f"{empty['startup_load_s']:.1f} / {empty['startup_build_s']:.1f}", ""),
            ("  compile workers handed their programs at (s)", empty.get("startup_handed_out_s", "-"), ""),
            ("  compile workers ready / done, the last, at (s)", " / ".join(
                f"{max(w[k] for w in empty['workers']):.1f}" for k in ("ready", "done")) if empty["workers"] else "-",
             ""),
            ("  CPU seconds: this process / compile workers",
             f"{empty['cpu_s']:.0f} / {empty['workers_cpu_s']:.0f}", ""),
            ("start-up with a filled cache (s)", filled["start_s"], BEFORE["start_filled_s"]),
            ("  of which weights read / placed with the KV (s)",
             f"{filled['startup_load_s']:.1f} / {filled['startup_build_s']:.1f}", ""),
            ("  of which lowering / compiling all (s)", f"{filled['lowering_s']:.1f} / {filled['total_s']:.1f}", ""),
            ("  of which waiting for the tokenizer after (s)", filled["startup_tokenizer_wait_s"], ""),
            ("programs compiled at start-up, empty cache", empty["programs"], 46),
            ("  with a filled cache: compiled / loaded", f"{filled['programs']} / {filled['loaded']}", ""),
            ("nano-vllm workload, first generate (tok/s)", filled["first_generate_tok_s"],
             BEFORE["first_generate_tok_s"]),
            ("nano-vllm workload, second generate (tok/s)", filled["second_generate_tok_s"],
             BEFORE["second_generate_tok_s"]),
            ("first / second", filled["first_generate_tok_s"] / filled["second_generate_tok_s"], 0.26),
            ("compiles after LLM() returned", filled["compiles_after_start"], BEFORE["compiles_after_start"]),
            ("batch 64, one penalized request vs none", filled["penalized_vs_plain"], BEFORE["penalized_vs_plain"]),
            ("batch 64, one top-p request vs none", filled["top_p_vs_plain"], ""),
            ("256 prompts x 100 tokens, max_tokens=1 (ms)", filled["prefill_256x100_ms"],
             BEFORE["prefill_256x100_ms"]),
            ("1 prompt x 4000 tokens, max_tokens=1 (ms)", filled["prefill_1x4000_ms"], BEFORE["prefill_1x4000_ms"])]
    print(f"\n{args.model} on {results['device']}")
    print(f"{'measure':<48} {'now':>10} {'before':>10}")
    for name, now, before in rows:
        print(f"{name:<48} {now:>10.3g} {before!s:>10}" if isinstance(now, float) else
              f"{name:<48} {now!s:>10} {before!s:>10}")


if __name__ == "__main__":
    main()
