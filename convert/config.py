"""Model configuration: one frozen, hashable dataclass, built explicitly from an HF config dict."""
import dataclasses
from typing import Any


class ConfigError(ValueError):
    """An HF config that nanojax cannot run; the message names the field."""


@dataclasses.dataclass(frozen=True)
class RopeLlama3:
    """Llama 3 frequency-dependent RoPE scaling (HF rope_type "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class MoE:
    """Top-k routed SwiGLU experts in place of every layer's MLP (Qwen3-MoE, Mixtral, Qwen2-MoE)."""

    num_experts: int
    top_k: int  # HF num_experts_per_tok
    norm_topk_prob: bool  # the top k routing weights renormalized to sum 1 (always for Mixtral)
    shared_size: int = 0  # Qwen2-MoE: a SwiGLU expert of this width that every row takes, sigmoid-gated; 0: none


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Everything the decoder needs; the architectures differ only in these flags. Hashable: a static jit argument."""

    architecture: str  # HF architectures[0], kept for the manifest and error messages
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # an expert's, for a MoE model
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    norm: str  # "rms" | "layer" (LayerNorm with bias, GPT-2)
    norm_eps: float
    mlp: str  # "swiglu" (gate/up/down) | "gelu_tanh" (GPT-2 fc/proj)
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    rope_theta: float | None  # None: learned absolute positions (GPT-2)
    rope_llama3: RopeLlama3 | None
    tie_word_embeddings: bool
    moe: MoE | None  # None: a dense MLP
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> "ModelConfig":
        """From an HF config dict as transformers' `PretrainedConfig.to_dict()` writes it."""
        archs = hf.get("architectures") or []
        model_type = hf.get("model_type")
        if model_type not in _BUILDERS:
            raise ConfigError(f"unknown architecture: model_type={model_type!r} architectures={archs}; "
                              f"supported model_type values: {sorted(_BUILDERS)}")
        eos = hf.get("eos_token_id")
        eos_ids = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
        config = cls(architecture=archs[0] if archs else model_type, **_BUILDERS[model_type](hf),
                     bos_token_id=hf.get("bos_token_id"), eos_token_ids=eos_ids)
        if config.num_heads % config.num_kv_heads:
            raise ConfigError(f"num_attention_heads={config.num_heads} is not a multiple of "
                              f"num_key_value_heads={config.num_kv_heads}")
        if config.head_dim % 2 and config.rope_theta is not None:
            raise ConfigError(f"head_dim={config.head_dim} must be even for RoPE")
        return config


def _get(hf: dict, key: str):
    if key not in hf or hf[key] is None:
        raise ConfigError(f"config field {key!r} is missing (model_type={hf.get('model_type')!r})")
    return hf[key]


def _rope(hf: dict) -> dict:
    params = _get(hf, "rope_parameters")
    rope_type = params.get("rope_type", "default")
    if rope_type not in ("default", "llama3"):
        raise ConfigError(f"rope_parameters.rope_type={rope_type!r} is not supported (default, llama3)")
    llama3 = RopeLlama3(*(float(params[k]) for k in ("factor", "low_freq_factor", "high_freq_factor")),
                        int(params["original_max_position_embeddings"])) if rope_type == "llama3" else None
    return {"rope_theta": float(params["rope_theta"]), "rope_llama3": llama3}


