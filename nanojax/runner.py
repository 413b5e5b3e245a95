"""The compiled steps: embed -> layers -> final norm -> LM head -> sampling in one jit, the KV cache donated.

Shapes are padded to buckets (batch rows, tokens per row) so steady state never recompiles; the page table
always has `pages_per_seq` columns.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np

from nanojax.config import ModelConfig
from nanojax.kv_cache import Batch, KVCache
from nanojax.model import forward, lm_logits
from nanojax.sampling import PAD_ID, SamplingBatch, SamplingMode, sample

_STATIC = ("config", "ops", "vocab_limit", "mode")


@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnums=(1,))
def step(params, cache, tokens, batch: Batch, sampling: SamplingBatch, *, config, ops, vocab_limit, mode):
    """tokens: [B, T] -> (next token of every row [1, B], cache). Rows still mid-prompt discard theirs."""
    hidden, cache = forward(params, tokens, cache, batch, config=config, ops=ops)
    last = jnp.take_along_axis(hidden, jnp.maximum(batch.q_lens - 1, 0)[:, None, None], axis=1)[:, 0]
    logits = lm_logits(params, last, config)
    return sample(logits, sampling, 0, vocab_limit=vocab_limit, mode=mode)[None], cache


@functools.partial(jax.jit, static_argnames=(*_STATIC, "num_steps"), donate_argnums=(1,))
def multi_decode(params, cache, tokens, batch: Batch, sampling: SamplingBatch, *, config, ops, vocab_limit, mode,
                 num_steps):
    """num_steps decode steps in one dispatch (fixed trip count: no host sync between them).

    tokens: [B] last token of each row; batch describes the first step (q_lens 1, 0 on padding rows).
    Returns ([num_steps, B] sampled tokens, cache). Rows that finish early keep decoding into pages the
    scheduler reserved; the host drops what follows their end.
    """
    active = batch.q_lens

    def body(i, carry):
        tokens, cache, seq_lens, out = carry
        hidden, cache = forward(params, tokens[:, None], cache, batch.replace(seq_lens=seq_lens),
                                config=config, ops=ops)
        nxt = sample(lm_logits(params, hidden[:, 0], config), sampling, i, vocab_limit=vocab_limit, mode=mode)
        return nxt, cache, seq_lens + active, out.at[i].set(nxt)

    out = jnp.zeros((num_steps, tokens.shape[0]), jnp.int32)
    _, cache, _, out = jax.lax.fori_loop(0, num_steps, body, (tokens, cache, batch.seq_lens, out))
    return out, cache


def bucket(n: int, buckets: tuple[int, ...]) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"{n} is larger than the largest bucket {buckets[-1]}")


def pow2_buckets(lo: int, hi: int) -> tuple[int, ...]:
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    return tuple(out) + (hi,)


class ModelRunner:
    """Holds params and the KV cache on device and runs padded steps.

    Compiled shapes: decode [B, 1] for B in `batch_buckets` (one step, and `decode_steps` steps per dispatch),
    and prefill [1, T] for T in `token_buckets`: a prefill chunk runs as its own row, so the shapes stay a short
    list that `warmup` compiles up front. ops: the kernel switch (nanojax.ops).
    """

    def __init__(self, config: ModelConfig, params, *, num_pages: int, page_size: int, pages_per_seq: int,
                 dtype, ops, vocab_limit: int, max_num_seqs: int, max_tokens_per_row: int):
        self.config, self.ops, self.vocab_limit = config, ops, vocab_limit
        self.params = jax.device_put(params)
        self.cache = KVCache.create(config, num_pages, page_size, dtype)
        self.pages_per_seq = pages_per_seq
        self.batch_buckets = pow2_buckets(1, max_num_seqs)
        self.token_buckets = pow2_buckets(16, max_tokens_per_row) if max_tokens_per_row > 16 else (
            max_tokens_per_row,)
        self.compiles = 0

    def decode(self, last_tokens: list[int], page_tables: list[list[int]], seq_lens: list[int],
               sampling: dict[str, np.ndarray], mode: SamplingMode, num_steps: int = 1) -> "Pending":
        """Dispatches num_steps decode steps for each row (seq_lens counts the last token); [num_steps, rows]."""
        rows = len(last_tokens)
        b = bucket(rows, self.batch_buckets)
        tokens = np.zeros((b, 1), np.int32)
        tokens[:rows, 0] = last_tokens
        q_lens = (np.arange(b) < rows).astype(np.int32)
        return Pending(self._call(tokens, page_tables, seq_lens, q_lens, sampling, mode, num_steps), rows)

    def prefill(self, tokens: list[int], page_table: list[int], seq_len: int, sampling: dict[str, np.ndarray],
                mode: SamplingMode) -> "Pending":
        """Dispatches a chunk of one sequence ending at seq_len; [1, 1]: the token sampled after it."""
        padded = np.zeros((1, bucket(len(tokens), self.token_buckets)), np.int32)
        padded[0, :len(tokens)] = tokens
        return Pending(self._call(padded, [page_table], [seq_len], np.array([len(tokens)], np.int32), sampling,
                                  mode, 1), 1)

    def warmup(self, decode_steps: int, modes: list[SamplingMode]) -> None:
        """Compiles every bucket for each sampling mode, on padding rows that write nothing to the cache."""
        for mode in modes:
            for b in self.batch_buckets:
                for steps in sorted({1, decode_steps}):
                    self._call(np.zeros((b, 1), np.int32), [], [], np.zeros(b, np.int32),
                               greedy_sampling(b)[0], mode, steps)
            for t in self.token_buckets:
                self._call(np.zeros((1, t), np.int32), [], [], np.zeros(1, np.int32), greedy_sampling(1)[0], mode, 1)

    def _call(self, tokens: np.ndarray, page_tables, seq_lens, q_lens: np.ndarray, sampling, mode, num_steps):
        """Dispatches one compiled step; returns its sampled tokens [num_steps, rows] on device, not waited for."""
        rows = tokens.shape[0]
        table = np.zeros((rows, self.pages_per_seq), np.int32)
        for i, pages in enumerate(page_tables):
            table[i, :len(pages)] = pages
        lens = np.zeros(rows, np.int32)
        lens[:len(seq_lens)] = seq_lens
        batch = Batch(page_table=table, seq_lens=lens, q_lens=q_lens)
        samp = SamplingBatch(**{k: _pad_rows(v, rows, PAD_ID if k.endswith("_ids") else 0)
                                for k, v in sampling.items()})
        # One transfer for all of the step's host arrays: a jnp.asarray per array costs ~0.3 ms each on the
        # H100 machine, which made the host, not the GPU, the bottleneck of a dispatch (docs/perf_notes.md).
        tokens, batch, samp = jax.device_put((tokens if num_steps == 1 else tokens[:, 0], batch, samp))
        fn = step if num_steps == 1 else functools.partial(multi_decode, num_steps=num_steps)
        before = _cache_size(fn)
        out, self.cache = fn(self.params, self.cache, tokens, batch, samp, config=self.config, ops=self.ops,
                             vocab_limit=self.vocab_limit, mode=mode)
        self.compiles += _cache_size(fn) - before
        return out


class Pending:
    """A dispatched step's sampled tokens, still on device: the host goes on (schedules, dispatches more, streams
    text) while the GPU computes, and waits only in `get`."""

    def __init__(self, tokens: jax.Array, rows: int):
        self._tokens, self._rows, self._host = tokens, rows, None

    def get(self) -> np.ndarray:
        """-> [num_steps, rows] int32 (waits for the step; copied to the host once, however many rows read it)."""
        if self._host is None:
            self._host = np.asarray(self._tokens)[:, :self._rows]
        return self._host


def _pad_rows(v: np.ndarray, rows: int, fill) -> np.ndarray:
    return np.pad(v, [(0, rows - v.shape[0])] + [(0, 0)] * (v.ndim - 1), constant_values=fill)


def greedy_sampling(rows: int) -> tuple[dict[str, np.ndarray], SamplingMode]:
    """Sampling arrays for `rows` greedy rows with no adjustments (benchmarks drive the runner with these)."""
    zeros_f, zeros_i, none = np.zeros(rows, np.float32), np.zeros(rows, np.int32), np.full((rows, 1), PAD_ID)
    arrays = dict(temperature=zeros_f, top_k=zeros_i, top_p=zeros_f + 1, min_p=zeros_f,
                  seeds=zeros_i.astype(np.uint32), counters=zeros_i, banned_ids=none, ban_steps=zeros_i,
                  bias_ids=none, bias_values=np.zeros((rows, 1), np.float32), seen_ids=none,
                  seen_counts=np.zeros((rows, 1), np.int32), repetition_penalty=zeros_f + 1,
                  presence_penalty=zeros_f, frequency_penalty=zeros_f)
    return arrays, SamplingMode(random=False, filtered=False, adjusted=False)


def _cache_size(fn) -> int:
    fn = getattr(fn, "func", fn)
    return fn._cache_size()
