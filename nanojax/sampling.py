"""Token sampling on device, inside the compiled step: every row carries its own parameters as data, so any mix of
greedy, random, filtered, biased and penalized rows shares one program, with no branch read on the host
(docs/perf_notes.md, "Sampling")."""
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from nanojax.sampling_params import MAX_LOGPROBS
from pallas_kernels.sampling_filters import kept

PROMPT, BANNED = 1, 2  # TokenTables.flags bits: the token is in the prompt; it may not be drawn before min_tokens


@flax.struct.dataclass
class SamplingBatch:
    """Per-row sampling parameters, each [B], as in SamplingParams. seeds and counters (+1 per sampled token) key the
    noise; slots: the `TokenTables` row; ban_steps / mask_steps: the steps BANNED tokens / the `allowed` mask hold."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    seeds: jax.Array
    counters: jax.Array
    slots: jax.Array
    ban_steps: jax.Array
    mask_steps: jax.Array
    repetition_penalty: jax.Array
    presence_penalty: jax.Array
    frequency_penalty: jax.Array
    logprobs: jax.Array


@flax.struct.dataclass
class TokenTables:
    """Per-request token state on the device, [S + 1, V]: one row per slot and the neutral row, which rows using none
    of it read (it stays in L2). counts: output occurrences; flags: PROMPT | BANNED; bias: logit_bias, -inf past the
    vocabulary limit (as data: a first start compiles before reading the tokenizer); allowed [S + 1, ceil(V / 32)]:
    the tokens a constraint allows next, as bits (all set in the neutral row)."""

    counts: jax.Array
    flags: jax.Array
    bias: jax.Array
    allowed: jax.Array

    @classmethod
    def create(cls, num_slots: int, vocab: int, vocab_limit: int) -> "TokenTables":
        shape = (num_slots + 1, vocab)
        row = limited_bias(np.zeros(vocab, np.float32), vocab_limit)
        # Broadcast on the device, not built whole on the host and copied (docs/perf_notes.md, "Sampling").
        return cls(jnp.zeros(shape, jnp.int32), jnp.zeros(shape, jnp.int8), jnp.broadcast_to(jnp.asarray(row), shape),
                   jnp.full((num_slots + 1, -(-vocab // 32)), -1, jnp.int32))

    @property
    def neutral(self) -> int:
        return self.counts.shape[0] - 1

    def count(self, slots, tokens):
        """Adds one occurrence of tokens [B] in slots [B]; the neutral row is never written."""
        slots = jnp.where(slots == self.neutral, self.counts.shape[0], slots)  # out of range: dropped
        return self.replace(counts=self.counts.at[slots, tokens].add(1, mode="drop"))


def limited_bias(bias: np.ndarray, vocab_limit: int) -> np.ndarray:
    """A bias row [V] as the tables hold it: -inf at the ids from vocab_limit on, whatever it held there."""
    return np.where(np.arange(bias.shape[0]) < vocab_limit, bias, -np.inf).astype(np.float32)


@flax.struct.dataclass
class Sampled:
    """What a step returns per row: tokens [B] int32, their logprobs [B] f32, and the top MAX_LOGPROBS tokens and
    logprobs [B, MAX_LOGPROBS] (zeros unless a row of the batch asked for logprobs)."""

    tokens: jax.Array
    logprobs: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array


def sample(logits, s: SamplingBatch, tables: TokenTables, step, *, ops) -> Sampled:
    """logits: [B, V] f32 -> Sampled, for the `step`-th step of a multi-step dispatch. Logprobs: the model's
    distribution after bias and penalties, before temperature and filters. ops: nanojax.ops.Ops."""
    model = _adjust(logits, s, tables, step)
    log_norm = jax.nn.logsumexp(model, axis=-1)
    token = jnp.arange(model.shape[1])  # the constraints' masks: token t is bit t % 32 of word t // 32
    allowed = (tables.allowed[s.slots][:, token // 32] >> (token % 32)) & 1
    logits = jnp.where((allowed == 0) & (step < s.mask_steps)[:, None], -jnp.inf, model)
    cut_key, cut_id, top_ids, top_logits = ops.sampling_filters(logits, s, num_top=MAX_LOGPROBS)
    tokens = _draw(logits, s, step, kept(logits, cut_key, cut_id))
    chosen = jnp.take_along_axis(model, tokens[:, None], axis=1)[:, 0] - log_norm
    return Sampled(tokens, chosen, top_ids, top_logits - log_norm[:, None])


def unmasked_tokens(logits, s: SamplingBatch, tables: TokenTables, step):
    """sample()'s draw with no constraint mask and no filters (the rows whose later draws a grammar may keep have
    none): the same noise, so where it equals sample()'s token, the model's own choice was allowed."""
    return _draw(_adjust(logits, s, tables, step), s, step)


def _draw(logits, s: SamplingBatch, step, keep=None):
    """-> [B] int32: the argmax of logits (greedy rows) or of logits / temperature plus the step's Gumbel noise, over
    the tokens `keep` [B, V] allows (all if None)."""
    noisy = logits / jnp.maximum(s.temperature, 1e-6)[:, None] + _gumbel(s.seeds, s.counters + step, logits.shape[1])
    if keep is not None:
        noisy = jnp.where(keep, noisy, -jnp.inf)
    return jnp.argmax(jnp.where(s.temperature[:, None] > 0, noisy, logits), axis=-1).astype(jnp.int32)


def _adjust(logits, s: SamplingBatch, tables: TokenTables, step):
    """logit_bias (with the vocabulary limit's -inf), then the repetition penalty (HF's: over prompt and output), the
    presence/frequency penalties (OpenAI's: over the output only) and the min_tokens ban."""
    counts, flags = tables.counts[s.slots], tables.flags[s.slots]
    logits = logits + tables.bias[s.slots]
    seen = ((flags & PROMPT) != 0) | (counts > 0)
    rep = s.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits -= s.frequency_penalty[:, None] * counts + s.presence_penalty[:, None] * (counts > 0)
    banned = ((flags & BANNED) != 0) & (step < s.ban_steps)[:, None]
    return jnp.where(banned, -jnp.inf, logits)


def _gumbel(seeds, counters, vocab):
    """[B, V] standard Gumbel noise, a pure function of (seed, counter, token id): murmur3's finalizer chained over
    the three, its top 24 bits as a uniform in (0, 1)."""
    def mix(h):
        for shift, factor in ((16, 0x85EBCA6B), (13, 0xC2B2AE35)):
            h = (h ^ (h >> shift)) * jnp.uint32(factor)
        return h ^ (h >> 16)

    token = jnp.arange(vocab, dtype=jnp.uint32)[None, :]
    row = mix(seeds.astype(jnp.uint32) ^ mix(counters.astype(jnp.uint32) + jnp.uint32(0x9E3779B9)))
    bits = mix(row[:, None] ^ (token * jnp.uint32(0x9E3779B9) + jnp.uint32(0x7F4A7C15)))
    u = ((bits >> 8).astype(jnp.float32) + 0.5) * (1.0 / (1 << 24))
    return -jnp.log(-jnp.log(u))
