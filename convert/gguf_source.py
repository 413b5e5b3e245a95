"""Read llama.cpp GGUF checkpoints into an HF-style config and HF-layout float32 tensors.

Public API (consumed by the rest of the converter):

    read_gguf(path) -> (hf_config: dict, tensors: dict[str, np.ndarray])
    save_gguf_tokenizer(path, dst_dir) -> None
    GGUFError(ValueError)

Scope: GGUF architectures ``llama`` (Llama 1/2/3, SmolLM2, TinyLlama; optional q/k/v/o attention
biases), ``qwen2`` (q/k/v biases) and ``qwen3`` (q/k norms); tensor types F32, F16, BF16, Q8_0, Q4_0,
Q4_1, Q4_K and Q6_K (decoded with gguf.quants.dequantize).  RoPE scaling comes from the
``{arch}.rope.scaling.*`` metadata (linear, yarn) or, for Llama 3.x, from the rope_freqs tensor.
Everything else is rejected with a GGUFError that names the offending tensor or metadata field.

Layout notes
  * GGUF stores a tensor's dims fastest-first (``ne[0]`` is the contiguous one), so a GGUF shape
    [in, out] is the row-major numpy/HF shape [out, in].  ``GGUFReader`` already hands out the data
    with numpy's (reversed) shape; we check it against the shape HF expects for every tensor.
  * llama.cpp's convert_hf_to_gguf.py permutes the rows of q_proj / k_proj for the ``llama`` arch
    only (llama.cpp's "normal" RoPE rotates adjacent pairs, HF's rotates the two halves of each head):
        permute(w, n_head, n_head_kv) = w.reshape(n, 2, rows // n // 2, ...).swapaxes(1, 2)
    with n = n_head_kv for K (when it differs) and n = n_head for Q.  We apply the inverse (the same
    thing transformers' ``LlamaTensorProcessor`` does).  qwen2/qwen3 use NEOX RoPE in llama.cpp, which
    matches HF's layout, so their tensors are stored unpermuted.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

import gguf
from gguf import GGMLQuantizationType, GGUFValueType

from convert import gguf_tokenizer

__all__ = ["GGUFError", "read_gguf", "save_gguf_tokenizer", "GGUF_TO_HF", "SUPPORTED_TYPES"]


class GGUFError(ValueError):
    """Any problem with a GGUF file: missing/invalid metadata or tensor, unsupported tensor type or
    architecture, truncated or corrupt file.  The message names the tensor or metadata field."""


# --------------------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------------------

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

SUPPORTED_TYPES = frozenset(
    {
        GGMLQuantizationType.F32,
        GGMLQuantizationType.F16,
        GGMLQuantizationType.BF16,
        GGMLQuantizationType.Q8_0,
        GGMLQuantizationType.Q4_0,
        GGMLQuantizationType.Q4_1,
        GGMLQuantizationType.Q4_K,
        GGMLQuantizationType.Q6_K,
    }
)

# The one mapping table: GGUF tensor name -> HF safetensors name ("{i}" = layer index).
GGUF_TO_HF: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "blk.{i}.attn_output.bias": "model.layers.{i}.self_attn.o_proj.bias",
    "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}

_COMMON = (
    "token_embd.weight",
    "output_norm.weight",
    "blk.{i}.attn_norm.weight",
    "blk.{i}.attn_q.weight",
    "blk.{i}.attn_k.weight",
    "blk.{i}.attn_v.weight",
    "blk.{i}.attn_output.weight",
    "blk.{i}.ffn_norm.weight",
    "blk.{i}.ffn_gate.weight",
    "blk.{i}.ffn_up.weight",
    "blk.{i}.ffn_down.weight",
)
# Which entries of GGUF_TO_HF each architecture must have.  "output.weight" is optional everywhere
# (absent <=> tied embeddings).  Anything in the file outside required + optional (+ _CONFIG_TENSORS)
# is an error.
_REQUIRED = {
    "llama": _COMMON,
    "qwen2": _COMMON + ("blk.{i}.attn_q.bias", "blk.{i}.attn_k.bias", "blk.{i}.attn_v.bias"),
    "qwen3": _COMMON + ("blk.{i}.attn_q_norm.weight", "blk.{i}.attn_k_norm.weight"),
}
_OPTIONAL = ("output.weight",)
# Llama checkpoints with attention_bias=True (HF: q/k/v/o all biased) -- all four or none, in every layer.
_LLAMA_BIASES = ("blk.{i}.attn_q.bias", "blk.{i}.attn_k.bias", "blk.{i}.attn_v.bias", "blk.{i}.attn_output.bias")
# Tensors that are not returned as weights.  rope_freqs.weight: llama.cpp writes it for Llama-3.x
# ("llama3" rope_type) as per-frequency divisors computed from HF's rope_scaling.  It has no HF tensor,
# but GGUF has no metadata for llama3 scaling either, so it is *not* simply dropped (transformers' own
# GGUF loader does drop it, losing the scaling): _llama3_rope_scaling() turns it back into
# config["rope_scaling"] and checks that this reproduces the tensor.  Only the llama arch has it.
_CONFIG_TENSORS = {"llama": ("rope_freqs.weight",), "qwen2": (), "qwen3": ()}

_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")

_INT_TYPES = {
    GGUFValueType.UINT8, GGUFValueType.INT8, GGUFValueType.UINT16, GGUFValueType.INT16,
    GGUFValueType.UINT32, GGUFValueType.INT32, GGUFValueType.UINT64, GGUFValueType.INT64,
}
_FLOAT_TYPES = {GGUFValueType.FLOAT32, GGUFValueType.FLOAT64}


# --------------------------------------------------------------------------------------------------
# Opening the file
# --------------------------------------------------------------------------------------------------

class _CheckedReader(gguf.GGUFReader):
    """GGUFReader that fails with a GGUFError naming what it was reading when the file ends early,
    and checks each tensor's type id and data extent before gguf slices the data.

    It hooks a few private GGUFReader methods; if a future gguf renames them the hooks are simply not
    called and read_gguf's catch-all still turns the failure into a (less specific) GGUFError."""

    _where = "the GGUF header"

    def _get(self, offset, dtype, count=1, *args, **kwargs):
        end = int(offset) + np.dtype(dtype).itemsize * int(count)
        if end > len(self.data):
            raise GGUFError(
                f"file ends at byte {len(self.data)} while reading {self._where} (needs byte {end}): "
                "truncated or corrupt GGUF file"
            )
        return super()._get(offset, dtype, count, *args, **kwargs)

    def _push_field(self, field, *args, **kwargs):
        self._where = f"the metadata entry after {field.name!r}"
        return super()._push_field(field, *args, **kwargs)

    def _get_tensor_info_field(self, orig_offs):
        field = super()._get_tensor_info_field(orig_offs)
        self._where = f"the tensor info after tensor {field.name!r}"
        return field

    def _build_tensors(self, start_offs, fields):
        size = len(self.data)
        for field in fields:
            parts = field.parts
            if len(parts) != 6:  # unknown gguf internals: leave the checks to gguf + read_gguf
                break
            name = bytes(parts[1]).decode("utf-8", errors="replace")
            dims = [int(d) for d in parts[3]]
            raw_type = int(parts[4][0])
            try:
                qtype = GGMLQuantizationType(raw_type)
                block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            except (ValueError, KeyError):
                raise GGUFError(f"tensor {name!r} has unknown GGML type id {raw_type}") from None
            if not dims or any(d <= 0 for d in dims):
                raise GGUFError(f"tensor {name!r} has invalid dims {dims}")
            if dims[0] % block:
                raise GGUFError(
                    f"tensor {name!r} ({qtype.name}) has row length {dims[0]}, not a multiple of the "
                    f"block size {block}"
                )
            n_bytes = math.prod(dims) // block * type_size
            start = int(start_offs) + int(parts[5][0])
            if start + n_bytes > size:
                raise GGUFError(
                    f"tensor {name!r} data (bytes {start}..{start + n_bytes}) runs past the end of the "
                    f"file ({size} bytes): truncated or corrupt GGUF file"
                )
        self._where = "the tensor data"
        return super()._build_tensors(start_offs, fields)


