"""A JSON-constrained request alone, on the default model (real weights): unconstrained, every step masked (one step a
dispatch, or on a GPU the hosted decode), the engine's policy (masked steps until the model has kept to its grammar for
RUN_AHEAD_AFTER draws, then the multi-step dispatch), and the multi-step dispatch always (its first draw masked, the
later ones kept while the grammar allows them): tok/s, the tokens each dispatch kept, and whether the constrained texts
agree.

    PYTHONPATH=$PWD python3 scripts/probe_run_ahead.py [--model PATH_OR_GGUF]
"""
import argparse
import collections
import time

from nanojax import LLM, SamplingParams
from nanojax import output as output_module

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "email", "city", "skills"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "email": {"type": "string"}, "city": {"type": "string"},
                         "skills": {"type": "array", "items": {"type": "string"}, "maxItems": 4}}}
PEOPLE = ("software engineer from Paris", "retired teacher", "young chef in Tokyo")
KEPT = collections.Counter()


def counting(accept):
    def wrapper(self, seq, pending, row, num_steps):
        kept = accept(self, seq, pending, row, num_steps)
        KEPT[len(kept)] += 1
        return kept
    return wrapper


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="a checkpoint, HF folder or GGUF (default: the embedded model)")
    ap.add_argument("--max-tokens", type=int, default=160)
    args = ap.parse_args()
    output_module.OutputProcessor.accept = counting(output_module.OutputProcessor.accept)
    llm = LLM(args.model) if args.model else LLM()
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": f"Describe a {who} as JSON with name, "
                                                   "age, email, city and skills."}], add_generation_prompt=True,
                                                 tokenize=False) for who in PEOPLE]
    bound = SamplingParams(temperature=0, max_tokens=args.max_tokens, structured_outputs={"json": SCHEMA})
    free = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    cases = (("unconstrained", free, None), ("masks every step", bound, 10**9),
             ("the engine's policy", bound, output_module.RUN_AHEAD_AFTER), ("run ahead always", bound, 0))
    texts = {}
    for rep in range(2):  # the first round compiles
        for label, params, after in cases:
            output_module.RUN_AHEAD_AFTER = output_module.RUN_AHEAD_AFTER if after is None else after
            KEPT.clear()
            start, outs = time.perf_counter(), [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
            tokens = sum(len(o.token_ids) for o in outs)
            if after is not None:
                texts[label] = [o.text for o in outs]
            print(f"{rep} {label:<20} {tokens / (time.perf_counter() - start):6.1f} tok/s, {tokens} tokens, "
                  f"dispatches by tokens kept: {dict(sorted(KEPT.items()))}")
    print("same texts:", len(set(map(tuple, texts.values()))) == 1)


if __name__ == "__main__":
    main()
