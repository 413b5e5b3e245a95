"""The shared decoder for every architecture, as Flax NNX modules over the converted params (weights as [in, out]):
    embed [V, H]; pos_embed [P, H] (learned positions only); final_norm; lm_head [H, V] (untied only);
    layers: tuple of {attn_norm?, qkv {w [H, q+2kv], b?}, q_norm [D]?, k_norm [D]?, o {w [q, H], b?},
                      mlp_norm?, up {w [H, 2I] (gate|up, swiglu) or [H, I] (gelu), b?}, down {w [I, H], b?}}
                   or, MoE, router {w [E, H]}, experts {up {w [E, 2I, H]}, down {w [E, H, I]}} (as HF holds them),
                   and up, down only for a shared expert (Qwen2-MoE: [H, 2S], [S, H]) with its gate, shared_gate [H]
    a norm is {scale [H], bias [H]?}; attn_norm and mlp_norm for LayerNorm (GPT-2) and before a MoE router only:
    convert/ folds an RMSNorm's scale into the projection after it, which computes the norm's statistic.

The compiled steps build the modules from the params' dict while tracing; layers see [B, T] tokens as N = B * T rows."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from convert.config import ModelConfig
from nanojax.kv_cache import KVCache
from nanojax.ops import Ops
from pallas_kernels.qkv_rope_cache import rope_cos_sin
from pallas_kernels.rms_norm import rms_norm


def _param(value) -> nnx.Param | None:
    return None if value is None else nnx.Param(value)


def value(param: nnx.Param | None):
    return None if param is None else param[...]


class Norm(nnx.Module):
    """LayerNorm {scale, bias} or RMSNorm {scale}, x: [..., H]."""

    def __init__(self, p: dict, config: ModelConfig):
        self.scale, self.bias = nnx.Param(p["scale"]), _param(p.get("bias"))
        self.eps = config.norm_eps

    def __call__(self, x):
        if self.bias is None:
            return rms_norm(x, self.scale[...], self.eps)
        xf = x.astype(jnp.float32)
        mean, var = jnp.mean(xf, axis=-1, keepdims=True), jnp.var(xf, axis=-1, keepdims=True)
        normed = (xf - mean) * jax.lax.rsqrt(var + self.eps)
        return (normed * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(x.dtype)


class Projection(nnx.Module):
    """x @ w [+ b], {w [K, N], b [N]?}, or FP8 {w_t float8_e4m3fn [N, K], scale [N], b [N]?} (convert/quantize.py).
    Ops.project computes it with a fused RMSNorm before and an activation or residual after."""

    def __init__(self, p: dict):
        if unknown := set(p) - {"w", "w_t", "scale", "b"}:
            raise ValueError(f"a projection has no params {sorted(unknown)}")
        self.w, self.w_t, self.scale, self.b = (_param(p.get(k)) for k in ("w", "w_t", "scale", "b"))

    @property
    def quantized(self) -> bool:
        return self.w_t is not None

    def experts(self) -> tuple:
        """(w [E, N, K], None), or FP8 (w_t [E, N, K], scale [E, N]): pallas_kernels.expert_matmul's operands."""
        return (self.w_t[...], self.scale[...]) if self.quantized else (self.w[...], None)


class Experts(nnx.Module):
    """A MoE layer's experts: {up, down} Projections of [E, 2I, H] (gate | up) and [E, H, I] (FP8: per expert)."""

    def __init__(self, p: dict):
        self.up, self.down = Projection(p["up"]), Projection(p["down"])

    @property
    def num_experts(self) -> int:
        return (self.up.w_t if self.up.quantized else self.up.w)[...].shape[0]


