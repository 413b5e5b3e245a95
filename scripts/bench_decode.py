"""Decode benchmark on the GPU: ms/step and tok/s per batch size and context, bandwidth use, TTFT, compile time.

    PYTHONPATH=$PWD python3 scripts/bench_decode.py --model qwen3-0.6b --out $OUT/decode.json

Random bf16 weights of a real architecture (scripts/configs). Before timing, nanojax's greedy tokens are checked
against HF transformers on the same weights in float32. Each point times the compiled multi-step decode
(`decode_steps` tokens per dispatch, the engine's steady state) with a full KV context of random values; the
step's bytes are all weights (LM head included) plus the KV read, against the 2.83 TB/s measured copy ceiling.
Peers in the same run: `--kernels reference` (the XLA path) and HF transformers (scripts/hf_peers.py: generate
eager, and a static cache under torch.compile). The JSON is rewritten after every point, so a run stopped by a
time limit keeps what it measured; give HF room with XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 (JAX takes 75% otherwise).
"""
import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from random_model import loaded_model, random_hf_model, weight_bytes  # noqa: E402

from nanojax import LLM, SamplingParams  # noqa: E402
from nanojax.kv_cache import KVCache  # noqa: E402
from nanojax.ops import get_ops  # noqa: E402
from nanojax.runner import ModelRunner, greedy_sampling  # noqa: E402
from nanojax.sharding import TensorParallel  # noqa: E402

HBM_BYTES_PER_S = 2.83e12
PAGE = 16


def check_parity(name: str, kernels: str, num_tokens: int = 8, tensor_parallel_size: int | None = None) -> bool:
    """float32 greedy tokens of nanojax vs HF on the same random weights (GPU, both)."""
    import torch

    hf = random_hf_model(name, "float32")
    llm = LLM(loaded_model(hf, "float32"), dtype="float32", max_model_len=256, kernels=kernels,
              max_num_seqs=4, decode_steps=4, tensor_parallel_size=tensor_parallel_size)
    prompts = np.random.default_rng(0).integers(0, 10000, (3, 37)).tolist()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True),
                        use_tqdm=False)
    ok = True
    with torch.no_grad():
        for p, o in zip(prompts, outs):
            ref = hf.generate(torch.tensor([p], device=hf.device), max_new_tokens=num_tokens, do_sample=False,
                              min_new_tokens=num_tokens)[0, len(p):].tolist()
            ok &= ref == o.token_ids
            if ref != o.token_ids:
                print(f"PARITY MISMATCH {name} {kernels}: hf {ref} nanojax {o.token_ids}")
    del hf, llm
    return ok


def time_call(fn, iters: int) -> float:
    """Median seconds of fn() over `iters` calls (fn waits for its result)."""
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def bench_point(runner: ModelRunner, batch: int, context: int, steps: int) -> dict:
    pps = runner.pages_per_seq
    tables = [list(range(b * pps, (b + 1) * pps)) for b in range(batch)]
    tokens = np.random.default_rng(batch).integers(0, 1000, batch).tolist()
    lens = [context] * batch
    samp = greedy_sampling(batch)
    t0 = time.perf_counter()
    runner.decode(tokens, tables, lens, samp, num_steps=steps).tokens()
    compile_s = time.perf_counter() - t0
    seconds = time_call(lambda: runner.decode(tokens, tables, lens, samp, num_steps=steps).tokens(), iters=5)
    return {"compile_s": compile_s, "ms_per_step": seconds / steps * 1e3}


def random_cache(runner: ModelRunner, key) -> None:
    """Random KV values (never time on zeros), written one layer at a time: each zero pool is dropped as its random
    replacement is made, so the cache never needs twice its size (Llama-3.2-1B at batch 256, context 4096: 35 GB)."""
    cache, runner.cache = runner.cache, None
    pools = {"k": list(cache.k), "v": list(cache.v)}
    del cache
    for i, layer_key in enumerate(jax.random.split(key, len(pools["k"]))):
        for name, kind_key in zip(("k", "v"), jax.random.split(layer_key)):
            shape, dtype, sharding = pools[name][i].shape, pools[name][i].dtype, pools[name][i].sharding
            pools[name][i] = None  # frees the zero pool before its replacement is made (on the same devices)
            pools[name][i] = jax.jit(lambda k: jax.random.normal(k, shape, dtype), out_shardings=sharding)(kind_key)
    runner.cache = KVCache(k=tuple(pools["k"]), v=tuple(pools["v"]))


def ttft(runner: ModelRunner, prompt_len: int) -> float:
    table = list(range(runner.pages_per_seq))
    tokens = np.random.default_rng(prompt_len).integers(0, 1000, prompt_len).tolist()
    fields = {k: v[0] for k, v in greedy_sampling(1).items()}
    run = lambda: runner.prefill([(tokens, table, prompt_len, fields)])[0][0].tokens()  # noqa: E731
    run()
    return time_call(run, iters=5)


