"""nano-vllm's throughput benchmark on nanojax, with HF transformers in the same run.

    PYTHONPATH=$PWD python3 scripts/bench_throughput.py --model qwen3-0.6b --out $OUT/throughput.json

The workload is nano-vllm's `bench.py`, draw for draw: `random.seed(0)`; 256 requests, each a prompt of
randint(100, 1024) token ids drawn from randint(0, 10000), then per request SamplingParams(temperature=0.6,
ignore_eos=True, max_tokens=randint(100, 1024)). Throughput = sum of max_tokens / wall time of one `generate`
call over all requests (prefill included), after start-up compilation and one warm-up request, as nano-vllm
counts it. Random bf16 weights of the real architecture; before timing, nanojax's float32 greedy tokens are
checked against HF's (scripts/bench_decode.check_parity).
"""
import argparse
import dataclasses
import json
import os
import random
import sys
import time
from pathlib import Path

# HF's dynamic cache grows by concatenation: batch 256 ran out of memory on the H100 with 25 GB reserved by torch but
# unallocated. Expandable segments let torch reuse such fragments (not re-measured at 256). Set before torch loads.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
sys.path.insert(0, str(Path(__file__).parent))
from bench_decode import check_parity  # noqa: E402
from random_model import loaded_model, model_config, random_hf_model, random_params  # noqa: E402

from nanojax import LLM, SamplingParams  # noqa: E402


def nano_vllm_workload(num_seqs: int, max_input_len: int, max_output_len: int):
    """(prompts, max_tokens) drawn exactly as nano-vllm's bench.py draws them (lengths from 100, or less for a
    smoke test with smaller maxima)."""
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(min(100, max_input_len), max_input_len))]
               for _ in range(num_seqs)]
    max_tokens = [random.randint(min(100, max_output_len), max_output_len) for _ in range(num_seqs)]
    return prompts, max_tokens


def weights(hf_model, args):
    """HF's weights where HF runs too; else random values drawn on the device(s), placed as LLM places them. With
    --quantization fp8 they are quantized here and handed over as host arrays, as a checkpoint's are: LLM would
    quantize device arrays while this frame still holds the bf16 ones (their share of memory lost to the KV pool),
    and freed here on the device they would leave holes between the FP8 weights."""
    if hf_model is not None:
        return loaded_model(hf_model, "bfloat16")
    import jax

    from convert.quantize import quantize_params
    from nanojax.sharding import TensorParallel

    size = args.tensor_parallel_size
    loaded = random_params(args.model, TensorParallel.create(model_config(args.model), size) if size else None)
    if args.quantization == "fp8":
        fp8 = jax.device_get(quantize_params(loaded.params, loaded.config, lm_head=False))
        return dataclasses.replace(loaded, params=fp8)
    return loaded


def run_nanojax(hf_model, prompts, max_tokens, args) -> dict:
    t0 = time.perf_counter()
    loaded = weights(hf_model, args)  # converted (and quantized) before LLM() starts its clock
    t1 = time.perf_counter()
    weights_s = t1 - t0
    llm = LLM(loaded, dtype="bfloat16", kernels=args.kernels, warmup=True,
              max_model_len=args.max_input_len + args.max_output_len + args.decode_steps,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              chunk_size=args.chunk_size, decode_steps=args.decode_steps,
              tensor_parallel_size=args.tensor_parallel_size, quantization=args.quantization)
    compile_s = time.perf_counter() - t1
    llm.generate([prompts[0][:100]], SamplingParams(temperature=0.6, max_tokens=16), use_tqdm=False)  # warm-up
    compiles = llm.runner.compiles
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in max_tokens]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    assert [len(o.token_ids) for o in outs] == max_tokens, "a request did not produce its max_tokens"
    return {"tok_s": sum(max_tokens) / seconds, "seconds": seconds, "weights_s": weights_s,
            "startup_compile_s": compile_s, "recompiles_during_run": llm.runner.compiles - compiles,
            "num_pages": llm.page_manager.num_pages}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--max-input-len", type=int, default=1024)
    ap.add_argument("--max-output-len", type=int, default=1024)
    ap.add_argument("--kernels", default="auto")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--chunk-size", type=int, default=1024)
    ap.add_argument("--decode-steps", type=int, default=16)
    # HF eager: the first 128 requests in one batch (~140 s on the H100); all 256 at once ran out of memory.
    ap.add_argument("--hf-requests", type=int, default=128, help="requests the HF eager peer runs (0: none)")
    ap.add_argument("--hf-batch", type=int, default=128)
    ap.add_argument("--skip-parity", action="store_true")
    ap.add_argument("--tensor-parallel-size", type=int, default=None,
                    help="split the model over this many GPUs (nanojax.sharding); default: one GPU, unsharded")
    ap.add_argument("--quantization", choices=["fp8"], default=None,
                    help="LLM(quantization=...): FP8 projections (the KV pool takes the memory the weights free)")
    ap.add_argument("--out", default="throughput.json")
    args = ap.parse_args()

    import jax

    prompts, max_tokens = nano_vllm_workload(args.num_seqs, args.max_input_len, args.max_output_len)
    results = {"device": str(jax.devices()[0]), "model": args.model, "args": vars(args),
               "requests": len(prompts), "output_tokens": sum(max_tokens)}
    hf = random_hf_model(args.model, "bfloat16") if args.hf_requests else None
    if args.hf_requests:  # first: JAX takes most of the GPU's memory for itself when it starts
        import torch
        from hf_peers import generate_tok_s

        n = args.hf_requests
        try:
            tok_s, seconds = generate_tok_s(hf, prompts[:n], max_tokens[:n], 0.6, args.hf_batch)
            results["hf_eager"] = {"tok_s": tok_s, "seconds": seconds, "requests": n}
        except torch.OutOfMemoryError as e:  # a peer that cannot run is reported, and nanojax still measured
            results["hf_eager"] = {"error": f"out of memory: {str(e).splitlines()[0]}", "requests": n}
        print(json.dumps(results["hf_eager"]), flush=True)
        torch.cuda.empty_cache()
    if not args.skip_parity:
        results["parity"] = check_parity(args.model, args.kernels, tensor_parallel_size=args.tensor_parallel_size)
    results["nanojax"] = run_nanojax(hf, prompts, max_tokens, args)
    print(json.dumps(results["nanojax"]), flush=True)
    Path(args.out).write_text(json.dumps(results, indent=2))

    print(f"\n{args.model} on {results['device']}: {len(prompts)} requests, {sum(max_tokens)} output tokens; "
          f"parity {results.get('parity')}")
    r = results["nanojax"]
    variant = args.kernels + (f", {args.quantization}" if args.quantization else "")
    print(f"nanojax ({variant}): {r['tok_s']:,.0f} tok/s ({r['seconds']:.1f} s; weights prepared in "
          f"{r['weights_s']:.0f} s, then LLM() start-up {r['startup_compile_s']:.0f} s; {r['num_pages']} KV pages; "
          f"recompiles during the run {r['recompiles_during_run']})")
    if "hf_eager" in results and "error" in results["hf_eager"]:
        print(f"HF transformers generate, eager: {results['hf_eager']['error']}")
    elif "hf_eager" in results:
        h = results["hf_eager"]
        print(f"HF transformers generate, eager: {h['tok_s']:,.0f} tok/s ({h['seconds']:.1f} s, first {h['requests']}"
              f" requests, batches of {args.hf_batch})")


if __name__ == "__main__":
    main()
