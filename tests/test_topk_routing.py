"""pallas_kernels/topk_routing.py in Pallas' interpreter against its jnp reference: row counts that are not a block's,
expert counts that are not powers of two, k from 1 to 8, tied logits, with and without renormalization."""
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.topk_routing import TopkRoutingConfig, topk_routing, topk_routing_reference


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
