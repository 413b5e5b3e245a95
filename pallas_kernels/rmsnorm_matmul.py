"""One fused kernel per projection of a decoder layer: [RMSNorm] -> matmul [+ bias] [-> SiLU-and-mul] [+ residual]:
qkv and gate/up (activation="silu_mul") take the norm, o_proj and down the residual.

The RMSNorm's scale is folded into w's rows at conversion (convert/keys.py, fold_norm_scale), so the kernel streams
raw x and scales its f32 accumulator by rstd at the end. FP8 weights [N, K] (convert/quantize.py) are the dot's left
operand ("swap AB"), upcast in registers to f16 with x (docs/perf_notes.md, "FP8 weights").
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._compat import check_pow2, dot, load, num_sms, store, triton_params
from pallas_kernels.rms_norm import rms_normalize

ACTIVATIONS = (None, "silu_mul")
NORM_STATS = (None, "rows", "gram")


def rmsnorm_matmul_reference(x, w, bias=None, *, w_scale=None, norm_eps=None, residual=None, activation=None):
    """rmsnorm_matmul in plain jnp, rounded as the decoder's RMSNorm, linear, SwiGLU and residual add; the kernel
    rounds once, at the end, so it can differ by about one rounding of x.dtype. x: [..., K] -> [..., N_out]."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    h = x if norm_eps is None else rms_normalize(x, norm_eps)
    contract = 0 if w_scale is None else 1  # w [K, N], or FP8 [N, K]
    out = lax.dot_general(h, w.astype(x.dtype), (((h.ndim - 1,), (contract,)), ((), ())),
                          preferred_element_type=jnp.float32, precision=lax.Precision.HIGHEST)
    if w_scale is not None:
        out = out * w_scale.astype(jnp.float32)
    if bias is not None:
        out = out + bias.astype(jnp.float32)
    out = out.astype(x.dtype)
    if activation == "silu_mul":
        gate, up = jnp.split(out, 2, axis=-1)
        out = jax.nn.silu(gate) * up
    if residual is not None:
        out = residual + out
    return out


# A program streams K in block_k slices into f32 accumulators of its output tile, one per weight column group (silu_mul:
# gate and up). A norm's sum of squares stays off the weight stream's critical path (docs/perf_notes.md, "The RMSNorm
# statistic in the fused projections"): "rows" loads the x rows over all of K before the loop and reduces them after
# it; "gram" adds a dot x @ x^T per K slice, whose diagonal is the sum. XLA finishes split K's f32 partials.


@dataclasses.dataclass(frozen=True)
class RmsNormMatmulConfig:
    """Up to 16 rows the kernel takes block_m 16 (tl.dot's minimum). norm_stat: "rows", "gram" or None (by size)."""
    block_m: int = 16
    block_n: int = 32
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 4
    k_splits: int = 1  # programs sharing an output tile's K range
    norm_stat: str | None = None

    def __post_init__(self):
        check_pow2(self, ("block_m", "block_n", "block_k"), minimum=16)
        if self.k_splits < 1:
            raise ValueError(f"k_splits must be >= 1, got {self.k_splits}")
        if self.norm_stat not in NORM_STATS:
            raise ValueError(f"norm_stat must be one of {NORM_STATS}, got {self.norm_stat!r}")


# Tilings from scripts/tune_projections.py (docs/perf_notes.md, "Fused projections: tiling and split K").
# Decode (M <= 16), memory-bound on w: 64 columns (128 contiguous bytes of a w row), split K set per shape.
DECODE_CONFIG = RmsNormMatmulConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4)
# Batched decode (16 < M <= 64): 32 columns fill the GPU without split K and its epilogue.
BATCHED_DECODE_CONFIG = RmsNormMatmulConfig(block_m=64, block_n=32, block_k=128, num_warps=4, num_stages=4)
# Prefill: compute-bound tiles.
PREFILL_CONFIG = RmsNormMatmulConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)
# FP8 weights [N, K] at decode sizes: rows of 256 bytes a tile (docs/perf_notes.md, "FP8 weights").
FP8_DECODE_CONFIG = RmsNormMatmulConfig(block_m=16, block_n=32, block_k=256, num_warps=4, num_stages=3)
FP8_GATE_UP_DECODE_CONFIG = RmsNormMatmulConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=3)
FP8_SPLIT_PROGRAMS = 4
# x's factor into f16 for FP8 weights, undone in f32: exact for bf16 2^-13 <= |x| < 2^20, and below f16's 65504.
FP8_X_SCALE = 2.0 ** -4

