"""Structured outputs on the GPU: decode speed with none, half or all rows constrained by a JSON schema, and the time
to first token of a request with a new schema, a cached one, and none; before them, the first constrained request's
(a new schema) after `LLM.prepare_structured_outputs`, as a server's first.

    PYTHONPATH=$PWD python3 scripts/bench_structured.py --model qwen3-8b --tokenizer DIR --out $OUT/structured.json

Random bf16 weights (scripts/configs) with the tokenizer in DIR (a tokenizer.json of the model's vocabulary, e.g.
Qwen3's saved by `scripts/bench_grammar.py`'s load_qwen3). Each request decodes --max-tokens tokens (ignore_eos;
a constrained one ends earlier where its grammar completes); a row's decode speed is its tokens after the first over
the time between its first and last events (`LLM.stream`), averaged per kind of row. Greedy: a constrained row keeps
the tokens drawn after its masked one only where the grammar allows them (random weights: rarely), so beside
unconstrained rows it gains about one token per dispatch, and alone it runs the one-step program.
"""
import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

from nanojax import SamplingParams  # noqa: E402

# ~30 fields: strings, numbers, enums, arrays, nested objects (the time-to-first-token case).
FIELDS = {**{f"name_{i}": {"type": "string", "maxLength": 16} for i in range(8)},
          **{f"count_{i}": {"type": "integer", "minimum": 0, "maximum": 1000} for i in range(8)},
          **{f"ratio_{i}": {"type": "number"} for i in range(4)},
          **{f"kind_{i}": {"enum": ["a", "b", "c"]} for i in range(4)},
          **{f"tags_{i}": {"type": "array", "items": {"type": "string"}, "maxItems": 3} for i in range(3)},
          **{f"where_{i}": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                            "required": ["city"]} for i in range(3)}}


def schema(tag: str = "") -> dict:
    """The 30-field schema; a different tag makes a schema the engine has not compiled."""
    return {"type": "object", "properties": {f"{k}{tag}": v for k, v in FIELDS.items()},
            "required": [f"{k}{tag}" for k in list(FIELDS)[:10]], "additionalProperties": False}


def row_speeds(llm, prompts, params) -> list[float]:
    """Each request's decode tok/s (tokens after its first over the time from its first to its last event)."""
    first, last, tokens = {}, {}, {}
    for out in llm.stream(prompts, params):
        now = time.perf_counter()
        if out.token_ids:
            first.setdefault(out.index, now)
        last[out.index], tokens[out.index] = now, len(out.token_ids)
    return [(tokens[i] - 1) / max(last[i] - first[i], 1e-9) for i in range(len(prompts))]


def ttft(llm, prompt, params) -> float:
    start = time.perf_counter()
    for _ in llm.stream([prompt], params):
        return time.perf_counter() - start


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1, help="each batch's none / half / all rows, in turn, this often")
    ap.add_argument("--one-step-masks", action="store_true", help="EngineConfig.hosted_masks=False")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from random_model import random_llm, saved_tokenizer

    tokenizer = saved_tokenizer(args.tokenizer)
    llm = random_llm(args.model, tokenizer, max_num_seqs=max(args.batches), max_model_len=1024,
                     hosted_masks=not args.one_step_masks)
    rng = np.random.default_rng(0)
    free = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    bound = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True,
                           structured_outputs={"json": schema()})
    prompt = np.random.default_rng(1).integers(0, len(tokenizer) - 1000, 32).tolist()  # (rng: the batches' prompts)
    one = dict(temperature=0, max_tokens=1)
    ttft(llm, prompt, SamplingParams(**one))
    start = time.perf_counter()
    llm.prepare_structured_outputs()  # as the server does when it starts
    first = {"prepare_structured_outputs_ms": 1e3 * (time.perf_counter() - start),
             "first_constrained_ttft_ms": 1e3 * ttft(llm, prompt, SamplingParams(**one, structured_outputs={
                 "json": schema("_first")}))}
    print(json.dumps(first), flush=True)
    rows = []
    for batch in args.batches:
        prompts = rng.integers(0, len(tokenizer) - 1000, (batch, 32)).tolist()
        for constrained in sorted({0, batch // 2, batch}):  # warm: a program's first run in a process costs more
            row_speeds(llm, prompts, [bound] * constrained + [free] * (batch - constrained))
        for repeat, (kind, constrained) in itertools.product(range(args.repeats),
                                                             (("none", 0), ("half", batch // 2), ("all", batch))):
            if batch == 1 and kind == "half":
                continue
            speeds = row_speeds(llm, prompts, [bound] * constrained + [free] * (batch - constrained))
            row = {"batch": batch, "constrained": kind, "repeat": repeat,
                   "free_tok_s": np.mean(speeds[constrained:] or [np.nan]),
                   "constrained_tok_s": np.mean(speeds[:constrained] or [np.nan])}
            rows.append(row)
            print(json.dumps(row), flush=True)
    times = {"none": [], "cached schema": [], "new schema": []}
    for i in range(5):
        times["none"].append(ttft(llm, prompt, SamplingParams(**one)))
        times["cached schema"].append(ttft(llm, prompt, SamplingParams(**one, structured_outputs={"json": schema()})))
        times["new schema"].append(ttft(llm, prompt, SamplingParams(**one,
                                                                    structured_outputs={"json": schema(f"_{i}")})))
    ttft_ms = {k: 1e3 * float(np.median(v)) for k, v in times.items()}
    print(json.dumps({"ttft_ms": ttft_ms}), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"model": args.model, "decode": rows, "ttft_ms": ttft_ms, **first},
                                             indent=1))


if __name__ == "__main__":
    main()
