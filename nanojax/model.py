"""The shared decoder for every architecture, as pure functions of an explicit params pytree.

params (built by convert/, weights as [in, out]):
    embed [V, H]; pos_embed [P, H] (learned positions only); final_norm; lm_head [H, V] (untied only);
    layers: tuple of {attn_norm?, qkv {w [H, q+2kv], b?}, q_norm [D]?, k_norm [D]?, o {w [q, H], b?},
                      mlp_norm?, up {w [H, 2I] (gate|up, swiglu) or [H, I] (gelu), b?}, down {w [I, H], b?}}
    a norm is {scale [H], bias [H]?}. attn_norm and mlp_norm exist for LayerNorm (GPT-2) only: an RMSNorm's scale is
    folded into the qkv / up weights after it by convert/, and the projection computes the norm's statistic.

Inside a layer the step's [B, T] tokens are one flat list of N = B * T rows; only attention sees [B, T] again. Each
fused step (projection with its norm / activation / residual, the QKV epilogue with the cache write, attention) goes
through `Ops`, the switch between the jnp references and the Pallas kernels.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np

from convert.config import ModelConfig
from nanojax.kv_cache import KVCache
from nanojax.ops import Ops
from pallas_kernels.qkv_rope_cache import rope_cos_sin
from pallas_kernels.rms_norm import rms_norm


def layer_norm(x, scale, bias, eps):
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    normed = (xf - mean) * jax.lax.rsqrt(var + eps)
    return (normed * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


def norm(x, p, config: ModelConfig):
    if config.norm == "layer":
        return layer_norm(x, p["scale"], p["bias"], config.norm_eps)
    return rms_norm(x, p["scale"], config.norm_eps)


@functools.lru_cache(maxsize=None)
def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """[head_dim // 2] float32 inverse frequencies, as HF computes them (Llama 3 scaling included)."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim))
    scaling = config.rope_llama3
    if scaling is None:
        return inv_freq.astype(np.float32)
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * np.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def pre_norm(x, lp, name: str, config: ModelConfig):
    """The norm before a projection, x: [N, H] -> (x, norm_eps for the projection). GPT-2's LayerNorm lp[name] is
    applied here, beside the projection (norm_eps None); an RMSNorm fuses into the projection, which computes its
    statistic (its scale is folded into the projection's w by convert/)."""
    if config.norm == "layer":
        return layer_norm(x, lp[name]["scale"], lp[name]["bias"], config.norm_eps), None
    return x, config.norm_eps


def project(ops: Ops, x, p, *, norm_eps=None, residual=None, activation=None):
    """[RMSNorm](x) @ w [+ b] [-> activation] [+ residual] for x: [N, K]. The RMSNorm and SiLU-and-mul fuse into the
    projection; GELU runs beside it."""
    if activation == "gelu_tanh":
        return jax.nn.gelu(ops.project(x, p, norm_eps=norm_eps), approximate=True)
    return ops.project(x, p, norm_eps=norm_eps, residual=residual, activation=activation)


def layer(ops: Ops, lp, x, positions, cos_sin, slots, k_pages, v_pages, batch, config: ModelConfig):
    """x: [N, H]; positions, slots: [N]; cos_sin: [N, D] the tokens' RoPE table or None; batch: a Batch of the
    N = B * T rows, or (Batch of B * T rows, Batch of D one-token rows) for N = B * T + D (forward's mixed step) ->
    (x after the layer, k_pages, v_pages)."""
    h, norm_eps = pre_norm(x, lp, "attn_norm", config)
    qkv = project(ops, h, lp["qkv"], norm_eps=norm_eps)
    q, k_pages, v_pages = ops.qkv_rope_cache(qkv, positions, slots, k_pages, v_pages, cos_sin, lp.get("q_norm"),
                                             lp.get("k_norm"), eps=config.norm_eps)
    attn = attention(ops, q, k_pages, v_pages, batch, config)
    x = ops.row_project(attn, lp["o"], residual=x)
    h, norm_eps = pre_norm(x, lp, "mlp_norm", config)
    h = project(ops, h, lp["up"], norm_eps=norm_eps, activation="silu_mul" if config.mlp == "swiglu" else "gelu_tanh")
    return ops.row_project(h, lp["down"], residual=x), k_pages, v_pages


def attention(ops: Ops, q, k_pages, v_pages, batch, config: ModelConfig):
    """q: [N, Hq, D] -> [N, Hq * D]: the rows of each of batch's segments (layer's) through their own attention."""
    segments = batch if isinstance(batch, tuple) else (batch,)
    one_token_rows = sum(s.q_lens.shape[0] for s in segments[1:])
    t = (q.shape[0] - one_token_rows) // segments[0].q_lens.shape[0]
    outs, start = [], 0
    for i, seg in enumerate(segments):
        b, seg_t = seg.q_lens.shape[0], t if i == 0 else 1
        rows = q[start:start + b * seg_t].reshape(b, seg_t, config.num_heads, config.head_dim)
        out = ops.attention(rows, k_pages, v_pages, seg.page_table, seg.seq_lens, seg.q_lens,
                            scale=config.head_dim**-0.5, cascade=seg.cascade)
        outs.append(out.reshape(b * seg_t, config.q_size))
        start += b * seg_t
    return outs[0] if len(outs) == 1 else jnp.concatenate(outs)


def forward(params, tokens, kv_cache: KVCache, batch, *, config: ModelConfig, ops: Ops):
    """tokens: [B, T] int32 with batch a Batch -> (hidden [B, T, H] after the final norm, updated kv_cache).
    A mixed step: tokens (prompt rows [B, T], decode tokens [D]) with batch (Batch, Batch) of each -> ((hidden
    [B, T, H], hidden [D, H]), kv_cache): one forward, so one read of the weights, for both."""
    segments = tuple(zip(tokens, batch)) if isinstance(batch, tuple) else ((tokens, batch),)
    positions = [seg_batch.positions(1 if ids.ndim == 1 else ids.shape[1]) for ids, seg_batch in segments]
    slots = jnp.concatenate([seg_batch.slots(pos, kv_cache.page_size).reshape(-1)
                             for pos, (_, seg_batch) in zip(positions, segments)])
    positions = jnp.concatenate([pos.reshape(-1) for pos in positions])
    x = ops.embed(params["embed"], jnp.concatenate([ids.reshape(-1) for ids, _ in segments]))
    if config.rope_theta is None:
        x = x + params["pos_embed"][jnp.maximum(positions, 0)]
        cos_sin = None
    else:
        cos_sin = rope_cos_sin(positions, jnp.asarray(rope_inv_freq(config)), x.dtype)
    new_k, new_v = [], []
    for lp, k_pages, v_pages in zip(params["layers"], kv_cache.k, kv_cache.v):
        x, k_pages, v_pages = ops.run_layer(layer, lp, x, positions, cos_sin, slots, k_pages, v_pages, batch, config)
        new_k.append(k_pages)
        new_v.append(v_pages)
    hidden = norm(x, params["final_norm"], config)
    cache = KVCache(k=tuple(new_k), v=tuple(new_v))
    if not isinstance(batch, tuple):
        return hidden.reshape(*tokens.shape, -1), cache
    prompt_rows = tokens[0].size
    return (hidden[:prompt_rows].reshape(*tokens[0].shape, -1), hidden[prompt_rows:]), cache


def lm_logits(params, hidden, ops: Ops = Ops()):
    """hidden: [..., H] -> float32 logits [..., V] (a tensor-parallel Ops computes each device's vocabulary shard
    there and gathers the logits, never the weights)."""
    head = {"lm_head": params["lm_head"]} if "lm_head" in params else {"embed": params["embed"]}
    return ops.vocab_head(head_logits, head, hidden)


def head_logits(head, hidden):
    """head: {lm_head [H, V]}, {embed [V, H]} (tied) or an FP8 {lm_head: {w_t [V, H], scale [V]}} (convert/quantize.py;
    beside the embedding when tied), dequantized in front of XLA's dot: (hidden @ w_t.astype(hidden.dtype)^T) * scale
    in f32. hidden: [..., H] -> float32 logits [..., V]."""
    precision = jax.lax.Precision.HIGHEST
    w = head.get("lm_head")
    if isinstance(w, dict):
        logits = jnp.einsum("...h,vh->...v", hidden, w["w_t"].astype(hidden.dtype), precision=precision,
                            preferred_element_type=jnp.float32)
        return logits * w["scale"]
    if w is None:
        return jnp.einsum("...h,vh->...v", hidden, head["embed"], precision=precision,
                          preferred_element_type=jnp.float32)
    return jnp.dot(hidden, w, precision=precision, preferred_element_type=jnp.float32)
