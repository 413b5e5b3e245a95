"""How many of a constrained row's tokens its grammar forces (llguidance's fast-forward tokens), the bound on what
jump-forward decoding (forced tokens run as one chunk) could save a model that does not keep to its grammar: the
30-field schema of `bench_structured.py`, each free token drawn uniformly from the allowed ones (as random weights do).

    PYTHONPATH=$PWD python3 scripts/probe_forced_tokens.py --tokenizer DIR   # DIR: a tokenizer.json, e.g. Qwen3's
"""
import argparse
import sys
from pathlib import Path

import llguidance
import llguidance.numpy
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

from bench_structured import schema
from random_model import saved_tokenizer

from nanojax.structured import StructuredOutputs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    hf = saved_tokenizer(args.tokenizer)
    tokenizer = llguidance.LLTokenizer(hf.backend_tokenizer.to_str(), eos_token=hf.eos_token_id)
    grammar, rng = StructuredOutputs.of({"json": schema()}).grammar_text, np.random.default_rng(0)
    mask = llguidance.numpy.allocate_token_bitmask(1, tokenizer.vocab_size)
    for run in range(args.runs):
        matcher, drawn, forced = llguidance.LLMatcher(tokenizer, grammar), 0, 0
        while not matcher.is_stopped() and drawn + forced < args.max_tokens:
            if ff := matcher.compute_ff_tokens():
                matcher.consume_tokens(ff)
                forced += len(ff)
            llguidance.numpy.fill_next_token_bitmask(matcher, mask, 0)
            allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[:tokenizer.vocab_size])
            matcher.consume_token(int(rng.choice(allowed)))
            drawn += 1
        print(f"run {run}: {drawn} drawn, {forced} forced: {(drawn + forced) / drawn:.2f} tokens a dispatch")


if __name__ == "__main__":
    main()
