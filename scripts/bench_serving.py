"""Serving benchmark shaped like `vllm bench serve`: random token-id prompts sent to an OpenAI-compatible server's
/v1/completions, streamed, at a request rate and under a concurrency cap; several scenarios per launch.

Against a running server (nanojax's, or any that takes token-id prompts):
    python3 scripts/bench_serving.py --base-url http://127.0.0.1:8000 --scenario 512,128,1000,- --out serving.json
With the random-weight model built in this process and served on a free port, once per --decode-steps value (each
compiles once and runs every scenario), beside offline `LLM.generate` on the same engine, then `transformers serve`
on the same weights. The client always runs in a process of its own (as `vllm bench serve`'s does), so the served
rows' host work is the server's alone, and the offline rows run on the same LLM with no client beside it. The H100
rows of docs/benchmarks.md "Serving", from the repository root, the git-ignored .whl/ carried (fastapi, uvicorn, pydantic, openai 2.x
(httpx-based), accelerate and their dependencies missing there); about 7 minutes:
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && PYTHONPATH=/tmp/site:$PWD \\
    PYTHONUNBUFFERED=1 python3 scripts/bench_serving.py --launch qwen3-0.6b --scenario 512,128,1000,- \\
    --scenario 128,128,32,1 --scenario 512,128,512,64 --decode-steps 8 32 --peer transformers \\
    --peer-num-prompts 16 --peer-timeout 45 --out $OUT/serving.json > $OUT/serving.log 2>&1; tail -45 $OUT/serving.log
.whl/ is made on the CPU machine (7.6 MB; Python 3.12 wheels, the versions the H100 run used):
    pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d .whl \
    accelerate==1.15.0 annotated_doc==0.0.7 annotated_types==0.8.0 anyio==4.16.0 click==8.5.1 distro==1.9.0 \
    fastapi==0.165.0 jiter==0.19.0 markdown_it_py==4.3.0 mdurl==0.1.2 openai==2.54.0 opentelemetry_api==1.45.2 \
    psutil==7.2.2 pydantic==2.14.4 pydantic_core==2.50.5 pygments==2.21.0 rich==15.0.0 shellingham==1.5.4 \
    sniffio==1.3.1 starlette==1.10.0 typer==0.29.2 typing_extensions==4.16.0 typing_inspection==0.4.5 uvicorn==0.54.0 \
    httptools==0.9.0
(httptools, not in the first H100 run: uvicorn's C HTTP parser, which it takes over h11 when installed; the GPU
machine has uvloop, and aiohttp for the client.)

--scenario IN,OUT,NUM,CONCURRENCY[,RATE]: NUM prompts of IN tokens asking for OUT tokens each, at most CONCURRENCY
in flight (`-`: no cap), arriving at RATE requests/s (default inf: all at once). Without --scenario, --input-len,
--output-len, --num-prompts, --max-concurrency and --request-rate make one. The offline row beside a served one:
without a concurrency cap, `LLM.generate` of NUM requests of the same shape (output tok/s; "vs offline" is the
server's over it); with cap C, the decode step at batch C (two generates of C prompts, OUT and 1 tokens, differenced
so the prefill cancels; the fastest of five of each) in the TPOT p50 column ("vs offline" is the server's TPOT p50
over it), then an "engine" row: the same scenario through the engine's `add_request` in its own process, timed as
the client times it (the served figures without HTTP and the pipe; its "vs offline" is what the engine's own mixing
of arrivals' prefills with the decodes costs).

Arrivals: a gamma process with mean interval 1/rate and shape `burstiness` (1: Poisson; smaller: burstier); rate inf
sends everything at once. Each request asks for exactly OUT tokens (greedy; nanojax: ignore_eos; the peer's model
has no EOS token). TTFT: to the first chunk with a token; ITL: between successive chunks with tokens (several decode
steps per dispatch deliver several tokens in one chunk, and that burst is what a client sees); TPOT: (E2E - TTFT) /
(output tokens - 1) per request. Tokens per chunk come from the chunk's `token_ids` (vLLM's `return_token_ids`),
else one per chunk with text (transformers serve sends a chunk per token).

The peer (`--peer transformers`, scripts/transformers_serve_peer.py) runs after nanojax's rows, as a subprocess,
with text prompts (it takes no token ids); its scenarios are capped at --peer-num-prompts requests and
--peer-timeout seconds each (unfinished requests count as failed). nanojax then gets --mem-fraction of the GPU's
memory (XLA_PYTHON_CLIENT_MEM_FRACTION, unless set), since JAX keeps its pool until the process ends.
"""
import argparse
import asyncio
import concurrent.futures
import dataclasses
import functools
import gc
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

