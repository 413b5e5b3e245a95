"""A mixture-of-experts router's choices in one kernel: the softmax over each row's expert logits, its top k (k rounds
of max, the lowest index winning ties as lax.top_k's), renormalized; XLA takes a softmax, a sort and a division, each a
launch a layer (docs/perf_notes.md, "Mixture of experts")."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._compat import check_pow2, load, store, triton_params


@dataclasses.dataclass(frozen=True)
class TopkRoutingConfig:
    """A program routes block_rows rows."""
    block_rows: int = 16
    num_warps: int = 4

    def __post_init__(self):
        check_pow2(self, ("block_rows",))


def topk_routing_reference(logits, top_k: int, normalize: bool):
    """logits: [N, E] -> (weights f32 [N, top_k], ids int32 [N, top_k]): the top_k of the softmax (in f32), divided
    by their sum where normalize (Qwen3-MoE's norm_topk_prob, Mixtral)."""
    weights, ids = jax.lax.top_k(jax.nn.softmax(logits.astype(jnp.float32), axis=-1), top_k)
    return (weights / weights.sum(axis=-1, keepdims=True) if normalize else weights), ids


def _kernel(logits_ref, weights_ref, ids_ref, *, top_k: int, normalize: bool):
    # logits_ref: [block_rows, E] (E a power of two, padding -inf); weights_ref, ids_ref: [block_rows, K] (K >= top_k
    # a power of two: the columns after top_k are left 0)
    x = load(logits_ref).astype(jnp.float32)
    p = jnp.exp(x - jnp.max(x, axis=1, keepdims=True))
    p = p / jnp.sum(p, axis=1, keepdims=True)
    experts = jax.lax.broadcasted_iota(jnp.int32, p.shape, 1)
    cols = jax.lax.broadcasted_iota(jnp.int32, weights_ref.shape, 1)
    weights, ids = jnp.zeros(weights_ref.shape, jnp.float32), jnp.zeros(ids_ref.shape, jnp.int32)
    for j in range(top_k):
        best = jnp.max(p, axis=1, keepdims=True)
        pick = jnp.min(jnp.where(p == best, experts, p.shape[1]), axis=1, keepdims=True)
        weights, ids = jnp.where(cols == j, best, weights), jnp.where(cols == j, pick, ids)
        p = jnp.where(experts == pick, -1.0, p)
    if normalize:
        weights = weights / jnp.sum(weights, axis=1, keepdims=True)
    store(weights_ref, weights)
    store(ids_ref, ids)


@functools.partial(jax.jit, static_argnames=("top_k", "normalize", "config", "interpret"))
def topk_routing(logits, top_k: int, normalize: bool, *, config: TopkRoutingConfig | None = None,
                 interpret: bool = False):
    """topk_routing_reference's contract; rows and experts padded to the block's powers of two."""
    n, num_experts = logits.shape
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}] (the experts), got {top_k}")
    config = config or TopkRoutingConfig(block_rows=min(TopkRoutingConfig.block_rows, pl.next_power_of_2(n)))
    rows = pl.cdiv(n, config.block_rows) * config.block_rows
    width, k = pl.next_power_of_2(num_experts), pl.next_power_of_2(top_k)
    logits = jnp.pad(jnp.pad(logits, ((0, 0), (0, width - num_experts)), constant_values=-jnp.inf),
                     ((0, rows - n), (0, 0)))
    weights, ids = pl.pallas_call(
        functools.partial(_kernel, top_k=top_k, normalize=normalize),
        grid=(rows // config.block_rows,),
        in_specs=[pl.BlockSpec((config.block_rows, width), lambda i: (i, 0))],
        out_specs=[pl.BlockSpec((config.block_rows, k), lambda i: (i, 0))] * 2,
        out_shape=[jax.ShapeDtypeStruct((rows, k), dtype) for dtype in (jnp.float32, jnp.int32)],
        compiler_params=triton_params(config.num_warps, 1),
        interpret=interpret,
    )(logits)
    return weights[:n, :top_k], ids[:n, :top_k]