def _open(path: str | os.PathLike) -> gguf.GGUFReader:
    if not os.path.isfile(path):
        raise GGUFError("GGUF file not found")
    try:
        reader = _CheckedReader(path)
    except GGUFError:
        raise
    except Exception as e:  # anything gguf/numpy raise while parsing means the file is bad
        raise GGUFError(f"not a readable GGUF file ({type(e).__name__}: {e})") from e
    if reader.byte_order != "I":
        raise GGUFError("byte-swapped (big-endian) GGUF files are not supported")
    return reader


# --------------------------------------------------------------------------------------------------
# Metadata
# --------------------------------------------------------------------------------------------------

_MISSING = object()


def _meta(reader, key: str, kind: type, default: Any = _MISSING) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is _MISSING:
            raise GGUFError(f"missing metadata field {key!r}")
        return default
    main = field.types[0] if field.types else None
    ok = {
        int: main in _INT_TYPES,
        float: main in _FLOAT_TYPES or main in _INT_TYPES,
        str: main == GGUFValueType.STRING,
        bool: main == GGUFValueType.BOOL,
        list: main == GGUFValueType.ARRAY,
    }[kind]
    if not ok:
        raise GGUFError(f"metadata field {key!r} has type {[t.name for t in field.types]}, expected {kind.__name__}")
    try:
        value = field.contents()
    except Exception as e:
        raise GGUFError(f"metadata field {key!r} is unreadable: {e}") from e
    return float(value) if kind is float else value


