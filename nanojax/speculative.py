"""Speculative decoding inside the compiled decode: proposals from n-grams of a row's own tokens or from a draft
model's greedy decode, checked by one forward over the row's last token and its k proposals. A dispatch yields exactly
the plain decode's tokens (each position drawn as the plain decode draws it; a rejected position's KV is overwritten
by the next forward), in fewer forwards (docs/perf_notes.md, "Speculative decoding")."""
from functools import partial

import jax
import jax.numpy as jnp

from convert.config import ModelConfig
from nanojax.config import SpeculativeConfig
from nanojax.kv_cache import Batch
from nanojax.model import forward, lm_logits
from nanojax.sampling import Sampled, sample


def history(cache, batch: Batch, base, last):
    """-> [B, W] int32: each row's tokens by position (W: its page table's positions), the token at `base` [B] being
    `last` [B] (not in the cache yet), -1 after it."""
    tokens = cache.tokens.reshape(-1, cache.page_size)[batch.page_table].reshape(batch.page_table.shape[0], -1)
    pos, base = jnp.arange(tokens.shape[1])[None, :], base[:, None]
    return jnp.where(pos < base, tokens, jnp.where(pos == base, last[:, None], -1))


def ngram_proposals(hist, base, spec: SpeculativeConfig):
    """hist [B, W] (`history`), base [B] the last token's position -> (proposals [B, k], counts [B]): up to k tokens
    that followed an earlier occurrence of the row's longest suffix of prompt_lookup_min..max tokens, from the
    occurrence most followed (up to k), then the latest; count 0 where none."""
    width, k = hist.shape[1], spec.num_speculative_tokens
    ends = jnp.arange(width)[None, :]  # a candidate occurrence's last position
    run = ends < base[:, None]  # it must be followed by a known token
    matched = jnp.zeros(hist.shape, jnp.int32)
    for i in range(spec.prompt_lookup_max):  # extend each candidate's match by one token backwards
        shifted = jnp.pad(hist, ((0, 0), (i, 0)), constant_values=-1)[:, :width]  # [b, e] = hist[b, e - i]
        target = jnp.take_along_axis(hist, jnp.maximum(base - i, 0)[:, None], axis=1)
        run &= (shifted == target) & (base - i >= 0)[:, None] & (ends - i >= 0)
        matched += run
    # longest, then the most followers up to k (in a repeating run the latest occurrence has one), then latest
    followers = jnp.minimum(base[:, None] - ends, k)
    score = jnp.where(matched >= spec.prompt_lookup_min, (matched * (k + 1) + followers) * width + ends, -1)
    end = jnp.argmax(score, axis=1)
    counts = jnp.where(jnp.max(score, axis=1) >= 0, jnp.minimum(k, base - end), 0)
    offsets = jnp.minimum(end[:, None] + 1 + jnp.arange(k)[None, :], width - 1)
    return jnp.maximum(jnp.take_along_axis(hist, offsets, axis=1), 0), counts


# Tokens a draft forward feeds a row that is behind (a prompt, or what plain dispatches decoded); steady state is 1-2.
CATCH_UP = 64


def draft_proposals(params, cache, batch: Batch, hist, base, last, left, k: int, *, draft: ModelConfig, ops):
    """The draft model's k greedy tokens after `last` -> (proposals [B, k], counts [B], cache): the draft is fed each
    row's tokens from its first stale slot to `last` (at base), then its own k - 1 (only into slots before
    base + left)."""
    b, width = hist.shape
    pos = jnp.arange(width)[None, :]
    stale = (pos < base[:, None]) & (history(cache.draft, batch, base, last) != hist)
    start = jnp.where(left > 0, jnp.min(jnp.where(stale, pos, base[:, None]), axis=1), base + 1)

    def next_tokens(ids, step, draft_cache, at):
        hidden, draft_cache = forward(params["draft"], ids, draft_cache, step, config=draft, ops=ops.unsharded)
        hidden = jnp.take_along_axis(hidden, at[:, None, None], axis=1)[:, 0]
        return jnp.argmax(lm_logits(params["draft"], hidden, ops.unsharded), axis=-1).astype(jnp.int32), draft_cache

    def feed(tokens_per_row, start, first, draft_cache):
        q = jnp.clip(base + 1 - start, 0, tokens_per_row)
        at = jnp.minimum(start[:, None] + jnp.arange(tokens_per_row)[None, :], width - 1)
        step = batch.replace(seq_lens=jnp.where(q > 0, start + q, 0), q_lens=q)
        token, draft_cache = next_tokens(jnp.maximum(jnp.take_along_axis(hist, at, axis=1), 0), step,
                                         draft_cache, jnp.maximum(q - 1, 0))
        return start + q, jnp.where((q > 0) & (start + q == base + 1), token, first), draft_cache

    def catch_up(state):
        return jax.lax.cond(jnp.max(base + 1 - state[0]) <= 2, partial(feed, 2), partial(feed, CATCH_UP), *state)

    state = (start, jnp.zeros(b, jnp.int32), cache.draft)
    # The steady state (1-2 tokens) outside the loop: the host reads one predicate, not three (docs/perf_notes.md).
    _, first, draft_cache = jax.lax.while_loop(lambda state: jnp.any(state[0] <= base), catch_up, feed(2, *state))

    def propose(i, state):
        proposals, draft_cache = state
        q = (i < left).astype(jnp.int32)
        step = batch.replace(seq_lens=jnp.where(q > 0, base + i + 1, 0), q_lens=q)
        ids = jax.lax.dynamic_slice_in_dim(proposals, i - 1, 1, axis=1)
        token, draft_cache = next_tokens(ids, step, draft_cache, jnp.zeros(b, jnp.int32))
        return proposals.at[:, i].set(token), draft_cache

    proposals = jnp.zeros((b, k), jnp.int32).at[:, 0].set(first)
    proposals, draft_cache = jax.lax.fori_loop(1, k, propose, (proposals, draft_cache))
    return proposals, jnp.where(left > 0, k, 0), cache.replace(draft=draft_cache)


