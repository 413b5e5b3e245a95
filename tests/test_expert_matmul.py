"""pallas_kernels/expert_matmul.py in Pallas' interpreter against its jnp reference: rows through their own experts'
weights, over shapes whose K and N are not powers of two, expert counts from 1 to 9, odd row counts and FP8 experts
(read as stored, w_t [E, N, K] with per-column scales)."""
import jax.numpy as jnp
import numpy as np
import pytest

from convert.quantize import dequantize
from pallas_kernels.expert_matmul import ExpertMatmulConfig, expert_matmul, expert_matmul_reference

TOL = dict(rtol=1e-5, atol=1e-4)  # both accumulate exact products in f32: only the order of the sums differs


def fp8_experts(rng, experts, k, n):
    """Random FP8 experts: (w_t [E, N, K] float8_e4m3fn, scale [E, N] f32)."""
    w_t = jnp.asarray(rng.normal(size=(experts, n, k)), jnp.float8_e4m3fn)
    return w_t, jnp.asarray(rng.uniform(0.5, 2.0, (experts, n)), jnp.float32)


@pytest.mark.parametrize("rows,k,n,experts,dtype", [(1, 64, 64, 1, jnp.float32), (3, 96, 48, 5, jnp.float32),
                                                     (8, 256, 192, 9, jnp.float32), (5, 128, 64, 8, jnp.bfloat16)])
def test_each_row_takes_its_experts_weights(rows, k, n, experts, dtype):
    rng = np.random.default_rng(rows * k + n)
    x = jnp.asarray(rng.normal(size=(rows, k)), dtype)
    w = jnp.asarray(rng.normal(size=(experts, k, n)), dtype)
    ids = jnp.asarray(rng.integers(0, experts, rows), jnp.int32)
    want = expert_matmul_reference(x, w, None, ids)
    np.testing.assert_allclose(expert_matmul(x, w, None, ids, interpret=True), want, **TOL)
    for small in (ExpertMatmulConfig(block_n=16, block_k=32), ExpertMatmulConfig(block_n=16, block_k=32, unroll=True)):
        # several K slices and column blocks a row, looped over or unrolled
        np.testing.assert_allclose(expert_matmul(x, w, None, ids, config=small, interpret=True), want, **TOL)


def test_ids_of_other_devices_experts_read_the_nearest_expert():
    """Expert parallelism hands each device ids outside its [0, E): the kernel clamps them in place of a launch."""
    rng = np.random.default_rng(7)
    x, w = jnp.asarray(rng.normal(size=(6, 64)), jnp.float32), jnp.asarray(rng.normal(size=(3, 64, 32)), jnp.float32)
    ids = jnp.asarray([-5, -1, 0, 2, 3, 9], jnp.int32)
    want = np.stack([np.asarray(x[i]) @ np.asarray(w[min(max(e, 0), 2)]) for i, e in enumerate(ids.tolist())])
    np.testing.assert_allclose(expert_matmul_reference(x, w, None, ids), want, **TOL)
    np.testing.assert_allclose(expert_matmul(x, w, None, ids, interpret=True), want, **TOL)


@pytest.mark.parametrize("rows,k,n,experts", [(3, 96, 48, 5), (8, 256, 64, 9)])
def test_fp8_experts_are_read_as_stored_and_scaled_after_the_products(rows, k, n, experts):
    rng = np.random.default_rng(rows)
    x = jnp.asarray(rng.normal(size=(rows, k)), jnp.float32)
    w_t, scale = fp8_experts(rng, experts, k, n)
    ids = jnp.asarray(rng.integers(0, experts, rows), jnp.int32)
    want = expert_matmul_reference(x, w_t, scale, ids)
    dense = dequantize({"w_t": w_t, "scale": scale})
    np.testing.assert_allclose(want, expert_matmul_reference(x, dense, None, ids), **TOL)
    np.testing.assert_allclose(expert_matmul(x, w_t, scale, ids, interpret=True), want, **TOL)


def test_bad_shapes_are_refused():
    x, w = jnp.zeros((2, 64)), jnp.zeros((3, 32, 64))
    with pytest.raises(ValueError, match="share K"):
        expert_matmul(x, w, None, jnp.zeros(2, jnp.int32), interpret=True)
    with pytest.raises(ValueError, match="ids must be int32"):
        expert_matmul(x, jnp.zeros((3, 64, 64)), None, jnp.zeros(3, jnp.int32), interpret=True)
