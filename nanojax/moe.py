"""The mixture-of-experts MLP (Qwen3-MoE, Qwen2-MoE, Mixtral) in plain jnp: a router picks each row's top-k experts,
each choice runs through its expert's SwiGLU, and each row's k outputs are summed with its routing weights. A step of
few rows (decode) takes each choice through its expert's weights (pallas_kernels/expert_matmul.py); more rows are sorted
by expert into blocks of one expert each (pallas_kernels/grouped_matmul.py). Both read only the chosen experts' weights
(Qwen2-MoE's shared expert is the layer's dense MLP: nanojax/model.py)."""
import jax
import jax.numpy as jnp

from convert.config import MoE
from pallas_kernels.expert_matmul import expert_matmul_reference
from pallas_kernels.grouped_matmul import block_rows, grouped_matmul_reference
from pallas_kernels.topk_routing import topk_routing_reference

_HIGHEST = jax.lax.Precision.HIGHEST


def route(h, router, moe: MoE, routing=topk_routing_reference):
    """h: [N, H] normalized rows; router: [H, E] -> (weights f32 [N, k], expert ids int32 [N, k]): the top k of the
    softmax over the logits (in f32, from logits rounded to h.dtype as HF's linear rounds them), renormalized to sum
    1 where moe.norm_topk_prob. routing: topk_routing's contract."""
    logits = jnp.dot(h, router, precision=_HIGHEST, preferred_element_type=jnp.float32).astype(h.dtype)
    return routing(logits, moe.top_k, moe.norm_topk_prob)


def grouped_swiglu(x, weights, ids, up, down, matmul=expert_matmul_reference, grouped=grouped_matmul_reference):
    """x: [N, H]; weights, ids: [N, k] each row's experts and their weights; up: (w [E, H, 2I] (gate | up), None);
    down: (w [E, I, H], None); FP8 experts (w_t [E, N, K], scale [E, N]) -> [N, H]: sum over j of weights[:, j] *
    down_e(silu(gate_e(x)) * up_e(x)), e = ids[:, j]. An id outside [0, E) (an expert another device holds) adds
    nothing. matmul: expert_matmul's contract, for few rows; grouped: grouped_matmul's, for more."""
    n, k = ids.shape
    num_experts = up[0].shape[0]
    kept = (ids >= 0) & (ids < num_experts)
    # Few rows gather their experts (never more weights than the whole set); more are grouped by expert.
    out = (_gathered(x, ids.reshape(-1), up, down, matmul) if n * k <= num_experts else
           _grouped(x, jnp.where(kept, ids, num_experts).reshape(-1), up, down, grouped))
    out = out.reshape(n, k, -1)
    return jnp.sum(jnp.where(kept[..., None], out * weights[..., None], 0), axis=1).astype(x.dtype)


def _swiglu(gate_up, dtype):
    """gate_up: [M, 2I] f32 -> [M, I]: silu(gate) * up in dtype (the rows' dtype, as HF's experts round)."""
    gate, up = jnp.split(gate_up.astype(dtype), 2, axis=-1)
    return jax.nn.silu(gate) * up


def _gathered(x, ids, up, down, matmul):
    """x: [N, H]; ids: [N k] -> [N k, H] f32: each choice through its expert's weights (one outside [0, E) through the
    nearest expert's, for the caller to drop)."""
    rows = jnp.repeat(x, ids.shape[0] // x.shape[0], axis=0)
    return matmul(_swiglu(matmul(rows, *up, ids), x.dtype), *down, ids)


def _grouped(x, choices, up, down, matmul):
    """_gathered's result, from the choices sorted by expert, each expert's run padded to whole blocks of rows."""
    m, num_experts = choices.shape[0], up[0].shape[0]
    block_m = block_rows(m, num_experts)
    num_blocks = m // block_m + min(m, num_experts)  # enough: each used expert adds at most one partial block
    order = jnp.argsort(choices)  # none (E) last
    sizes = jnp.bincount(choices, length=num_experts)
    blocks = -(-sizes // block_m)
    blocks_end = jnp.cumsum(blocks)  # each expert's blocks end here
    sorted_choices = choices[order]
    e = jnp.minimum(sorted_choices, num_experts - 1)
    rank = jnp.arange(m) - (jnp.cumsum(sizes) - sizes)[e]  # place in its expert's run
    start = (blocks_end - blocks)[e] * block_m
    slots = jnp.where(sorted_choices < num_experts, start + rank, num_blocks * block_m)  # none: past the end
    rows = jnp.full(num_blocks * block_m, x.shape[0]).at[slots].set(order // (m // x.shape[0]), mode="drop")
    block_experts = jnp.searchsorted(blocks_end, jnp.arange(num_blocks), side="right").astype(jnp.int32)
    block_experts = jnp.where(block_experts < num_experts, block_experts, -1)
    xs = jnp.concatenate([x, jnp.zeros_like(x[:1])])[rows]  # padding reads a zero row
    out = matmul(_swiglu(matmul(xs, *up, block_experts), x.dtype), *down, block_experts)
    slot_of_choice = jnp.zeros_like(slots).at[order].set(jnp.minimum(slots, num_blocks * block_m - 1))
    return out[slot_of_choice]  # a none's row is any row: the caller drops it
