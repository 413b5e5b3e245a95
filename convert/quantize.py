"""FP8 (E4M3) weight-only quantization with one scale per output channel: a small-batch decode step reads every
weight once, and E4M3 halves bf16's bytes. Each projection {w [K, N], b [N]?} becomes

    {w_t: float8_e4m3fn [N, K], scale: float32 [N], b [N]?}    w[:, n] ~= w_t[n, :] * scale[n]

HF's [out, in] layout, which XLA's dot reads faster than [K, N] (docs/perf_notes.md, "FP8 weights"). The RMSNorm
scales folded into the qkv / up weights are quantized with them. A MoE layer's experts {w [E, N, K]} become {w_t
[E, N, K], scale [E, N]}, each expert's columns scaled apart; its router, embedding rows and norms keep their dtype.
"""
import jax
import jax.numpy as jnp

FP8 = jnp.float8_e4m3fn
FP8_MAX = float(jnp.finfo(FP8).max)  # 448
PROJECTIONS = ("qkv", "o", "up", "down")


def is_quantized(p) -> bool:
    """Whether a projection's params are FP8 {w_t, scale, b?} rather than {w, b?} (nanojax.ops routes on this)."""
    return "w_t" in p


# Candidate clip ratios, 1 first (argmin keeps the first of equal errors: no clipping unless it helps). Clipping a
# column's few largest values lowers the rest's rounding error (docs/perf_notes.md, "FP8 weights").
CLIP_RATIOS = tuple(1.0 - i / 128 for i in range(33))  # 1 down to 0.75


def _round(wf, scale):
    """wf [K, N] f32 / scale [N] rounded to nearest even E4M3, saturating at +-448 (astype alone gives NaN there)."""
    return jnp.clip(wf / scale, -FP8_MAX, FP8_MAX).astype(FP8)


@jax.jit
def quantize_weight(w):
    """w: [K, N] float -> {"w_t": float8_e4m3fn [N, K], "scale": float32 [N]}, scale[n] = r * max_k |w[k, n]| / 448
    for the clip ratio r of CLIP_RATIOS with the column's least squared error (1 for an all-zero column)."""
    wf = jnp.asarray(w).astype(jnp.float32)
    amax = jnp.max(jnp.abs(wf), axis=0)
    ratios = jnp.asarray(CLIP_RATIOS, jnp.float32)

    def scale_for(ratio):
        return jnp.where(amax > 0, amax * ratio / FP8_MAX, 1.0)

    def column_errors(_, ratio):  # one candidate at a time: memory stays O(K N) for any number of candidates
        scale = scale_for(ratio)
        return None, jnp.sum(jnp.square(_round(wf, scale).astype(jnp.float32) * scale - wf), axis=0)

    _, errors = jax.lax.scan(column_errors, None, ratios)  # [R, N]
    scale = scale_for(ratios[jnp.argmin(errors, axis=0)])
    return {"w_t": _round(wf, scale).T, "scale": scale}


def dequantize(p, dtype=jnp.float32):
    """{w_t [..., N, K], scale [..., N]} -> the weight [..., K, N] it stands for, in dtype (for references)."""
    w = p["w_t"].astype(jnp.float32) * p["scale"].astype(jnp.float32)[..., None]
    return jnp.swapaxes(w, -1, -2).astype(dtype)


def quantize_layer(lp: dict) -> dict:
    """One layer's params with its projections (qkv, o, and up, down or the experts') in FP8, the rest as is."""
    out = {**lp, **{name: _quantized(lp[name]) for name in PROJECTIONS if name in lp}}
    if "experts" in lp:
        out["experts"] = {name: _quantized(p) for name, p in lp["experts"].items()}
    return out


def _quantized(p: dict) -> dict:
    """{w [K, N] or experts [E, N, K], b?} -> {w_t, scale, b?}; experts one at a time, in one expert's memory."""
    w = p["w"]
    return {k: v for k, v in p.items() if k != "w"} | (quantize_weight(w) if w.ndim == 2 else
                                                       jax.lax.map(lambda e: quantize_weight(e.T), jnp.asarray(w)))


def quantize_params(params, config, *, lm_head: bool = True) -> dict:
    """The params with every layer's projections and, if lm_head, the LM head in FP8: params["lm_head"] = {w_t [V, H],
    scale [V]}, for tied embeddings beside params["embed"], which stays for the lookup (the head's share of FP8's
    KL divergence: docs/perf_notes.md, "FP8 weights")."""
    if any(is_quantized(lp["qkv"]) for lp in params["layers"]):
        raise ValueError("params are FP8-quantized already")
    layers = tuple(quantize_layer(lp) for lp in params["layers"])
    if not lm_head:
        return {**params, "layers": layers}
    head = jnp.asarray(params["embed"]).T if config.tie_word_embeddings else params["lm_head"]
    return {**params, "layers": layers, "lm_head": quantize_weight(head)}