class DecoderLayer(nnx.Module):
    """Pre-norm attention and MLP, each with a residual."""

    def __init__(self, lp: dict, config: ModelConfig):
        self.attn_norm = Norm(lp["attn_norm"], config) if "attn_norm" in lp else None
        self.qkv, self.o = Projection(lp["qkv"]), Projection(lp["o"])
        self.q_norm, self.k_norm = _param(lp.get("q_norm")), _param(lp.get("k_norm"))
        self.mlp_norm = Norm(lp["mlp_norm"], config) if "mlp_norm" in lp else None
        moe = "experts" in lp
        self.router, self.experts = (Projection(lp["router"]), Experts(lp["experts"])) if moe else (None, None)
        self.up, self.down = (Projection(lp["up"]), Projection(lp["down"])) if "up" in lp else (None, None)
        self.shared_gate = _param(lp.get("shared_gate"))

    def __call__(self, ops: Ops, x, positions, cos_sin, slots, k_pages, v_pages, batch, config: ModelConfig):
        """x [N, H], positions, slots [N], cos_sin [N, D] or None; batch: `attention`'s -> (x, k_pages, v_pages)."""
        h, norm_eps = self._pre_norm(self.attn_norm, x, config)
        qkv = ops.project(h, self.qkv, norm_eps=norm_eps)
        q, k_pages, v_pages = ops.qkv_rope_cache(qkv, positions, slots, k_pages, v_pages, cos_sin,
                                                 value(self.q_norm), value(self.k_norm), eps=config.norm_eps)
        x = ops.row_project(attention(ops, q, k_pages, v_pages, batch, config), self.o, residual=x)
        if self.experts is None:
            (h, norm_eps), gate = self._pre_norm(self.mlp_norm, x, config), None
        else:  # the normalized rows h feed the router, the experts and a shared expert
            h, weights, ids = ops.route(x, self.mlp_norm.scale[...], self.router.w[...], config.moe, config.norm_eps)
            x, norm_eps = ops.experts(self.experts, h, weights, ids, residual=x), None
            if self.up is None:
                return x, k_pages, v_pages
            # the shared expert's sigmoid gate, one scalar a row: on its activations, before the down projection
            gate = jax.nn.sigmoid(jnp.dot(h, self.shared_gate[...], precision=jax.lax.Precision.HIGHEST,
                                          preferred_element_type=jnp.float32).astype(h.dtype))[:, None]
        if config.mlp == "swiglu":
            h = ops.project(h, self.up, norm_eps=norm_eps, activation="silu_mul")
        else:  # GELU runs beside the projection
            h = jax.nn.gelu(ops.project(h, self.up, norm_eps=norm_eps), approximate=True)
        return ops.row_project(h if gate is None else gate * h, self.down, residual=x), k_pages, v_pages

    @staticmethod
    def _pre_norm(norm: Norm | None, x, config: ModelConfig):
        """-> (x, norm_eps for the projection): a LayerNorm runs here; an RMSNorm fuses into the projection."""
        return (x, config.norm_eps) if norm is None else (norm(x), None)


def attention(ops: Ops, q, k_pages, v_pages, batch, config: ModelConfig):
    """q: [N, Hq, D] -> [N, Hq * D]; batch: a Batch, or a mixed step's (prompt rows' Batch, one-token rows' Batch)."""
    segments = batch if isinstance(batch, tuple) else (batch,)
    parts = jnp.split(q, [q.shape[0] - segments[1].q_lens.shape[0]]) if len(segments) > 1 else [q]
    outs = [ops.attention(part.reshape(seg.q_lens.shape[0], -1, *q.shape[1:]), k_pages, v_pages, seg.page_table,
                          seg.seq_lens, seg.q_lens, scale=config.head_dim**-0.5, cascade=seg.cascade)
            for part, seg in zip(parts, segments)]
    return jnp.concatenate([out.reshape(-1, config.q_size) for out in outs])


