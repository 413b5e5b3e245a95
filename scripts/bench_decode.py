"""Decode benchmark on the GPU: ms/step and tok/s per batch size and context, bandwidth use, TTFT, compile time.

    PYTHONPATH=$PWD python3 scripts/bench_decode.py --model qwen3-0.6b --out $OUT/decode.json

Random bf16 weights of a real architecture (scripts/configs): HF's model and its init where an HF peer runs on the
same weights, else values drawn on the device(s), so that models no single GPU holds build in seconds. Before
timing (unless --skip-parity), nanojax's greedy tokens are checked against HF transformers on the same weights in
float32. Each point times the compiled multi-step decode
(`decode_steps` tokens per dispatch, the engine's steady state) with a full KV context of random values; the
step's bytes are all weights (LM head included) plus the KV read, against the copy ceiling measured at the start
(`copy_ceiling`: 4.2 TB/s on an H200; ../shared/DEVICE.md's 2.83 TB/s on the H100 was a bf16 op's).
Peers in the same run: `--kernels reference` (the XLA path) and HF transformers (scripts/hf_peers.py: generate
eager, and a static cache under torch.compile). The JSON is rewritten after every point, so a run stopped by a
time limit keeps what it measured; give HF room with XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 (JAX takes 75% otherwise).
"""
import argparse
import dataclasses
import itertools
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from random_model import loaded_model, model_config, random_array, random_hf_model, random_params, weight_bytes  # noqa: E402

from convert.quantize import quantize_layer, quantize_params  # noqa: E402
from nanojax import LLM, SamplingParams  # noqa: E402
from nanojax.cascade import CascadeRules  # noqa: E402
from nanojax.config import EngineConfig  # noqa: E402
from nanojax.kv_cache import KVCache  # noqa: E402
from nanojax.runner import ModelRunner, greedy_sampling  # noqa: E402
from nanojax.sharding import TensorParallel  # noqa: E402

PAGE = 16


def copy_ceiling() -> float:
    """Bytes read + written per second of an elementwise op over 1 GiB of uint32 on this device, after a second of
    it to raise the clocks: the ceiling the steps' bandwidth use is read against. 32-bit elements: XLA's bf16
    elementwise ops stop short of it (on an H200, 3.3 TB/s against 4.2 for uint32 and for torch's device copy)."""
    x = jnp.zeros((256 << 20,), jnp.uint32)
    add = jax.jit(lambda a: a + 1)
    warm = time.perf_counter() + 1.0
    while time.perf_counter() < warm:
        add(x).block_until_ready()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(20):
            y = add(x)
        y.block_until_ready()
        times.append((time.perf_counter() - start) / 20)
    return 2 * x.nbytes / sorted(times)[2]


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
    samp = greedy_sampling(batch, runner.tables.neutral)
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
            pools[name][i] = random_array(kind_key, shape, sharding, dtype, scale=1.0)
    runner.cache = KVCache(k=tuple(pools["k"]), v=tuple(pools["v"]))


def ttft(runner: ModelRunner, prompt_len: int) -> float:
    table = list(range(runner.pages_per_seq))
    tokens = np.random.default_rng(prompt_len).integers(0, 1000, prompt_len).tolist()
    fields = {k: v[0] for k, v in greedy_sampling(1, runner.tables.neutral).items()}
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


