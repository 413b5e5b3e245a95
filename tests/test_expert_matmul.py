"""pallas_kernels/expert_matmul.py in Pallas' interpreter against its jnp reference: rows through their own experts'
weights, over shapes whose K and N are not powers of two, expert counts from 1 to 9 and odd row counts."""
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.expert_matmul import ExpertMatmulConfig, expert_matmul, expert_matmul_reference


@pytest.mark.parametrize("rows,k,n,experts,dtype", [(1, 64, 64, 1, jnp.float32), (3, 96, 48, 5, jnp.float32),
                                                     (8, 256, 192, 9, jnp.float32), (5, 128, 64, 8, jnp.bfloat16)])
def test_each_row_takes_its_experts_weights(rows, k, n, experts, dtype):
    rng = np.random.default_rng(rows * k + n)
    x = jnp.asarray(rng.normal(size=(rows, k)), dtype)
    w = jnp.asarray(rng.normal(size=(experts, k, n)), dtype)
    ids = jnp.asarray(rng.integers(0, experts, rows), jnp.int32)
    want = expert_matmul_reference(x, w, ids)
    tol = dict(rtol=1e-5, atol=1e-4)  # both accumulate exact products in f32: only the order of the sums differs
    np.testing.assert_allclose(expert_matmul(x, w, ids, interpret=True), want, **tol)
    small = ExpertMatmulConfig(block_n=16, block_k=32)  # several K slices and column blocks a row
    np.testing.assert_allclose(expert_matmul(x, w, ids, config=small, interpret=True), want, **tol)


def test_bad_shapes_are_refused():
    x, w = jnp.zeros((2, 64)), jnp.zeros((3, 32, 64))
    with pytest.raises(ValueError, match="share K"):
        expert_matmul(x, w, jnp.zeros(2, jnp.int32), interpret=True)
    with pytest.raises(ValueError, match="ids must be int32"):
        expert_matmul(x, jnp.zeros((3, 64, 64)), jnp.zeros(3, jnp.int32), interpret=True)