from transformers_serve_peer import prompt_text


@dataclasses.dataclass(frozen=True)
class Scenario:
    input_len: int
    output_len: int
    num_prompts: int
    max_concurrency: int | None = None
    request_rate: float = float("inf")

    @property
    def label(self) -> str:
        rate = "inf" if np.isinf(self.request_rate) else f"{self.request_rate:g}"
        return f"{self.input_len},{self.output_len},{self.num_prompts},{self.max_concurrency or '-'},{rate}"


def parse_scenario(text: str) -> Scenario:
    """'IN,OUT,NUM,CONCURRENCY[,RATE]' (CONCURRENCY '-': no cap; RATE default inf) -> Scenario."""
    fields = [f.strip() for f in text.split(",")]
    if len(fields) not in (4, 5):
        raise argparse.ArgumentTypeError(f"scenario {text!r}: expected IN,OUT,NUM,CONCURRENCY[,RATE]")
    try:
        input_len, output_len, num_prompts = (int(f) for f in fields[:3])
        concurrency = None if fields[3] == "-" else int(fields[3])
        rate = float(fields[4]) if len(fields) == 5 else float("inf")
    except ValueError:
        raise argparse.ArgumentTypeError(f"scenario {text!r}: IN, OUT, NUM and CONCURRENCY are integers "
                                         "(CONCURRENCY may be '-'), RATE a number or inf") from None
    if min(input_len, output_len, num_prompts) < 1 or (concurrency is not None and concurrency < 1) or not rate > 0:
        raise argparse.ArgumentTypeError(f"scenario {text!r}: IN, OUT, NUM, CONCURRENCY and RATE must be positive")
    return Scenario(input_len, output_len, num_prompts, concurrency, rate)


def random_prompts(num: int, input_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab, (num, input_len)).tolist()


def arrival_offsets(num: int, rate: float, burstiness: float, seed: int) -> np.ndarray:
    """When each request is sent, in seconds from the start."""
    if np.isinf(rate):
        return np.zeros(num)
    intervals = np.random.default_rng(seed).gamma(burstiness, 1 / (rate * burstiness), num)
    return np.cumsum(intervals) - intervals[0]


def request_body(prompt: list[int], output_len: int, model: str | None, as_text: bool) -> dict:
    """nanojax's: token ids with vLLM's extras. as_text: the prompt as text and OpenAI's fields only (transformers
    serve refuses any other field)."""
    if as_text:
        body = {"prompt": prompt_text(prompt), "max_tokens": output_len, "temperature": 0, "stream": True}
    else:
        body = {"prompt": prompt, "max_tokens": output_len, "temperature": 0, "stream": True, "ignore_eos": True,
                "return_token_ids": True, "stream_options": {"include_usage": True}}
    return {**body, "model": model} if model else body


