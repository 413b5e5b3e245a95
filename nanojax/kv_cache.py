"""The paged KV cache: one page pool per layer (its layout: pallas_kernels.paged_attention) and a step's `Batch`."""
import flax.struct
import jax
import jax.numpy as jnp

from convert.config import ModelConfig


@flax.struct.dataclass
class KVCache:
    """k[i], v[i]: layer i's page pool, [num_pages, num_kv_heads, page_size, head_dim]; tokens: None, or the token
    at each slot [num_pages * page_size] int32, -1 where none was written (what speculative decoding looks its n-grams
    up in); draft: None, or a draft model's cache over the same pages and slots, its tokens those the draft was fed."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    tokens: jax.Array | None = None
    draft: "KVCache | None" = None

    @classmethod
    def create(cls, config: ModelConfig, num_pages: int, page_size: int, dtype, tokens: bool = False,
               draft: ModelConfig | None = None) -> "KVCache":
        shape = (num_pages, config.num_kv_heads, page_size, config.head_dim)
        layers = range(config.num_layers)
        return cls(k=tuple(jnp.zeros(shape, dtype) for _ in layers), v=tuple(jnp.zeros(shape, dtype) for _ in layers),
                   tokens=jnp.full(num_pages * page_size, -1, jnp.int32) if tokens else None,
                   draft=None if draft is None else cls.create(draft, num_pages, page_size, dtype, True))

    @property
    def page_size(self) -> int:
        return self.k[0].shape[2]


@flax.struct.dataclass
class Batch:
    """Which sequences a step computes, padded to [B, T] tokens; rows with q_lens == 0 are padding."""

    page_table: jax.Array  # [B, pages_per_seq] int32, the pages of each sequence in order
    seq_lens: jax.Array  # [B] int32, tokens in the cache once this step has run
    q_lens: jax.Array  # [B] int32, new tokens this step, at positions seq_lens - q_lens + t, t < q_lens
    # A decode step's shared prefixes, nanojax.cascade.CascadePlan.arrays(); None: each row reads all its own pages.
    cascade: tuple[jax.Array, ...] | None = None

    def positions(self, num_tokens: int) -> jax.Array:
        """[B, T] absolute positions, -1 on padding tokens."""
        t = jnp.arange(num_tokens)[None, :]
        pos = (self.seq_lens - self.q_lens)[:, None] + t
        return jnp.where(t < self.q_lens[:, None], pos, -1)

    def slots(self, positions: jax.Array, page_size: int) -> jax.Array:
        """[B, T] flat cache slots (page * page_size + offset) of the tokens at `positions`, -1 on padding."""
        safe = jnp.maximum(positions, 0)
        last = self.page_table.shape[1] - 1
        page = jnp.take_along_axis(self.page_table, jnp.minimum(safe // page_size, last), axis=1)
        return jnp.where(positions >= 0, page * page_size + safe % page_size, -1)
