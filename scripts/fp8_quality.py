"""FP8 weight quality on real weights: the embedded SmolLM2-135M-Instruct on CPU, bf16 against
- "f32": the same weights in float32 with float32 activations, the noise floor (how far rounding alone moves bf16);
- "fp8": convert.quantize.quantize_params, the projections and the LM head in FP8;
- "fp8_bf16_head": the projections only (what LLM(quantization="fp8") serves).
Activations, KV cache, embeddings and norms are bf16 in the bf16 and FP8 models.

    python scripts/fp8_quality.py --out fp8_quality.json

Each prompt of PROMPTS (chat template) is continued greedily for --tokens tokens by each model on its own (EOS
ignored, so every prompt gives the same count). Reported over all prompts, for each model against bf16:
- agreement_teacher_forced: both models read the prompt followed by the bf16 continuation; the share of the
  positions predicting the continuation where their argmaxes agree (the standard top-1 agreement, measured on the
  same positions as the mean KL below);
- agreement_free_running: the share of the tokens where the model's own continuation equals the bf16 one, position
  by position; after a first difference the two continuations are different texts, so one near-tie flipped early
  costs every later token of that prompt (f32 against bf16 shows how low that goes without any quantization);
- agreement_free_running_before_first_difference: the share of the tokens before each prompt's first difference;
- KL(bf16 || model) of the next-token distributions on the teacher-forced positions: the mean over the positions
  that predict the continuation, over all positions, and the largest;
- the answer to the first prompt, "What is the capital of France?", up to its EOS.
The quality check ("greedy agreement of the first 32 tokens of 50 prompts") is read as agreement_teacher_forced: it is
a property of the two models' next-token choices, where the free-running share mostly counts where the first
near-tie falls (docs/benchmarks.md, "FP8 weights").

The models run as nanojax.model.forward on a paged KV cache with the jnp reference ops (the engine's CPU path),
rows in chunks of CHUNK under jit.
"""
import argparse
import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from convert.quantize import quantize_params
from nanojax.kv_cache import Batch, KVCache
from nanojax.loader import load_model
from nanojax.model import forward, lm_logits
from nanojax.ops import Ops

PROMPTS = [
    "What is the capital of France?",
    "What is the capital of Japan?",
    "Who wrote Romeo and Juliet?",
    "How many legs does a spider have?",
    "What is the boiling point of water in Celsius?",
    "Name three primary colors.",
    "What is 12 times 7?",
    "Explain photosynthesis in one sentence.",
    "What is the largest planet in our solar system?",
    "Translate 'good morning' into Spanish.",
    "Write a haiku about the ocean.",
    "Give me a synonym for 'happy'.",
    "What does DNA stand for?",
    "Why is the sky blue?",
    "What is the speed of light?",
    "Write a Python function that returns the square of a number.",
    "What is the difference between weather and climate?",
    "List the days of the week.",
    "Who painted the Mona Lisa?",
    "What is the chemical symbol for gold?",
    "How do I make a cup of tea?",
    "Summarize the plot of Cinderella in two sentences.",
    "What is machine learning?",
    "Tell me a fun fact about octopuses.",
    "What year did World War II end?",
    "Suggest a name for a pet goldfish.",
    "What is the square root of 144?",
    "How many continents are there?",
    "Write a short poem about autumn leaves.",
    "What is the tallest mountain in the world?",
    "Explain what a noun is.",
    "Give two tips for better sleep.",
    "What is the freezing point of water in Fahrenheit?",
    "Who was the first person to walk on the Moon?",
    "What language is spoken in Brazil?",
    "Describe a cat in three words.",
    "What is the main ingredient of guacamole?",
    "How does a rainbow form?",
    "What is a prime number? Give an example.",
    "Write a sentence using the word 'serendipity'.",
    "What are the three states of matter?",
    "Recommend a book for a ten-year-old.",
    "What is the capital of Australia?",
    "How many minutes are in a day?",
    "What is gravity?",
    "Write a limerick about a frog.",
    "What do bees make?",
    "Explain the water cycle briefly.",
    "What is the opposite of 'ancient'?",
    "Why do we need to drink water?",
    "What is the longest river in Africa?",
    "Give me a recipe idea for breakfast.",
    "What is an atom made of?",
    "Write a thank-you note to a teacher.",
    "What is the plural of 'mouse'?",
    "How many sides does a hexagon have?",
]
CHUNK = 8  # rows per compiled call
PAGE = 16


