"""rmsnorm_matmul against rmsnorm_matmul_reference, for every variant (norm or not, bias, SiLU-and-mul, residual) and
both ways of taking the norm's statistic ("rows", "gram"), with and without split K, on x.dtype weights and on FP8
weights (E4M3 [N, K] with per-channel scales, convert/quantize.py).

CPU tests run the kernel in interpret mode (which fills the output with NaN first, so an unwritten element shows up);
the `gpu` variants run the Triton kernel at Qwen3-0.6B / Llama-3.2-1B projection sizes.
"""
import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import requires_gpu

from convert.quantize import dequantize, quantize_weight
from pallas_kernels import rmsnorm_matmul as rmsnorm_matmul_module
from pallas_kernels._compat import can_lower_for_cuda
from pallas_kernels.rms_norm import rms_norm
from pallas_kernels.rmsnorm_matmul import (
    DECODE_CONFIG,
    FP8_SPLIT_PROGRAMS,
    PREFILL_CONFIG,
    ROW_STAT_BYTES,
    STAGE_BYTES,
    RmsNormMatmulConfig,
    _block_m,
    _default_config,
    _row_stat_rows,
    _stage_bytes,
    rmsnorm_matmul,
    rmsnorm_matmul_reference,
)

# The kernel and the reference compute one function in two rounding orders: the reference rounds the normalized x to
# x.dtype before its dot, as HF's RMSNorm does, and each step's result after it; the kernel scales the f32 dot of raw x
# by rstd and rounds once at the end. Where a dot or gate * up cancels, the two can then differ by more than any
# elementwise tolerance of the output's size, while both err by no more than their rounding: so each is measured
# against the float64 truth (`exact`). The kernel's largest error may not exceed the reference's by more than the
# spread between two rounding orders (`slack` of the largest value), and its error norm stays within what the dtype's
# rounding gives (REL_ERROR, ||out - exact|| / ||exact||).
REL_ERROR = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 1e-2}


def slack(dtype, k):
    """bf16: a quarter of a rounding step (the reference rounds several times where the kernel rounds once). f32:
    sqrt(K) ulps, the spread of a K-term f32 sum between two summation orders (on the GPU the reference is cuBLAS,
    whose blocked sums err 4-6x less than the kernel's running one, at 1-3 sqrt(K) ulps; no-norm projections too)."""
    return 2 ** -9 if dtype == jnp.bfloat16 else 2 ** -23 * np.sqrt(k)


EPS = 1e-6
# Small blocks so that CPU-sized problems still span several M, N and K blocks with ragged edges.
SMALL = RmsNormMatmulConfig(block_m=16, block_n=16, block_k=32)
STATS = ["rows", "gram"]


