"""pallas_kernels/topk_routing.py in Pallas' interpreter against its jnp references: the norm and router logits over
odd row counts, expert counts that are not powers of two and several slices of H; the routing over row counts that are
not a block's, k from 1 to 8, tied logits, with and without renormalization."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels._compat import can_lower_for_cuda
from pallas_kernels.rms_norm import rms_norm
from pallas_kernels.topk_routing import (RouterConfig, TopkRoutingConfig, rmsnorm_router, rmsnorm_router_reference,
                                         topk_routing, topk_routing_reference)


@pytest.mark.parametrize("rows,hidden,experts,dtype", [(1, 64, 8, jnp.float32), (3, 96, 60, jnp.float32),
                                                       (5, 128, 128, jnp.bfloat16)])
def test_router_normalizes_and_takes_the_logits(rows, hidden, experts, dtype):
    rng = np.random.default_rng(rows * hidden + experts)
    x = jnp.asarray(rng.normal(size=(rows, hidden)) * 3, dtype)
    scale, router = (jnp.asarray(rng.normal(size=shape), dtype) for shape in ((hidden,), (experts, hidden)))
    want_h, want_logits = rmsnorm_router_reference(x, scale, router, eps=1e-6)
    np.testing.assert_array_equal(want_h, rms_norm(x, scale, 1e-6))
    f32 = np.asarray(want_h, np.float32) @ np.asarray(router, np.float32).T
    np.testing.assert_allclose(np.asarray(want_logits, np.float32), f32, rtol=1e-2 if dtype == jnp.bfloat16 else 1e-5,
                               atol=1e-4)
    for config in (None, RouterConfig(block_e=4, block_k=32, num_warps=4)):
        h, logits = rmsnorm_router(x, scale, router, eps=1e-6, config=config, interpret=True)
        np.testing.assert_array_equal(h, want_h)  # the same roundings
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == jnp.float32 else dict(rtol=8e-3, atol=1e-2)  # one rounding
        np.testing.assert_allclose(np.asarray(logits, np.float32), np.asarray(want_logits, np.float32), **tol)


def test_router_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match="router \\[E, H\\]"):
        rmsnorm_router(jnp.zeros((2, 64)), jnp.ones(64), jnp.zeros((64, 8)), eps=1e-6, interpret=True)


@pytest.mark.skipif(not can_lower_for_cuda(), reason="this jaxlib compiles Triton kernels while lowering")
@pytest.mark.parametrize("experts,hidden", [(128, 2048), (64, 3584)])
def test_router_lowers_to_triton(experts, hidden):
    """Qwen3-30B-A3B's router and Qwen2-57B-A14B's (a hidden size not a power of two) at batch 1, lowered for cuda
    on CPU."""
    args = [jax.ShapeDtypeStruct(shape, jnp.bfloat16) for shape in ((1, hidden), (hidden,), (experts, hidden))]
    lowered = jax.jit(lambda *a: rmsnorm_router(*a, eps=1e-6)).trace(*args).lower(lowering_platforms=("cuda",))
    assert "triton" in lowered.as_text()


@pytest.mark.parametrize("rows,experts,top_k,normalize,dtype", [
    (1, 128, 8, True, jnp.bfloat16), (3, 8, 2, True, jnp.float32), (17, 60, 4, False, jnp.float32),
    (5, 9, 1, True, jnp.bfloat16), (33, 64, 6, True, jnp.bfloat16)])
def test_routing_matches_the_reference(rows, experts, top_k, normalize, dtype):
    logits = jnp.asarray(np.random.default_rng(rows * experts + top_k).normal(size=(rows, experts)), dtype)
    want_weights, want_ids = topk_routing_reference(logits, top_k, normalize)
    for config in (None, TopkRoutingConfig(block_rows=2)):
        weights, ids = topk_routing(logits, top_k, normalize, config=config, interpret=True)
        np.testing.assert_array_equal(ids, want_ids)
        np.testing.assert_allclose(weights, want_weights, rtol=1e-6, atol=1e-7)


def test_ties_go_to_the_lowest_expert_as_in_lax_top_k():
    logits = jnp.asarray([[0.5, 2.0, 2.0, 1.0, 2.0, -1.0], [1.0] * 6], jnp.bfloat16)
    want = topk_routing_reference(logits, 3, True)
    got = topk_routing(logits, 3, True, interpret=True)
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_array_equal(got[1], [[1, 2, 4], [0, 1, 2]])
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)


def test_bad_top_k_is_refused():
    with pytest.raises(ValueError, match="top_k must be in"):
        topk_routing(jnp.zeros((2, 4)), 5, True, interpret=True)