@functools.partial(jax.jit, static_argnames=("config",))
def _step(params, cache, tokens, batch, *, config):
    """tokens [B, T] -> (float32 logits [B, T, V], cache), the reference ops."""
    hidden, cache = forward(params, tokens, cache, batch, config=config, ops=Ops())
    return lm_logits(params, hidden), cache


def _pad(rows: list[list[int]], width: int) -> tuple[np.ndarray, np.ndarray]:
    """-> (tokens [CHUNK, width] int32, lens [CHUNK] int32); rows past len(rows) are padding (length 0)."""
    tokens, lens = np.zeros((CHUNK, width), np.int32), np.zeros(CHUNK, np.int32)
    for i, r in enumerate(rows):
        tokens[i, :len(r)], lens[i] = r, len(r)
    return tokens, lens


def _cache(config, width: int, dtype):
    """A KV cache with width tokens of pages for each of CHUNK rows, and its page table [CHUNK, pages]."""
    pages = -(-width // PAGE)
    return KVCache.create(config, CHUNK * pages, PAGE, dtype), np.arange(CHUNK * pages, dtype=np.int32).reshape(
        CHUNK, pages)


def greedy(params, config, prompts: list[list[int]], num_tokens: int, width: int) -> np.ndarray:
    """Greedy continuations [len(prompts), num_tokens]: a prefill of each chunk's prompts, then decode steps."""
    out = []
    for start in range(0, len(prompts), CHUNK):
        tokens, lens = _pad(prompts[start:start + CHUNK], width)
        cache, table = _cache(config, width + num_tokens, params["embed"].dtype)
        logits, cache = _step(params, cache, tokens, Batch(table, lens, lens), config=config)
        nxt = np.asarray(logits[np.arange(CHUNK), np.maximum(lens - 1, 0)].argmax(-1), np.int32)
        chunk = [nxt]
        for i in range(1, num_tokens):
            batch = Batch(table, np.where(lens > 0, lens + i, 0), (lens > 0).astype(np.int32))
            logits, cache = _step(params, cache, nxt[:, None], batch, config=config)
            nxt = np.asarray(logits[:, 0].argmax(-1), np.int32)
            chunk.append(nxt)
        out.append(np.stack(chunk, axis=1)[:len(prompts[start:start + CHUNK])])
    return np.concatenate(out)


@jax.jit
def _kl(logits_p, logits_q):
    """KL(p || q) per position [B, T] and whether the argmaxes agree, from float32 logits [B, T, V]."""
    log_p, log_q = jax.nn.log_softmax(logits_p, axis=-1), jax.nn.log_softmax(logits_q, axis=-1)
    kl = jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)
    return kl, logits_p.argmax(-1) == logits_q.argmax(-1)


def teacher_forced(params_p, params_q, config, seqs: list[list[int]], width: int):
    """Both models read each sequence whole -> per sequence (KL [len - 1], argmax agreement [len - 1]) at the
    positions that predict the sequence's next token."""
    out = []
    for start in range(0, len(seqs), CHUNK):
        tokens, lens = _pad(seqs[start:start + CHUNK], width)
        logits = []
        for params in (params_p, params_q):
            cache, table = _cache(config, width, params["embed"].dtype)
            logits.append(_step(params, cache, tokens, Batch(table, lens, lens), config=config)[0])
        kl, agree = (np.asarray(a) for a in _kl(*logits))
        out += [(kl[i, :n - 1], agree[i, :n - 1]) for i, n in enumerate(lens[:len(seqs[start:start + CHUNK])])]
    return out


def common_prefix(a, b) -> int:
    diff = np.flatnonzero(np.asarray(a) != np.asarray(b))
    return int(diff[0]) if diff.size else len(a)


