"""pallas_kernels/expert_matmul.py in Pallas' interpreter against its jnp references: each choice's SwiGLU through its
expert, and each token's choices combined through their experts' down projections, over widths that are not powers of
two, expert counts from 1 to 9, odd token counts, choices of experts another device holds, FP8 experts (read as
stored, w_t [E, N, K] with per-column scales), with and without the residual."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from convert.quantize import dequantize
from pallas_kernels._compat import can_lower_for_cuda
from pallas_kernels.expert_matmul import (ExpertMatmulConfig, expert_combine, expert_combine_reference,
                                          expert_products_reference, expert_swiglu, expert_swiglu_reference)

TOL = dict(rtol=1e-5, atol=1e-4)  # both accumulate exact products in f32: only the order of the sums differs
# Several K slices and column blocks a program, looped over or unrolled.
SMALL = (ExpertMatmulConfig(block_n=16, block_k=32), ExpertMatmulConfig(block_n=16, block_k=32, unroll=False))


def fp8_experts(rng, experts, k, n):
    """Random FP8 experts: (w_t [E, N, K] float8_e4m3fn, scale [E, N] f32)."""
    w_t = jnp.asarray(rng.normal(size=(experts, n, k)), jnp.float8_e4m3fn)
    return w_t, jnp.asarray(rng.uniform(0.5, 2.0, (experts, n)), jnp.float32)


def experts_and_choices(rng, tokens, top_k, k, n, experts, dtype, fp8=False):
    """(x [T, K], ids [T, k] with ids of other devices' experts among them, weights [T, k], (w, scale))."""
    x = jnp.asarray(rng.normal(size=(tokens, k)), dtype)
    ids = jnp.asarray(rng.integers(-1, experts + 1, (tokens, top_k)), jnp.int32)
    weights = jnp.asarray(rng.uniform(size=(tokens, top_k)), jnp.float32)
    w = fp8_experts(rng, experts, k, n) if fp8 else (jnp.asarray(rng.normal(size=(experts, n, k)) * 0.1, dtype), None)
    return x, ids, weights, w


@pytest.mark.parametrize("tokens,top_k,k,width,experts,dtype", [
    (1, 1, 64, 32, 1, jnp.float32), (3, 2, 96, 48, 5, jnp.float32), (1, 8, 256, 96, 9, jnp.float32),
    (5, 2, 128, 64, 8, jnp.bfloat16)])
def test_each_choice_takes_its_experts_swiglu(tokens, top_k, k, width, experts, dtype):
    rng = np.random.default_rng(tokens * k + width)
    x, ids, _, (w, _) = experts_and_choices(rng, tokens, top_k, k, 2 * width, experts, dtype)
    rows = np.repeat(np.asarray(x, np.float32), top_k, axis=0)
    gate_up = np.einsum("mk,mnk->mn", rows, np.asarray(w, np.float32)[np.clip(np.asarray(ids).reshape(-1), 0,
                                                                                        experts - 1)])
    gate, up = np.split(gate_up, 2, axis=1)
    want = expert_swiglu_reference(x, ids, w, None)
    if dtype == jnp.float32:  # the reference is silu(gate) * up, each choice through its (nearest) expert
        np.testing.assert_allclose(want, gate / (1 + np.exp(-gate)) * up, rtol=1e-4, atol=1e-4)
    tol = TOL if dtype == jnp.float32 else dict(rtol=2e-2, atol=2e-2)  # bf16: a rounding of the products apart
    for config in (None, *SMALL):
        got = expert_swiglu(x, ids, w, None, config=config, interpret=True)
        assert got.dtype == x.dtype and got.shape == (tokens * top_k, width)
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), **tol)


@pytest.mark.parametrize("tokens,top_k,k,n,experts,dtype", [
    (1, 1, 64, 32, 1, jnp.float32), (3, 2, 96, 48, 5, jnp.float32), (1, 8, 64, 256, 9, jnp.float32),
    (5, 2, 128, 64, 8, jnp.bfloat16)])
def test_each_tokens_choices_are_weighted_and_summed(tokens, top_k, k, n, experts, dtype):
    rng = np.random.default_rng(tokens * k + n)
    _, ids, weights, (w, _) = experts_and_choices(rng, tokens, top_k, k, n, experts, dtype)
    a = jnp.asarray(rng.normal(size=(tokens * top_k, k)), dtype)
    residual = jnp.asarray(rng.normal(size=(tokens, n)), dtype)
    kept = (np.asarray(ids) >= 0) & (np.asarray(ids) < experts)
    products = np.asarray(expert_products_reference(a, w, None, ids.reshape(-1))).reshape(tokens, top_k, n)
    want = np.sum(np.where(kept[..., None], products * np.asarray(weights)[..., None], 0), axis=1)
    np.testing.assert_allclose(np.asarray(expert_combine_reference(a, weights, ids, w, None), np.float32),
                               np.asarray(jnp.asarray(want).astype(dtype), np.float32), **TOL)
    for res in (None, residual):
        want_out = expert_combine_reference(a, weights, ids, w, None, res)
        tol = TOL if dtype == jnp.float32 else dict(rtol=1e-2, atol=1e-2)  # one bf16 rounding of the sum
        for config in (None, *SMALL):
            got = expert_combine(a, weights, ids, w, None, res, config=config, interpret=True)
            assert got.dtype == dtype and got.shape == (tokens, n)
            np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want_out, np.float32), **tol)


