"""rmsnorm_matmul against rmsnorm_matmul_reference, for every variant (norm or not, bias, SiLU-and-mul, residual).

CPU tests run the kernel in interpret mode (which fills the output with NaN first, so an unwritten element shows up);
the `gpu` variants run the Triton kernel at Qwen3-0.6B / Llama-3.2-1B projection sizes.
"""
import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels._compat import can_lower_for_cuda
from pallas_kernels.rmsnorm_matmul import (
    DECODE_CONFIG,
    NUM_SMS,
    PREFILL_CONFIG,
    STAGE_BYTES,
    RmsNormMatmulConfig,
    _block_m,
    _default_config,
    _stage_bytes,
    rmsnorm_matmul,
    rmsnorm_matmul_reference,
)

TOLERANCE = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 1e-2}
# With a SiLU-and-mul or a residual add, the reference rounds the projection (and gate, up, silu) to x.dtype before
# the last step, as the model does, while the kernel keeps them in f32 and rounds once: in bf16 the two are a few
# roundings apart, of intermediate values that can be larger than the output (a residual cancelling the projection),
# so the bound is wider and its absolute part scales with the output's RMS.
FUSED_TOLERANCE = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 2e-2}
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


def make_fused_inputs(seed, m, k, n_out, dtype, *, norm, bias, residual, activation):
    """-> (x, norm_scale or None, w [K, N], bias [N] or None, residual [M, n_out] or None); N = 2 * n_out for
    silu_mul (gate | up columns)."""
    n = 2 * n_out if activation == "silu_mul" else n_out
    x, scale, w, b = make_inputs(seed, m, k, n, dtype, bias)
    r = jnp.asarray(np.random.default_rng(seed + 1).standard_normal((m, n_out), np.float32) * 2.0, dtype)
    return x, scale if norm else None, w, b, r if residual else None


def check(x, scale, w, bias, residual=None, activation=None, config=None, interpret=True):
    kw = {"eps": EPS, "residual": residual, "activation": activation}
    out = rmsnorm_matmul(x, scale, w, bias, config=config, interpret=interpret, **kw)
    ref = rmsnorm_matmul_reference(x, scale, w, bias, **kw)
    n_out = w.shape[1] // 2 if activation == "silu_mul" else w.shape[1]
    assert out.shape == ref.shape == (x.shape[0], n_out) and out.dtype == ref.dtype == x.dtype
    out, ref = np.asarray(out.astype(jnp.float32)), np.asarray(ref.astype(jnp.float32))
    assert np.isfinite(out).all()
    if residual is None and activation is None:
        tol = TOLERANCE[x.dtype]
        np.testing.assert_allclose(out, ref, rtol=tol, atol=tol)
        return
    tol = FUSED_TOLERANCE[x.dtype]
    np.testing.assert_allclose(out, ref, rtol=tol, atol=tol * max(1.0, float(np.sqrt(np.mean(np.square(ref))))))
    if x.dtype != jnp.float32:  # rounding once is no less accurate: compare both with f32 math on the same inputs
        f32 = lambda a: None if a is None else a.astype(jnp.float32)
        exact = np.asarray(rmsnorm_matmul_reference(*map(f32, (x, scale, w, bias)), eps=EPS,
                                                    residual=f32(residual), activation=activation))
        assert np.abs(out - exact).max() <= np.abs(ref - exact).max() + 2 ** -9 * np.abs(exact).max()


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