# Shared memory of one pipeline stage: at 4 stages, 48 KiB compiled and ran on sm_90, 64 KiB did not.
STAGE_BYTES = 56 << 10
# Bytes of x per program that the "rows" statistic keeps in registers across the loop (16 rows of K = 1024 in bf16).
ROW_STAT_BYTES = 32 << 10


def _block_m(config, m):
    return 16 if m <= 16 else config.block_m


def _stage_bytes(block_m, block_n, block_k, *, itemsize, w_tiles):
    return block_k * (block_m + w_tiles * block_n) * itemsize


def _default_config(m, k, n_out, dtype, *, silu_mul=False, fp8=False):
    """The preset for m rows, block_k halved to fit STAGE_BYTES, split K up to num_sms() programs to 64 rows. FP8 up
    to 16 rows: its decode preset, split K up to FP8_SPLIT_PROGRAMS per SM with two K blocks a split."""
    if fp8 and m > 16:
        return PREFILL_CONFIG
    if fp8:
        preset = FP8_GATE_UP_DECODE_CONFIG if silu_mul else FP8_DECODE_CONFIG
        k_splits = _k_splits(pl.cdiv(n_out, preset.block_n), pl.cdiv(k, preset.block_k),
                             FP8_SPLIT_PROGRAMS * num_sms(), min_blocks=2)
        return dataclasses.replace(preset, k_splits=k_splits)
    preset = DECODE_CONFIG if m <= 16 else BATCHED_DECODE_CONFIG if m <= 64 else PREFILL_CONFIG
    block_m, block_k = _block_m(preset, m), preset.block_k
    size, w_tiles = jnp.dtype(dtype).itemsize, 2 if silu_mul else 1
    while block_k > 16 and _stage_bytes(block_m, preset.block_n, block_k, itemsize=size, w_tiles=w_tiles) > STAGE_BYTES:
        block_k //= 2
    tiles = pl.cdiv(m, block_m) * pl.cdiv(n_out, preset.block_n)
    k_splits = _k_splits(tiles, pl.cdiv(k, block_k), num_sms(), min_blocks=1) if m <= 64 else 1
    return dataclasses.replace(preset, block_k=block_k, k_splits=k_splits)


def _k_splits(tiles, k_blocks, max_programs, *, min_blocks):
    """k_splits doubled, up to 8, while the grid fits max_programs and every split keeps min_blocks K blocks."""
    k_splits = 1
    while k_splits < 8 and 2 * k_splits * tiles <= max_programs:
        per_split = pl.cdiv(k_blocks, 2 * k_splits)
        if per_split < min_blocks or (2 * k_splits - 1) * per_split >= k_blocks:
            break
        k_splits *= 2
    return k_splits


def _row_stat_rows(config, m, k, itemsize):
    """-> the x rows a program loads for the "rows" statistic (1 for a single row, else block_m), 0 for "gram"."""
    rows = 1 if m == 1 else _block_m(config, m)
    row_bytes = rows * pl.cdiv(k, config.block_k) * config.block_k * itemsize
    stat = config.norm_stat or ("rows" if row_bytes <= ROW_STAT_BYTES else "gram")
    return rows if stat == "rows" else 0


