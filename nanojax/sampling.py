"""Token sampling on device, inside the compiled step: per-row parameters, reproducible per-request seeds."""
import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class SamplingBatch:
    """Per-row sampling state, [B] each (banned_ids: [B, N], -1 padded).

    temperature 0 means greedy. seeds and counters give each row its own key: fold_in(key(seed), counter), so a
    seeded request draws the same numbers whatever else shares its batch.
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    seeds: jax.Array
    counters: jax.Array
    banned_ids: jax.Array  # ids that may not be drawn (EOS/stop ids before min_tokens) ...
    ban_steps: jax.Array  # ... during the next ban_steps steps of this row


def sample(logits, s: SamplingBatch, step, *, vocab_limit: int, filtered: bool):
    """logits: [B, V] f32 -> tokens [B] int32, for the `step`-th step of a multi-step dispatch (0 for one step).

    Rows past `vocab_limit` (embedding padding the tokenizer never produces) are never drawn. `filtered` is static:
    False skips the full-vocabulary sort when no row uses top-k/top-p/min-p.
    """
    vocab = logits.shape[-1]
    ids = jnp.arange(vocab)
    banned_now = jnp.any(ids[None, None, :] == s.banned_ids[:, :, None], axis=1) & (step < s.ban_steps)[:, None]
    banned = (ids[None, :] >= vocab_limit) | banned_now
    logits = jnp.where(banned, -jnp.inf, logits)
    greedy = jnp.argmax(logits, axis=-1)
    scaled = logits / jnp.maximum(s.temperature, 1e-6)[:, None]
    keys = jax.vmap(lambda seed, c: jax.random.fold_in(jax.random.key(seed), c))(s.seeds, s.counters + step)
    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (vocab,), jnp.float32))(keys)
    if filtered:
        drawn = _sample_filtered(scaled, gumbel, s)
    else:
        drawn = jnp.argmax(scaled + gumbel, axis=-1)
    return jnp.where(s.temperature > 0, drawn, greedy).astype(jnp.int32)


def _sample_filtered(scaled, gumbel, s: SamplingBatch):
    """Top-k, then top-p over what is left, then min-p (relative to the top token), then a Gumbel-max draw.

    The noise is i.i.d., so it is added in sorted order without being permuted along.
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
    choice = jnp.argmax(jnp.where(keep, sorted_logits + gumbel, -jnp.inf), -1)
    return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0]
