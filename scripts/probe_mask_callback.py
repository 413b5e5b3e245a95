"""A constrained row alone with its grammar's masks fetched by a host callback between the steps of one multi-step
dispatch, against the one-step masked dispatch a token and against the same multi-step dispatch unconstrained.

    PYTHONPATH=$PWD python3 scripts/probe_mask_callback.py --tokenizer DIR

Qwen3-0.6B with random weights, greedy, the 30-field schema of bench_structured.py; ms a token (medians of --runs
after the first) and the callback's own host time a call (a trivial callback returns a constant mask: the
mechanism's cost alone). XLA bakes a callback into its program: such a program cannot be serialized.
"""
import argparse
import functools
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import llguidance.numpy
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_structured import schema  # noqa: E402
from random_model import random_llm, saved_tokenizer  # noqa: E402

from nanojax import runner as R  # noqa: E402
from nanojax.kv_cache import Batch  # noqa: E402
from nanojax.model import forward, lm_logits  # noqa: E402
from nanojax.sampling import sample  # noqa: E402
from nanojax.structured import StructuredOutputs  # noqa: E402


class Feed:
    """The host side: step i > 0 consumes the previous step's token, then the row's next mask (trivial: a constant
    mask, no grammar: the callback's own cost)."""

    def __init__(self, grammars, constraint, width: int, trivial: bool = False):
        self.grammars, self.constraint, self.trivial, self.matcher = grammars, constraint, trivial, None
        self.mask, self.seconds, self.calls = np.full((1, width), -1, np.int32), 0.0, 0

    def reset(self):
        self.matcher = self.grammars.matcher(self.constraint)
        self.words = llguidance.numpy.allocate_token_bitmask(1, self.grammars._ll_tokenizer.vocab_size)
        self.seconds, self.calls, self.consumed = 0.0, 0, []

    def __call__(self, tokens, step):
        start = time.perf_counter()
        if not self.trivial:
            if int(np.asarray(step)) > 0:  # (numpy: indexing the callback's jax.Arrays dispatches an op)
                token = int(np.asarray(tokens)[0])
                self.matcher.consume_token(token)
                self.consumed.append(token)
            llguidance.numpy.fill_next_token_bitmask(self.matcher, self.words, 0)
            self.mask[:, :self.words.shape[1]] = self.words
        self.seconds += time.perf_counter() - start
        self.calls += 1
        return self.mask


@functools.partial(jax.jit, static_argnames=("config", "ops", "num_steps", "feed", "unroll"), donate_argnums=(1, 2))
def callback_decode(params, cache, tables, tokens, batch, sampling, *, config, ops, num_steps, feed, unroll):
    shape = (num_steps, tokens.shape[0])
    out = jnp.zeros(shape, jnp.int32)
    width = tables.allowed.shape[1]

    def body(i, carry):
        tokens, cache, tables, seq_lens, out = carry
        if feed is not None:
            masks = jax.pure_callback(feed, jax.ShapeDtypeStruct((tokens.shape[0], width), jnp.int32), tokens, i)
            tables = tables.replace(allowed=tables.allowed.at[sampling.slots].set(masks, mode="drop"))
        hidden, cache = forward(params, tokens[:, None], cache, batch.replace(seq_lens=seq_lens), config=config,
                                ops=ops)
        new = sample(lm_logits(params, hidden[:, 0], ops), sampling, tables, i, ops=ops)
        return new.tokens, cache, tables, seq_lens + 1, out.at[i].set(new.tokens)

    carry = (tokens, cache, tables, batch.seq_lens, out)
    if unroll:  # straight-line steps: XLA's graphs between the callbacks
        for i in range(num_steps):
            carry = body(i, carry)
        _, cache, tables, _, out = carry
    else:
        _, cache, tables, _, out = jax.lax.fori_loop(0, num_steps, body, carry)
    return out, cache, tables


_COMPILED = {}


