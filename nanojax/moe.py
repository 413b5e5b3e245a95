"""The mixture-of-experts MLP (Qwen3-MoE, Mixtral) in plain jnp: a router picks each row's top-k experts, the rows are
grouped by expert (one sort of the N * k choices) and run through grouped GEMMs (`jax.lax.ragged_dot`), so that a
small batch reads only its chosen experts' weights; each row's k outputs are then summed with its routing weights."""
import jax
import jax.numpy as jnp

from convert.config import MoE

_HIGHEST = jax.lax.Precision.HIGHEST


def route(h, router, moe: MoE):
    """h: [N, H] normalized rows; router: [H, E] -> (weights f32 [N, k], expert ids int32 [N, k]): the top k of the
    softmax over the logits (in f32, from logits rounded to h.dtype as HF's linear rounds them), renormalized to sum
    1 where moe.norm_topk_prob."""
    logits = jnp.dot(h, router, precision=_HIGHEST, preferred_element_type=jnp.float32).astype(h.dtype)
    weights, ids = jax.lax.top_k(jax.nn.softmax(logits.astype(jnp.float32), axis=-1), moe.top_k)
    return (weights / weights.sum(axis=-1, keepdims=True) if moe.norm_topk_prob else weights), ids


def grouped_swiglu(x, weights, ids, up, down):
    """x: [N, H]; weights, ids: [N, k] each row's experts and their weights; up: [E, H, 2I] (gate | up); down:
    [E, I, H] -> [N, H]: sum over j of weights[:, j] * down_e(silu(gate_e(x)) * up_e(x)), e = ids[:, j]. An id outside
    [0, E) (an expert another device holds) adds nothing."""
    n, k = ids.shape
    num_experts = up.shape[0]
    flat = jnp.where((ids >= 0) & (ids < num_experts), ids, num_experts).reshape(-1)  # others: last, in no group
    order = jnp.argsort(flat)
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)

    def grouped(rows, w):
        return jax.lax.ragged_dot(rows, w.astype(rows.dtype), group_sizes, precision=_HIGHEST,
                                  preferred_element_type=jnp.float32)

    gate, up_rows = jnp.split(grouped(x[order // k], up).astype(x.dtype), 2, axis=-1)
    out = grouped(jax.nn.silu(gate) * up_rows, down)  # [N k, H] in expert order
    out = jnp.zeros_like(out).at[order].set(out).reshape(n, k, -1)  # back in (row, choice) order
    kept = (flat < num_experts).reshape(n, k, 1)  # rows past the groups are not computed: select, not multiply
    return jnp.sum(jnp.where(kept, out * weights[..., None], 0), axis=1).astype(x.dtype)