class Decoder(nnx.Module):
    def __init__(self, config: ModelConfig, params: dict):
        self.config = config
        self.embed, self.pos_embed = nnx.Param(params["embed"]), _param(params.get("pos_embed"))
        self.layers = nnx.data(tuple(DecoderLayer(lp, config) for lp in params["layers"]))
        self.final_norm = Norm(params["final_norm"], config)

    def __call__(self, ops: Ops, tokens, kv_cache: KVCache, batch):
        """tokens [B, T] with a Batch -> (hidden [B, T, H] after the final norm, kv_cache); a mixed step's (prompt
        rows [B, T], decode tokens [D]) with (Batch, Batch) -> ((hidden [B, T, H], hidden [D, H]), kv_cache)."""
        segments = tuple(zip(tokens, batch)) if isinstance(batch, tuple) else ((tokens, batch),)
        positions = [seg.positions(1 if ids.ndim == 1 else ids.shape[1]) for ids, seg in segments]
        slots = [seg.slots(pos, kv_cache.page_size) for pos, (_, seg) in zip(positions, segments)]
        positions, slots, ids = (jnp.concatenate([a.reshape(-1) for a in arrays])
                                 for arrays in (positions, slots, [ids for ids, _ in segments]))
        x = ops.embed(self.embed[...], ids)
        if self.pos_embed is not None:
            x, cos_sin = x + self.pos_embed[...][jnp.maximum(positions, 0)], None
        else:
            cos_sin = rope_cos_sin(positions, jnp.asarray(rope_inv_freq(self.config)), x.dtype)
        k, v = list(kv_cache.k), list(kv_cache.v)
        for i, layer in enumerate(self.layers):
            x, k[i], v[i] = ops.run_layer(layer, x, positions, cos_sin, slots, k[i], v[i], batch, self.config)
        hidden = self.final_norm(x)
        slot_tokens = kv_cache.tokens  # each slot's token, where the cache keeps them (speculative decoding)
        if slot_tokens is not None:
            slot_tokens = slot_tokens.at[jnp.where(slots < 0, slot_tokens.shape[0], slots)].set(ids, mode="drop")
        cache = kv_cache.replace(k=tuple(k), v=tuple(v), tokens=slot_tokens)
        if not isinstance(batch, tuple):
            return hidden.reshape(*tokens.shape, -1), cache
        return (hidden[:tokens[0].size].reshape(*tokens[0].shape, -1), hidden[tokens[0].size:]), cache


class LMHead(nnx.Module):
    """hidden [..., H] -> float32 logits [..., V], from lm_head [H, V], the tied embedding [V, H], or an FP8
    {w_t [V, H], scale [V]} (beside the embedding when tied)."""

    def __init__(self, params: dict):
        head = params.get("lm_head")
        self.embed = nnx.Param(params["embed"]) if head is None else None
        self.lm_head = Projection(head) if isinstance(head, dict) else _param(head)

    def __call__(self, hidden):
        kw = {"precision": jax.lax.Precision.HIGHEST, "preferred_element_type": jnp.float32}
        if self.lm_head is None:
            return jnp.einsum("...h,vh->...v", hidden, self.embed[...], **kw)
        if isinstance(self.lm_head, Projection):  # dequantized in front of XLA's dot, the scale applied in f32
            w_t = self.lm_head.w_t[...].astype(hidden.dtype)
            return jnp.einsum("...h,vh->...v", hidden, w_t, **kw) * self.lm_head.scale[...]
        return jnp.dot(hidden, self.lm_head[...], **kw)


def forward(params, tokens, kv_cache: KVCache, batch, *, config: ModelConfig, ops: Ops):
    return Decoder(config, params)(ops, tokens, kv_cache, batch)


def lm_logits(params, hidden, ops: Ops = Ops()):
    """hidden: [..., H] -> float32 logits [..., V] (tensor-parallel: per vocabulary shard, the logits gathered)."""
    return ops.vocab_head(LMHead(params), hidden)


@functools.lru_cache(maxsize=None)
def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """[head_dim // 2] float32 inverse frequencies, as HF computes them (Llama 3 scaling included)."""
    dim, scaling = config.head_dim, config.rope_llama3
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim))
    if scaling is None:
        return inv_freq.astype(np.float32)
    original = scaling.original_max_position_embeddings
    low_wavelen, high_wavelen = original / scaling.low_freq_factor, original / scaling.high_freq_factor
    wavelen = 2 * np.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (original / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)
