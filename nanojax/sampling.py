"""Token sampling on device, inside the compiled step: per-row parameters, reproducible per-request seeds."""
import dataclasses

import flax.struct
import jax
import jax.numpy as jnp


PAD_ID = 2**31 - 1  # out of range, so scatters drop it (a negative index would wrap around to the last token)


@flax.struct.dataclass
class SamplingBatch:
    """Per-row sampling state; [B] unless noted. Sparse per-row token lists are padded with PAD_ID.

    temperature 0 means greedy. seeds and counters give each row its own key: fold_in(key(seed), counter), so a
    seeded request draws the same numbers whatever else shares its batch.
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    seeds: jax.Array
    counters: jax.Array
    banned_ids: jax.Array  # [B, N] ids that may not be drawn (EOS/stop ids before min_tokens) ...
    ban_steps: jax.Array  # ... during the next ban_steps steps of this row
    bias_ids: jax.Array  # [B, L] logit_bias token ids ...
    bias_values: jax.Array  # [B, L] ... and the values added to their logits
    seen_ids: jax.Array  # [B, U] distinct tokens of prompt + output (repetition penalty) ...
    seen_counts: jax.Array  # [B, U] ... and how often each occurs in the output (presence/frequency)
    repetition_penalty: jax.Array
    presence_penalty: jax.Array
    frequency_penalty: jax.Array


@dataclasses.dataclass(frozen=True)
class SamplingMode:
    """Static: which parts of sampling a batch needs, so a greedy batch compiles to a bare argmax."""

    random: bool  # some row has temperature > 0
    filtered: bool  # some row uses top-k / top-p / min-p (needs a full-vocabulary sort)
    adjusted: bool  # some row uses logit_bias or penalties


def sample(logits, s: SamplingBatch, step, *, vocab_limit: int, mode: SamplingMode):
    """logits: [B, V] f32 -> tokens [B] int32, for the `step`-th step of a multi-step dispatch (0 for one step).

    Rows past `vocab_limit` (embedding padding the tokenizer never produces) are never drawn.
    """
    batch, vocab = logits.shape
    rows = jnp.arange(batch)[:, None]
    if mode.adjusted:
        logits = _adjust(logits, s, rows)
    banned = jnp.zeros((batch, vocab), bool).at[rows, s.banned_ids].set((step < s.ban_steps)[:, None], mode="drop")
    logits = jnp.where(banned | (jnp.arange(vocab) >= vocab_limit)[None, :], -jnp.inf, logits)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if not mode.random:
        return greedy
    scaled = logits / jnp.maximum(s.temperature, 1e-6)[:, None]
    keys = jax.vmap(lambda seed, c: jax.random.fold_in(jax.random.key(seed), c))(s.seeds, s.counters + step)
    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (vocab,), jnp.float32))(keys)
    drawn = _sample_filtered(scaled, gumbel, s) if mode.filtered else jnp.argmax(scaled + gumbel, axis=-1)
    return jnp.where(s.temperature > 0, drawn, greedy).astype(jnp.int32)


def _adjust(logits, s: SamplingBatch, rows):
    """logit_bias, then the repetition penalty (HF's: over prompt and output) and the presence/frequency
    penalties (OpenAI's: over the output only)."""
    logits = logits.at[rows, s.bias_ids].add(s.bias_values, mode="drop")
    seen = jnp.take_along_axis(logits, jnp.minimum(s.seen_ids, logits.shape[1] - 1), axis=1)
    rep = s.repetition_penalty[:, None]
    penalized = jnp.where(seen > 0, seen / rep, seen * rep)
    counts = s.seen_counts.astype(jnp.float32)
    penalized -= s.frequency_penalty[:, None] * counts + s.presence_penalty[:, None] * (counts > 0)
    return logits.at[rows, s.seen_ids].set(penalized, mode="drop")


def _sample_filtered(scaled, gumbel, s: SamplingBatch):
    """Top-k, then top-p over what is left, then min-p (relative to the top token), then a Gumbel-max draw.

    The noise is indexed by token id, as in the unfiltered draw, so a seeded row draws the same numbers whether or
    not a filtered row shares its batch (and its filters are off).
    """
    order = jnp.argsort(-scaled, axis=-1)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    rank = jnp.arange(scaled.shape[-1])[None, :]
    keep = (s.top_k[:, None] <= 0) | (rank < s.top_k[:, None])
    kept_probs = jnp.where(keep, probs, 0.0)
    kept_probs = kept_probs / jnp.sum(kept_probs, axis=-1, keepdims=True)
    mass_before = jnp.cumsum(kept_probs, axis=-1) - kept_probs
    keep &= mass_before < s.top_p[:, None]
    keep &= probs >= s.min_p[:, None] * probs[:, :1]
    keep = keep.at[:, 0].set(True)
    choice = jnp.argmax(jnp.where(keep, sorted_logits + jnp.take_along_axis(gumbel, order, axis=-1), -jnp.inf), -1)
    return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0]
