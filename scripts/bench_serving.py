"""Serving benchmark shaped like `vllm bench serve`: random token-id prompts sent to an OpenAI-compatible server's
/v1/completions, streamed, at a request rate and under a concurrency cap.

Against a running server (nanojax's, or any that takes token-id prompts):
    python3 scripts/bench_serving.py --base-url http://127.0.0.1:8000 --input-len 512 --output-len 128 \\
        --num-prompts 1000 --request-rate inf --out serving.json
With the random-weight model built in this process, served on a free port, and offline `LLM.generate` of requests of
the same shape on the same engine (the "vs offline" row):
    PYTHONPATH=$PWD python3 scripts/bench_serving.py --launch qwen3-0.6b --decode-steps 8 --max-concurrency 64 ...

Arrivals: a gamma process with mean interval 1/rate and shape `burstiness` (1: Poisson; smaller: burstier); rate inf
sends everything at once. Each request asks for exactly --output-len tokens (ignore_eos, greedy). TTFT: to the first
chunk with a token; ITL: between successive chunks with tokens (several decode steps per dispatch deliver several
tokens in one chunk, and that burst is what a client sees); TPOT: (E2E - TTFT) / (output tokens - 1) per request.
Tokens per chunk come from the chunk's `token_ids` (vLLM's `return_token_ids`), else one per chunk with text.
"""
import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))


def random_prompts(num: int, input_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab, (num, input_len)).tolist()


def arrival_offsets(num: int, rate: float, burstiness: float, seed: int) -> np.ndarray:
    """When each request is sent, in seconds from the start."""
    if np.isinf(rate):
        return np.zeros(num)
    intervals = np.random.default_rng(seed).gamma(burstiness, 1 / (rate * burstiness), num)
    return np.cumsum(intervals) - intervals[0]


async def one_request(client, url: str, body: dict) -> dict:
    """Streams one completion -> ttft, itl (list), e2e (s), output_tokens, error."""
    start = time.perf_counter()
    last, ttft, itl, tokens, usage = start, None, [], 0, None
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                return {"error": f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"}
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return {"error": chunk["error"]["message"]}
                usage = chunk.get("usage") or usage
                gained = sum(len(c["token_ids"]) if "token_ids" in c else bool(c.get("text"))
                             for c in chunk["choices"])
                if gained:
                    now = time.perf_counter()
                    if ttft is None:
                        ttft = now - start
                    else:
                        itl.append(now - last)
                    last, tokens = now, tokens + gained
    except Exception as e:  # noqa: BLE001 -- a failed request is counted, the run goes on
        return {"error": repr(e)}
    tokens = usage["completion_tokens"] if usage else tokens
    return {"ttft": ttft, "itl": itl, "e2e": last - start, "output_tokens": tokens, "error": None}


async def run_requests(base_url: str, model: str | None, prompts, output_len: int, offsets, max_concurrency,
                       api_key: str | None) -> tuple[list[dict], float]:
    import httpx

    limit = asyncio.Semaphore(max_concurrency or len(prompts))
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = base_url.rstrip("/") + "/v1/completions"

    async def send(client, prompt, offset):
        await asyncio.sleep(max(0.0, offset - (time.perf_counter() - start)))
        async with limit:
            body = {"prompt": prompt, "max_tokens": output_len, "temperature": 0, "stream": True,
                    "ignore_eos": True, "return_token_ids": True, "stream_options": {"include_usage": True}}
            return await one_request(client, url, {**body, "model": model} if model else body)

    connections = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=connections, headers=headers) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(send(client, p, o) for p, o in zip(prompts, offsets)))
        return results, time.perf_counter() - start


def summarize(results: list[dict], seconds: float, input_len: int) -> dict:
    ok = [r for r in results if r["error"] is None]

    def stats(name, values):
        ms = np.asarray(values, np.float64) * 1e3
        if not len(ms):
            return {f"{k}_{name}_ms": None for k in ("mean", "median", "p99")}
        return {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
                f"p99_{name}_ms": float(np.percentile(ms, 99))}

    output = sum(r["output_tokens"] for r in ok)
    tpot = [(r["e2e"] - r["ttft"]) / (r["output_tokens"] - 1) for r in ok if r["output_tokens"] > 1]
    return {"completed": len(ok), "failed": len(results) - len(ok),
            "errors": sorted({r["error"] for r in results if r["error"]})[:5], "duration_s": seconds,
            "total_input_tokens": len(ok) * input_len, "total_output_tokens": output,
            "request_throughput": len(ok) / seconds, "output_throughput": output / seconds,
            "total_token_throughput": (output + len(ok) * input_len) / seconds,
            **stats("ttft", [r["ttft"] for r in ok]), **stats("tpot", tpot),
            **stats("itl", [x for r in ok for x in r["itl"]]), **stats("e2el", [r["e2e"] for r in ok])}