class Clock:
    """When one request's tokens came, as its client sees them: time to the first, gaps between the next ones."""

    def __init__(self):
        self.start = self.last = time.perf_counter()
        self.ttft, self.itl = None, []

    def tokens_came(self) -> None:
        now = time.perf_counter()
        if self.ttft is None:
            self.ttft = now - self.start
        else:
            self.itl.append(now - self.last)
        self.last = now

    def result(self, output_tokens: int) -> dict:
        """-> ttft, itl (list), e2e (s), output_tokens, error."""
        return {"ttft": self.ttft, "itl": self.itl, "e2e": self.last - self.start, "output_tokens": output_tokens,
                "error": None}


async def one_request(session, url: str, body: dict) -> dict:
    """Streams one completion -> Clock.result's, or an error."""
    clock, tokens, usage = Clock(), 0, None
    try:
        async with session.post(url, json=body) as response:
            if response.status != 200:
                return {"error": f"HTTP {response.status}: {(await response.read())[:300]!r}"}
            async for raw in response.content:  # a line at a time
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:  # OpenAI's shape (nanojax) or a bare message (transformers serve)
                    error = chunk["error"]
                    return {"error": error["message"] if isinstance(error, dict) else str(error)}
                usage = chunk.get("usage") or usage
                # The peer sends text, each token one word of its tokenizer's (transformers_serve_peer), several a
                # chunk at times (transformers 5.25).
                gained = sum(len(c["token_ids"]) if "token_ids" in c else len(c.get("text", "").split())
                             for c in chunk["choices"])
                if gained:
                    clock.tokens_came()
                    tokens += gained
    except Exception as e:  # noqa: BLE001 -- a failed request is counted, the run goes on
        return {"error": repr(e)}
    if clock.ttft is None:
        return {"error": "no token came back"}
    return clock.result(usage["completion_tokens"] if usage else tokens)


async def run_requests(base_url: str, model: str | None, prompts, output_len: int, offsets, max_concurrency,
                       api_key: str | None, *, as_text: bool = False,
                       time_limit: float | None = None) -> tuple[list[dict], float]:
    """Sends every prompt at its offset -> (one result per prompt, seconds). Requests unfinished time_limit
    seconds after the start are cancelled and counted as failed. The client is aiohttp's, as `vllm bench serve`'s:
    httpx's connection pool held a request 71 ms on average before its first byte went out (concurrency 64 on the
    2-core CPU machine), longer than the server then took to start its prefill (docs/perf_notes.md, "Serving")."""
    import aiohttp

    limit = asyncio.Semaphore(max_concurrency or len(prompts))
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = base_url.rstrip("/") + "/v1/completions"

    async def send(session, prompt, offset):
        await asyncio.sleep(max(0.0, offset - (time.perf_counter() - start)))
        async with limit:
            sent = time.perf_counter() - start  # from the run's start
            return {**await one_request(session, url, request_body(prompt, output_len, model, as_text)), "sent": sent}

    async def send_in_time(session, prompt, offset):
        if time_limit is None:
            return await send(session, prompt, offset)
        try:
            return await asyncio.wait_for(send(session, prompt, offset), start + time_limit - time.perf_counter())
        except TimeoutError:
            return {"error": f"not finished within {time_limit:g} s"}

    async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=None),
                                     connector=aiohttp.TCPConnector(limit=0)) as session:  # 0: no connection cap
        start = time.perf_counter()
        results = await asyncio.gather(*(send_in_time(session, p, o) for p, o in zip(prompts, offsets)))
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