def shared_tables(runner: ModelRunner, batch: int, prefix: int, levels: int, own: int, steps: int):
    """Page tables of `batch` rows over one shared prefix of `prefix` tokens (levels 1), or a system prompt of a
    quarter of it shared by all and two documents, each shared by half the rows (levels 2); then `own` tokens of
    each row's own, in pages that hold `steps` more. -> (tables, seq_lens)."""
    pages = iter(range(runner.cache.k[0].shape[0]))
    system = prefix // 4 // PAGE if levels == 2 else prefix // PAGE
    common = [next(pages) for _ in range(system)]
    docs = [[next(pages) for _ in range(prefix // PAGE - system)] for _ in range(levels)]
    own_pages = -(-(own + steps) // PAGE)
    tables = [common + docs[b * levels // batch] + [next(pages) for _ in range(own_pages)] for b in range(batch)]
    return tables, [prefix + own] * batch


def shared_point(runner: ModelRunner, batch: int, prefix: int, levels: int, own: int, steps: int) -> dict:
    """One shared-prefix point: ms/step and the KV tokens per layer and KV head the cascade path did not read."""
    tables, lens = shared_tables(runner, batch, prefix, levels, own, steps)
    tokens = np.random.default_rng(batch).integers(0, 1000, batch).tolist()
    samp = greedy_sampling(batch, runner.tables.neutral)
    runner.decode(tokens, tables, lens, samp, num_steps=steps).tokens()
    saved = runner.cascade_saved_tokens
    seconds = time_call(lambda: runner.decode(tokens, tables, lens, samp, num_steps=steps).tokens(), iters=5)
    return {"ms_per_step": seconds / steps * 1e3, "saved_tokens": (runner.cascade_saved_tokens - saved) / 5 / steps}


def variant_params(model: str, config, loaded, quantization: str, tp_size: int):
    """-> (params on the device(s), TensorParallel or None); tp_size 0: unsharded. loaded: HF's weights, or None
    for random values drawn on the device(s) (random_model.random_params; FP8 only unsharded)."""
    tp = TensorParallel.create(config, tp_size) if tp_size else None
    if loaded is None:
        params = random_params(model, tp).params
        return (_fp8_layer_by_layer(params) if quantization == "fp8" else params), tp
    params = loaded.params
    if quantization == "fp8":
        params = quantize_params(jax.tree.map(jnp.asarray, params), config, lm_head=False)
    return (tp.place(params, progress=True) if tp else jax.tree.map(jnp.asarray, params)), tp


def _fp8_layer_by_layer(params) -> dict:
    """params with each layer's projections in FP8 (LM head bf16), each bf16 layer freed as it is quantized, so that a
    model and its FP8 copy need not fit on the device together (Mixtral-8x7B: 94 + 47 GB)."""
    layers = list(params["layers"])
    for i, bf16 in enumerate(layers):
        layers[i] = quantize_layer(bf16)
        kept = {id(x) for x in jax.tree.leaves(layers[i])}
        for x in jax.tree.leaves(bf16):
            if id(x) not in kept:
                x.delete()
    return {**params, "layers": tuple(layers)}


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    ap.add_argument("--contexts", type=int, nargs="*", default=[512, 4096])
    ap.add_argument("--kernels", nargs="+", default=["pallas", "reference"])
    ap.add_argument("--quantization", nargs="+", default=["none"], choices=["none", "fp8"],
                    help="weights: none (the dtype) and/or fp8 (convert.quantize, LM head in bf16), each a variant")
    ap.add_argument("--steps", type=int, nargs="+", default=[32], help="decode steps per dispatch (each is a point)")
    ap.add_argument("--ttft", type=int, nargs="*", default=[128, 512, 2048])
    ap.add_argument("--skip-parity", action="store_true")
    ap.add_argument("--hf-eager-batches", type=int, nargs="*", default=[1, 8, 64, 256],
                    help="HF generate (eager) peer points, at the first context")
    ap.add_argument("--hf-compiled-batches", type=int, nargs="*", default=[1, 64],
                    help="HF static cache + torch.compile peer points (a compile each), at the first context")
    ap.add_argument("--table-tokens", type=int, default=0,
                    help="page-table width in tokens, as the engine's max_model_len gives (default: context + steps)")
    ap.add_argument("--tensor-parallel-size", type=int, nargs="+", default=[0],
                    help="split the model over this many GPUs (nanojax.sharding), each a variant; 0: one GPU, "
                         "unsharded (e.g. `0 1` compares size 1 through the sharded code with the plain path)")
    ap.add_argument("--shared-prefix", type=int, nargs="*", default=[],
                    help="shared-prefix points: rows over one prefix of this many tokens (a multiple of 16) and "
                         "--own-tokens of their own, with the cascade path on and off (not with --kernels reference)")
    ap.add_argument("--levels", type=int, nargs="+", default=[1], choices=[1, 2],
                    help="shared levels: 1 (one prefix) or 2 (a system prompt of a quarter of it shared by all, then "
                         "two documents each shared by half the rows)")
    ap.add_argument("--own-tokens", type=int, default=16)
    ap.add_argument("--piece-tokens", type=int, nargs="+", default=[CascadeRules.min_piece_tokens],
                    help="cascade points per value of CascadeRules.min_piece_tokens (the shared prefix's split)")
    ap.add_argument("--out", default="decode.json")
    return ap.parse_args()


def main():
    args = parse_args()
    results = {"device": str(jax.devices()[0]), "model": args.model, "steps_per_dispatch": args.steps,
               "parity": {}, "points": [], "ttft_ms": {}, "peers": [], "copy_bytes_per_s": copy_ceiling()}
    print(f"copy ceiling: {results['copy_bytes_per_s'] / 1e12:.2f} TB/s", flush=True)
    save = lambda: Path(args.out).write_text(json.dumps(results, indent=2))  # noqa: E731 -- after every point
    if not args.skip_parity:
        for kern in args.kernels:
            for tp_size in args.tensor_parallel_size:
                key = kern + (f"-tp{tp_size}" if tp_size else "")
                results["parity"][key] = check_parity(args.model, kern, tensor_parallel_size=tp_size or None)
        print(f"parity with HF (float32 greedy): {results['parity']}", flush=True)
    # HF's model only where something reads it: without it, random weights are drawn on the device(s) in seconds.
    hf = random_hf_model(args.model, "bfloat16") if args.hf_eager_batches or args.hf_compiled_batches else None
    loaded = loaded_model(hf, "bfloat16") if hf else None
    c = loaded.config if loaded else model_config(args.model)
    kv_token_bytes = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 2
    for quant in args.quantization:
        for tp_size in args.tensor_parallel_size:
            if quant == "fp8" and tp_size and loaded is None:
                print(f"skipped fp8 at tensor-parallel size {tp_size}: random weights are drawn already sharded")
                continue
            params, tp = variant_params(args.model, c, loaded, quant, tp_size)
            wbytes = weight_bytes(params) - c.vocab_size * c.hidden_size * 2 * (
                0 if c.tie_word_embeddings else 1)  # untied: the input embedding is read only by row
            for kern in args.kernels:
                name = kern + ("" if quant == "none" else f"-{quant}") + (f"-tp{tp_size}" if tp_size else "")
                run_variant(args, name, kern, c, params, tp, wbytes, kv_token_bytes, results, save)
            del params, tp
    if hf:
        hf_points(hf, args, results["peers"], save)
    print_tables(args, results)


def make_runner(c, params, tp, kern: str, *, batch: int, num_pages: int, pages_per_seq: int, prefill: int,
                steps: int, cascade: bool = False) -> ModelRunner:
    engine = EngineConfig(dtype="bfloat16", max_model_len=pages_per_seq * PAGE, page_size=PAGE, kernels=kern,
                          max_num_seqs=batch, max_num_batched_tokens=prefill, decode_steps=steps, cascade=cascade)
    return ModelRunner(c, engine, params, num_pages=num_pages, vocab_limit=c.vocab_size, tensor_parallel=tp)


def step_weight_bytes(c, params, wbytes: int, batch: int) -> float:
    """The weight bytes a decode step of `batch` rows reads: all, or of a MoE model's experts those its rows choose
    (expected under uniform routing: a share 1 - (1 - k / E)^batch of each layer's)."""
    if c.moe is None:
        return wbytes
    experts = sum(weight_bytes(layer["experts"]) for layer in params["layers"])
    return wbytes - experts * (1 - c.moe.top_k / c.moe.num_experts) ** batch


def run_variant(args, name, kern, c, params, tp, wbytes, kv_token_bytes, results, save):
    """The TTFT, decode and shared-prefix points of one variant (kernels x weights x tensor-parallel size)."""
    def record(point, step_bytes):
        point.update(kernels=name, tok_s=point["batch"] / point["ms_per_step"] * 1e3,
                     bw_pct=100 * step_bytes / (point["ms_per_step"] / 1e3) / results["copy_bytes_per_s"])
        results["points"].append(point)
        save()
        print(json.dumps(point), flush=True)

    if args.ttft:
        pps = -(-max(args.ttft) // PAGE)
        runner = make_runner(c, params, tp, kern, batch=1, num_pages=pps, pages_per_seq=pps,
                             prefill=max(args.ttft), steps=1)
        results["ttft_ms"][name] = {n: ttft(runner, n) * 1e3 for n in args.ttft}
        save()
        print(f"TTFT {name}: {results['ttft_ms'][name]}", flush=True)
        del runner
    for context in args.contexts:
        pps = -(-max(context + max(args.steps), args.table_tokens) // PAGE)
        for batch in args.batches:
            if batch * pps * PAGE * kv_token_bytes > 40e9:
                continue
            runner = make_runner(c, params, tp, kern, batch=batch, num_pages=batch * pps, pages_per_seq=pps,
                                 prefill=16, steps=max(args.steps))
            random_cache(runner, jax.random.key(0))
            for steps in args.steps:
                point = bench_point(runner, batch, context, steps)
                point.update(batch=batch, context=context, steps=steps, table_tokens=pps * PAGE)
                record(point, step_weight_bytes(c, params, wbytes, batch) + batch * context * kv_token_bytes)
            del runner
    steps = max(args.steps)
    prefixes = args.shared_prefix if kern != "reference" else []  # the cascade reference is for tests
    own_pages = -(-(args.own_tokens + steps) // PAGE)
    for batch in args.batches if prefixes else []:
        for cascade in (False, True):  # one runner (one compile) for every prefix and level
            pps = max(prefixes) // PAGE + own_pages
            num_pages = 2 * max(prefixes) // PAGE + batch * own_pages
            runner = make_runner(c, params, tp, kern, batch=batch, num_pages=num_pages, pages_per_seq=pps,
                                 prefill=16, steps=steps, cascade=cascade)
            random_cache(runner, jax.random.key(0))
            for prefix, levels, piece in itertools.product(prefixes, args.levels,
                                                           args.piece_tokens if cascade else [None]):
                if piece:  # a host-side rule: the same program
                    runner.cascade_rules = dataclasses.replace(runner.cascade_rules, min_piece_tokens=piece)
                point = shared_point(runner, batch, prefix, levels, args.own_tokens, steps)
                point.update(batch=batch, context=prefix + args.own_tokens, steps=steps, shared_prefix=prefix,
                             levels=levels, cascade=cascade, piece_tokens=piece,
                             saved_gb_per_step=point["saved_tokens"] * kv_token_bytes / 1e9)
                kv_bytes = (batch * (prefix + args.own_tokens) - point["saved_tokens"]) * kv_token_bytes
                record(point, wbytes + kv_bytes)
            del runner


def print_tables(args, results):
    print(f"\n{args.model} on {results['device']}; parity {results['parity']}")
    print(f"{'variant':>16} {'ctx':>6} {'batch':>5} {'steps':>5} {'ms/step':>8} {'tok/s':>9} {'BW%':>5} "
          f"{'compile s':>9}")
    for p in results["points"]:
        if "shared_prefix" not in p:
            print(f"{p['kernels']:>16} {p['context']:>6} {p['batch']:>5} {p['steps']:>5} {p['ms_per_step']:>8.3f} "
                  f"{p['tok_s']:>9.0f} {p['bw_pct']:>5.1f} {p['compile_s']:>9.1f}")
    shared = [p for p in results["points"] if "shared_prefix" in p]
    if shared:
        print(f"\nshared prefix ({args.own_tokens} own tokens per row): cascade off vs on")
        print(f"{'variant':>16} {'prefix':>6} {'lvl':>3} {'batch':>5} {'cascade':>7} {'piece':>5} {'ms/step':>8} "
              f"{'tok/s':>9} {'saved GB/step':>13} {'BW%':>5}")
        for p in shared:
            print(f"{p['kernels']:>16} {p['shared_prefix']:>6} {p['levels']:>3} {p['batch']:>5} "
                  f"{'on' if p['cascade'] else 'off':>7} {p['piece_tokens'] or '':>5} {p['ms_per_step']:>8.3f} "
                  f"{p['tok_s']:>9.0f} "
                  f"{p['saved_gb_per_step']:>13.3f} {p['bw_pct']:>5.1f}")
    for p in results["peers"]:
        print(f"{p['kernels']:>16} {p['context']:>6} {p['batch']:>5} {'':>5} {p.get('ms_per_step', 0):>8.3f} "
              f"{p.get('tok_s', 0):>9.0f} {p.get('error', '')}")
    for kern, t in results["ttft_ms"].items():
        print(f"TTFT {kern}: " + ", ".join(f"{n} tok {ms:.1f} ms" for n, ms in t.items()))


if __name__ == "__main__":
    main()
