"""Speculative decoding: n-gram acceptance on real weights, and speed with speculation off beside it.

    python scripts/bench_speculative.py acceptance            # the default SmolLM2 model, CPU is fine
    PYTHONPATH=$PWD python3 scripts/bench_speculative.py speed --model qwen3-8b --out $OUT/spec.json   # GPU
    PYTHONPATH=$PWD python3 scripts/bench_speculative.py draft --model qwen3-8b --draft qwen3-0.6b --k 2 4 8  # GPU

acceptance: greedy answers to three kinds of prompt (quoting a given document, editing given code, open chat), with
speculation off and on: the tokens must be equal; prints the mean tokens a verifying forward gives a row (1 + the
proposals accepted) and the share of row-forwards that had proposals.
speed: a bf16 model of random weights built on the device (scripts/configs) with each layer's output projections
(o_proj, down_proj) zeroed: its next token depends on the last token only (a bigram model), while a forward reads and
computes what the full model's does. LLMs over the same weights (speculation off, and on at each --k), decode tok/s
(the time of max_tokens tokens less that of one) at each batch for: prompts that contain their own continuation (P of
--prompt-len random tokens, its greedy continuation G, P again and G's first half: the model continues with G's second
half, which the lookup finds, so every proposal is accepted: the mechanism's ceiling), random prompts sampled at
temperature 1 (nothing is found: the overhead), and at batch 64. The peer, on the same weights and prompts at batch 1:
HF transformers' `generate` (eager, bf16), plain and with its prompt lookup (`prompt_lookup_num_tokens=k`) at each k.
draft: the cost of a draft model's speculative forward (`draft_speed`), HF's assisted generation beside it.
"""
import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

from nanojax import LLM, SamplingParams  # noqa: E402

DOCUMENT = """The Transformer follows an encoder-decoder structure using stacked self-attention and point-wise, fully
connected layers for both the encoder and decoder. The encoder is composed of a stack of N = 6 identical layers. Each
layer has two sub-layers. The first is a multi-head self-attention mechanism, and the second is a simple, position-wise
fully connected feed-forward network. We employ a residual connection around each of the two sub-layers, followed by
layer normalization. The decoder is also composed of a stack of N = 6 identical layers. In addition to the two
sub-layers in each encoder layer, the decoder inserts a third sub-layer, which performs multi-head attention over the
output of the encoder stack."""

CODE = '''def merge_intervals(intervals):
    intervals = sorted(intervals, key=lambda pair: pair[0])
    merged = []
    for start, end in intervals:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def total_length(intervals):
    return sum(end - start for start, end in merge_intervals(intervals))
'''

PROMPTS = {
    "quote a document": f"{DOCUMENT}\n\nQuote the text above word for word, then summarize it in one sentence.",
    "edit code": f"{CODE}\nRewrite this Python code with type hints and a docstring for each function.",
    "open chat": "What are three good habits for staying healthy? Explain each one.",
}
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4}


def acceptance(args) -> list[dict]:
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    rows = []
    with LLM(max_num_seqs=1) as plain, LLM(max_num_seqs=1, speculative_config=SPEC) as spec:
        for kind, text in PROMPTS.items():
            prompt = plain.apply_chat_template([{"role": "user", "content": text}])
            want = plain.generate([prompt], greedy, use_tqdm=False)[0]
            before = spec.speculation_stats()
            got = spec.generate([prompt], greedy, use_tqdm=False)[0]
            stats = spec.speculation_stats() - before
            rows.append({"prompt": kind, "tokens": len(got.token_ids), "same_tokens": got.token_ids == want.token_ids,
                         "tokens_per_verify": stats[2] / max(stats[1], 1),
                         "forwards": int(stats[0]), "verifying_forwards": int(stats[1])})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def decode_tok_s(llm, prompts, params) -> float:
    """Decode tokens per second: the time of params.max_tokens tokens less that of one, per token after the first."""
    first = SamplingParams(**{**params_dict(params), "max_tokens": 1})
    llm.generate(prompts, params, use_tqdm=False)  # compiled and warm
    t0 = time.perf_counter()
    llm.generate(prompts, first, use_tqdm=False)
    t1 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    t2 = time.perf_counter()
    return (sum(len(o.token_ids) for o in outs) - len(prompts)) / ((t2 - t1) - (t1 - t0))


def params_dict(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in ("temperature", "max_tokens", "ignore_eos", "seed")}


def bigram_model(name: str):
    """(the HF model, nanojax's LoadedModel of the same weights on the device), output projections zeroed."""
    import jax
    import torch
    from random_model import loaded_model, random_hf_model

    hf = random_hf_model(name, torch_dtype="bfloat16")
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    loaded = loaded_model(hf)
    return hf, dataclasses.replace(loaded, params=jax.device_put(loaded.params))


