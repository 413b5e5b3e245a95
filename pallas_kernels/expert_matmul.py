"""A mixture-of-experts decode's experts, reading only the chosen ones, in two kernels: `expert_swiglu`, each choice's
silu(gate) * up through its expert, and `expert_combine`, each token's choices through their experts' down projections,
weighted, summed and added to the residual. Experts are [E, N, K] as HF holds them (K contiguous: a program's columns
are long runs); FP8 experts (convert/quantize.py) are w_t [E, N, K] with scale [E, N], applied after the products.
XLA lowers the gathered one-row products to reductions that stream the weights at a fraction of the bandwidth, and
split K or a separate SwiGLU and combine cost a launch each (docs/perf_notes.md, "Mixture of experts")."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._compat import check_pow2, load, pow2_divisor, store, triton_params


@dataclasses.dataclass(frozen=True)
class ExpertMatmulConfig:
    """A program computes block_n columns of one row (swiglu: of gate and of up; combine: of each of a token's
    choices), streaming K in block_k slices."""
    block_n: int = 16
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 3
    unroll: bool = True  # the K slices unrolled: every slice's loads in flight at once, not a load's latency a slice

    def __post_init__(self):
        check_pow2(self, ("block_n", "block_k"))


MAX_UNROLLED = 16  # K slices a program unrolls at most (more: a longer compile for a loop's last few loads)


def default_config(k: int, n: int, *, combine: bool, fp8: bool) -> ExpertMatmulConfig:
    """K slices of 256 elements, unrolled up to MAX_UNROLLED; bf16: 16 columns a program for the SwiGLU, 8 for the
    combine (which reads a token's k choices a program); FP8 rows, half the bytes: 32 for the SwiGLU, 16 with 8 warps
    for the combine (docs/perf_notes.md, "Mixture of experts")."""
    block_k = pow2_divisor(k, 256)
    block_n, warps = ((16, 8) if combine else (32, 4)) if fp8 else ((8 if combine else 16), 4)
    return ExpertMatmulConfig(block_n=pow2_divisor(n, block_n), block_k=block_k, num_warps=warps,
                              unroll=k // block_k <= MAX_UNROLLED)


def expert_products_reference(x, w, scale, ids):
    """x: [M, K]; w: experts [E, N, K] (FP8 with scale [E, N], else None); ids: [M] int32 -> [M, N] f32, each row
    through its expert. An id outside [0, E) (an expert another device holds) reads the nearest one."""
    ids = jnp.clip(ids, 0, w.shape[0] - 1)
    out = jnp.einsum("mk,mnk->mn", x, w[ids].astype(x.dtype), precision=lax.Precision.HIGHEST,
                     preferred_element_type=jnp.float32)
    return out if scale is None else out * scale[ids]


def swiglu(gate_up, dtype):
    """gate_up: [M, 2I] f32 -> [M, I]: silu(gate) * up in dtype (the rows' dtype, as HF's experts round)."""
    gate, up = jnp.split(gate_up.astype(dtype), 2, axis=-1)
    return jax.nn.silu(gate) * up


def expert_swiglu_reference(x, ids, w, scale):
    """x: [T, K]; ids: [T, k]; w: [E, 2I, K] (gate | up; FP8 with scale [E, 2I]) -> [T k, I] in x's dtype, choice j
    of token t at row t k + j."""
    rows = jnp.repeat(x, ids.shape[1], axis=0)
    return swiglu(expert_products_reference(rows, w, scale, ids.reshape(-1)), x.dtype)


def expert_combine_reference(a, weights, ids, w, scale, residual=None):
    """a: [T k, K] (expert_swiglu's); weights f32, ids int32: [T, k]; w: [E, N, K] (FP8 with scale [E, N]); residual:
    [T, N] or None -> [T, N] in a's dtype: residual + sum over j of weights[t, j] * a[t k + j] @ w[ids[t, j]]^T, summed
    in f32 and rounded once. An id outside [0, E) adds nothing."""
    out = expert_products_reference(a, w, scale, ids.reshape(-1)).reshape(*ids.shape, -1)
    return weighted_sum(out, weights, ids, w.shape[0], a.dtype, residual)


def weighted_sum(out, weights, ids, num_experts, dtype, residual):
    """out: [T, k, N] f32, each token's choices' outputs -> [T, N] in dtype: residual (or None) + their sum weighted
    by weights [T, k], in f32 and rounded once; a choice whose id in ids [T, k] is outside [0, num_experts) adds
    nothing."""
    kept = (ids >= 0) & (ids < num_experts)
    out = jnp.sum(jnp.where(kept[..., None], out * weights[..., None], 0), axis=1).astype(dtype)
    return out if residual is None else residual + out


def _row_product(x_slice, w_ref, expert, *, block_k: int, unroll: bool):
    """x . w_ref[expert]^T -> [block_n] f32; x_slice(ks): x's K slice ks; w_ref: [E, block_n, K]."""
    def body(i, acc):  # elementwise: one reduction over K at the end, not one a slice
        ks = pl.ds(i * block_k, block_k)
        return acc + load(w_ref.at[expert, :, ks]).astype(jnp.float32) * x_slice(ks).astype(jnp.float32)[None, :]

    acc = jnp.zeros((w_ref.shape[1], block_k), jnp.float32)
    slices = w_ref.shape[2] // block_k
    if unroll:
        for i in range(slices):
            acc = body(i, acc)
    else:
        acc = lax.fori_loop(0, slices, body, acc)
    return jnp.sum(acc, axis=1)


def _swiglu_kernel(ids_ref, x_ref, gate_ref, up_ref, *refs, block_k: int, unroll: bool):
    # ids_ref: [] the choice's expert; x_ref: [K] its token's row; gate_ref, up_ref: [E, block_n, K] every expert's
    # gate and up column blocks, then in refs FP8's gate and up scale refs [E, block_n]; o_ref: [block_n] x's dtype
    *scale_refs, o_ref = refs
    expert = jnp.clip(load(ids_ref), 0, gate_ref.shape[0] - 1)  # (in the kernel: no launch)
    gate, up = (_row_product(lambda ks: load(x_ref.at[ks]), w, expert, block_k=block_k, unroll=unroll)
                for w in (gate_ref, up_ref))
    if scale_refs:
        gate, up = gate * load(scale_refs[0].at[expert, :]), up * load(scale_refs[1].at[expert, :])
    dtype = o_ref.dtype  # rounded as `swiglu`: the products, silu's sigmoid, silu, then the product with up

    def rounded(v):
        return v.astype(dtype).astype(jnp.float32)

    gate, up = rounded(gate), rounded(up)
    store(o_ref, (rounded(gate * rounded(1.0 / (1.0 + jnp.exp(-gate)))) * up).astype(dtype))


def _combine_kernel(ids_ref, weights_ref, a_ref, w_ref, *refs, block_k: int, unroll: bool, fp8: bool):
    # ids_ref, weights_ref: [k] a token's choices and their weights; a_ref: [k, K] their activations; w_ref:
    # [E, block_n, K] every expert's column block, then in refs FP8's scale_ref [E, block_n], the residual's
    # res_ref [block_n] if any, and o_ref [block_n] in a's dtype
    *refs, o_ref = refs
    scale_ref, res_ref = (refs.pop(0) if fp8 else None), (refs[0] if refs else None)
    num_experts, out = w_ref.shape[0], jnp.zeros(o_ref.shape, jnp.float32)
    for j in range(a_ref.shape[0]):
        j = jnp.int32(j)  # an array index: Pallas' discharge takes no Python int
        chosen = load(ids_ref.at[j])
        expert = jnp.clip(chosen, 0, num_experts - 1)
        y = _row_product(lambda ks, j=j: load(a_ref.at[j, ks]), w_ref, expert, block_k=block_k, unroll=unroll)
        if fp8:
            y = y * load(scale_ref.at[expert, :])
        out += y * jnp.where((chosen >= 0) & (chosen < num_experts), load(weights_ref.at[j]), 0.0)
    if res_ref is not None:  # rounded as the reference: the sum, then the residual add
        out = load(res_ref).astype(jnp.float32) + out.astype(o_ref.dtype).astype(jnp.float32)
    store(o_ref, out.astype(o_ref.dtype))


def _check_experts(w, scale, k):
    """-> (E, N) of experts w [E, N, K] (FP8: with scale [E, N])."""
    if w.ndim != 3 or w.shape[2] != k:
        raise ValueError(f"w must be experts [E, N, K] with K = {k} (the rows' width), got {w.shape}")
    if (scale is None) != (w.dtype != jnp.float8_e4m3fn) or scale is not None and scale.shape != w.shape[:2]:
        raise ValueError(f"w: FP8 experts need scale [E, N] = {list(w.shape[:2])}, others none; got {w.dtype} "
                         f"and {None if scale is None else scale.shape}")
    return w.shape[:2]


def _check_ids(ids, t):
    if ids.ndim != 2 or ids.shape[0] != t or ids.dtype != jnp.int32:
        raise ValueError(f"ids must be int32 [T, k] with T = {t}, got {ids.dtype}{ids.shape}")


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def expert_swiglu(x, ids, w, scale, *, config: ExpertMatmulConfig | None = None, interpret: bool = False):
    """expert_swiglu_reference's contract: a program per (choice, block of columns), reading its token's row."""
    (t, k), top_k = x.shape, ids.shape[1]
    _check_ids(ids, t)
    num_experts, n = _check_experts(w, scale, k)
    width = n // 2
    config = config or default_config(k, width, combine=False, fp8=scale is not None)
    bn = config.block_n
    if n % 2 or width % bn or k % config.block_k:
        raise ValueError(f"w's N = 2I must split in gate and up, I by block_n and K by block_k: {w.shape}, {config}")
    # gate's column block j, then up's: the same array through two windows
    halves = [lambda c, j, half=half: (0, j + half * width // bn, 0) for half in (0, 1)]
    scales = [] if scale is None else [scale, scale]
    return pl.pallas_call(
        functools.partial(_swiglu_kernel, block_k=config.block_k, unroll=config.unroll),
        grid=(t * top_k, width // bn),
        in_specs=[pl.BlockSpec((None,), lambda c, j: (c,)), pl.BlockSpec((None, k), lambda c, j: (c // top_k, 0))]
        + [pl.BlockSpec((num_experts, bn, k), index) for index in halves]
        + [pl.BlockSpec((num_experts, bn), lambda c, j, index=index: index(c, j)[:2])
           for index in halves[:len(scales)]],
        out_specs=pl.BlockSpec((None, bn), lambda c, j: (c, j)),
        out_shape=jax.ShapeDtypeStruct((t * top_k, width), x.dtype),
        compiler_params=triton_params(config.num_warps, config.num_stages),
        interpret=interpret,
    )(ids.reshape(-1), x, w, w, *scales)


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def expert_combine(a, weights, ids, w, scale, residual=None, *, config: ExpertMatmulConfig | None = None,
                   interpret: bool = False):
    """expert_combine_reference's contract: a program per (token, block of columns), through its k choices."""
    t, top_k = ids.shape
    _check_ids(ids, t)
    k = a.shape[1]
    num_experts, n = _check_experts(w, scale, k)
    config = config or default_config(k, n, combine=True, fp8=scale is not None)
    bn = config.block_n
    if a.shape[0] != t * top_k or weights.shape != ids.shape or n % bn or k % config.block_k:
        raise ValueError(f"a [T k, K], weights and ids [T, k] and w [E, N, K] with N by block_n and K by block_k: "
                         f"a {a.shape}, weights {weights.shape}, ids {ids.shape}, w {w.shape}, {config}")
    if residual is not None and (residual.shape != (t, n) or residual.dtype != a.dtype):
        raise ValueError(f"residual must be [T, N] = [{t}, {n}] of a's dtype, got {residual.dtype}{residual.shape}")
    extras = [x for x in (scale, residual) if x is not None]
    extra_specs = ([pl.BlockSpec((num_experts, bn), lambda r, j: (0, j))] if scale is not None else []) + (
        [pl.BlockSpec((None, bn), lambda r, j: (r, j))] if residual is not None else [])
    return pl.pallas_call(
        functools.partial(_combine_kernel, block_k=config.block_k, unroll=config.unroll, fp8=scale is not None),
        grid=(t, n // bn),
        in_specs=[pl.BlockSpec((None, top_k), lambda r, j: (r, 0))] * 2
        + [pl.BlockSpec((top_k, k), lambda r, j: (r, 0)), pl.BlockSpec((num_experts, bn, k), lambda r, j: (0, j, 0))]
        + extra_specs,
        out_specs=pl.BlockSpec((None, bn), lambda r, j: (r, j)),
        out_shape=jax.ShapeDtypeStruct((t, n), a.dtype),
        compiler_params=triton_params(config.num_warps, config.num_stages),
        interpret=interpret,
    )(ids, weights, a, w, *extras)
