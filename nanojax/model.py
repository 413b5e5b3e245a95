"""The shared decoder for every architecture, as pure functions of an explicit params pytree.

params (built by convert/, weights as [in, out]):
    embed [V, H]; pos_embed [P, H] (learned positions only); final_norm; lm_head [H, V] (untied only);
    layers: tuple of {attn_norm, qkv {w [H, q+2kv], b?}, q_norm [D]?, k_norm [D]?, o {w [q, H], b?},
                      mlp_norm, up {w [H, 2I] (gate|up, swiglu) or [H, I] (gelu), b?}, down {w [I, H], b?}}
    a norm is {scale [H], bias [H]?}.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np

from nanojax.config import ModelConfig
from nanojax.kv_cache import Batch, KVCache, write_kv
from pallas_kernels.paged_attention import paged_attention_reference

HIGHEST = jax.lax.Precision.HIGHEST


def rms_norm(x, scale, eps):
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return scale.astype(x.dtype) * normed.astype(x.dtype)


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


def linear(x, p):
    out = jnp.dot(x, p["w"], precision=HIGHEST, preferred_element_type=jnp.float32)
    if "b" in p:
        out = out + p["b"].astype(jnp.float32)
    return out.astype(x.dtype)


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


def apply_rope(x, positions, inv_freq):
    """x: [B, T, heads, D], rotating the two halves of D (HF rotate_half); positions: [B, T]."""
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    cos = jnp.cos(freqs)[:, :, None, :].astype(x.dtype)
    sin = jnp.sin(freqs)[:, :, None, :].astype(x.dtype)
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def attention_block(lp, x, positions, k_pages, v_pages, batch: Batch, config: ModelConfig, attention):
    """x: [B, T, H] -> ([B, T, H], k_pages, v_pages)."""
    b, t, _ = x.shape
    qkv = linear(norm(x, lp["attn_norm"], config), lp["qkv"])
    q, k, v = jnp.split(qkv, [config.q_size, config.q_size + config.kv_size], axis=-1)
    q = q.reshape(b, t, config.num_heads, config.head_dim)
    k = k.reshape(b, t, config.num_kv_heads, config.head_dim)
    v = v.reshape(b, t, config.num_kv_heads, config.head_dim)
    if config.qk_norm:
        q = rms_norm(q, lp["q_norm"], config.norm_eps)
        k = rms_norm(k, lp["k_norm"], config.norm_eps)
    if config.rope_theta is not None:
        inv_freq = rope_inv_freq(config)
        q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
    k_pages, v_pages = write_kv(k_pages, v_pages, k, v, batch.page_table, positions)
    out = attention(q, k_pages, v_pages, batch.page_table, batch.seq_lens, batch.q_lens,
                    scale=config.head_dim**-0.5)
    return linear(out.reshape(b, t, config.q_size), lp["o"]), k_pages, v_pages


def mlp_block(lp, x, config: ModelConfig):
    h = linear(norm(x, lp["mlp_norm"], config), lp["up"])
    if config.mlp == "swiglu":
        gate, up = jnp.split(h, 2, axis=-1)
        h = jax.nn.silu(gate) * up
    else:
        h = jax.nn.gelu(h, approximate=True)
    return linear(h, lp["down"])


def forward(params, tokens, kv_cache: KVCache, batch: Batch, *, config: ModelConfig, attention=None):
    """tokens: [B, T] int32 -> (hidden [B, T, H] after the final norm, updated kv_cache).

    `attention(q, k_pages, v_pages, page_table, seq_lens, q_lens, scale=)` is the paged attention
    implementation (the jnp reference by default; the Pallas kernels drop in here).
    """
    attention = attention or paged_attention_reference
    positions = batch.positions(tokens.shape[1])
    x = params["embed"][tokens]
    if config.rope_theta is None:
        x = x + params["pos_embed"][jnp.maximum(positions, 0)]
    new_k, new_v = [], []
    for lp, k_pages, v_pages in zip(params["layers"], kv_cache.k, kv_cache.v):
        attn_out, k_pages, v_pages = attention_block(lp, x, positions, k_pages, v_pages, batch, config, attention)
        x = x + attn_out
        x = x + mlp_block(lp, x, config)
        new_k.append(k_pages)
        new_v.append(v_pages)
    return norm(x, params["final_norm"], config), KVCache(k=tuple(new_k), v=tuple(new_v))


def lm_logits(params, hidden, config: ModelConfig):
    """hidden: [..., H] -> float32 logits [..., V]."""
    if config.tie_word_embeddings:
        return jnp.einsum("...h,vh->...v", hidden, params["embed"], precision=HIGHEST,
                          preferred_element_type=jnp.float32)
    return jnp.dot(hidden, params["lm_head"], precision=HIGHEST, preferred_element_type=jnp.float32)