def test_other_devices_experts_add_nothing_and_read_the_nearest():
    """Expert parallelism hands each device ids outside its [0, E): the kernels clamp them in place of a launch, and
    the combine gives them no weight."""
    rng = np.random.default_rng(7)
    x, w = jnp.asarray(rng.normal(size=(2, 64)), jnp.float32), jnp.asarray(rng.normal(size=(3, 32, 64)), jnp.float32)
    ids = jnp.asarray([[-5, 2], [3, 9]], jnp.int32)
    want = np.stack([np.asarray(w[min(max(e, 0), 2)]) @ np.asarray(x[i // 2]) for i, e in
                     enumerate(ids.reshape(-1).tolist())])
    gate, up = np.split(want, 2, axis=1)
    np.testing.assert_allclose(expert_swiglu(x, ids, w, None, interpret=True), gate / (1 + np.exp(-gate)) * up, **TOL)
    down = jnp.asarray(rng.normal(size=(3, 64, 16)), jnp.float32)
    a = jnp.asarray(rng.normal(size=(4, 16)), jnp.float32)
    got = expert_combine(a, jnp.ones((2, 2), jnp.float32), ids, down, None, interpret=True)
    np.testing.assert_allclose(got, np.stack([np.asarray(down[2]) @ np.asarray(a[1]), np.zeros(64)]), **TOL)


@pytest.mark.parametrize("tokens,top_k,k,n,experts", [(3, 2, 96, 48, 5), (1, 8, 256, 64, 9)])
def test_fp8_experts_are_read_as_stored_and_scaled_after_the_products(tokens, top_k, k, n, experts):
    rng = np.random.default_rng(tokens)
    x, ids, weights, (w_t, scale) = experts_and_choices(rng, tokens, top_k, k, 2 * n, experts, jnp.float32, fp8=True)
    x = x * 0.05  # products of order 1, as a model's (unit FP8 weights with unit rows would give gate * up ~ 1e3)
    dense = jnp.swapaxes(dequantize({"w_t": w_t, "scale": scale}), 1, 2)
    want = expert_swiglu_reference(x, ids, w_t, scale)
    np.testing.assert_allclose(want, expert_swiglu_reference(x, ids, dense, None), **TOL)
    np.testing.assert_allclose(expert_swiglu(x, ids, w_t, scale, interpret=True), want, **TOL)
    down_t, down_scale = fp8_experts(rng, experts, n, k)
    want = expert_combine_reference(want, weights, ids, down_t, down_scale, x)
    got = expert_combine(expert_swiglu(x, ids, w_t, scale, interpret=True), weights, ids, down_t, down_scale, x,
                         interpret=True)
    np.testing.assert_allclose(got, want, **TOL)


def test_bad_shapes_are_refused():
    x, ids = jnp.zeros((2, 64)), jnp.zeros((2, 2), jnp.int32)
    with pytest.raises(ValueError, match="experts \\[E, N, K\\] with K = 64"):
        expert_swiglu(x, ids, jnp.zeros((3, 64, 32)), None, interpret=True)
    with pytest.raises(ValueError, match="ids must be int32 \\[T, k\\] with T = 2"):
        expert_swiglu(x, ids[:1], jnp.zeros((3, 64, 64)), None, interpret=True)
    with pytest.raises(ValueError, match="FP8 experts need scale"):
        expert_swiglu(x, ids, jnp.zeros((3, 64, 64), jnp.float8_e4m3fn), None, interpret=True)
    with pytest.raises(ValueError, match="residual must be"):
        expert_combine(jnp.zeros((4, 64)), jnp.zeros((2, 2)), ids, jnp.zeros((3, 32, 64)), None, jnp.zeros((2, 64)),
                       interpret=True)


@pytest.mark.skipif(not can_lower_for_cuda(), reason="this jaxlib compiles Triton kernels while lowering")
@pytest.mark.parametrize("fp8", [False, True])
def test_both_kernels_lower_to_triton(fp8):
    """The Triton lowering rules, checked on CPU by lowering for cuda: Qwen3-30B-A3B's experts (128 of 2048 x 768),
    bf16 or FP8 as stored, at batch 1, with the residual."""
    def experts(n, k):
        dtype = jnp.float8_e4m3fn if fp8 else jnp.bfloat16
        return jax.ShapeDtypeStruct((128, n, k), dtype), jax.ShapeDtypeStruct((128, n), jnp.float32) if fp8 else None

    ids, x = jax.ShapeDtypeStruct((1, 8), jnp.int32), jax.ShapeDtypeStruct((1, 2048), jnp.bfloat16)
    weights, a = jax.ShapeDtypeStruct((1, 8), jnp.float32), jax.ShapeDtypeStruct((8, 768), jnp.bfloat16)
    for lowered in (jax.jit(expert_swiglu).trace(x, ids, *experts(1536, 2048)),
                    jax.jit(expert_combine).trace(a, weights, ids, *experts(2048, 768), x)):
        assert "triton" in lowered.lower(lowering_platforms=("cuda",)).as_text()
