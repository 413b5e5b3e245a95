"""pallas_kernels/grouped_matmul.py in Pallas' interpreter against its reference, and nanojax.moe's layout of a step's
choices in blocks of one expert against each choice through its own expert: odd row counts, unused experts, choices
of experts another device holds, blocks of 16 to 64 rows, FP8 experts."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from test_expert_matmul import fp8_experts

from nanojax.moe import _grouped
from pallas_kernels._compat import can_lower_for_cuda
from pallas_kernels.expert_matmul import expert_products_reference, swiglu
from pallas_kernels.grouped_matmul import GroupedMatmulConfig, grouped_matmul, grouped_matmul_reference

TOL = dict(rtol=1e-5, atol=1e-4)  # both accumulate exact products in f32: only the order of the sums differs


@pytest.mark.parametrize("block_m,k,n,experts,dtype,fp8", [(16, 64, 48, 5, jnp.float32, False),
                                                           (32, 96, 64, 3, jnp.bfloat16, False),
                                                           (16, 64, 32, 4, jnp.float32, True)])
def test_each_block_takes_its_experts_weights(block_m, k, n, experts, dtype, fp8):
    rng = np.random.default_rng(block_m * k + n)
    block_experts = np.sort(rng.choice(experts, size=min(experts, 4), replace=False))
    block_experts = jnp.asarray(np.concatenate([np.repeat(block_experts, 2), [-1, -1]]), jnp.int32)  # 2 unused
    x = jnp.asarray(rng.normal(size=(block_experts.shape[0] * block_m, k)), dtype)
    w, scale = fp8_experts(rng, experts, k, n) if fp8 else (jnp.asarray(rng.normal(size=(experts, n, k)), dtype), None)
    used = np.repeat(np.asarray(block_experts) >= 0, block_m)
    want = grouped_matmul_reference(x, w, scale, block_experts)
    for config in (None, GroupedMatmulConfig(block_n=16, block_k=32)):  # several K slices and column blocks
        got = grouped_matmul(x, w, scale, block_experts, config=config, interpret=True)
        np.testing.assert_allclose(got[used], want[used], **TOL)


@pytest.mark.parametrize("rows,top_k,experts", [(33, 4, 16)])
def test_choices_grouped_by_expert_equal_each_through_its_expert(rows, top_k, experts):
    rng = np.random.default_rng(rows)
    x = jnp.asarray(rng.normal(size=(rows, 64)), jnp.float32)
    up = (jnp.asarray(rng.normal(size=(experts, 96, 64)) * 0.1, jnp.float32), None)
    down = (jnp.asarray(rng.normal(size=(experts, 64, 48)) * 0.1, jnp.float32), None)
    choices = jnp.asarray(rng.integers(0, experts + 1, rows * top_k), jnp.int32)  # experts: held by another device
    kept = np.asarray(choices) < experts
    gated = swiglu(expert_products_reference(jnp.repeat(x, top_k, axis=0), *up, choices), x.dtype)
    want = expert_products_reference(gated, *down, choices)[kept]
    np.testing.assert_allclose(_grouped(x, choices, up, down, grouped_matmul_reference)[kept], want, **TOL)
    kernel = functools.partial(grouped_matmul, interpret=True)
    np.testing.assert_allclose(_grouped(x, choices, up, down, kernel)[kept], want, **TOL)


def test_bad_shapes_are_refused():
    w = jnp.zeros((3, 64, 64))
    with pytest.raises(ValueError, match="share K"):
        grouped_matmul(jnp.zeros((32, 32)), w, None, jnp.zeros(2, jnp.int32), interpret=True)
    with pytest.raises(ValueError, match="whole blocks"):
        grouped_matmul(jnp.zeros((24, 64)), w, None, jnp.zeros(2, jnp.int32), interpret=True)


@pytest.mark.skipif(not can_lower_for_cuda(), reason="this jaxlib compiles Triton kernels while lowering")
@pytest.mark.parametrize("fp8", [False, True])
def test_grouped_kernel_lowers_to_triton(fp8):
    """The Triton lowering rules, checked on CPU by lowering for cuda: Qwen3-30B-A3B's up projection (128 experts of
    1536 x 2048), bf16 or FP8 as stored, at batch 64."""
    dtype = jnp.float8_e4m3fn if fp8 else jnp.bfloat16
    w, scale = jax.ShapeDtypeStruct((128, 1536, 2048), dtype), jax.ShapeDtypeStruct((128, 1536), jnp.float32)
    args = (jax.ShapeDtypeStruct((640, 2048), jnp.bfloat16), w, scale if fp8 else None,
            jax.ShapeDtypeStruct((40,), jnp.int32))
    lowered = jax.jit(grouped_matmul).trace(*args).lower(lowering_platforms=("cuda",))
    assert "triton" in lowered.as_text()
