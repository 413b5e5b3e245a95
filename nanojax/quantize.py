"""FP8 (E4M3) weight-only quantization with one scale per output channel.

A decode step at small batch reads every weight once, so its time is the weight bytes over the memory bandwidth:
E4M3 weights halve the bytes of bf16. Each projection {w [K, N], b [N]?} becomes

    {w: float8_e4m3fn [K, N], scale: float32 [N], b [N]?}      w_hf[:, n] ~= w[:, n] * scale[n]

with scale[n] = max_k |w_hf[k, n]| / 448 (E4M3's largest finite value), so every column uses the format's whole
range; the projection computes (x @ w) * scale with an f32 accumulator (pallas_kernels/rmsnorm_matmul.py). The
RMSNorm scales folded into the qkv / up weights by convert/ are in w_hf already: quantizing after the fold keeps the
fused norm exact up to the weights' rounding. The LM head becomes params["lm_head"] = {w [H, V], scale [V]}; for tied
embeddings it is added beside params["embed"], which stays for the embedding lookup. Embedding rows and norms keep
their dtype.
"""
import jax
import jax.numpy as jnp

FP8 = jnp.float8_e4m3fn
FP8_MAX = float(jnp.finfo(FP8).max)  # 448
PROJECTIONS = ("qkv", "o", "up", "down")


def is_quantized(p) -> bool:
    """Whether a projection's params {w, scale?, b?} hold FP8 weights (nanojax.ops routes on this)."""
    return "scale" in p


@jax.jit
def quantize_weight(w):
    """w: [K, N] float -> {"w": float8_e4m3fn [K, N], "scale": float32 [N]}, each column scaled so that its largest
    magnitude maps to 448 and rounded to nearest even. An all-zero column gets scale 1 (any scale dequantizes its
    zeros exactly). Runs on the default device; numpy inputs are copied there."""
    wf = jnp.asarray(w).astype(jnp.float32)
    amax = jnp.max(jnp.abs(wf), axis=0)
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    # amax / (amax / 448) may round one f32 ulp above 448, which E4M3 (no infinities) would turn into NaN.
    q = jnp.clip(wf / scale, -FP8_MAX, FP8_MAX).astype(FP8)
    return {"w": q, "scale": scale}


def dequantize(p, dtype=jnp.float32):
    """{w float8_e4m3fn [K, N], scale [N]} -> w * scale [K, N] in dtype (multiplied in f32): the weight the FP8
    projection stands for, for references."""
    return (p["w"].astype(jnp.float32) * p["scale"].astype(jnp.float32)).astype(dtype)


def quantize_layer(lp: dict) -> dict:
    """One layer's params with its projections (qkv, o, up, down) in FP8, the rest as is."""
    return {**lp, **{name: {**lp[name], **quantize_weight(lp[name]["w"])} for name in PROJECTIONS}}


def quantize_params(params, config, *, lm_head: bool = True) -> dict:
    """The model's params (nanojax.model's layout) with every projection (qkv, o, up, down of each layer) and, if
    lm_head, the LM head in FP8: {w [K, N], b?} -> {w float8_e4m3fn, scale float32 [N], b?}. The LM head is
    params["lm_head"] = {w [H, V], scale [V]}, quantized from params["lm_head"] or, for tied embeddings, from
    params["embed"].T (embed stays). Everything else is returned as is. ValueError for params that are quantized
    already. (On SmolLM2-135M the head alone gives 40% of FP8's KL divergence: scripts/fp8_quality.py.)"""
    if any(is_quantized(lp[name]) for lp in params["layers"] for name in PROJECTIONS):
        raise ValueError("params are FP8-quantized already")
    layers = tuple(quantize_layer(lp) for lp in params["layers"])
    if not lm_head:
        return {**params, "layers": layers}
    head = jnp.asarray(params["embed"]).T if config.tie_word_embeddings else params["lm_head"]
    return {**params, "layers": layers, "lm_head": quantize_weight(head)}