def serve_scenario(url: str, scenario: Scenario, index: int, args, *, as_text: bool = False, cap: int | None = None,
                   time_limit: float | None = None, client_processes: int = 1, after_warmup=lambda: None) -> dict:
    """The scenario's requests (at most `cap`) after --warmup-requests of its shape -> summarize's metrics. The
    client runs in processes of its own, as `vllm bench serve` does: in this one it would share the GIL with a
    launched server and its engine loop (docs/perf_notes.md, "Serving"). Without a
    concurrency cap the requests are dealt round-robin to client_processes processes, which start together.
    after_warmup() is called once the warm-up requests have finished."""
    num = min(scenario.num_prompts, cap or scenario.num_prompts)
    seed, length = args.seed + 10 * index, scenario.input_len
    client = functools.partial(run_client, url, args.model, output_len=scenario.output_len, api_key=args.api_key,
                               as_text=as_text, time_limit=time_limit)
    warmup = random_prompts(args.warmup_requests, length, args.vocab_size, seed + 1)
    prompts = random_prompts(num, scenario.input_len, args.vocab_size, seed)
    offsets = arrival_offsets(num, scenario.request_rate, args.burstiness, seed)
    procs = 1 if scenario.max_concurrency is not None else max(1, min(client_processes, num))
    # spawn, not fork: this process runs JAX's and uvicorn's threads
    with concurrent.futures.ProcessPoolExecutor(procs, mp_context=multiprocessing.get_context("spawn")) as pool:
        pool.submit(client, prompts=warmup, offsets=np.zeros(len(warmup)), max_concurrency=None).result()
        after_warmup()
        list(pool.map(time.sleep, [0.5] * procs))  # every process spawned and idle before the clock starts
        start_at = time.time() + 0.2
        shares = [pool.submit(client, prompts=prompts[i::procs], offsets=offsets[i::procs],
                              max_concurrency=scenario.max_concurrency, start_at=start_at) for i in range(procs)]
        done = [f.result() for f in shares]
    results = [r for share, _ in done for r in share]
    row = {"num_prompts": num, "client_processes": procs,
           **summarize(results, max(seconds for _, seconds in done), scenario.input_len)}
    if args.save_detailed:  # as `vllm bench serve --save-detailed`: each request's times, in the order sent
        row["requests"] = sorted(({"sent_s": r["sent"], "ttft_s": r["ttft"], "e2el_s": r["e2e"],
                                   "output_tokens": r["output_tokens"]} for r in results if r["error"] is None),
                                 key=lambda r: r["sent_s"])
    return row


def run_client(url: str, model: str | None, *, prompts, offsets, max_concurrency, start_at: float | None = None,
               **kwargs):
    """In a client process: the prompts at their offsets from start_at (time.time(); default now) ->
    run_requests'."""
    if start_at is not None:
        time.sleep(max(0.0, start_at - time.time()))
    return asyncio.run(run_requests(url, model, prompts, offsets=offsets, max_concurrency=max_concurrency, **kwargs))


# ----- offline rows (the same LLM, no server) -----
def timed_generate(llm, num: int, input_len: int, output_len: int, vocab: int, seed: int) -> tuple[float, int]:
    """-> (seconds, output tokens) of LLM.generate on `num` random prompts."""
    from nanojax import SamplingParams

    prompts = random_prompts(num, input_len, vocab, seed)
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=output_len)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, sum(len(o.token_ids) for o in outs)


def offline_row(llm, scenario: Scenario, index: int, args) -> dict:
    """No concurrency cap: LLM.generate of the scenario's requests. Cap C: the decode step at batch C. Other random
    tokens than the served ones, which sit in the prefix cache."""
    seed = args.seed + 10 * index + 5
    shape = (scenario.input_len, scenario.output_len, args.vocab_size)
    if scenario.max_concurrency is None:
        seconds, output = timed_generate(llm, scenario.num_prompts, *shape, seed)
        return {"num_prompts": scenario.num_prompts, "duration_s": seconds, "total_output_tokens": output,
                "request_throughput": scenario.num_prompts / seconds, "output_throughput": output / seconds}
    batch = scenario.max_concurrency
    timed_generate(llm, batch, scenario.input_len, 1, args.vocab_size, seed + 2)  # a first call's costs go here
    prefills, wholes = [], []
    # Five of each, the fastest of each taken: one difference of two runs varied by 20% on the H100 (docs/benchmarks.md,
    # "Serving"), and a loaded host only adds time, so the fastest runs are the least disturbed; a median of the five
    # differences came out negative once on a busy 2-core machine.
    for i in range(1, 6):
        prefills.append(timed_generate(llm, batch, scenario.input_len, 1, args.vocab_size, seed + 1000 * i)[0])
        wholes.append(timed_generate(llm, batch, *shape, seed + 1000 * i + 1)[0])
    per_step = 1e3 / max(1, scenario.output_len - 1)
    step_ms = (min(wholes) - min(prefills)) * per_step
    return {"num_prompts": batch, "decode_ms_per_step": step_ms,
            "decode_ms_per_step_runs": [(w - p) * per_step for p, w in zip(prefills, wholes)],
            "median_tpot_ms": step_ms}