def _decoder(hf: dict) -> dict:
    """Llama, Qwen2, Qwen3 and ERNIE 4.5 (and _moe's attention): they differ in their biases and Qwen3's q/k norms."""
    if _get(hf, "hidden_act") != "silu":
        raise ConfigError(f"hidden_act={hf['hidden_act']!r} is not supported (silu)")
    model_type, heads = hf["model_type"], _get(hf, "num_attention_heads")
    qwen2 = model_type in ("qwen2", "qwen2_moe")
    bias = bool(hf.get("use_bias" if model_type == "ernie4_5" else "attention_bias", False))
    # ERNIE 4.5 rotates interleaved (x0, x1) pairs; convert/ permutes its q/k rows to the half-split layout the
    # shared decoder uses, which leaves every q.k product unchanged.
    return dict(vocab_size=_get(hf, "vocab_size"), hidden_size=_get(hf, "hidden_size"),
                intermediate_size=_get(hf, "intermediate_size"), num_layers=_get(hf, "num_hidden_layers"),
                num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
                head_dim=hf.get("head_dim") or _get(hf, "hidden_size") // heads,
                max_position_embeddings=_get(hf, "max_position_embeddings"),
                norm="rms", norm_eps=float(_get(hf, "rms_norm_eps")), mlp="swiglu",
                qkv_bias=bias or qwen2, o_bias=bias and not qwen2,  # Qwen2: q/k/v only
                mlp_bias={"llama": bool(hf.get("mlp_bias", False)), "ernie4_5": bias}.get(model_type, False),
                qk_norm=model_type in ("qwen3", "qwen3_moe"),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)), moe=None, **_rope(hf))


def _moe(hf: dict) -> dict:
    """Qwen3-MoE, Qwen2-MoE and Mixtral: _decoder's attention, every layer's MLP a set of routed experts."""
    qwen, shared = hf["model_type"] in ("qwen3_moe", "qwen2_moe"), hf["model_type"] == "qwen2_moe"
    if qwen and (hf.get("mlp_only_layers") or _get(hf, "decoder_sparse_step") != 1):
        raise ConfigError(f"mlp_only_layers={hf.get('mlp_only_layers')}, decoder_sparse_step="
                          f"{hf.get('decoder_sparse_step')}: dense MLP layers between the MoE ones are not supported")
    if hf.get("sliding_window") is not None and hf.get("use_sliding_window", True):  # Mixtral has no such switch
        raise ConfigError(f"sliding_window={hf['sliding_window']} is not supported (attention sees the whole context)")
    # Qwen3-MoE's num_experts: transformers 5.2x writes it as Mixtral's num_local_experts
    moe = MoE(num_experts=_get(hf, "num_local_experts" if "num_local_experts" in hf else "num_experts"),
              top_k=_get(hf, "num_experts_per_tok"), norm_topk_prob=bool(_get(hf, "norm_topk_prob")) if qwen else True,
              shared_size=_get(hf, "shared_expert_intermediate_size") if shared else 0)
    size = _get(hf, "moe_intermediate_size" if qwen else "intermediate_size")
    return {**_decoder(hf), "intermediate_size": size, "moe": moe}


def _gpt2(hf):
    if _get(hf, "activation_function") not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ConfigError(f"activation_function={hf['activation_function']!r} is not supported (gelu_new)")
    for flag, supported in (("scale_attn_by_inverse_layer_idx", False), ("reorder_and_upcast_attn", False),
                            ("scale_attn_weights", True)):
        if bool(hf.get(flag, supported)) != supported:
            raise ConfigError(f"GPT-2 option {flag}={not supported} is not supported")
    hidden, heads = _get(hf, "n_embd"), _get(hf, "n_head")
    return dict(vocab_size=_get(hf, "vocab_size"), hidden_size=hidden,
                intermediate_size=hf.get("n_inner") or 4 * hidden, num_layers=_get(hf, "n_layer"),
                num_heads=heads, num_kv_heads=heads, head_dim=hidden // heads,
                max_position_embeddings=_get(hf, "n_positions"),
                norm="layer", norm_eps=float(_get(hf, "layer_norm_epsilon")), mlp="gelu_tanh",
                qkv_bias=True, o_bias=True, mlp_bias=True, qk_norm=False, rope_theta=None, rope_llama3=None,
                tie_word_embeddings=True, moe=None)  # GPT2LMHeadModel always ties lm_head to wte


_BUILDERS = {"llama": _decoder, "qwen2": _decoder, "qwen3": _decoder, "ernie4_5": _decoder, "gpt2": _gpt2,
             "qwen3_moe": _moe, "qwen2_moe": _moe, "mixtral": _moe}
