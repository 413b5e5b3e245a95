"""A mixture-of-experts router in two kernels: `rmsnorm_router`, the norm before it and its logits, and `topk_routing`,
the softmax over each row's expert logits, its top k (k rounds of max, the lowest index winning ties as lax.top_k's),
renormalized; XLA takes a launch for each of the norm's statistic, the norm, the product, the softmax, a sort and a
division (docs/perf_notes.md, "Mixture of experts")."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._compat import check_pow2, load, pow2_divisor, store, triton_params
from pallas_kernels.rms_norm import rms_norm


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


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    """A program takes one row and block_e experts, streaming H in block_k slices."""
    block_e: int = 2
    block_k: int = 512
    num_warps: int = 2

    def __post_init__(self):
        check_pow2(self, ("block_e", "block_k"))


def rmsnorm_router_reference(x, scale, router, *, eps: float):
    """x: [T, H]; scale: [H] the RMSNorm's weight; router: [E, H] -> (h = rms_norm(x) [T, H], logits [T, E]): the
    logits in x's dtype, as HF's linear rounds them (from h in x's dtype)."""
    h = rms_norm(x, scale, eps)
    logits = jnp.einsum("th,eh->te", h, router, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return h, logits.astype(x.dtype)


def _router_kernel(x_ref, scale_ref, router_ref, h_ref, logits_ref, *, eps: float, block_k: int):
    # x_ref: [H] a row; scale_ref: [H] the norm's weight; router_ref: [block_e, H] a block of experts; h_ref: [H] the
    # normalized row (program 0 of the row writes it); logits_ref: [block_e]
    dtype, hdim = h_ref.dtype, x_ref.shape[0]
    slices = [pl.ds(i * block_k, block_k) for i in range(hdim // block_k)]  # (H need not be a power of two)
    xs = [load(x_ref.at[ks]).astype(jnp.float32) for ks in slices]
    rstd = jax.lax.rsqrt(sum(jnp.sum(jnp.square(x)) for x in xs) / hdim + eps)
    # rms_norm's rounding: normalized in f32, rounded, times the weight in x's dtype
    hs = [(load(scale_ref.at[ks]).astype(dtype).astype(jnp.float32) * (x * rstd).astype(dtype).astype(jnp.float32))
          .astype(dtype) for ks, x in zip(slices, xs)]
    acc = jnp.zeros((router_ref.shape[0], block_k), jnp.float32)
    for ks, h in zip(slices, hs):
        acc += load(router_ref.at[:, ks]).astype(jnp.float32) * h.astype(jnp.float32)[None, :]
    store(logits_ref, jnp.sum(acc, axis=1).astype(logits_ref.dtype))

    @pl.when(pl.program_id(1) == 0)
    def _():
        for ks, h in zip(slices, hs):
            store(h_ref.at[ks], h)


@functools.partial(jax.jit, static_argnames=("eps", "config", "interpret"))
def rmsnorm_router(x, scale, router, *, eps: float, config: RouterConfig | None = None, interpret: bool = False):
    """rmsnorm_router_reference's contract, a program per (row, block of experts): many programs read the router at
    once, each normalizing its row (a few KiB) in place of a launch for the norm."""
    (t, hdim), num_experts = x.shape, router.shape[0]
    config = config or RouterConfig(block_e=pow2_divisor(num_experts, RouterConfig.block_e),
                                    block_k=pow2_divisor(hdim, RouterConfig.block_k))
    if router.shape != (num_experts, hdim) or scale.shape != (hdim,) or num_experts % config.block_e or (
            hdim % config.block_k):
        raise ValueError(f"x [T, H], scale [H] and router [E, H] with E by block_e and H by block_k: x {x.shape}, "
                         f"scale {scale.shape}, router {router.shape}, {config}")
    return pl.pallas_call(
        functools.partial(_router_kernel, eps=eps, block_k=config.block_k),
        grid=(t, num_experts // config.block_e),
        in_specs=[pl.BlockSpec((None, hdim), lambda r, j: (r, 0)), pl.BlockSpec((hdim,), lambda r, j: (0,)),
                  pl.BlockSpec((config.block_e, hdim), lambda r, j: (j, 0))],
        out_specs=[pl.BlockSpec((None, hdim), lambda r, j: (r, 0)), pl.BlockSpec((None, config.block_e),
                                                                                lambda r, j: (r, j))],
        out_shape=[jax.ShapeDtypeStruct((t, hdim), x.dtype), jax.ShapeDtypeStruct((t, num_experts), x.dtype)],
        compiler_params=triton_params(config.num_warps, 1),
        interpret=interpret,
    )(x, scale, router)
