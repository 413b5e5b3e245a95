"""The mixture-of-experts MLP (Qwen3-MoE, Qwen2-MoE, Mixtral) in plain jnp: a router picks each row's top-k experts,
each choice runs through its expert's SwiGLU, and each row's k outputs are summed with its routing weights. A step of
few rows (decode) takes each choice through its expert's weights and each token's choices through the combine
(pallas_kernels/expert_matmul.py); more rows are sorted by expert into blocks of one expert each
(pallas_kernels/grouped_matmul.py). Both read only the chosen experts' weights (Qwen2-MoE's shared expert is the
layer's dense MLP: nanojax/model.py)."""
import jax.numpy as jnp

from convert.config import MoE
from pallas_kernels.expert_matmul import expert_combine_reference, expert_swiglu_reference, swiglu, weighted_sum
from pallas_kernels.grouped_matmul import block_rows, grouped_matmul_reference
from pallas_kernels.topk_routing import rmsnorm_router_reference, topk_routing_reference


def route(x, scale, router, moe: MoE, eps: float, router_logits=rmsnorm_router_reference,
          routing=topk_routing_reference):
    """x: [N, H] rows before the RMSNorm of weight scale [H]; router: [E, H] -> (h, the normalized rows, and each
    row's routing weights f32 [N, k] and expert ids int32 [N, k]): the top k of the softmax over the logits (in f32,
    from logits rounded to x.dtype as HF's linear rounds them), renormalized to sum 1 where moe.norm_topk_prob.
    router_logits and routing: rmsnorm_router's and topk_routing's contracts."""
    h, logits = router_logits(x, scale, router, eps=eps)
    return (h, *routing(logits, moe.top_k, moe.norm_topk_prob))


def few_rows(rows: int, top_k: int, num_experts: int) -> bool:
    """Whether a step's choices gather their experts (never more weights than the whole set) rather than group by
    expert: the decode kernels' sizes, for the router too."""
    return rows * top_k <= num_experts


def moe_mlp(x, weights, ids, up, down, residual=None, kernels=(expert_swiglu_reference, expert_combine_reference,
                                                              grouped_matmul_reference)):
    """x: [N, H]; weights, ids: [N, k] each row's experts and their weights; up: (w [E, 2I, H] (gate | up), None);
    down: (w [E, H, I], None), or FP8 experts (w_t, scale [E, N]); residual: [N, H] or None -> [N, H]: residual + the
    sum over j of weights[:, j] * down_e(silu(gate_e(x)) * up_e(x)), e = ids[:, j]; an id outside [0, E) (an expert
    another device holds) adds nothing. kernels: expert_swiglu's, expert_combine's and grouped_matmul's contracts:
    the first two for few rows, the third for more."""
    n, k = ids.shape
    num_experts = up[0].shape[0]
    expert_swiglu, expert_combine, grouped = kernels
    if few_rows(n, k, num_experts):
        return expert_combine(expert_swiglu(x, ids, *up), weights, ids, *down, residual)
    choices = jnp.where((ids >= 0) & (ids < num_experts), ids, num_experts).reshape(-1)
    out = _grouped(x, choices, up, down, grouped).reshape(n, k, -1)
    return weighted_sum(out, weights, ids, num_experts, x.dtype, residual)


def _grouped(x, choices, up, down, matmul):
    """x: [N, H]; choices: [N k] (E: none) -> [N k, H] f32, each choice through its expert's SwiGLU (a none's row: any
    value), from the choices sorted by expert, each expert's run padded to whole blocks of rows."""
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
    out = matmul(swiglu(matmul(xs, *up, block_experts), x.dtype), *down, block_experts)
    slot_of_choice = jnp.zeros_like(slots).at[order].set(jnp.minimum(slots, num_blocks * block_m - 1))
    return out[slot_of_choice]  # a none's row is any row: the caller drops it
