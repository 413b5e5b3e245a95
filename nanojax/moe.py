"""The mixture-of-experts MLP (Qwen3-MoE, Mixtral) in plain jnp: a router picks each row's top-k experts, each choice
runs through its expert's SwiGLU, and each row's k outputs are summed with its routing weights. A step of few rows
(decode) gathers each choice's expert weights; more rows are grouped by expert (one sort of the N * k choices) for
grouped GEMMs (`jax.lax.ragged_dot`). Both read only the chosen experts' weights in principle; on an H200 XLA's
ragged_dot was slower than reading every expert, and the gathered products want a kernel
(pallas_kernels/expert_matmul.py; docs/perf_notes.md, "Mixture of experts")."""
import jax
import jax.numpy as jnp

from convert.config import MoE
from pallas_kernels.expert_matmul import expert_matmul_reference

_HIGHEST = jax.lax.Precision.HIGHEST


def route(h, router, moe: MoE):
    """h: [N, H] normalized rows; router: [H, E] -> (weights f32 [N, k], expert ids int32 [N, k]): the top k of the
    softmax over the logits (in f32, from logits rounded to h.dtype as HF's linear rounds them), renormalized to sum
    1 where moe.norm_topk_prob."""
    logits = jnp.dot(h, router, precision=_HIGHEST, preferred_element_type=jnp.float32).astype(h.dtype)
    weights, ids = jax.lax.top_k(jax.nn.softmax(logits.astype(jnp.float32), axis=-1), moe.top_k)
    return (weights / weights.sum(axis=-1, keepdims=True) if moe.norm_topk_prob else weights), ids


def grouped_swiglu(x, weights, ids, up, down, matmul=expert_matmul_reference):
    """x: [N, H]; weights, ids: [N, k] each row's experts and their weights; up: [E, H, 2I] (gate | up); down:
    [E, I, H] -> [N, H]: sum over j of weights[:, j] * down_e(silu(gate_e(x)) * up_e(x)), e = ids[:, j]. An id outside
    [0, E) (an expert another device holds) adds nothing. matmul: expert_matmul's contract, for few rows."""
    n, k = ids.shape
    num_experts = up.shape[0]
    kept = (ids >= 0) & (ids < num_experts)
    choices = jnp.where(kept, ids, num_experts).reshape(-1)
    # Few rows gather their experts (never more weights than the whole set); more are grouped by expert.
    out = (_gathered(x, choices, up, down, matmul) if n * k <= num_experts else _grouped(x, choices, up, down))
    out = out.reshape(n, k, -1)
    return jnp.sum(jnp.where(kept[..., None], out * weights[..., None], 0), axis=1).astype(x.dtype)


def _swiglu(gate_up, dtype):
    """gate_up: [M, 2I] f32 -> [M, I]: silu(gate) * up in dtype (the rows' dtype, as HF's experts round)."""
    gate, up = jnp.split(gate_up.astype(dtype), 2, axis=-1)
    return jax.nn.silu(gate) * up


def _gathered(x, choices, up, down, matmul):
    """x: [N, H]; choices: [N k] expert ids (E: none) -> [N k, H] f32: each choice through its expert's weights."""
    e = jnp.minimum(choices, up.shape[0] - 1)  # none: computed with the last expert, then dropped
    rows = jnp.repeat(x, choices.shape[0] // x.shape[0], axis=0)
    return matmul(_swiglu(matmul(rows, up, e), x.dtype), down, e)


def _grouped(x, choices, up, down):
    """_gathered's result, from the choices grouped by expert (sorted) through grouped GEMMs."""
    num_experts, k = up.shape[0], choices.shape[0] // x.shape[0]
    order = jnp.argsort(choices)  # none: last, in no group (ragged_dot leaves those rows zero)
    group_sizes = jnp.bincount(choices, length=num_experts).astype(jnp.int32)

    def dot(rows, w):
        return jax.lax.ragged_dot(rows, w.astype(rows.dtype), group_sizes, precision=_HIGHEST,
                                  preferred_element_type=jnp.float32)

    out = dot(_swiglu(dot(x[order // k], up), x.dtype), down)  # [N k, H] in expert order
    return jnp.zeros_like(out).at[order].set(out)  # back in (row, choice) order