def make_inputs(seed, m, k, n, dtype, bias):
    """-> (x [M, K], w [K, N], bias [N] or None). x is not of unit RMS, so the norm matters."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k), np.float32) * 3.0
    w = rng.standard_normal((k, n), np.float32) / np.sqrt(k)
    b = rng.standard_normal(n, np.float32) if bias else None
    return tuple(None if a is None else jnp.asarray(a, dtype) for a in (x, w, b))


def make_fused_inputs(seed, m, k, n_out, dtype, *, bias, residual, activation):
    """-> (x, w [K, N], bias [N] or None, residual [M, n_out] or None); N = 2 * n_out for silu_mul (gate | up)."""
    n = 2 * n_out if activation == "silu_mul" else n_out
    x, w, b = make_inputs(seed, m, k, n, dtype, bias)
    r = jnp.asarray(np.random.default_rng(seed + 1).standard_normal((m, n_out), np.float32) * 2.0, dtype)
    return x, w, b, r if residual else None


def fp8_weights(w, seed):
    """w [K, N] with its columns' magnitudes spread over e^-2..e^2 (so that the scales differ) -> FP8 (w_t
    float8_e4m3fn [N, K], scale [N] float32). (w_t * scale[:, None])^T is the weight the reference computes with."""
    spread = np.exp(np.random.default_rng(seed).uniform(-2, 2, w.shape[1]))
    p = quantize_weight(np.asarray(w.astype(jnp.float32)) * spread)
    return p["w_t"], p["scale"]


def exact(x, w, bias, residual, activation, norm):
    """The semantics in float64 numpy, nothing rounded on the way: what the kernel and the reference both
    approximate."""
    x, w, bias, residual = (None if a is None else np.asarray(a.astype(jnp.float32), np.float64)
                            for a in (x, w, bias, residual))
    if norm:
        x = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS)
    p = x @ w + (0.0 if bias is None else bias)
    if activation == "silu_mul":
        gate, up = np.split(p, 2, axis=-1)
        p = gate / (1 + np.exp(-gate)) * up
    return p if residual is None else p + residual


def check(x, w, bias, residual=None, activation=None, norm=True, config=None, interpret=True, fp8=False):
    """fp8: w [K, N] is quantized first (fp8_weights); the truth is then the product with the dequantized weight."""
    kw = {"norm_eps": EPS if norm else None, "residual": residual, "activation": activation}
    if fp8:
        w, kw["w_scale"] = fp8_weights(w, x.shape[0])
    out = rmsnorm_matmul(x, w, bias, config=config, interpret=interpret, **kw)
    ref = rmsnorm_matmul_reference(x, w, bias, **kw)
    if fp8:
        w = dequantize({"w_t": w, "scale": kw["w_scale"]})
    n_out = w.shape[1] // 2 if activation == "silu_mul" else w.shape[1]
    assert out.shape == ref.shape == (x.shape[0], n_out) and out.dtype == ref.dtype == x.dtype
    out, ref = (np.asarray(a.astype(jnp.float32), np.float64) for a in (out, ref))
    assert np.isfinite(out).all()
    truth = exact(x, w, bias, residual, activation, norm)
    err, ref_err = np.abs(out - truth).max(), np.abs(ref - truth).max()
    assert err <= ref_err + slack(x.dtype, x.shape[1]) * np.abs(truth).max(), (err, ref_err)
    assert np.linalg.norm(out - truth) <= REL_ERROR[x.dtype] * np.linalg.norm(truth)


def stat_config(config, stat):
    return dataclasses.replace(config, norm_stat=stat)


@pytest.mark.parametrize("stat", STATS)
@pytest.mark.parametrize("m", [1, 5, 16, 33])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rows(m, dtype, stat):
    check(*make_inputs(m, m, 96, 40, dtype, bias=False), config=stat_config(SMALL, stat))


@pytest.mark.parametrize("stat", STATS)
@pytest.mark.parametrize("k", [64, 72, 576])
def test_k_not_a_block_multiple(k, stat):
    check(*make_inputs(k, 3, k, 24, jnp.float32, bias=True), config=stat_config(SMALL, stat))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_default_configs_with_bias(dtype):
    check(*make_inputs(1, 1, 200, 100, dtype, bias=True))  # DECODE_CONFIG, one row, N not a multiple of block_n
    check(*make_inputs(1, 2, 200, 100, dtype, bias=True))  # DECODE_CONFIG
    check(*make_inputs(2, 40, 600, 48, dtype, bias=True))  # BATCHED_DECODE_CONFIG, K = 600 ends in a partial block
    check(*make_inputs(3, 130, 64, 72, dtype, bias=True))  # PREFILL_CONFIG, two M blocks


def test_the_norm_is_hf_rms_norm_with_the_scale_folded_into_w():
    """rms_norm(x, scale) @ w, HF's order of operations, equals the kernel on w with the scale folded into its rows."""
    from convert.keys import fold_norm_scale

    x, w, _ = make_inputs(4, 3, 64, 32, jnp.float32, bias=False)
    scale = jnp.asarray(1 + 0.1 * np.random.default_rng(5).standard_normal(64), jnp.float32)
    hf = np.dot(rms_norm(x, scale, EPS), w)
    folded = jnp.asarray(fold_norm_scale(np.asarray(scale), np.asarray(w)))
    np.testing.assert_allclose(rmsnorm_matmul(x, folded, norm_eps=EPS, config=SMALL, interpret=True), hf, rtol=1e-5,
                               atol=1e-5)