def _meta_pos_int(reader, key: str, default: Any = _MISSING) -> Any:
    value = _meta(reader, key, int, default)
    if value is not default and value <= 0:
        raise GGUFError(f"metadata field {key!r} must be positive, got {value}")
    return value


def _f32_value(x: float) -> float:
    """llama.cpp stores these floats as float32; give back the shortest decimal that round-trips
    through float32 (1e-05, not 9.999999747378752e-06), i.e. the value the HF config most likely had.
    Values that are not float32 (a FLOAT64 field) are returned unchanged."""
    f32 = np.float32(x)
    return float(str(f32)) if float(f32) == x else float(x)


def _kv_heads(reader, arch: str, n_head: int) -> int:
    key = f"{arch}.attention.head_count_kv"
    field = reader.fields.get(key)
    if field is None:
        return n_head  # llama.cpp's default
    if field.types and field.types[0] == GGUFValueType.ARRAY:  # per-layer list (llama.cpp allows it)
        values = _meta(reader, key, list)
        if not values or len(set(values)) != 1:
            raise GGUFError(f"metadata field {key!r}: per-layer KV head counts {values} are not supported")
        value = int(values[0])
    else:
        value = _meta(reader, key, int)
    if value <= 0 or n_head % value:
        raise GGUFError(f"metadata field {key!r} = {value} does not divide head_count {n_head}")
    return value


def _rope_scaling_from_metadata(reader, arch: str) -> dict | None:
    p = f"{arch}.rope.scaling."
    for suffix in ("attn_factor", "alpha", "yarn_log_multiplier", "yarn_ext_factor", "yarn_attn_factor"):
        if p + suffix in reader.fields:
            raise GGUFError(f"metadata field {p + suffix!r} is not supported")
    kind = _meta(reader, p + "type", str, None)
    legacy = _meta(reader, f"{arch}.rope.scale_linear", float, None)  # pre-2023 key
    if kind is None and legacy is not None and legacy != 1.0:
        return {"rope_type": "linear", "factor": _f32_value(legacy)}
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": _f32_value(_meta(reader, p + "factor", float))}
    if kind == "yarn":
        out = {"rope_type": "yarn", "factor": _f32_value(_meta(reader, p + "factor", float))}
        orig = _meta(reader, p + "original_context_length", int, None)
        if orig is not None:
            out["original_max_position_embeddings"] = orig
        for suffix in ("beta_fast", "beta_slow"):
            v = _meta(reader, p + "yarn_" + suffix, float, None)
            if v is not None:
                out[suffix] = _f32_value(v)
        return out
    raise GGUFError(f"metadata field {p + 'type'!r}: unsupported rope scaling type {kind!r}")


