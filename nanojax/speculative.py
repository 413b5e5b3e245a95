"""Speculative decoding inside the compiled decode: n-gram proposals from a row's own tokens, checked by one forward
of the model over the row's last token and its k proposals.

A dispatch still yields exactly row_steps[b] tokens per row, as the plain decode does, in fewer forwards: the
scheduler, the pages and the chaining of dispatches are unchanged, and no KV is rolled back (a rejected position is
overwritten by the next forward; attention never reads past seq_lens).

Position i of a forward draws its token exactly as the plain decode draws the row's j-th token (the same adjustments,
tables and noise), and position i + 1 counts only if that token equals proposal i: rejection sampling of a proposal of
probability 1, its draws coupled to the plain decode's, so rows get the tokens they get with speculation off.
"""
import jax
import jax.numpy as jnp

from nanojax.config import SpeculativeConfig
from nanojax.kv_cache import Batch
from nanojax.model import forward, lm_logits
from nanojax.sampling import Sampled, sample


def history(cache, batch: Batch, base, last):
    """-> [B, W] int32: each row's tokens by position (W: its page table's positions), the token at `base` [B] being
    `last` [B] (not in the cache yet), -1 after it."""
    b, pages = batch.page_table.shape
    page_size = cache.page_size
    tokens = cache.tokens.reshape(-1, page_size)[batch.page_table].reshape(b, pages * page_size)
    pos = jnp.arange(pages * page_size)[None, :]
    tokens = jnp.where(pos == base[:, None], last[:, None], tokens)
    return jnp.where(pos <= base[:, None], tokens, -1)


def ngram_proposals(hist, base, spec: SpeculativeConfig):
    """hist: [B, W] (`history`), base: [B] the position of each row's last token -> (proposals [B, k], counts [B]):
    the tokens that followed an earlier occurrence of the longest suffix of n tokens (prompt_lookup_min <= n
    <= prompt_lookup_max) that occurs before, up to k of them, from the occurrence most followed (up to k), then the
    latest; count 0 where none does."""
    b, width = hist.shape
    ends = jnp.arange(width)[None, :]  # a candidate occurrence's last position
    run = ends < base[:, None]  # it must be followed by a known token
    matched = jnp.zeros((b, width), jnp.int32)
    for i in range(spec.prompt_lookup_max):  # extend each candidate's match by one token backwards
        shifted = jnp.pad(hist, ((0, 0), (i, 0)), constant_values=-1)[:, :width]  # [b, e] = hist[b, e - i]
        target = jnp.take_along_axis(hist, jnp.maximum(base - i, 0)[:, None], axis=1)
        run &= (shifted == target) & (base - i >= 0)[:, None] & (ends - i >= 0)
        matched += run
    # longest, then the most followers up to k (in a repeating run the latest occurrence has one), then latest
    followers = jnp.minimum(base[:, None] - ends, spec.num_speculative_tokens)
    score = jnp.where(matched >= spec.prompt_lookup_min, (matched * (spec.num_speculative_tokens + 1) + followers)
                      * width + ends, -1)
    end = jnp.argmax(score, axis=1)
    found = jnp.max(score, axis=1) >= 0
    counts = jnp.where(found, jnp.minimum(spec.num_speculative_tokens, base - end), 0)
    offsets = end[:, None] + 1 + jnp.arange(spec.num_speculative_tokens)[None, :]
    proposals = jnp.take_along_axis(hist, jnp.minimum(offsets, width - 1), axis=1)
    return jnp.maximum(proposals, 0), counts


def speculative_decode(params, cache, tables, tokens, batch: Batch, sampling, row_steps, out: Sampled, *, config,
                       ops, spec: SpeculativeConfig):
    """The plain decode's contract (nanojax.runner.decode_step: tokens [B] after chaining, batch the first step's,
    out [num_steps, B, ...] zeros) in as few forwards as the proposals allow -> (out, cache, tables, stats [3] int32:
    forwards, row-forwards with proposals, tokens those gave)."""
    b, num_steps = tokens.shape[0], out.tokens.shape[0]
    rows = jnp.arange(b)

    def body(carry):
        last, done, cache, tables, out, stats = carry
        base = jnp.maximum(batch.seq_lens - 1, 0) + done  # the last token's position
        left = jnp.where(batch.q_lens > 0, row_steps - done, 0)
        proposals, counts = ngram_proposals(history(cache, batch, base, last), base, spec)

        def verify(width):
            def run(cache, tables, out):
                q = jnp.minimum(jnp.minimum(counts, width - 1) + 1, left)
                ids = jnp.concatenate([last[:, None], proposals[:, :width - 1]], axis=1)
                step = batch.replace(seq_lens=jnp.where(q > 0, base + q, 0), q_lens=q)
                hidden, cache = forward(params, ids, cache, step, config=config, ops=ops)
                logits = lm_logits(params, hidden.reshape(b * width, -1), ops).reshape(b, width, -1)
                return cache, *accept(logits, proposals, q, done, tables, out)
            return run

        cache, new_last, produced, tables, out = jax.lax.cond(
            jnp.any(counts > 0), verify(spec.num_speculative_tokens + 1), verify(1), cache, tables, out)
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
            out = jax.tree.map(lambda o, n: o.at[at, rows].set(n, mode="drop"), out, new)
            tables = tables.count(jnp.where(valid, sampling.slots, tables.neutral), new.tokens)
            last = jnp.where(valid, new.tokens, last)
            produced += valid
            if i < proposals.shape[1]:
                alive = valid & (new.tokens == proposals[:, i])
        return last, produced, tables, out

    def more(carry):  # each forward gives every row with slots left at least one token
        return jnp.any(carry[1] < jnp.where(batch.q_lens > 0, row_steps, 0))

    carry = (tokens, jnp.zeros(b, jnp.int32), cache, tables, out, jnp.zeros(3, jnp.int32))
    _, _, cache, tables, out, stats = jax.lax.while_loop(more, body, carry)
    return out, cache, tables, stats