def hf_points(hf, args, points: list, save) -> None:
    """HF transformers peers on the same weights (scripts/hf_peers.py), appended to points; a peer that fails is
    reported, not fatal."""
    from hf_peers import decode_tok_s

    context, steps = args.contexts[0], max(args.steps)
    for compiled, batches in ((False, args.hf_eager_batches), (True, args.hf_compiled_batches)):
        for batch in batches:
            point = {"kernels": "hf-compiled" if compiled else "hf-eager", "batch": batch, "context": context}
            try:
                tok_s = decode_tok_s(hf, batch, context, steps, compiled=compiled)
                point.update(tok_s=tok_s, ms_per_step=batch / tok_s * 1e3)
            except Exception as e:  # noqa: BLE001 -- a peer's failure is a result to print, not a crash
                point["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            points.append(point)
            save()
            print(json.dumps(point), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 4096])
    ap.add_argument("--kernels", nargs="+", default=["pallas", "reference"])
    ap.add_argument("--steps", type=int, nargs="+", default=[32], help="decode steps per dispatch (each is a point)")
    ap.add_argument("--ttft", type=int, nargs="*", default=[128, 512, 2048])
    ap.add_argument("--skip-parity", action="store_true")
    ap.add_argument("--hf-eager-batches", type=int, nargs="*", default=[1, 8, 64, 256],
                    help="HF generate (eager) peer points, at the first context")
    ap.add_argument("--hf-compiled-batches", type=int, nargs="*", default=[1, 64],
                    help="HF static cache + torch.compile peer points (a compile each), at the first context")
    ap.add_argument("--table-tokens", type=int, default=0,
                    help="page-table width in tokens, as the engine's max_model_len gives (default: context + steps)")
    ap.add_argument("--tensor-parallel-size", type=int, default=None,
                    help="split the model over this many GPUs (nanojax.sharding); default: one GPU, unsharded")
    ap.add_argument("--out", default="decode.json")
    args = ap.parse_args()

    results = {"device": str(jax.devices()[0]), "model": args.model, "tensor_parallel_size": args.tensor_parallel_size,
               "steps_per_dispatch": args.steps,
               "parity": {}, "points": [], "ttft_ms": {}, "peers": []}
    save = lambda: Path(args.out).write_text(json.dumps(results, indent=2))  # noqa: E731 -- after every point
    if not args.skip_parity:
        for kern in args.kernels:
            results["parity"][kern] = check_parity(args.model, kern, tensor_parallel_size=args.tensor_parallel_size)
        print(f"parity with HF (float32 greedy): {results['parity']}", flush=True)
    hf = random_hf_model(args.model, "bfloat16")
    loaded = loaded_model(hf, "bfloat16")
    tp = TensorParallel.create(loaded.config, args.tensor_parallel_size) if args.tensor_parallel_size else None
    params = tp.place(loaded.params, progress=True) if tp else jax.tree.map(jnp.asarray, loaded.params)
    wbytes = weight_bytes(params) - loaded.config.vocab_size * loaded.config.hidden_size * 2 * (
        0 if loaded.config.tie_word_embeddings else 1)  # untied: the input embedding is read only by row
    c = loaded.config
    kv_token_bytes = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 2
    max_ctx = max(args.contexts + args.ttft)
    for kern in args.kernels:
        if args.ttft:
            pps = -(-max_ctx // PAGE)
            runner = ModelRunner(c, params, num_pages=pps, page_size=PAGE, pages_per_seq=pps, dtype=jnp.bfloat16,
                                 ops=get_ops(kern, c), vocab_limit=c.vocab_size, max_num_seqs=1,
                                 max_prefill_tokens=max(args.ttft), decode_steps=1, tensor_parallel=tp)
            results["ttft_ms"][kern] = {n: ttft(runner, n) * 1e3 for n in args.ttft}
            save()
            print(f"TTFT {kern}: {results['ttft_ms'][kern]}", flush=True)
            del runner
        for context in args.contexts:
            pps = -(-max(context + max(args.steps), args.table_tokens) // PAGE)
            for batch in args.batches:
                if batch * pps * PAGE * kv_token_bytes > 40e9:
                    continue
                runner = ModelRunner(c, params, num_pages=batch * pps, page_size=PAGE, pages_per_seq=pps,
                                     dtype=jnp.bfloat16, ops=get_ops(kern, c), vocab_limit=c.vocab_size,
                                     max_num_seqs=batch, max_prefill_tokens=16, decode_steps=max(args.steps),
                                     tensor_parallel=tp)
                random_cache(runner, jax.random.key(0))
                for steps in args.steps:
                    point = bench_point(runner, batch, context, steps)
                    step_bytes = wbytes + batch * context * kv_token_bytes
                    point.update(kernels=kern, batch=batch, context=context, steps=steps, table_tokens=pps * PAGE,
                                 tok_s=batch / point["ms_per_step"] * 1e3,
                                 bw_pct=100 * step_bytes / (point["ms_per_step"] / 1e3) / HBM_BYTES_PER_S)
                    results["points"].append(point)
                    save()
                    print(json.dumps(point), flush=True)
                del runner
    hf_points(hf, args, results["peers"], save)
    print(f"\n{args.model} on {results['device']}; parity {results['parity']}; weights {wbytes / 1e9:.2f} GB")
    print(f"{'kernels':>10} {'ctx':>6} {'batch':>5} {'steps':>5} {'ms/step':>8} {'tok/s':>9} {'BW%':>5} "
          f"{'compile s':>9}")
    for p in results["points"]:
        print(f"{p['kernels']:>10} {p['context']:>6} {p['batch']:>5} {p['steps']:>5} {p['ms_per_step']:>8.3f} "
              f"{p['tok_s']:>9.0f} "
              f"{p['bw_pct']:>5.1f} {p['compile_s']:>9.1f}")
    for p in results["peers"]:
        print(f"{p['kernels']:>10} {p['context']:>6} {p['batch']:>5} {'':>5} {p.get('ms_per_step', 0):>8.3f} "
              f"{p.get('tok_s', 0):>9.0f} {p.get('error', '')}")
    for kern, t in results["ttft_ms"].items():
        print(f"TTFT {kern}: " + ", ".join(f"{n} tok {ms:.1f} ms" for n, ms in t.items()))


if __name__ == "__main__":
    main()