def engine_row(llm, scenario: Scenario, index: int, args) -> dict:
    """Cap C: the scenario's requests through the engine's own request surface, in its process (`add_request`,
    delivered to asyncio as the server's are: one wakeup per step for every stream), at most C in flight, all at
    once, timed as the client times them: the served row without HTTP and the pipe. Its TPOT over the decode step
    is what the engine's own scheduling costs (the arrivals' prefills among the decodes). Other random tokens."""
    from nanojax import SamplingParams
    from nanojax.engine_io import RequestStream

    prompts = random_prompts(scenario.num_prompts, scenario.input_len, args.vocab_size, args.seed + 10 * index + 7)
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=scenario.output_len)

    async def one(prompt, limit) -> dict:
        async with limit:
            clock, tokens = Clock(), 0
            async for batch in llm.add_request(prompt, params, stream=RequestStream(asyncio.get_running_loop())
                                               ).batches():
                if len(batch[-1].token_ids) > tokens:  # one wakeup's events: one SSE chunk when served
                    clock.tokens_came()
                    tokens = len(batch[-1].token_ids)
            return clock.result(tokens)

    async def run() -> tuple[list[dict], float]:
        limit, start = asyncio.Semaphore(scenario.max_concurrency), time.perf_counter()
        results = await asyncio.gather(*(one(p, limit) for p in prompts))
        return results, time.perf_counter() - start

    return {"num_prompts": len(prompts), **summarize(*asyncio.run(run()), scenario.input_len)}


# ----- results -----
COLUMNS = [("server", "server", "{}"), ("steps", "decode_steps", "{}"), ("scenario", "scenario", "{}"),
           ("n", "num_prompts", "{}"), ("fail", "failed", "{}"), ("req/s", "request_throughput", "{:,.2f}"),
           ("out tok/s", "output_throughput", "{:,.0f}"), ("TTFT p50", "median_ttft_ms", "{:,.2f}"),
           ("TTFT p99", "p99_ttft_ms", "{:,.2f}"), ("TTFT mean", "mean_ttft_ms", "{:,.2f}"),
           ("at engine", "mean_engine_ttft_ms", "{:,.2f}"), ("TPOT p50", "median_tpot_ms", "{:,.3f}"),
           ("TPOT p99", "p99_tpot_ms", "{:,.3f}"), ("ITL p50", "median_itl_ms", "{:,.2f}"),
           ("ITL p99", "p99_itl_ms", "{:,.2f}"), ("E2E p50", "median_e2el_ms", "{:,.1f}"),
           ("vs offline", "vs_offline", "{:.3f}")]