def speculative_decode(params, cache, tables, tokens, batch: Batch, sampling, row_steps, out: Sampled, *, config,
                       ops, spec: SpeculativeConfig, draft: ModelConfig | None = None):
    """The plain decode's contract (nanojax.runner.decode_step: tokens [B] after chaining, batch the first step's,
    out [num_steps, B, ...] zeros) in as few forwards as the proposals allow -> (out, cache, tables, stats [3] int32:
    forwards, row-forwards with proposals, tokens those gave)."""
    b, num_steps, k = tokens.shape[0], out.tokens.shape[0], spec.num_speculative_tokens
    steps = jnp.where(batch.q_lens > 0, row_steps, 0)

    def body(carry):
        last, done, cache, tables, out, stats = carry
        base = jnp.maximum(batch.seq_lens - 1, 0) + done  # the last token's position
        left = steps - done
        hist = history(cache, batch, base, last)
        if draft is None:
            proposals, counts = ngram_proposals(hist, base, spec)
        else:
            proposals, counts, cache = draft_proposals(params, cache, batch, hist, base, last, left, k, draft=draft,
                                                       ops=ops)

        def verify(width, cache, tables, out):
            q = jnp.minimum(jnp.minimum(counts, width - 1) + 1, left)
            ids = jnp.concatenate([last[:, None], proposals[:, :width - 1]], axis=1)
            step = batch.replace(seq_lens=jnp.where(q > 0, base + q, 0), q_lens=q)
            hidden, cache = forward(params, ids, cache, step, config=config, ops=ops)
            logits = lm_logits(params, hidden.reshape(b * width, -1), ops).reshape(b, width, -1)
            return cache, *accept(logits, proposals, q, done, tables, out)

        if draft is None:  # n-gram rows may find nothing: a one-token forward then
            cache, new_last, produced, tables, out = jax.lax.cond(
                jnp.any(counts > 0), partial(verify, k + 1), partial(verify, 1), cache, tables, out)
        else:  # a draft always proposes
            cache, new_last, produced, tables, out = verify(k + 1, cache, tables, out)
        with_proposals = (counts > 0) & (left > 1)
        stats += jnp.stack([1, jnp.sum(with_proposals), jnp.sum(jnp.where(with_proposals, produced, 0))])
        return jnp.where(produced > 0, new_last, last), done + produced, cache, tables, out, stats

    def accept(logits, proposals, q, done, tables, out):
        """Draws position by position while the proposals hold -> (last token, tokens drawn, tables, out)."""
        last, produced, alive = jnp.zeros(b, jnp.int32), jnp.zeros(b, jnp.int32), q > 0
        for i in range(logits.shape[1]):
            valid = alive & (i < q)
            new = sample(logits[:, i], sampling, tables, done + i, ops=ops)
            at = jnp.where(valid, done + i, num_steps)  # past the end: dropped
            out = jax.tree.map(lambda o, n: o.at[at, jnp.arange(b)].set(n, mode="drop"), out, new)
            tables = tables.count(jnp.where(valid, sampling.slots, tables.neutral), new.tokens)
            last = jnp.where(valid, new.tokens, last)
            produced += valid
            if i < proposals.shape[1]:
                alive = valid & (new.tokens == proposals[:, i])
        return last, produced, tables, out

    carry = (tokens, jnp.zeros(b, jnp.int32), cache, tables, out, jnp.zeros(3, jnp.int32))
    # each forward gives every row with slots left at least one token
    _, _, cache, tables, out, stats = jax.lax.while_loop(lambda carry: jnp.any(carry[1] < steps), body, carry)
    return out, cache, tables, stats