def hf_tok_s(hf, prompt: list[int], max_tokens: int, **generate_kw) -> float:
    """HF generate's greedy decode tok/s at batch 1, the time of max_tokens tokens less that of one."""
    import torch

    ids = torch.tensor([prompt], device=hf.device)
    sync = torch.cuda.synchronize if hf.device.type == "cuda" else lambda: None

    def run(n):
        sync()
        t0 = time.perf_counter()
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, pad_token_id=0, **generate_kw)
        sync()
        return time.perf_counter() - t0, out.shape[1] - len(prompt)

    run(max_tokens)  # warm
    one, _ = run(1)
    total, made = run(max_tokens)
    return (made - 1) / (total - one)


def speed(args) -> list[dict]:
    hf, loaded = bigram_model(args.model)
    vocab = loaded.config.vocab_size
    kw = dict(dtype="bfloat16", max_model_len=4 * args.prompt_len + 6 * args.max_tokens, num_pages=args.num_pages,
              max_num_seqs=64)
    plain = LLM(loaded, **kw)
    specs = {k: LLM(loaded, **kw, speculative_config={**SPEC, "num_speculative_tokens": k}) for k in args.k}
    rng = np.random.default_rng(0)
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True, seed=1)
    rows = []
    for batch in args.batches:
        random_prompts = rng.integers(0, vocab, (batch, args.prompt_len)).tolist()
        outs = plain.generate(random_prompts, SamplingParams(temperature=0, max_tokens=2 * args.max_tokens,
                                                             ignore_eos=True), use_tqdm=False)
        half = args.max_tokens
        own = [p + o.token_ids + p + o.token_ids[:half] for p, o in zip(random_prompts, outs)]
        for kind, prompts, params in (("contains its continuation", own, greedy),
                                      ("random, sampled", random_prompts, sampled)):
            row = {"batch": batch, "prompts": kind, "context": len(prompts[0]) + args.max_tokens,
                   "off_tok_s": decode_tok_s(plain, prompts, params)}
            for k, llm in specs.items():
                before = llm.speculation_stats()
                row[f"k{k}_tok_s"] = decode_tok_s(llm, prompts, params)
                stats = llm.speculation_stats() - before
                row[f"k{k}_speedup"] = row[f"k{k}_tok_s"] / row["off_tok_s"]
                row[f"k{k}_tokens_per_verify"] = stats[2] / max(stats[1], 1)
                row[f"k{k}_verifying_share"] = stats[1] / max(stats[0] * batch, 1)
            if batch == 1 and kind != "random, sampled":
                row["hf_tok_s"] = hf_tok_s(hf, prompts[0], args.max_tokens)
                for k in args.k:
                    row[f"hf_lookup_k{k}_tok_s"] = hf_tok_s(hf, prompts[0], args.max_tokens, prompt_lookup_num_tokens=k)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def draft_speed(args) -> list[dict]:
    """A random --draft model (saved as an HF folder) proposing for the bigram --model: its proposals are wrong, so
    on / off is the cost of a speculative forward (k draft steps and the verification) against a plain step."""
    from random_model import random_hf_model

    hf, loaded = bigram_model(args.model)
    draft_hf = random_hf_model(args.draft, torch_dtype="bfloat16")
    folder = Path(tempfile.mkdtemp()) / args.draft
    draft_hf.save_pretrained(folder)
    kw = dict(dtype="bfloat16", max_model_len=2 * args.prompt_len + 2 * args.max_tokens, num_pages=args.num_pages,
              max_num_seqs=64)
    plain = LLM(loaded, **kw)
    specs = {k: LLM(loaded, **kw, speculative_config={"method": "draft_model", "model": str(folder),
                                                      "num_speculative_tokens": k}) for k in args.k}
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    rng = np.random.default_rng(0)
    rows = []
    for batch in args.batches:
        prompts = rng.integers(0, loaded.config.vocab_size, (batch, args.prompt_len)).tolist()
        row = {"batch": batch, "context": args.prompt_len + args.max_tokens,
               "off_tok_s": decode_tok_s(plain, prompts, greedy)}
        for k, llm in specs.items():
            before = llm.speculation_stats()
            row[f"k{k}_tok_s"] = decode_tok_s(llm, prompts, greedy)
            stats = llm.speculation_stats() - before
            per_forward = stats[2] / max(stats[1], 1)
            row[f"k{k}_tokens_per_verify"] = per_forward
            row[f"k{k}_step_cost"] = per_forward * row["off_tok_s"] / row[f"k{k}_tok_s"]
        if batch == 1:
            row["hf_tok_s"] = hf_tok_s(hf, prompts[0], args.max_tokens)
            for k in args.k[:1]:  # eager and slow: the first k only
                row[f"hf_assisted_k{k}_tok_s"] = hf_tok_s(hf, prompts[0], args.max_tokens, assistant_model=draft_hf,
                                                          num_assistant_tokens=k,
                                                          num_assistant_tokens_schedule="constant")
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["acceptance", "speed", "draft"])
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--draft", default="qwen3-0.6b")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--k", type=int, nargs="+", default=[4])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--num-pages", type=int, default=4096)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = {"acceptance": acceptance, "speed": speed, "draft": draft_speed}[args.mode](args)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