def compare(prompts, gen_bf16, gen_q, forced, num_tokens):
    """-> (per-prompt rows, summary) of one quantized model against bf16."""
    rows = []
    for text, p, a, b, (kl, agree) in zip(PROMPTS, prompts, gen_bf16, gen_q, forced):
        new = slice(len(p) - 1, None)  # the positions that predict the continuation
        rows.append({"prompt": text, "same_tokens": int((a == b).sum()), "common_prefix": common_prefix(a, b),
                     "kl_continuation": float(kl[new].mean()), "kl_all": float(kl.mean()),
                     "top1_continuation": float(agree[new].mean())})
    n_tok = len(PROMPTS) * num_tokens
    all_kl = np.concatenate([kl for kl, _ in forced])
    summary = {
        "agreement_teacher_forced": float(np.mean(np.concatenate(
            [agree[len(p) - 1:] for p, (_, agree) in zip(prompts, forced)]))),
        "agreement_free_running": sum(r["same_tokens"] for r in rows) / n_tok,
        "agreement_free_running_before_first_difference": sum(r["common_prefix"] for r in rows) / n_tok,
        "prompts_identical": sum(r["common_prefix"] == num_tokens for r in rows),
        "mean_kl_continuation": float(np.mean([kl[len(p) - 1:] for p, (kl, _) in zip(prompts, forced)])),
        "mean_kl_all_positions": float(all_kl.mean()),
        "max_kl": float(all_kl.max()),
    }
    return rows, summary


def answer(tok, config, ids) -> str:
    """The text of greedy token ids up to the first EOS."""
    ids = ids.tolist()
    ends = [i for i, t in enumerate(ids) if t in config.eos_token_ids]
    return tok.decode(ids[:ends[0]] if ends else ids)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()

    t0 = time.perf_counter()
    loaded = load_model(None, "bfloat16").resolved()
    config, tok, bf16 = loaded.config, loaded.tokenizer, loaded.params
    models = {"bf16": bf16, "f32": load_model(None, "float32").params, "fp8": quantize_params(bf16, config),
              "fp8_bf16_head": quantize_params(bf16, config, lm_head=False)}
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True,
                                       return_dict=False) for p in PROMPTS]
    width = -(-max(map(len, prompts)) // PAGE) * PAGE
    gen = {name: greedy(params, config, prompts, args.tokens, width) for name, params in models.items()}
    seqs = [p + g.tolist() for p, g in zip(prompts, gen["bf16"])]
    results = {}
    for name in list(models)[1:]:
        forced = teacher_forced(bf16, models[name], config, seqs, width + args.tokens)
        results[name] = compare(prompts, gen["bf16"], gen[name], forced, args.tokens)
    answers = {name: answer(tok, config, g[0]) for name, g in gen.items()}

    print(f"{'':38s}" + "".join(f"{name:>26s}" for name in results))
    print(f"{'prompt':38s}" + f"{'same prefix  KL cont':>26s}" * len(results))
    for i, text in enumerate(PROMPTS):
        cells = [results[name][0][i] for name in results]
        print(f"{text[:38]:38s}" + "".join(f"{r['same_tokens']:10d} {r['common_prefix']:6d} {r['kl_continuation']:8.4f}"
                                           for r in cells))
    print(f"\n{len(PROMPTS)} prompts, {args.tokens} greedy tokens each, against bf16")
    print(f"{'':48s}" + "".join(f"{name:>14s}" for name in results))
    for key in results["fp8"][1]:
        print(f"{key:48s}" + "".join(f"{results[name][1][key]:>14.4f}" for name in results))
    for name, text in answers.items():
        print(f"capital of France, {name:14s} {text!r}")
    seconds = round(time.perf_counter() - t0, 1)
    print(f"{seconds} s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": "SmolLM2-135M-Instruct (embedded default)", "reference": "bfloat16",
                       "backend": jax.default_backend(), "prompts": len(PROMPTS), "tokens_per_prompt": args.tokens,
                       "capital_of_france": answers, "seconds": seconds,
                       "summary": {name: r[1] for name, r in results.items()},
                       "per_prompt": {name: r[0] for name, r in results.items()}}, f, indent=2)


if __name__ == "__main__":
    main()