# Every variant x bias x dtype; M and K rotate over the variants so that each variant meets every M (1, 3, 17, 64: one
# to four M blocks, ragged or not) and both K (576 and 896: 2.25 and 3.5 blocks of block_k = 256, the K of SmolLM's
# and Qwen2-0.5B's projections). The output width 40 is not a multiple of block_n = 16 (nor is silu_mul's up columns'
# offset 40 in w).
FUSED_SMALL = RmsNormMatmulConfig(block_m=16, block_n=16, block_k=256)
VARIANTS = list(itertools.product([True, False], [True, False], [None, "silu_mul"]))  # norm, residual, activation
FUSED_CASES = [
    pytest.param(norm, residual, activation, bias, dtype, m, k,
                 id=f"{'norm' if norm else 'nonorm'}-{'res' if residual else 'nores'}-{activation}-"
                    f"{'bias' if bias else 'nobias'}-{jnp.dtype(dtype).name}-m{m}-k{k}")
    for v, (norm, residual, activation) in enumerate(VARIANTS)
    for j, (bias, dtype) in enumerate(itertools.product([True, False], [jnp.float32, jnp.bfloat16]))
    for m, k in [([1, 3, 17, 64][(v + j) % 4], [576, 896][(v + j // 2) % 2])]
]


@pytest.mark.parametrize("norm,residual,activation,bias,dtype,m,k", FUSED_CASES)
def test_fused_variants(norm, residual, activation, bias, dtype, m, k):
    inputs = make_fused_inputs(m * k, m, k, 40, dtype, norm=norm, bias=bias, residual=residual, activation=activation)
    check(*inputs, activation=activation, config=FUSED_SMALL)


@pytest.mark.parametrize("norm,residual,activation", VARIANTS)
@pytest.mark.parametrize("k_splits", [2, 3])
def test_split_k(norm, residual, activation, k_splits):
    """Split K over 4 K blocks (2 splits of two, or 3 splits of which the last is empty), bias included:
    the f32 partials summed in XLA and the epilogue there give the kernel's result."""
    config = dataclasses.replace(SMALL, k_splits=k_splits)
    for dtype in (jnp.float32, jnp.bfloat16):
        inputs = make_fused_inputs(k_splits, 5, 120, 40, dtype, norm=norm, bias=True, residual=residual,
                                   activation=activation)
        check(*inputs, activation=activation, config=config)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("variant", ["o_proj", "gate_up"])
def test_fused_default_configs(variant, dtype):
    """The adapted presets (narrower N tiles, longer K tiles, two w tiles) on the three presets' M ranges."""
    kw = {"o_proj": {"norm": False, "residual": True, "activation": None},
          "gate_up": {"norm": True, "residual": False, "activation": "silu_mul"}}[variant]
    for seed, (m, k, n_out) in enumerate([(2, 600, 100), (40, 200, 48), (130, 72, 72)]):
        check(*make_fused_inputs(seed, m, k, n_out, dtype, bias=True, **kw), activation=kw["activation"])


@pytest.mark.parametrize("m,k,n_out,silu_mul,splits", [
    (1, 1024, 4096, False, 2), (1, 2048, 1024, False, 8), (1, 1024, 3072, True, 2), (1, 3072, 1024, False, 8),
    (8, 2048, 1024, False, 8), (64, 1024, 3072, True, 2), (64, 1024, 4096, False, 2), (1, 256, 1024, False, 2),
    (2048, 1024, 3072, True, 1),
])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_default_config_adapts(m, k, n_out, silu_mul, splits, dtype):
    """Decode grids get split K up to about one program per SM (the Qwen3-0.6B splits that measured best: 2 for QKV
    and gate/up, 8 for o_proj and down_proj; never more splits than K blocks), and no stage needs more shared memory
    than STAGE_BYTES."""
    config = _default_config(m, k, n_out, dtype, silu_mul=silu_mul)
    assert config.k_splits == splits
    block_m = _block_m(config, m)
    assert -(-m // block_m) * -(-n_out // config.block_n) * config.k_splits <= NUM_SMS or config.k_splits == 1
    assert _stage_bytes(block_m, config.block_n, config.block_k, itemsize=jnp.dtype(dtype).itemsize,
                        w_tiles=2 if silu_mul else 1) <= STAGE_BYTES


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


@pytest.mark.parametrize("shapes,kw,message", [
    (((3, 64), (64,), (64, 32), None, (3, 16)), {}, r"residual must be \[M, N_out\] = \[3, 32\]"),
    (((3, 64), (64,), (64, 32), None, (1, 32)), {}, "residual must be"),
    (((3, 64), (64,), (64, 32), None, (3, 32)), {"activation": "silu_mul"}, r"residual must be .* = \[3, 16\]"),
    (((3, 64), (64,), (64, 33), None, None), {"activation": "silu_mul"}, "odd N = 33"),
    (((3, 64), (64,), (64, 32), (16,), None), {"activation": "silu_mul"}, r"bias must be \[N\] = \[32\]"),
    (((3, 64), (64,), (64, 32), None, None), {"activation": "gelu"}, "activation must be one of"),
    (((3, 64), (64,), (64, 32), None, None), {"eps": None}, "eps is required"),
    (((3, 64), (1, 64), (64, 32), None, None), {}, "expected x"),
    (((3, 64), None, (48, 32), None, None), {}, "K differs"),
])
def test_rejects_bad_fused_inputs(shapes, kw, message):
    x, scale, w, bias, residual = (None if s is None else jnp.zeros(s) for s in shapes)
    with pytest.raises(ValueError, match=message):
        rmsnorm_matmul(x, scale, w, bias, **{"eps": EPS, "residual": residual, "interpret": True, **kw})


def test_no_norm_needs_no_eps():
    x, _, w, bias, residual = make_fused_inputs(9, 3, 64, 24, jnp.float32, norm=False, bias=True, residual=True,
                                                activation=None)
    out = rmsnorm_matmul(x, None, w, bias, residual=residual, config=SMALL, interpret=True)
    np.testing.assert_allclose(out, rmsnorm_matmul_reference(x, None, w, bias, residual=residual), rtol=1e-5,
                               atol=1e-5)


def test_rejects_bad_dtypes():
    x, scale, w, _ = make_inputs(0, 2, 64, 32, jnp.float32, bias=False)
    with pytest.raises(ValueError, match="dtype"):
        rmsnorm_matmul(x, scale, w.astype(jnp.bfloat16), eps=EPS, interpret=True)
    with pytest.raises(ValueError, match="dtype"):
        rmsnorm_matmul(x.astype(jnp.int32), scale, w.astype(jnp.int32), eps=EPS, interpret=True)
    with pytest.raises(ValueError, match="floating"):
        rmsnorm_matmul(x, scale.astype(jnp.int32), w, eps=EPS, interpret=True)
    with pytest.raises(ValueError, match="floating"):
        rmsnorm_matmul(x, None, w, jnp.zeros(32, jnp.int32), interpret=True)
    with pytest.raises(ValueError, match="residual dtype"):
        rmsnorm_matmul(x, scale, w, eps=EPS, residual=jnp.zeros((2, 32), jnp.bfloat16), interpret=True)


@pytest.mark.parametrize("field,value", [("block_m", 8), ("block_n", 24), ("block_k", 0), ("k_splits", 0)])
def test_config_rejects_bad_blocks(field, value):
    with pytest.raises(ValueError):
        dataclasses.replace(DECODE_CONFIG, **{field: value})


@pytest.mark.skipif(not can_lower_for_cuda(), reason="this jaxlib compiles Triton kernels while lowering")
@pytest.mark.parametrize("m", [1, 64, 2048])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("norm,residual,activation", VARIANTS)
def test_lowers_to_triton(m, dtype, norm, residual, activation):
    """The Triton lowering rules (power-of-two tensors, supported primitives), checked on CPU by lowering for cuda."""
    n_out = 576 if activation else 1152
    shapes = ((m, 896), (896,) if norm else None, (896, 1152), (1152,), (m, n_out) if residual else None)
    args = [None if s is None else jax.ShapeDtypeStruct(s, dtype) for s in shapes]
    for config in (None, dataclasses.replace(DECODE_CONFIG, k_splits=4)):
        fn = lambda x, s, w, b, r: rmsnorm_matmul(x, s, w, b, eps=EPS, residual=r, activation=activation,
                                                  config=config)
        lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
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


# Fused variants at model sizes: (K, N_out) of o_proj / down_proj with the residual add (Qwen3-0.6B 2048 -> 1024 and
# 3072 -> 1024; Llama-3.2-1B 2048 -> 2048 and 8192 -> 2048), and of gate/up with SiLU-and-mul (Qwen3-0.6B
# 1024 -> 2 x 3072; Llama-3.2-1B 2048 -> 2 x 8192; Qwen2-0.5B widths with a bias).
GPU_FUSED_SHAPES = [
    (2048, 1024, "o_proj"), (3072, 1024, "down"), (2048, 2048, "o_proj"), (8192, 2048, "down"),
    (1024, 3072, "gate_up"), (2048, 8192, "gate_up"), (896, 4864, "gate_up_bias"),
]
GPU_ALT_CONFIG = RmsNormMatmulConfig(block_m=32, block_n=32, block_k=64, num_warps=4, num_stages=3)
GPU_FUSED_KW = {"o_proj": {"norm": False, "bias": False, "residual": True, "activation": None},
                "down": {"norm": False, "bias": False, "residual": True, "activation": None},
                "gate_up": {"norm": True, "bias": False, "residual": False, "activation": "silu_mul"},
                "gate_up_bias": {"norm": True, "bias": True, "residual": False, "activation": "silu_mul"}}


@requires_gpu
@pytest.mark.parametrize("k,n_out,variant", GPU_FUSED_SHAPES)
@pytest.mark.parametrize("m", [1, 8, 64, 2048])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_gpu_fused(k, n_out, variant, m, dtype):
    kw = GPU_FUSED_KW[variant]
    inputs = make_fused_inputs(m + k, m, k, n_out, dtype, **kw)
    check(*inputs, activation=kw["activation"], interpret=False)
    if dtype == jnp.bfloat16:  # another tiling too, small enough for any variant's shared memory
        check(*inputs, activation=kw["activation"], config=GPU_ALT_CONFIG, interpret=False)