def _llama3_factors(wavelen: np.ndarray, factor: float, low: float, high: float, orig: float) -> np.ndarray:
    # llama.cpp convert_hf_to_gguf.py (LlamaModel.generate_extra_tensors), same math as HF's
    # _compute_llama3_parameters: rope_freqs[i] divides inv_freq[i].
    low_wavelen, high_wavelen = orig / low, orig / high
    smooth = (orig / wavelen - low) / (high - low)
    mid = 1.0 / ((1.0 - smooth) / factor + smooth)
    return np.where(wavelen < high_wavelen, 1.0, np.where(wavelen > low_wavelen, factor, mid))


def _llama3_rope_scaling(factors: np.ndarray, head_dim: int, theta: float) -> dict | None:
    """Recover HF's {"rope_type": "llama3", ...} from llama.cpp's rope_freqs.weight tensor."""
    name = "rope_freqs.weight"
    factors = np.asarray(factors, dtype=np.float64).reshape(-1)
    if factors.shape != (head_dim // 2,):
        raise GGUFError(f"tensor {name!r} has {factors.size} entries, expected head_dim/2 = {head_dim // 2}")
    if not np.all(np.isfinite(factors)) or np.any(factors <= 0):
        raise GGUFError(f"tensor {name!r} holds non-positive or non-finite values")
    if np.allclose(factors, 1.0, rtol=0, atol=1e-6):
        return None
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    factor = float(factors.max())
    # (original_max_position_embeddings, low_freq_factor, high_freq_factor); only the ratios
    # orig/low and orig/high matter, so low is normalised to 1 in the fit.
    candidates = [(8192.0, 1.0, 4.0)]  # every official Llama 3.1/3.2/3.3 checkpoint
    mid = (factors > 1 + 1e-6) & (factors < factor * (1 - 1e-6))
    if mid.sum() >= 2:
        # smooth = (orig/wavelen - low)/(high - low) is linear in 1/wavelen.
        smooth = (1 / factors[mid] - 1 / factor) / (1 - 1 / factor)
        a, b = np.polyfit(1 / wavelen[mid], smooth, 1)
        if b < 0:
            high = 1 - 1 / b
            orig = a * (high - 1)
            candidates += [(float(round(orig)), 1.0, round(float(high), 4)), (float(round(orig)), 1.0, float(high)),
                           (float(orig), 1.0, float(high))]
    for orig, low, high in candidates:
        if np.allclose(_llama3_factors(wavelen, factor, low, high, orig), factors, rtol=1e-4, atol=1e-6):
            return {
                "rope_type": "llama3",
                "factor": _f32_value(factor),
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": int(orig) if float(orig).is_integer() else orig,
            }
    raise GGUFError(f"tensor {name!r} does not match any llama3 rope scaling; refusing to guess the RoPE frequencies")


def _build_config(reader, arch: str, tinfo: dict) -> dict:
    hidden = _meta_pos_int(reader, f"{arch}.embedding_length")
    n_layers = _meta_pos_int(reader, f"{arch}.block_count")
    n_head = _meta_pos_int(reader, f"{arch}.attention.head_count")
    n_kv = _kv_heads(reader, arch, n_head)
    ffn_key = f"{arch}.feed_forward_length"
    if ffn_key in reader.fields and reader.fields[ffn_key].types[0] == GGUFValueType.ARRAY:
        raise GGUFError(f"metadata field {ffn_key!r}: per-layer feed-forward sizes are not supported")
    inter = _meta_pos_int(reader, ffn_key)
    ctx = _meta_pos_int(reader, f"{arch}.context_length")
    eps = _meta(reader, f"{arch}.attention.layer_norm_rms_epsilon", float)
    theta = _meta(reader, f"{arch}.rope.freq_base", float, 10000.0)  # llama.cpp's default
    if not (eps > 0 and theta > 0):
        raise GGUFError(f"metadata fields {arch}.attention.layer_norm_rms_epsilon / {arch}.rope.freq_base must be > 0")
    expert_count = _meta(reader, f"{arch}.expert_count", int, 0)
    if expert_count:
        raise GGUFError(f"metadata field '{arch}.expert_count' = {expert_count}: mixture-of-experts is not supported")

    key_len = f"{arch}.attention.key_length"
    if key_len in reader.fields:
        head_dim = _meta_pos_int(reader, key_len)
    elif hidden % n_head == 0:
        head_dim = hidden // n_head  # llama.cpp's default n_embd_head_k
    else:
        raise GGUFError(f"missing metadata field {key_len!r} and embedding_length {hidden} is not divisible by head_count {n_head}")
    v_len = _meta_pos_int(reader, f"{arch}.attention.value_length", head_dim)
    if v_len != head_dim:
        raise GGUFError(f"metadata field '{arch}.attention.value_length' = {v_len} != key_length {head_dim}: unsupported")
    n_rot = _meta_pos_int(reader, f"{arch}.rope.dimension_count", head_dim)
    if n_rot != head_dim:
        raise GGUFError(f"metadata field '{arch}.rope.dimension_count' = {n_rot} != head_dim {head_dim}: partial rotary is unsupported")
    if head_dim % 2:
        raise GGUFError(f"head_dim {head_dim} (from '{key_len}' or embedding_length/head_count) must be even")

    if "token_embd.weight" not in tinfo:
        raise GGUFError("missing tensor 'token_embd.weight'")
    embd_ne = [int(d) for d in tinfo["token_embd.weight"].shape]
    if len(embd_ne) != 2:
        raise GGUFError(f"tensor 'token_embd.weight' has GGUF shape {embd_ne}, expected 2 dims")
    vocab = embd_ne[1]
    meta_vocab = _meta(reader, f"{arch}.vocab_size", int, None)
    if meta_vocab is not None and meta_vocab != vocab:
        raise GGUFError(f"metadata field '{arch}.vocab_size' = {meta_vocab} disagrees with tensor 'token_embd.weight' ({vocab} rows)")

    rope_scaling = _rope_scaling_from_metadata(reader, arch)
    if "rope_freqs.weight" in tinfo and arch == "llama":
        if rope_scaling is not None:
            raise GGUFError(f"tensor 'rope_freqs.weight' together with metadata rope scaling {rope_scaling} is not supported")
        rope_scaling = _llama3_rope_scaling(_dequantize(tinfo["rope_freqs.weight"]), head_dim, theta)

    cfg: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _f32_value(eps),
        "rope_theta": _f32_value(theta),
        "max_position_embeddings": ctx,
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in tinfo,
    }
    if rope_scaling is not None:
        cfg["rope_scaling"] = rope_scaling
    if arch == "llama":  # llama.cpp writes (and permutes) attention biases when the HF model has them
        biases = {t.split(".", 2)[2] for t in _LLAMA_BIASES}
        cfg["attention_bias"] = any(m.group(2) in biases for m in map(_BLOCK_RE.match, tinfo) if m)
    for tok_key, cfg_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                             ("padding_token_id", "pad_token_id")):
        cfg[cfg_key] = _meta(reader, f"tokenizer.ggml.{tok_key}", int, None)
    if cfg["pad_token_id"] is None:
        del cfg["pad_token_id"]
    cfg["torch_dtype"] = _torch_dtype(tinfo)
    return cfg


