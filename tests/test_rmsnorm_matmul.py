"""rmsnorm_matmul against rmsnorm_matmul_reference.

CPU tests run the kernel in interpret mode (which fills the output with NaN first, so an unwritten element shows up);
the `gpu` variants run the Triton kernel at Qwen3-0.6B / Llama-3.2-1B projection sizes.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels._compat import can_lower_for_cuda
from pallas_kernels.rmsnorm_matmul import (
    DECODE_CONFIG,
    PREFILL_CONFIG,
    RmsNormMatmulConfig,
    rmsnorm_matmul,
    rmsnorm_matmul_reference,
)

TOLERANCE = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 1e-2}
EPS = 1e-6
# Small blocks so that CPU-sized problems still span several M, N and K blocks with ragged edges.
SMALL = RmsNormMatmulConfig(block_m=16, block_n=16, block_k=32)


def requires_gpu(test):
    """Marks a test `gpu` and skips it unless jax runs on a GPU."""
    return pytest.mark.gpu(pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")(test))


def make_inputs(seed, m, k, n, dtype, bias):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k), np.float32) * 3.0  # not unit RMS, so the norm matters
    scale = 1.0 + 0.1 * rng.standard_normal(k, np.float32)
    w = rng.standard_normal((k, n), np.float32) / np.sqrt(k)
    b = rng.standard_normal(n, np.float32) if bias else None
    return tuple(None if a is None else jnp.asarray(a, dtype) for a in (x, scale, w, b))


def check(x, scale, w, bias, config=None, interpret=True):
    out = rmsnorm_matmul(x, scale, w, bias, eps=EPS, config=config, interpret=interpret)
    ref = rmsnorm_matmul_reference(x, scale, w, bias, eps=EPS)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    out, ref = np.asarray(out.astype(jnp.float32)), np.asarray(ref.astype(jnp.float32))
    assert np.isfinite(out).all()
    tol = TOLERANCE[x.dtype]
    np.testing.assert_allclose(out, ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("m", [1, 5, 16, 33])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rows(m, dtype):
    check(*make_inputs(m, m, 96, 40, dtype, bias=False), config=SMALL)


@pytest.mark.parametrize("k", [64, 72, 576])
def test_k_not_a_block_multiple(k):
    check(*make_inputs(k, 3, k, 24, jnp.float32, bias=True), config=SMALL)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_default_configs_with_bias(dtype):
    check(*make_inputs(1, 2, 200, 100, dtype, bias=True))  # DECODE_CONFIG, N not a multiple of block_n
    check(*make_inputs(2, 40, 600, 48, dtype, bias=True))  # BATCHED_DECODE_CONFIG, K = 600 ends in a partial block
    check(*make_inputs(3, 130, 64, 72, dtype, bias=True))  # PREFILL_CONFIG, two M blocks


def test_norm_scale_and_bias_dtypes_follow_reference():
    x, scale, w, bias = make_inputs(3, 4, 64, 32, jnp.bfloat16, bias=True)
    check(x, scale.astype(jnp.float32), w, bias.astype(jnp.float32), config=SMALL)


@pytest.mark.parametrize("args,message", [
    (((4, 3, 64), (64,), (64, 32), None), "expected x"),
    (((3, 64), (64,), (1, 64, 32), None), "expected x"),
    (((3, 64), (48,), (64, 32), None), "K differs"),
    (((3, 64), (64,), (48, 32), None), "K differs"),
    (((3, 64), (64,), (64, 32), (31,)), "bias"),
])
def test_rejects_bad_shapes(args, message):
    x, scale, w, bias = (None if s is None else jnp.zeros(s) for s in args)
    with pytest.raises(ValueError, match=message):
        rmsnorm_matmul(x, scale, w, bias, eps=EPS, interpret=True)


def test_rejects_bad_dtypes():
    x, scale, w, _ = make_inputs(0, 2, 64, 32, jnp.float32, bias=False)
    with pytest.raises(ValueError, match="dtype"):
        rmsnorm_matmul(x, scale, w.astype(jnp.bfloat16), eps=EPS, interpret=True)
    with pytest.raises(ValueError, match="dtype"):
        rmsnorm_matmul(x.astype(jnp.int32), scale, w.astype(jnp.int32), eps=EPS, interpret=True)
    with pytest.raises(ValueError, match="floating"):
        rmsnorm_matmul(x, scale.astype(jnp.int32), w, eps=EPS, interpret=True)


@pytest.mark.parametrize("field,value", [("block_m", 8), ("block_n", 24), ("block_k", 0)])
def test_config_rejects_bad_blocks(field, value):
    with pytest.raises(ValueError):
        dataclasses.replace(DECODE_CONFIG, **{field: value})


@pytest.mark.skipif(not can_lower_for_cuda(), reason="this jaxlib compiles Triton kernels while lowering")
@pytest.mark.parametrize("m", [1, 64, 2048])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_lowers_to_triton(m, dtype):
    """The Triton lowering rules (power-of-two tensors, supported primitives), checked on CPU by lowering for cuda."""
    args = [jax.ShapeDtypeStruct(s, dtype) for s in ((m, 896), (896,), (896, 1152), (1152,))]
    lowered = jax.jit(lambda *a: rmsnorm_matmul(*a, eps=EPS)).trace(*args).lower(lowering_platforms=("cuda",))
    assert "triton" in lowered.as_text()


# ------------------------------------------------------------------------------------------------ GPU, model sizes
# (K, N): Qwen3-0.6B QKV (1024 -> (16 + 2 * 8) * 128) and gate/up (1024 -> 2 * 3072); Llama-3.2-1B QKV
# (2048 -> (32 + 2 * 8) * 64); K = 576 and 896 for SmolLM / Qwen2-0.5B widths, with a bias as Qwen2's QKV.
GPU_SHAPES = [(1024, 4096, False), (1024, 6144, False), (2048, 3072, False), (576, 960, False), (896, 1152, True)]


@requires_gpu
@pytest.mark.parametrize("k,n,bias", GPU_SHAPES)
@pytest.mark.parametrize("m", [1, 8, 64, 2048])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_gpu(k, n, bias, m, dtype):
    inputs = make_inputs(m + k, m, k, n, dtype, bias)
    check(*inputs, interpret=False)
    if dtype == jnp.bfloat16:  # another preset at this size too (f32 needs the default's halved block_k)
        check(*inputs, config=PREFILL_CONFIG if m <= 16 else DECODE_CONFIG, interpret=False)
