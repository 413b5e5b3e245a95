"""A JSON-constrained request alone, on the default model (real weights): one masked step a dispatch (the engine's
way) against the multi-step dispatch a constrained row takes beside unconstrained ones (its first draw masked, the
later ones kept while the grammar allows them): tok/s, the tokens each dispatch kept, and whether the texts agree.

    PYTHONPATH=$PWD python3 scripts/probe_run_ahead.py [--model PATH_OR_GGUF]
"""
import argparse
import collections
import dataclasses
import time

from nanojax import LLM, SamplingParams
from nanojax import engine as engine_module
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


def run_ahead(self, chunks):
    """EngineCore._constrain as if unconstrained rows shared the step: the row keeps its multi-step dispatch."""
    constrained = [c for c in chunks if c.sample and c.seq.request.matcher is not None]
    if not constrained:
        return chunks, None, False
    masks = [c.seq.request.slot for c in constrained], self.output.grammars.masks(
        [c.seq.request.matcher for c in constrained])
    return [dataclasses.replace(c, num_steps=1) if c in constrained and not c.seq.request.speculative_constraint
            else c for c in chunks], masks, False


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="a checkpoint, HF folder or GGUF (default: the embedded model)")
    ap.add_argument("--max-tokens", type=int, default=160)
    args = ap.parse_args()
    output_module.OutputProcessor.accept = counting(output_module.OutputProcessor.accept)
    one_step = engine_module.EngineCore._constrain
    llm = LLM(args.model) if args.model else LLM()
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": f"Describe a {who} as JSON with name, "
                                                   "age, email, city and skills."}], add_generation_prompt=True,
                                                 tokenize=False) for who in PEOPLE]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, structured_outputs={"json": SCHEMA})
    texts = {}
    for rep in range(2):  # the first round compiles
        for label, constrain in (("one step a dispatch", one_step), ("run ahead", run_ahead)):
            engine_module.EngineCore._constrain = constrain
            KEPT.clear()
            start, outs = time.perf_counter(), [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
            tokens = sum(len(o.token_ids) for o in outs)
            texts[label] = [o.text for o in outs]
            print(f"{rep} {label:<20} {tokens / (time.perf_counter() - start):6.1f} tok/s, {tokens} tokens, "
                  f"dispatches by tokens kept: {dict(sorted(KEPT.items()))}")
    print("same texts:", len(set(map(tuple, texts.values()))) == 1)


if __name__ == "__main__":
    main()