def _torch_dtype(tinfo: dict) -> str:
    # Dtype of the checkpoint's matrices: f16/bf16 when they are all stored that way, else float32
    # (F32 files, and quantized ones: dequantized values are exact in float32 only; HF loads GGUF
    # as float32 too).  1-D tensors are ignored (llama.cpp always keeps norms/biases in F32).
    types = {t.tensor_type for t in tinfo.values() if len(t.shape) >= 2}
    if types == {GGMLQuantizationType.F16}:
        return "float16"
    if types == {GGMLQuantizationType.BF16}:
        return "bfloat16"
    return "float32"


# --------------------------------------------------------------------------------------------------
# Tensors
# --------------------------------------------------------------------------------------------------

def _dequantize(t) -> np.ndarray:
    """ReaderTensor -> owned, C-contiguous float32 array in numpy/HF dim order (GGUF ne reversed)."""
    qtype = t.tensor_type
    if qtype not in SUPPORTED_TYPES:
        supported = ", ".join(sorted(q.name for q in SUPPORTED_TYPES))
        raise GGUFError(f"tensor {t.name!r} has unsupported type {qtype.name} (supported: {supported})")
    shape = tuple(int(d) for d in reversed([int(x) for x in t.shape]))
    try:
        if qtype == GGMLQuantizationType.F32:
            arr = np.array(t.data, dtype=np.float32)  # copy: t.data is a view of the memmap
        elif qtype == GGMLQuantizationType.F16:
            arr = np.asarray(t.data).astype(np.float32)
        else:
            arr = gguf.quants.dequantize(np.asarray(t.data), qtype)
        arr = np.ascontiguousarray(arr, dtype=np.float32).reshape(shape)
    except GGUFError:
        raise
    except Exception as e:
        raise GGUFError(f"tensor {t.name!r} ({qtype.name}, GGUF shape {list(t.shape)}) could not be decoded: {e}") from e
    return arr