# Every variant x bias x dtype; M and K rotate over the variants so that each variant meets every M (1, 3, 17, 64: one
# to four M blocks, ragged or not) and both K (576 and 896: 2.25 and 3.5 blocks of block_k = 256, the K of SmolLM's
# and Qwen2-0.5B's projections), and each normed variant both statistics. The output width 40 is not a multiple of
# block_n = 16 (nor is silu_mul's up columns' offset 40 in w).
FUSED_SMALL = RmsNormMatmulConfig(block_m=16, block_n=16, block_k=256)
VARIANTS = list(itertools.product([True, False], [True, False], [None, "silu_mul"]))  # norm, residual, activation
FUSED_CASES = [
    pytest.param(norm, residual, activation, bias, dtype, m, k, stat,
                 id=f"{'norm' if norm else 'nonorm'}-{'res' if residual else 'nores'}-{activation}-"
                    f"{'bias' if bias else 'nobias'}-{jnp.dtype(dtype).name}-m{m}-k{k}-{stat}")
    for v, (norm, residual, activation) in enumerate(VARIANTS)
    for j, (bias, dtype) in enumerate(itertools.product([True, False], [jnp.float32, jnp.bfloat16]))
    for m, k, stat in [([1, 3, 17, 64][(v + j) % 4], [576, 896][(v + j // 2) % 2], STATS[j % 2])]
]


@pytest.mark.parametrize("norm,residual,activation,bias,dtype,m,k,stat", FUSED_CASES)
def test_fused_variants(norm, residual, activation, bias, dtype, m, k, stat):
    inputs = make_fused_inputs(m * k, m, k, 40, dtype, bias=bias, residual=residual, activation=activation)
    check(*inputs, activation=activation, norm=norm, config=stat_config(FUSED_SMALL, stat))


@pytest.mark.parametrize("norm,residual,activation", VARIANTS)
@pytest.mark.parametrize("k_splits", [2, 3])
@pytest.mark.parametrize("stat", STATS)
def test_split_k(norm, residual, activation, k_splits, stat):
    """Split K over 4 K blocks (2 splits of two, or 3 splits of which the last is empty), bias included: the f32
    partials (and with "gram" each split's sums of squares) summed in XLA and the epilogue there give the kernel's
    result. Two row blocks, so the sums of squares of each are stored by their own programs."""
    config = dataclasses.replace(SMALL, k_splits=k_splits, norm_stat=stat)
    for dtype in (jnp.float32, jnp.bfloat16):
        inputs = make_fused_inputs(k_splits, 21, 120, 40, dtype, bias=True, residual=residual, activation=activation)
        check(*inputs, activation=activation, norm=norm, config=config)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("variant", ["o_proj", "gate_up"])
def test_fused_default_configs(variant, dtype):
    """The adapted presets (narrower N tiles, longer K tiles, two w tiles) on the three presets' M ranges."""
    kw = {"o_proj": {"norm": False, "residual": True, "activation": None},
          "gate_up": {"norm": True, "residual": False, "activation": "silu_mul"}}[variant]
    for seed, (m, k, n_out) in enumerate([(2, 600, 100), (40, 200, 48), (130, 72, 72)]):
        inputs = make_fused_inputs(seed, m, k, n_out, dtype, bias=True, residual=kw["residual"],
                                   activation=kw["activation"])
        check(*inputs, activation=kw["activation"], norm=kw["norm"])


@pytest.mark.parametrize("norm,residual,activation", VARIANTS)
@pytest.mark.parametrize("m", [1, 5])
def test_fp8_reference_is_dequantize_then_dot(norm, residual, activation, m):
    """The reference on FP8 weights (w_t [N, K], one row per output channel: XLA's dot reads them so) is the f32 dot
    with the dequantized [K, N] weight, up to f32 rounding, in every variant."""
    x, w, b, r = make_fused_inputs(9 + m, m, 96, 40, jnp.float32, bias=True, residual=residual, activation=activation)
    w_t, scale = fp8_weights(w, 9)
    assert w_t.shape == w.shape[::-1]
    kw = {"norm_eps": EPS if norm else None, "residual": r, "activation": activation}
    out = rmsnorm_matmul_reference(x, w_t, b, w_scale=scale, **kw)
    ref = rmsnorm_matmul_reference(x, dequantize({"w_t": w_t, "scale": scale}), b, **kw)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


# FP8 weights through the kernel: every variant in f32 and bf16 (x in f16 for the dot), M of one to three blocks,
# ragged K and N, both statistics, split K.
FP8_CASES = [
    pytest.param(norm, residual, activation, dtype, m, stat, k_splits,
                 id=f"{'norm' if norm else 'nonorm'}-{'res' if residual else 'nores'}-{activation}-"
                    f"{jnp.dtype(dtype).name}-m{m}-{stat}-s{k_splits}")
    for v, (norm, residual, activation) in enumerate(VARIANTS)
    for j, dtype in enumerate([jnp.float32, jnp.bfloat16])
    for m, stat, k_splits in [([1, 5, 33][(v + j) % 3], STATS[(v + j) % 2], [1, 2][v % 2])]
]


@pytest.mark.parametrize("norm,residual,activation,dtype,m,stat,k_splits", FP8_CASES)
def test_fp8_kernel(norm, residual, activation, dtype, m, stat, k_splits):
    inputs = make_fused_inputs(m + 40, m, 200, 40, dtype, bias=True, residual=residual, activation=activation)
    config = dataclasses.replace(SMALL, k_splits=k_splits, norm_stat=stat)
    check(*inputs, activation=activation, norm=norm, config=config, fp8=True)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fp8_default_configs(dtype):
    """The FP8 decode presets (gate/up's and the others', with their split K) at one and 16 rows, PREFILL_CONFIG
    above."""
    for seed, (m, k, n_out, activation) in enumerate([(1, 600, 100, None), (1, 1024, 72, "silu_mul"),
                                                      (16, 640, 48, None), (40, 200, 48, "silu_mul")]):
        inputs = make_fused_inputs(seed, m, k, n_out, dtype, bias=False, residual=activation is None,
                                   activation=activation)
        check(*inputs, activation=activation, norm=activation is not None, fp8=True)


@pytest.mark.parametrize("stat", STATS)
@pytest.mark.parametrize("norm", [True, False])
def test_fp8_kernel_takes_activations_past_f16s_range(norm, stat):
    """x enters the FP8 dot as f16 times FP8_X_SCALE: rows with activations of 2e5 (past f16's 65504, as the
    residual streams of real models come within a few times of it) and rows of tiny values both match the truth."""
    x, w, b, r = make_fused_inputs(7, 5, 200, 40, jnp.bfloat16, bias=True, residual=not norm, activation=None)
    scale = np.ones((5, 1), np.float32)
    scale[1], scale[3] = 2e5 / 3, 1e-3  # row 1 peaks near 2e5 (x is ~N(0, 3)), row 3 holds values near 1e-3
    x = jnp.asarray(np.asarray(x.astype(jnp.float32)) * scale, jnp.bfloat16)
    check(x, w, b, r, norm=norm, config=stat_config(SMALL, stat), fp8=True)


@pytest.mark.parametrize("m,k,dtype,rows", [
    (1, 1024, jnp.bfloat16, 1), (1, 8192, jnp.float32, 1), (8, 1024, jnp.bfloat16, 16),
    (16, 1024, jnp.bfloat16, 16), (16, 1024, jnp.float32, 0), (8, 2048, jnp.bfloat16, 0), (64, 1024, jnp.bfloat16, 0),
])
def test_statistic_choice(m, k, dtype, rows):
    """A single row loads only itself for the "rows" statistic; block_m rows do while they fit ROW_STAT_BYTES (decode
    batches up to 16 at hidden 1024 in bf16); larger blocks take the "gram" statistic (0)."""
    config = _default_config(m, k, 4096, dtype)
    itemsize = jnp.dtype(dtype).itemsize
    assert _row_stat_rows(config, m, k, itemsize) == rows
    if rows:
        assert rows * -(-k // config.block_k) * config.block_k * itemsize <= ROW_STAT_BYTES or m == 1
    assert _row_stat_rows(stat_config(config, "gram"), m, k, itemsize) == 0


# The H100's shared memory per thread block.
SHARED_MEMORY_BYTES = 227 << 10


@pytest.mark.parametrize("sms", [132, 108])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("fp8", [False, True])
def test_default_config_properties(sms, dtype, fp8, monkeypatch):
    """For any shape and SM count: every pipeline stage fits STAGE_BYTES and all stages the GPU's shared memory;
    split K only for decode rows, only while the grid stays within one program per SM (FP8: FP8_SPLIT_PROGRAMS per
    SM, and two K blocks per split), and every split starts inside K; blocks are powers of two (the config checks)."""
    monkeypatch.setattr(rmsnorm_matmul_module, "num_sms", lambda: sms)
    itemsize = jnp.dtype(dtype).itemsize
    for m, k, n_out, silu_mul in itertools.product((1, 8, 16, 17, 64, 65, 2048), (64, 256, 640, 896, 1024, 1152, 3072),
                                                   (64, 1024, 3072, 4096), (False, True)):
        config = _default_config(m, k, n_out, dtype, silu_mul=silu_mul, fp8=fp8)
        block_m, k_blocks = _block_m(config, m), -(-k // config.block_k)
        w_tiles = 2 if silu_mul else 1
        stage = (config.block_k * (block_m * itemsize + w_tiles * config.block_n) if fp8 else
                 _stage_bytes(block_m, config.block_n, config.block_k, itemsize=itemsize, w_tiles=w_tiles))
        where = f"{m=} {k=} {n_out=} {silu_mul=}: {config}"
        assert stage <= STAGE_BYTES and config.num_stages * stage <= SHARED_MEMORY_BYTES, where
        if config.k_splits > 1:
            programs = -(-m // block_m) * -(-n_out // config.block_n) * config.k_splits
            assert m <= 64 and programs <= (FP8_SPLIT_PROGRAMS if fp8 else 1) * sms, where
            assert (config.k_splits - 1) * -(-k_blocks // config.k_splits) < k_blocks, where
            assert not fp8 or -(-k_blocks // config.k_splits) >= 2, where


@pytest.mark.parametrize("shapes,kw,message", [
    (((4, 3, 64), (64, 32), None, None), {}, "expected x"),
    (((3, 64), (1, 64, 32), None, None), {}, "expected x"),
    (((3, 64), (48, 32), None, None), {}, "K differs"),
    (((3, 64), (64, 32), (31,), None), {}, r"bias must be \[N\] = \[32\]"),
    (((3, 64), (64, 32), None, (3, 16)), {}, r"residual must be \[M, N_out\] = \[3, 32\]"),
    (((3, 64), (64, 32), None, (1, 32)), {}, "residual must be"),
    (((3, 64), (64, 32), None, (3, 32)), {"activation": "silu_mul"}, r"residual must be .* = \[3, 16\]"),
    (((3, 64), (64, 33), None, None), {"activation": "silu_mul"}, "odd N = 33"),
    (((3, 64), (64, 32), (16,), None), {"activation": "silu_mul"}, r"bias must be \[N\] = \[32\]"),
    (((3, 64), (64, 32), None, None), {"activation": "gelu"}, "activation must be one of"),
    (((3, 64), (64, 32), None, None), {"norm_eps": 0.0}, "norm_eps must be None"),
    (((3, 64), (64, 32), None, None), {"norm_eps": -1e-6}, "norm_eps must be None"),
])
def test_rejects_bad_inputs(shapes, kw, message):
    x, w, bias, residual = (None if s is None else jnp.zeros(s) for s in shapes)
    with pytest.raises(ValueError, match=message):
        rmsnorm_matmul(x, w, bias, **{"norm_eps": EPS, "residual": residual, "interpret": True, **kw})


def test_rejects_bad_fp8_weights():
    """FP8 weights come as [N, K] with float32 scales [N]: without w_scale, transposed, or with scales of another
    shape or dtype they are refused, the error naming what is wrong."""
    x, w, _ = make_inputs(0, 2, 64, 32, jnp.bfloat16, bias=False)
    w_t, scale = fp8_weights(w, 0)
    with pytest.raises(ValueError, match="need w_scale"):
        rmsnorm_matmul(x, w_t, norm_eps=EPS, interpret=True)
    with pytest.raises(ValueError, match=r"K differs: x \(2, 64\), w FP8 \[N, K\]"):
        rmsnorm_matmul(x, w_t.T, w_scale=scale, interpret=True)
    with pytest.raises(ValueError, match="w_scale needs"):
        rmsnorm_matmul(x, w_t, w_scale=scale[:16], interpret=True)
    with pytest.raises(ValueError, match="w_scale needs"):
        rmsnorm_matmul(x, w_t.astype(jnp.bfloat16), w_scale=scale, interpret=True)
    with pytest.raises(ValueError, match="w_scale needs"):
        rmsnorm_matmul(x, w_t, w_scale=scale.astype(jnp.bfloat16), interpret=True)


def test_rejects_bad_dtypes():
    x, w, _ = make_inputs(0, 2, 64, 32, jnp.float32, bias=False)
    with pytest.raises(ValueError, match="dtype"):
        rmsnorm_matmul(x, w.astype(jnp.bfloat16), norm_eps=EPS, interpret=True)
    with pytest.raises(ValueError, match="dtype"):
        rmsnorm_matmul(x.astype(jnp.int32), w.astype(jnp.int32), norm_eps=EPS, interpret=True)
    with pytest.raises(ValueError, match="floating"):
        rmsnorm_matmul(x, w, jnp.zeros(32, jnp.int32), interpret=True)
    with pytest.raises(ValueError, match="residual dtype"):
        rmsnorm_matmul(x, w, norm_eps=EPS, residual=jnp.zeros((2, 32), jnp.bfloat16), interpret=True)


@pytest.mark.parametrize("field,value", [("block_m", 8), ("block_n", 24), ("block_k", 0), ("k_splits", 0),
                                         ("norm_stat", "prepass")])
def test_config_rejects_bad_blocks(field, value):
    with pytest.raises(ValueError):
        dataclasses.replace(DECODE_CONFIG, **{field: value})


@pytest.mark.skipif(not can_lower_for_cuda(), reason="this jaxlib compiles Triton kernels while lowering")
@pytest.mark.parametrize("m", [1, 64, 2048])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("norm,residual,activation", VARIANTS)
@pytest.mark.parametrize("fp8", [False, True])
def test_lowers_to_triton(m, dtype, norm, residual, activation, fp8):
    """The Triton lowering rules (power-of-two tensors, supported primitives), checked on CPU by lowering for cuda."""
    n_out = 576 if activation else 1152
    w = jax.ShapeDtypeStruct((1152, 896), jnp.float8_e4m3fn) if fp8 else jax.ShapeDtypeStruct((896, 1152), dtype)
    w_scale = jax.ShapeDtypeStruct((1152,), jnp.float32) if fp8 else None
    shapes = ((m, 896), (1152,), (m, n_out) if residual else None)
    x, b, r = (None if s is None else jax.ShapeDtypeStruct(s, dtype) for s in shapes)
    split = dataclasses.replace(DECODE_CONFIG, k_splits=4)
    for config in (None, split, stat_config(split, "gram"), stat_config(split, "rows")):
        fn = lambda x, w, s, b, r: rmsnorm_matmul(x, w, b, w_scale=s, norm_eps=EPS if norm else None, residual=r,
                                                  activation=activation, config=config)
        lowered = jax.jit(fn).trace(x, w, w_scale, b, r).lower(lowering_platforms=("cuda",))
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
    if dtype == jnp.bfloat16:  # another preset at this size too (f32 needs the default's halved block_k), and the
        # other statistic with split K
        check(*inputs, config=PREFILL_CONFIG if m <= 16 else DECODE_CONFIG, interpret=False)
        default = _default_config(m, k, n, dtype)
        other = "gram" if _row_stat_rows(default, m, k, 2) else "rows"
        if m <= 64:
            check(*inputs, config=dataclasses.replace(default, k_splits=2, norm_stat=other), interpret=False)


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
    inputs = make_fused_inputs(m + k, m, k, n_out, dtype, bias=kw["bias"], residual=kw["residual"],
                               activation=kw["activation"])
    check(*inputs, activation=kw["activation"], norm=kw["norm"], interpret=False)
    if dtype == jnp.bfloat16:  # another tiling too, small enough for any variant's shared memory
        check(*inputs, activation=kw["activation"], norm=kw["norm"], config=GPU_ALT_CONFIG, interpret=False)


# FP8 weights at model sizes: Qwen3-0.6B's four projections (which take the kernel at one row, nanojax.ops) and
# Qwen3-8B's gate/up and down, in their fused forms, at 1, 8 and 64 rows.
GPU_FP8_SHAPES = [(1024, 4096, "qkv"), (2048, 1024, "o_proj"), (1024, 3072, "gate_up"), (3072, 1024, "down"),
                  (4096, 12288, "gate_up"), (12288, 4096, "down")]
GPU_FP8_KW = dict(GPU_FUSED_KW, qkv={"norm": True, "bias": False, "residual": False, "activation": None})


@requires_gpu
@pytest.mark.parametrize("k,n_out,variant", GPU_FP8_SHAPES)
@pytest.mark.parametrize("m", [1, 8, 64])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_gpu_fp8(k, n_out, variant, m, dtype):
    kw = GPU_FP8_KW[variant]
    inputs = make_fused_inputs(m + k, m, k, n_out, dtype, bias=kw["bias"], residual=kw["residual"],
                               activation=kw["activation"])
    check(*inputs, activation=kw["activation"], norm=kw["norm"], interpret=False, fp8=True)