def _rmsnorm_matmul_kernel(x_ref, w_ref, w_scale_ref, bias_ref, res_ref, o_ref, *sum_sq_refs, norm_eps, stat_rows,
                           silu_mul, block_m, block_n, block_k, n_out, k_blocks_per_split, partial):
    # x_ref: [M, K]; w_ref: [K, N], or FP8 [N, K] with w_scale_ref [N] f32 (else None); bias_ref: [N] or None
    # res_ref: [M, N_out] or None; o_ref: [M, N_out] (N_out: N / 2 for silu_mul), or partial: [k_splits, M, N] f32
    # sum_sq_refs: () or, with split K and "gram", (sum_sq_ref [k_splits, M] f32,)
    m, k = x_ref.shape
    norm, gram = norm_eps is not None, norm_eps is not None and not stat_rows
    rows = pl.program_id(0) * block_m + jnp.arange(block_m)
    cols_n = pl.program_id(1) * block_n + jnp.arange(block_n)
    row_ok, n_ok = rows < m, cols_n < n_out
    first_kb = pl.program_id(2) * k_blocks_per_split
    num_kb = jnp.minimum(pl.cdiv(k, block_k) - first_kb, k_blocks_per_split)
    col_groups = (cols_n, cols_n + n_out) if silu_mul else (cols_n,)

    def x_tile(x_rows, cols_k):  # -> [len(x_rows), block_k], zeros outside x
        return load(x_ref.at[x_rows[:, None], cols_k[None, :]], mask=(x_rows < m)[:, None] & (cols_k < k)[None, :],
                    other=0.0)

    if norm and not gram:  # "rows": issued here, reduced after the loop
        stat_x_rows = pl.program_id(0) * block_m + jnp.arange(stat_rows)
        stat_tiles = [x_tile(stat_x_rows, kb * block_k + jnp.arange(block_k)) for kb in range(pl.cdiv(k, block_k))]

    fp8 = w_scale_ref is not None
    # FP8 tiles meet 16-bit x in f16, one conversion from E4M3 (docs/perf_notes.md, "FP8 weights").
    f16_dot = fp8 and x_ref.dtype != jnp.float32
    dot_dtype, x_scale = (jnp.float16, FP8_X_SCALE) if f16_dot else (x_ref.dtype, 1.0)

    def body(i, carry):
        accs, gram_acc = carry
        cols_k = (first_kb + i) * block_k + jnp.arange(block_k)
        k_ok = cols_k < k
        x = x_tile(rows, cols_k)
        x = (x.astype(jnp.float32) * x_scale).astype(dot_dtype) if x_scale != 1.0 else x.astype(dot_dtype)
        if fp8:  # [block_n, block_k] tiles of w [N, K] @ x^T: accumulators [block_n, block_m]
            ws = [load(w_ref.at[cols[:, None], cols_k[None, :]], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                  for cols in col_groups]
            accs = tuple(acc + dot(w.astype(dot_dtype), x, trans_b=True) for acc, w in zip(accs, ws))
        else:
            ws = [load(w_ref.at[cols_k[:, None], cols[None, :]], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
                  for cols in col_groups]
            accs = tuple(acc + dot(x, w) for acc, w in zip(accs, ws))
        return accs, gram_acc + dot(x, x, trans_b=True) if gram else None

    acc_shape = (block_n, block_m) if fp8 else (block_m, block_n)
    init = (tuple(jnp.zeros(acc_shape, jnp.float32) for _ in col_groups),
            jnp.zeros((block_m, block_m), jnp.float32) if gram else None)
    accs, gram_acc = lax.fori_loop(0, num_kb, body, init)
    if fp8:  # back to [block_m, block_n], times the channel scales
        accs = tuple(acc.T * (load(w_scale_ref.at[cols], mask=n_ok, other=0.0) / x_scale)[None, :]
                     for acc, cols in zip(accs, col_groups))
    if gram:  # the diagonal of x @ x^T (of x * x_scale)
        sum_sq = jnp.where(rows[:, None] == rows[None, :], gram_acc, 0.0).sum(axis=1) / (x_scale * x_scale)
    elif norm:
        sum_sq = sum(jnp.square(t.astype(jnp.float32)).sum(axis=1) for t in stat_tiles)  # [stat_rows]
    if norm and not (gram and partial):
        accs = tuple(acc * lax.rsqrt(sum_sq / k + norm_eps)[:, None] for acc in accs)
    tile_mask = row_ok[:, None] & n_ok[None, :]
    if partial:
        for acc, cols in zip(accs, col_groups):
            store(o_ref.at[pl.program_id(2), rows[:, None], cols[None, :]], acc, mask=tile_mask)
        if sum_sq_refs:  # one program per row block and split stores its x^2 sums
            store(sum_sq_refs[0].at[pl.program_id(2), rows], sum_sq, mask=row_ok & (pl.program_id(1) == 0))
        return
    biases = None if bias_ref is None else tuple(load(bias_ref.at[cols], mask=n_ok, other=0.0) for cols in col_groups)
    residual = None if res_ref is None else load(res_ref.at[rows[:, None], cols_n[None, :]], mask=tile_mask, other=0.0)
    store(o_ref.at[rows[:, None], cols_n[None, :]], _epilogue(accs, biases, residual, o_ref.dtype), mask=tile_mask)


def _epilogue(accs, biases, residual, dtype):
    """f32 accumulators [+ bias] [-> silu(gate) * up] [+ residual], rounded once: the kernel's, or XLA's for split K."""
    if biases is not None:
        accs = tuple(acc + b.astype(jnp.float32)[None, :] for acc, b in zip(accs, biases))
    if len(accs) == 2:
        gate, up = accs
        out = gate * jax.nn.sigmoid(gate) * up  # sigmoid lowers to 1 / (1 + exp(-x)) in Triton
    else:
        (out,) = accs
    if residual is not None:
        out += residual.astype(jnp.float32)
    return out.astype(dtype)


def _check_inputs(x, w, w_scale, bias, residual, norm_eps, activation):
    """-> N_out, the output width; ValueError for anything the kernel does not handle."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if w_scale is None and w.dtype == jnp.float8_e4m3fn:
        raise ValueError("FP8 weights [N, K] need w_scale, their per-channel scales [N]")
    layout = "[K, N]" if w_scale is None else "FP8 [N, K]"
    if x.ndim != 2 or w.ndim != 2:
        raise ValueError(f"expected x [M, K] and w {layout}, got {x.shape} and {w.shape}")
    (m, k), (n, w_k) = x.shape, w.shape[::-1] if w_scale is None else w.shape
    if w_k != k:
        raise ValueError(f"K differs: x {x.shape}, w {layout} {w.shape}")
    if activation == "silu_mul" and n % 2:
        raise ValueError(f"silu_mul needs w's N = 2 * I (gate | up), got an odd N = {n}")
    n_out = n // 2 if activation == "silu_mul" else n
    if bias is not None and (bias.shape != (n,) or not jnp.issubdtype(bias.dtype, jnp.floating)):
        raise ValueError(f"bias must be [N] = [{n}] (w's outputs), floating point, got {bias.dtype}{bias.shape}")
    if residual is not None and (residual.shape != (m, n_out) or residual.dtype != x.dtype):
        raise ValueError(f"residual must be [M, N_out] = [{m}, {n_out}] (the output's shape) of x's dtype {x.dtype}, "
                         f"got residual dtype {residual.dtype}, shape {residual.shape}")
    if x.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
        raise ValueError(f"x's dtype must be bf16, f16 or f32, got {x.dtype}")
    if w_scale is None and w.dtype != x.dtype:
        raise ValueError(f"w must be x's dtype {x.dtype} (or float8_e4m3fn [N, K] with w_scale), got {w.dtype}")
    if w_scale is not None and (w.dtype != jnp.float8_e4m3fn or w_scale.shape != (n,) or w_scale.dtype != jnp.float32):
        raise ValueError(f"w_scale needs w float8_e4m3fn [N, K] and w_scale float32 [N] = [{n}], got w {w.dtype} "
                         f"and w_scale {w_scale.dtype} {w_scale.shape}")
    if norm_eps is not None and not norm_eps > 0:
        raise ValueError(f"norm_eps must be None (no norm) or > 0, got {norm_eps}")
    return n_out


@functools.partial(jax.jit, static_argnames=("norm_eps", "activation", "config", "interpret"))
def rmsnorm_matmul(x, w, bias=None, *, w_scale=None, norm_eps=None, residual=None, activation=None, config=None,
                   interpret=False):
    """x [M, K] @ w ([K, N] in x.dtype, or FP8 [N, K] with f32 w_scale [N]) -> [M, N_out]: rmsnorm_matmul_reference.
    silu_mul: w's N holds the gate columns, then the up columns. config None: a preset by M, fit to the shape."""
    n_out = _check_inputs(x, w, w_scale, bias, residual, norm_eps, activation)
    (m, k), silu_mul, fp8 = x.shape, activation == "silu_mul", w_scale is not None
    groups = 2 if silu_mul else 1  # weight column groups: gate and up, or one
    config = config or _default_config(m, k, n_out, x.dtype, silu_mul=silu_mul, fp8=fp8)
    block_m = _block_m(config, m)
    k_blocks = pl.cdiv(k, config.block_k)
    k_splits = min(config.k_splits, k_blocks)
    partial = k_splits > 1
    stat_rows = 0 if norm_eps is None else _row_stat_rows(config, m, k, x.dtype.itemsize)
    gram_partials = norm_eps is not None and not stat_rows and partial
    kernel = functools.partial(_rmsnorm_matmul_kernel, norm_eps=norm_eps, stat_rows=stat_rows, silu_mul=silu_mul,
                               block_m=block_m, block_n=config.block_n, block_k=config.block_k, n_out=n_out,
                               k_blocks_per_split=pl.cdiv(k_blocks, k_splits), partial=partial)
    out_shape = [jax.ShapeDtypeStruct((k_splits, m, groups * n_out), jnp.float32) if partial else
                 jax.ShapeDtypeStruct((m, n_out), x.dtype)]
    if gram_partials:
        out_shape.append(jax.ShapeDtypeStruct((k_splits, m), jnp.float32))
    outs = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(m, block_m), pl.cdiv(n_out, config.block_n), k_splits),
        out_shape=out_shape,
        compiler_params=triton_params(config.num_warps, config.num_stages),
        interpret=interpret,
        name="rmsnorm_matmul",
    )(x, w, w_scale, bias, residual)
    if not partial:
        return outs[0]
    acc = outs[0].sum(axis=0)
    if gram_partials:
        acc = acc * lax.rsqrt(outs[1].sum(axis=0) / k + norm_eps)[:, None]
    biases = None if bias is None else jnp.split(bias, groups)
    return _epilogue(jnp.split(acc, groups, axis=1), biases, residual, x.dtype)