class Report:
    """The rows as they come, the JSON rewritten after each (a run cut short keeps what it measured)."""

    def __init__(self, args, scenarios: list[Scenario]):
        self.path = Path(args.out) if args.out else None
        plain = {k: v for k, v in vars(args).items() if k != "scenario"}
        plain["request_rate"] = str(args.request_rate)  # inf is not JSON
        self.data = {"args": plain, "scenarios": [s.label for s in scenarios], "rows": []}

    def add(self, server: str, decode_steps: int | None, scenario: Scenario, metrics: dict) -> None:
        row = {"server": server, "decode_steps": decode_steps, "scenario": scenario.label, **metrics}
        if server == "offline":  # the served row it stands beside: same engine, same scenario
            served = self.data["rows"][-1]
            key = "output_throughput" if scenario.max_concurrency is None else "median_tpot_ms"
            if served.get(key) is not None:
                served["vs_offline"] = served[key] / row[key]
        if server == "engine":  # after the offline row of its scenario: the decode step
            row["vs_offline"] = row["median_tpot_ms"] / self.data["rows"][-1]["median_tpot_ms"]
        self.data["rows"].append(row)
        self.write()
        print(" | ".join(f"{head} {cell(row, key, fmt)}" for head, key, fmt in COLUMNS[:-1]), flush=True)

    def write(self) -> None:
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps(self.data, indent=2))

    def print_table(self) -> None:
        table = [[head for head, _, _ in COLUMNS]]
        table += [[cell(row, key, fmt) for _, key, fmt in COLUMNS] for row in self.data["rows"]]
        widths = [max(len(r[i]) for r in table) for i in range(len(COLUMNS))]
        print("\nms for TTFT / TPOT / ITL / E2E; scenario IN,OUT,NUM,CONCURRENCY,RATE; offline TPOT p50: the decode "
              "step at batch CONCURRENCY; TTFT mean at engine: the served requests' as the engine measured it (from "
              "their arrival there); engine: the scenario through add_request in the engine's process; vs "
              "offline: out tok/s over offline's (no cap), TPOT p50 over its (cap)")
        for r in table:
            print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
        for row in self.data["rows"]:
            for error in row.get("errors", []):
                print(f"  {row['server']} {row['scenario']}: {error}")
        if "peer_error" in self.data:
            print(f"peer failed: {self.data['peer_error']}")


def cell(row: dict, key: str, fmt: str) -> str:
    value = row.get(key)
    return "-" if value is None else fmt.format(value)


# ----- the launched servers -----
class EngineTTFT:
    """The mean time to first token the engine measured (from a request's arrival in the engine to its first token)
    over the requests that finished between start() and mean_ms(), from nanojax's /metrics: the client's TTFT less
    this is the requests' way through HTTP, the server and the pipe, and their first tokens' way back."""
    NAME = "nanojax_time_to_first_token_seconds"

    def __init__(self, url: str):
        self.url, self.at_start = url, (0.0, 0.0)

    def read(self) -> tuple[float, float]:
        import urllib.request

        with urllib.request.urlopen(f"{self.url}/metrics") as response:
            lines = response.read().decode().splitlines()
        value = {x.split()[0]: float(x.split()[-1]) for x in lines if x.startswith(self.NAME + "_")}
        return value.get(self.NAME + "_sum", 0.0), value.get(self.NAME + "_count", 0.0)

    def start(self) -> None:
        self.at_start = self.read()

    def mean_ms(self) -> float | None:
        (total, count), (total0, count0) = self.read(), self.at_start
        return 1e3 * (total - total0) / (count - count0) if count > count0 else None