def print_table(title: str, m: dict) -> None:
    print(f"{'=' * 18} {title} {'=' * max(0, 40 - len(title))}")
    rows = [("Successful requests", m["completed"]), ("Failed requests", m["failed"]),
            ("Benchmark duration (s)", m["duration_s"]), ("Total input tokens", m["total_input_tokens"]),
            ("Total generated tokens", m["total_output_tokens"]),
            ("Request throughput (req/s)", m["request_throughput"]),
            ("Output token throughput (tok/s)", m["output_throughput"]),
            ("Total token throughput (tok/s)", m["total_token_throughput"])]
    for name in ("ttft", "tpot", "itl", "e2el"):
        rows += [(f"{k.capitalize()} {name.upper()} (ms)", m.get(f"{k}_{name}_ms")) for k in ("mean", "median", "p99")]
    for label, value in rows:
        shown = f"{value:,.2f}" if isinstance(value, float) else str(value)
        print(f"{label:<36}{shown:>20}")
    for error in m["errors"]:
        print(f"  error: {error}")


def launch(args):
    """The random-weight model served in this process -> (llm, server)."""
    import torch
    from random_model import loaded_model, random_hf_model

    from nanojax import LLM
    from nanojax.serve import BackgroundServer, ServerLimits, build_app

    # Built by torch before JAX starts (JAX takes most of the GPU's memory for itself when it does).
    dtype = args.dtype or ("bfloat16" if torch.cuda.is_available() else "float32")
    hf = random_hf_model(args.launch, dtype)
    loaded = loaded_model(hf, dtype)
    del hf
    torch.cuda.empty_cache()
    # + 64: room for a multi-step decode's last dispatch, so every request reaches --output-len
    llm = LLM(loaded, dtype=dtype, max_model_len=args.input_len + args.output_len + 64,
              max_num_seqs=args.max_num_seqs, decode_steps=args.decode_steps, kernels=args.kernels)
    return llm, BackgroundServer(build_app(llm, args.launch, limits=ServerLimits(max_n=1, max_prompts=1)))


def offline_row(llm, args) -> dict:
    """LLM.generate on requests of the same shape (other random tokens: the served ones sit in the prefix cache)."""
    from nanojax import SamplingParams

    prompts = random_prompts(args.num_prompts, args.input_len, args.vocab_size, args.seed + 1)
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=args.output_len)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    output = sum(len(o.token_ids) for o in outs)
    return {"requests": len(outs), "duration_s": seconds, "total_output_tokens": output,
            "request_throughput": len(outs) / seconds, "output_throughput": output / seconds,
            "total_token_throughput": (output + len(outs) * args.input_len) / seconds}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="a running server (ignored with --launch)")
    p.add_argument("--launch", metavar="MODEL_CONFIG", help="build this random-weight model (scripts/configs) and "
                   "serve it in this process; also runs offline generate")
    p.add_argument("--model", default=None, help="the `model` field sent (default: none, the server's own)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (inf: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrivals (1: Poisson)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--vocab-size", type=int, default=10000, help="prompt tokens are drawn from [0, this)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup-requests", type=int, default=2, help="sent (and not counted) before the run")
    # --launch only
    p.add_argument("--decode-steps", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float32"])
    p.add_argument("--kernels", default="auto")
    p.add_argument("--no-offline", action="store_true", help="--launch without the offline generate row")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    llm = server = None
    base_url = args.base_url
    if args.launch:
        t0 = time.perf_counter()
        llm, server = launch(args)
        base_url = server.url
        print(f"served {args.launch} at {base_url} after {time.perf_counter() - t0:.1f} s "
              f"(decode_steps={llm.decode_steps})", flush=True)
    prompts = random_prompts(args.num_prompts, args.input_len, args.vocab_size, args.seed)
    warmup = random_prompts(args.warmup_requests, args.input_len, args.vocab_size, args.seed + 2)
    asyncio.run(run_requests(base_url, args.model, warmup, args.output_len, np.zeros(len(warmup)), None,
                             args.api_key))
    offsets = arrival_offsets(len(prompts), args.request_rate, args.burstiness, args.seed)
    results, seconds = asyncio.run(run_requests(base_url, args.model, prompts, args.output_len, offsets,
                                                args.max_concurrency, args.api_key))
    report = {"args": vars(args), "server": summarize(results, seconds, args.input_len)}
    if llm is not None:
        import jax

        report["device"] = str(jax.devices()[0])
        report["decode_steps"] = llm.decode_steps
        if not args.no_offline:
            report["offline"] = offline_row(llm, args)
            report["server_vs_offline_output_throughput"] = (report["server"]["output_throughput"]
                                                            / report["offline"]["output_throughput"])
        server.stop()
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    rate = "inf" if np.isinf(args.request_rate) else f"{args.request_rate:g}/s"
    print_table(f"serving: {args.num_prompts} x {args.input_len} in / {args.output_len} out, rate {rate}, "
                f"concurrency {args.max_concurrency or 'unlimited'}", report["server"])
    if "offline" in report:
        o = report["offline"]
        print(f"offline LLM.generate, same engine and shapes: {o['output_throughput']:,.1f} output tok/s "
              f"({o['duration_s']:.2f} s); server / offline = {report['server_vs_offline_output_throughput']:.3f}")
    return report


if __name__ == "__main__":
    main()