def _unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's LlamaModel.permute(w, n_head, n_head_kv) (pass n_head_kv for K)."""
    return np.ascontiguousarray(
        w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def _expected_tensors(arch: str, cfg: dict) -> dict[str, tuple[str, tuple[int, ...]]]:
    """GGUF name -> (HF name, HF shape) for every tensor the architecture may have."""
    H, I, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d, nh, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    shapes = {
        "token_embd.weight": (V, H),
        "output_norm.weight": (H,),
        "output.weight": (V, H),
        "blk.{i}.attn_norm.weight": (H,),
        "blk.{i}.attn_q.weight": (nh * d, H),
        "blk.{i}.attn_k.weight": (nkv * d, H),
        "blk.{i}.attn_v.weight": (nkv * d, H),
        "blk.{i}.attn_output.weight": (H, nh * d),
        "blk.{i}.attn_q.bias": (nh * d,),
        "blk.{i}.attn_k.bias": (nkv * d,),
        "blk.{i}.attn_v.bias": (nkv * d,),
        "blk.{i}.attn_output.bias": (H,),
        "blk.{i}.attn_q_norm.weight": (d,),
        "blk.{i}.attn_k_norm.weight": (d,),
        "blk.{i}.ffn_norm.weight": (H,),
        "blk.{i}.ffn_gate.weight": (I, H),
        "blk.{i}.ffn_up.weight": (I, H),
        "blk.{i}.ffn_down.weight": (H, I),
    }
    templates = _REQUIRED[arch] + _OPTIONAL + (_LLAMA_BIASES if cfg.get("attention_bias") else ())
    out = {t: (GGUF_TO_HF[t], shapes[t]) for t in templates if "{i}" not in t}
    for i in range(cfg["num_hidden_layers"]):  # layer-major order
        for t in templates:
            if "{i}" in t:
                out[t.format(i=i)] = (GGUF_TO_HF[t].format(i=i), shapes[t])
    return out


def read_gguf(path: str | os.PathLike) -> tuple[dict, dict[str, np.ndarray]]:
    """Returns (hf_config, tensors): an HF-style config.json dict (architectures, model_type, hidden_size,
    intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim (always),
    hidden_act, rms_norm_eps, rope_theta, rope_scaling if any, max_position_embeddings, vocab_size,
    tie_word_embeddings, attention_bias (llama only), bos_token_id, eos_token_id, pad_token_id if given,
    torch_dtype) and tensors keyed
    by the HF safetensors names (model.embed_tokens.weight, model.layers.{i}.self_attn.q_proj.weight, ...,
    lm_head.weight only when the file has output.weight), as float32 numpy arrays in HF's shapes
    ([out, in] for Linear).  Raises GGUFError (message prefixed with the path) for anything unexpected."""
    try:
        return _read_gguf(path)
    except GGUFError as e:
        raise GGUFError(f"{os.fspath(path)}: {e}") from e.__cause__


def _read_gguf(path: str | os.PathLike) -> tuple[dict, dict[str, np.ndarray]]:
    reader = _open(path)
    arch = _meta(reader, "general.architecture", str)
    if arch not in _ARCHITECTURES:
        raise GGUFError(
            f"metadata field 'general.architecture' = {arch!r}: unsupported architecture "
            f"(supported: {', '.join(_ARCHITECTURES)})"
        )
    tinfo = {t.name: t for t in reader.tensors}
    cfg = _build_config(reader, arch, tinfo)
    expected = _expected_tensors(arch, cfg)

    for name in tinfo:
        if name in expected or name in _CONFIG_TENSORS[arch]:
            continue
        m = _BLOCK_RE.match(name)
        if m and int(m.group(1)) >= cfg["num_hidden_layers"]:
            raise GGUFError(f"tensor {name!r} belongs to layer {m.group(1)} but block_count is {cfg['num_hidden_layers']}")
        raise GGUFError(f"tensor {name!r} is not in the GGUF->HF mapping table for architecture {arch!r}")
    if cfg.get("attention_bias"):
        present = sorted(n for n in expected if n in tinfo and n.endswith(".bias"))
        absent = sorted(n for n in expected if n not in tinfo and n.endswith(".bias"))
        if absent:
            raise GGUFError(
                f"tensor {present[0]!r} present but {absent[0]!r} missing: Llama attention biases must exist "
                "for q, k, v and output in every layer"
            )
    for name in expected:
        if name not in tinfo and name not in _OPTIONAL:
            raise GGUFError(f"missing tensor {name!r} (architecture {arch!r})")

    tensors: dict[str, np.ndarray] = {}
    for gname, (hname, shape) in expected.items():
        t = tinfo.get(gname)
        if t is None:
            continue
        arr = _dequantize(t)
        if arr.shape != shape:
            raise GGUFError(
                f"tensor {gname!r} has shape {list(arr.shape)} (GGUF ne {[int(x) for x in t.shape]}), "
                f"expected {list(shape)} from the metadata"
            )
        if arch == "llama" and gname.endswith((".attn_q.weight", ".attn_q.bias")):
            arr = _unpermute_rope(arr, cfg["num_attention_heads"])
        elif arch == "llama" and gname.endswith((".attn_k.weight", ".attn_k.bias")):
            arr = _unpermute_rope(arr, cfg["num_key_value_heads"])
        if not np.isfinite(arr).all():
            raise GGUFError(f"tensor {gname!r} contains NaN/Inf values: corrupt file?")
        tensors[hname] = arr
    return cfg, tensors


# --------------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------------

def save_gguf_tokenizer(path: str | os.PathLike, dst_dir: str | os.PathLike) -> None:
    """Writes HF tokenizer files (tokenizer.json, tokenizer_config.json with the chat template and the
    special tokens) built from the GGUF metadata into dst_dir, via transformers'
    AutoTokenizer.from_pretrained(dir, gguf_file=name) + save_pretrained(save_jinja_files=False)."""
    try:
        _save_gguf_tokenizer(Path(path), dst_dir)
    except GGUFError as e:
        raise GGUFError(f"{os.fspath(path)}: {e}") from e.__cause__


def _save_gguf_tokenizer(path: Path, dst_dir: str | os.PathLike) -> None:
    reader = _open(path)
    model = _meta(reader, "tokenizer.ggml.model", str)
    tokens = _meta(reader, "tokenizer.ggml.tokens", list)
    if tokens == []:
        raise GGUFError("metadata field 'tokenizer.ggml.tokens' is empty")
    template = _meta(reader, "tokenizer.chat_template", str, None)
    special = {}
    for attr, key in (("bos_token", "tokenizer.ggml.bos_token_id"), ("eos_token", "tokenizer.ggml.eos_token_id"),
                      ("unk_token", "tokenizer.ggml.unknown_token_id"), ("pad_token", "tokenizer.ggml.padding_token_id")):
        special[attr] = _meta(reader, key, int, None)
        if special[attr] is not None and not 0 <= special[attr] < len(tokens):
            raise GGUFError(f"metadata field {key!r} = {special[attr]} is outside the vocabulary ({len(tokens)} tokens)")
    pre = _meta(reader, "tokenizer.ggml.pre", str, None)
    if gguf_tokenizer.can_build(model, pre, "tokenizer.ggml.merges" in reader.fields):
        tok = _byte_level_tokenizer(reader, tokens, pre, special, template)
    else:
        tok = _transformers_tokenizer(path, model, pre)
    del reader
    if template is not None and tok.chat_template != template:
        tok.chat_template = template
    for attr, idx in special.items():
        if idx is None:
            continue
        token = tok.convert_ids_to_tokens(idx)
        if getattr(tok, attr) != token:
            setattr(tok, attr, token)
    os.makedirs(dst_dir, exist_ok=True)
    # save_jinja_files=False: the chat template goes into tokenizer_config.json (transformers 5
    # would otherwise write it to a separate chat_template.jinja).
    tok.save_pretrained(os.fspath(dst_dir), save_jinja_files=False)


def _byte_level_tokenizer(reader, tokens: list[str], pre: str | None, special: dict, template: str | None):
    """Byte-level BPE, built here from the metadata (convert/gguf_tokenizer.py): no torch needed."""
    from transformers import PreTrainedTokenizerFast  # heavy import, only needed here

    names = {attr: tokens[idx] for attr, idx in special.items() if idx is not None}
    backend = gguf_tokenizer.build(
        tokens, _meta(reader, "tokenizer.ggml.merges", list), _meta(reader, "tokenizer.ggml.token_type", list, None),
        pre, bos=names.get("bos_token"), eos=names.get("eos_token"),
        add_bos=_meta(reader, "tokenizer.ggml.add_bos_token", bool, False) and "bos_token" in names,
        add_eos=_meta(reader, "tokenizer.ggml.add_eos_token", bool, False) and "eos_token" in names)
    return PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=template, **names)


def _transformers_tokenizer(path: Path, model: str, pre: str | None):
    """Any other tokenizer through transformers' GGUF loader, which imports torch."""
    import importlib.util

    from transformers import AutoTokenizer  # heavy import, only needed here

    if importlib.util.find_spec("torch") is None:
        raise GGUFError(f"its tokenizer (tokenizer.ggml.model {model!r}, pre {pre!r}) is built by transformers' GGUF "
                        "loader, which needs torch: pip install torch (byte-level BPE vocabularies are built without)")
    # Load from a private directory holding just a link to the file, so that unrelated tokenizer
    # files next to the GGUF can't be mixed in.
    with tempfile.TemporaryDirectory(prefix="nanojax-gguf-tok-") as tmp:
        link = Path(tmp) / path.name
        try:
            os.symlink(path.resolve(), link)
            src_dir = tmp
        except OSError:
            src_dir = str(path.parent)
        try:
            return AutoTokenizer.from_pretrained(src_dir, gguf_file=path.name, local_files_only=True)
        except Exception as e:
            raise GGUFError(f"transformers could not build a tokenizer from the GGUF metadata: {e}") from e