def run_nanojax(model, decode_steps: int | None, args, scenarios: list[Scenario], report: Report) -> None:
    """One engine (compiled once) served on a free port; every scenario through it, each with its offline row.
    model: a LoadedModel, or a picklable function returning one (called where the engine runs). The engine runs in
    a process of its own, as `python -m nanojax.serve` runs it, unless --engine-in-process."""
    from nanojax import LLM
    from nanojax.engine_process import EngineProcess, freeze_startup_heap
    from nanojax.serve import BackgroundServer, ServerLimits, build_app

    start = time.perf_counter()
    # + 64: room for a multi-step decode's last dispatch, so every request reaches its output length
    max_model_len = max(s.input_len + s.output_len for s in scenarios) + 64
    knobs = dict(dtype=args.dtype, max_model_len=max_model_len, max_num_seqs=args.max_num_seqs,
                 decode_steps=decode_steps, kernels=args.kernels, warmup=True)  # no compiling in a measurement
    if args.engine_in_process:
        engine = LLM(model() if callable(model) else model, **knobs)
    else:
        engine = EngineProcess(model, **knobs)
    on_engine = (lambda fn, *a: fn(engine, *a)) if isinstance(engine, LLM) else engine.call
    args.vocab_size = min(args.vocab_size, engine.config.vocab_size)  # a small model's prompts stay in its vocabulary
    report.data["device"] = on_engine(_device_name)
    server = BackgroundServer(build_app(engine, args.launch, limits=ServerLimits(max_n=1, max_prompts=1)))
    freeze_startup_heap()  # as `python -m nanojax.serve` does in the server's process
    print(f"served {args.launch} at {server.url} after {time.perf_counter() - start:.1f} s "
          f"(decode_steps={engine.decode_steps}, engine {'in process' if args.engine_in_process else 'process'})",
          flush=True)
    try:
        for procs in args.client_processes:
            name = "nanojax" + (f" c{procs}" if len(args.client_processes) > 1 else "")
            for index, scenario in enumerate(scenarios):
                ttft = EngineTTFT(server.url)
                metrics = serve_scenario(server.url, scenario, index, args, client_processes=procs,
                                         after_warmup=ttft.start)
                report.add(name, engine.decode_steps, scenario, {**metrics, "mean_engine_ttft_ms": ttft.mean_ms()})
                if not args.no_offline:
                    report.add("offline", engine.decode_steps, scenario, on_engine(offline_row, scenario, index, args))
                    if scenario.max_concurrency is not None:
                        report.add("engine", engine.decode_steps, scenario,
                                   on_engine(engine_row, scenario, index, args))
    finally:
        server.stop()
        gc.unfreeze()  # this process goes on (a peer, a test): what it frees from now on is collected again
        if isinstance(engine, EngineProcess):
            engine.close()


def _device_name(llm) -> str:
    import jax

    return str(jax.devices()[0])


def run_peer(folder: Path, args, scenarios: list[Scenario], report: Report) -> None:
    """transformers serve on the same weights (a subprocess); every scenario, capped, with text prompts."""
    import torch
    from transformers_serve_peer import TransformersServe

    log = Path(args.out).with_suffix(".transformers.log") if args.out else folder.with_suffix(".log")
    start = time.perf_counter()
    try:
        peer = TransformersServe(folder, log, args.dtype, "cuda" if torch.cuda.is_available() else "cpu",
                                 args.peer_args)
    except RuntimeError as e:
        report.data["peer_error"] = str(e)
        report.write()
        return
    print(f"`{peer.command}` answered after {time.perf_counter() - start:.1f} s (log: {log})", flush=True)
    report.data["peer_command"] = peer.command
    try:
        for index, scenario in enumerate(scenarios):
            metrics = serve_scenario(peer.url, scenario, index, args, as_text=True, cap=args.peer_num_prompts,
                                     time_limit=args.peer_timeout)
            report.add("transformers", None, scenario, metrics)
    finally:
        peer.stop()