def run_callback(r, feed, steps, total, options, unroll=False):
    """ms a token for `total` tokens in dispatches of `steps`, and the compile seconds."""
    table = R._stacked([list(range(16))], 1, r.pages_per_seq)
    sampling = R.sampling_batch({**R.greedy_sampling(1, r.tables.neutral), "slots": [0], "mask_steps": [steps]}, 1,
                                r.tables.neutral)
    batch = Batch(table, np.array([40], np.int32), np.array([1], np.int32), None)
    key = (steps, feed, tuple(options.items()), unroll)
    if key not in _COMPILED:
        start = time.perf_counter()
        _COMPILED[key] = callback_decode.lower(r.params, r.cache, r.tables, np.array([5], np.int32), batch, sampling,
                                               config=r.config, ops=r.ops, num_steps=steps, feed=feed,
                                               unroll=unroll).compile(
            compiler_options=options), time.perf_counter() - start
    program, compile_s = _COMPILED[key]
    if feed is not None:
        feed.reset()
    token, seq_len, begin = np.array([5], np.int32), 40, time.perf_counter()
    for _ in range(total // steps):
        batch = batch.replace(seq_lens=np.array([seq_len], np.int32))
        sampling = sampling.replace(counters=np.array([seq_len], np.int32))
        out, r.cache, r.tables = program(r.params, r.cache, r.tables, token, batch, sampling)
        out = np.asarray(out)
        token, seq_len = out[-1], seq_len + steps
        if feed is not None and not feed.trivial:
            feed.matcher.consume_token(int(out[-1, 0]))  # the last step's token (the next dispatch's step 0 skips it)
    host = feed.seconds * 1e3 / max(feed.calls, 1) if feed is not None else 0.0
    return (time.perf_counter() - begin) * 1e3 / total, compile_s, host


def replayed_ms(feed) -> float:
    """The feed's last run again on this thread, without the device: ms a token of its masks and consumes (against
    the callback's: the same text, the callback's thread apart)."""
    matcher, words = feed.grammars.matcher(feed.constraint), np.copy(feed.words)
    start = time.perf_counter()
    for token in feed.consumed:
        llguidance.numpy.fill_next_token_bitmask(matcher, words, 0)
        matcher.consume_token(token)
    return (time.perf_counter() - start) * 1e3 / max(len(feed.consumed), 1)


def run_one_step(r, grammars, constraint, total):
    """The engine's path today: the masked one-step program a token, its token read and the mask made between."""
    matcher = grammars.matcher(constraint)
    token, seq_len, begin = 5, 40, time.perf_counter()
    for _ in range(total):
        masks = ([0], grammars.masks([matcher]))
        sampling = {**R.greedy_sampling(1, r.tables.neutral), "slots": [0], "mask_steps": [1], "counters": [seq_len]}
        token = int(r.decode([token], [list(range(16))], [seq_len], sampling, 1, masks=masks).tokens()[0, 0])
        matcher.consume_token(token)
        seq_len += 1
    return (time.perf_counter() - begin) * 1e3 / total, 0.0, 0.0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    llm = random_llm(args.model, saved_tokenizer(args.tokenizer), max_num_seqs=8, max_model_len=1024)
    r, grammars = llm.runner, llm.core.output.grammars
    constraint = StructuredOutputs(json=schema())
    width = r.tables.allowed.shape[1]
    feed, trivial = Feed(grammars, constraint, width), Feed(grammars, constraint, width, trivial=True)
    cases = {"one-step masked dispatch a token (engine today)": lambda: run_one_step(r, grammars, constraint,
                                                                                       args.tokens)}
    for steps, unroll in ((8, False), (32, False), (4, True), (8, True)):
        how = f"{steps} steps{', unrolled' if unroll else ''}"
        for label, f in (("unconstrained", None), ("callback masks", feed), ("trivial callback", trivial)):
            cases[f"{how}, {label}"] = functools.partial(run_callback, r, f, steps, args.tokens, {}, unroll)
    rows = []
    for label, case in cases.items():
        results = [case() for _ in range(args.runs)]
        rows.append((label, *np.median(np.array(results[1:]), axis=0), results[0][1]))
    print(f"{'case':<44} {'ms/token':>9} {'callback ms':>12} {'compile s':>10}")
    for label, ms, _, host, compile_s in rows:
        print(f"{label:<44} {ms:9.3f} {host:12.3f} {compile_s:10.2f}")
    print(f"the last callback run's masks and consumes again, on the main thread: {replayed_ms(feed):.3f} ms a token")


if __name__ == "__main__":
    main()