def run_launched(args, scenarios: list[Scenario], report: Report) -> None:
    """The random-weight model: nanojax served once per --decode-steps value, then the peer."""
    if args.peer:  # before JAX starts: the peer needs what JAX's pool would keep until the process ends
        os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", str(args.mem_fraction))
    import torch
    from random_model import loaded_model, random_hf_model, random_params
    from transformers_serve_peer import save_peer_folder

    args.dtype = args.dtype or ("bfloat16" if torch.cuda.is_available() else "float32")
    folder = None
    if args.peer or args.dtype != "bfloat16":
        # Built by torch before JAX starts (JAX takes most of the GPU's memory for itself when it does).
        hf = random_hf_model(args.launch, args.dtype)
        loaded = loaded_model(hf, args.dtype)
        folder = save_peer_folder(hf, Path(tempfile.mkdtemp(prefix="bench-serving-"))) if args.peer else None
        del hf
        torch.cuda.empty_cache()
    else:  # no peer: bf16 weights drawn on the engine's device, no HF model and no host copy (Qwen3-8B in seconds)
        loaded = functools.partial(random_params, args.launch)
    for decode_steps in args.decode_steps:
        run_nanojax(loaded, decode_steps, args, scenarios, report)
        gc.collect()  # the LLM and its KV pages go before the next one is built
    del loaded
    gc.collect()
    if folder is not None:
        try:
            run_peer(folder, args, scenarios, report)
        finally:
            shutil.rmtree(folder, ignore_errors=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="a running server (ignored with --launch)")
    p.add_argument("--launch", metavar="MODEL_CONFIG", help="build this random-weight model (scripts/configs) and "
                   "serve it in this process (the client runs in another); also runs offline generate")
    p.add_argument("--model", default=None, help="the `model` field sent (default: none, the server's own)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--scenario", action="append", type=parse_scenario, metavar="IN,OUT,NUM,CONCURRENCY[,RATE]",
                   help="run this scenario (repeat for several, run in order); without it the five flags below "
                   "make one")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (inf: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrivals (1: Poisson)")
    p.add_argument("--vocab-size", type=int, default=10000, help="prompt tokens are drawn from [0, this)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup-requests", type=int, default=2, help="sent (and not counted) before each scenario")
    # --launch only
    p.add_argument("--decode-steps", type=int, nargs="+", default=[None], help="decode steps per dispatch; several "
                   "values: the server is built and run once per value (default: the engine's)")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float32"])
    p.add_argument("--kernels", default="auto")
    p.add_argument("--no-offline", action="store_true", help="--launch without the offline rows")
    p.add_argument("--client-processes", type=int, nargs="+", default=[1], help="client processes sharing a "
                   "scenario without a concurrency cap (one Python process may not keep up with 1,000 streams); "
                   "--launch: the scenarios run once per value")
    p.add_argument("--engine-in-process", action="store_true", help="--launch: the engine loop in the server's "
                   "process (default: a process of its own, as `python -m nanojax.serve` runs it)")
    p.add_argument("--peer", choices=["transformers"], default=None, help="--launch: then serve the same weights "
                   "with `transformers serve --continuous-batching` and run the scenarios against it")
    p.add_argument("--peer-num-prompts", type=int, default=None, help="at most this many requests per scenario "
                   "for the peer")
    p.add_argument("--peer-timeout", type=float, default=None, help="seconds per peer scenario; unfinished "
                   "requests count as failed")
    p.add_argument("--peer-args", default="", help="more flags for transformers serve, e.g. '--cb-num-blocks 64'")
    p.add_argument("--mem-fraction", type=float, default=0.5, help="with --peer: JAX's share of the GPU's memory "
                   "(XLA_PYTHON_CLIENT_MEM_FRACTION, unless set)")
    p.add_argument("--out", default=None, help="write the results as JSON here (rewritten after each row)")
    p.add_argument("--save-detailed", action="store_true",
                   help="served rows also list each request: when it was sent, its TTFT, E2E latency and tokens")
    args = p.parse_args(argv)
    if args.peer and not args.launch:
        p.error("--peer needs --launch (the peer serves the launched random-weight model)")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    scenarios = args.scenario or [Scenario(args.input_len, args.output_len, args.num_prompts, args.max_concurrency,
                                           args.request_rate)]
    report = Report(args, scenarios)
    if args.launch:
        run_launched(args, scenarios, report)
    else:
        for index, scenario in enumerate(scenarios):
            report.add("server", None, scenario, serve_scenario(args.base_url, scenario, index, args,
                                                                client_processes=args.client_processes[0]))
    report.print_table()
    return report.data


if __name__ == "__main__":
    main()
