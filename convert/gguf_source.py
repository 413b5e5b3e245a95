"""A llama.cpp GGUF file (llama, qwen2, qwen3, qwen3moe, qwen2moe; Mixtral is llama with experts) as a source: its
metadata as an HF config, its tensors by HF name, read when asked for (one without an HF name keeps its GGUF name:
convert/keys.py reports it unmapped). GGUF dims run fastest-first: its [in, out] is HF's [out, in]. llama.cpp permutes
the llama arch's q/k rows (its RoPE rotates adjacent pairs, HF's the halves of each head); reading undoes that. Llama
3's RoPE scaling comes back from the rope_freqs tensor; scalings in metadata (linear, yarn) are refused, as in
config.py."""
import contextlib
import functools
import importlib.util
import math
import os
import struct
import tempfile
from pathlib import Path
from typing import Any, Callable

import numpy as np

import gguf
from gguf import GGMLQuantizationType, GGUFValueType

from convert import gguf_tokenizer
from convert.files import recovery
from convert.keys import interleaved_to_halves


class GGUFError(ValueError):
    """Any problem with a GGUF file; the message names the tensor or metadata field."""


# GGUF architecture -> (HF model_type, architecture); llama.cpp writes Mixtral as llama with experts.
_ARCHITECTURES = {"llama": ("llama", "LlamaForCausalLM"), "qwen2": ("qwen2", "Qwen2ForCausalLM"),
                  "qwen3": ("qwen3", "Qwen3ForCausalLM"), "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
                  "qwen2moe": ("qwen2_moe", "Qwen2MoeForCausalLM")}
_MOE_ARCHITECTURES = ("qwen3moe", "qwen2moe")  # mixture-of-experts by name; llama is Mixtral where it has experts
SUPPORTED_TYPES = frozenset(GGMLQuantizationType[name] for name in "F32 F16 BF16 Q8_0 Q4_0 Q4_1 Q4_K Q6_K".split())

# GGUF tensor name -> HF name, outside the layers and (after "blk.{i}." -> "model.layers.{i}.") inside them.
_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    **{f"attn_{name}.{kind}": f"self_attn.{hf}_proj.{kind}" for name, hf in zip(("q", "k", "v", "output"), "qkvo")
       for kind in ("weight", "bias")},
    **{f"ffn_{name}.weight": f"mlp.{name}_proj.weight" for name in ("gate", "up", "down")},
    "ffn_gate_inp.weight": "mlp.gate.weight",  # the router
    **{f"ffn_{name}_exps.weight": f"mlp.experts.{name}_proj" for name in ("gate", "up", "down")},
    **{f"ffn_{name}_shexp.weight": f"mlp.shared_expert.{name}_proj.weight" for name in ("gate", "up", "down")},
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",  # Qwen2-MoE's shared expert and its gate
}
_TOP_FROM_HF = {hf: name for name, hf in _TOP_NAMES.items()}
_LAYER_FROM_HF = {hf: name for name, hf in _LAYER_NAMES.items()}
# Llama 3.x's per-frequency RoPE divisors, written without metadata for the scaling; only the llama arch has it.
_ROPE_FREQS = "rope_freqs.weight"

_SCALAR_BYTES = {kind: np.dtype(t).itemsize for kind, t in gguf.GGUFReader.gguf_scalar_to_np.items()}
_INT_TYPES = {t for t in _SCALAR_BYTES if "INT" in t.name}
# The value types _meta accepts for each Python type it is asked for.
_VALUE_TYPES = {int: _INT_TYPES, float: _INT_TYPES | {GGUFValueType.FLOAT32, GGUFValueType.FLOAT64},
                str: {GGUFValueType.STRING}, bool: {GGUFValueType.BOOL}, list: {GGUFValueType.ARRAY}}


def hf_name(name: str) -> str | None:
    """The HF name of GGUF tensor `name`; None if it has none."""
    return _rename(name, _TOP_NAMES, "blk.", _LAYER_NAMES, "model.layers.")


def gguf_name(name: str) -> str | None:
    """The GGUF name of HF tensor `name` (inverse of hf_name); None if it has none."""
    return _rename(name, _TOP_FROM_HF, "model.layers.", _LAYER_FROM_HF, "blk.")


def _rename(name: str, top: dict, layer_prefix: str, layer: dict, new_layer_prefix: str) -> str | None:
    if name in top:
        return top[name]
    block, _, layer_name = name.removeprefix(layer_prefix).partition(".")
    if name.startswith(layer_prefix) and block.isdigit() and layer_name in layer:
        return f"{new_layer_prefix}{block}.{layer[layer_name]}"
    return None


def tensor_label(name: str) -> str:
    """How errors name a tensor: by its HF name and, where it has one, its name in the GGUF file."""
    in_file = gguf_name(name)
    return f"{name!r} (GGUF {in_file!r})" if in_file else repr(name)


@contextlib.contextmanager
def _naming(path):
    """Prefixes the message of a GGUFError raised in the block with the file's path."""
    try:
        yield
    except GGUFError as e:
        raise GGUFError(f"{os.fspath(path)}: {e}") from e.__cause__


def _open(path: Path) -> gguf.GGUFReader:
    if not os.path.isfile(path):
        raise GGUFError("GGUF file not found")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # anything gguf/numpy raise while parsing means the file is bad
        problem = _header_problem(path) or f"not a readable GGUF file ({type(e).__name__}: {e})"
        raise GGUFError(f"{problem}; {recovery(path)}") from e
    if reader.byte_order != "I":
        raise GGUFError("byte-swapped (big-endian) GGUF files are not supported")
    return reader


def _header_problem(path: Path) -> str | None:
    """What is wrong with a file gguf's reader refused, read field by field (gguf's errors name no metadata entry or
    tensor); None: gguf's message says."""
    with open(path, "rb") as f:
        size, where, infos, alignment = os.fstat(f.fileno()).st_size, "the GGUF header", [], gguf.GGUF_DEFAULT_ALIGNMENT

        def take(n: int) -> bytes:
            if f.tell() + n > size:  # checked before reading: a corrupt length may be huge
                raise EOFError
            return f.read(n)

        def unpack(fmt: str) -> tuple:
            return struct.unpack("<" + fmt, take(struct.calcsize("<" + fmt)))

        def string() -> str:
            return take(unpack("Q")[0]).decode("utf-8", errors="replace")

        def value(kind: int):  # one metadata value of GGUFValueType `kind`, returned if it is a scalar
            if kind == GGUFValueType.STRING:
                return string()
            if kind != GGUFValueType.ARRAY:
                return int.from_bytes(take(_SCALAR_BYTES[GGUFValueType(kind)]), "little")
            item, count = unpack("IQ")
            if item in _SCALAR_BYTES:
                take(_SCALAR_BYTES[GGUFValueType(item)] * count)
            else:
                for _ in range(count):
                    value(item)

        try:
            magic, _, n_tensors, n_kv = unpack("IIQQ")
            if magic != gguf.GGUF_MAGIC:  # not a GGUF file at all: gguf's message says so
                return None
            for _ in range(n_kv):
                key = string()
                where = f"the metadata entry {key!r}"
                meta = value(unpack("I")[0])
                alignment = meta if key == "general.alignment" and meta else alignment
            for _ in range(n_tensors):
                name = string()
                where = f"the tensor info of {name!r}"
                dims = unpack(f"{unpack('I')[0]}Q")
                infos.append((name, dims, *unpack("IQ")))
        except EOFError:
            return f"file ends at byte {size} while reading {where}: truncated or corrupt GGUF file"
        except (ValueError, KeyError):  # an unknown value type: gguf's message says which
            return None
        data_start = -(-f.tell() // alignment) * alignment
    for name, dims, type_id, offset in infos:
        try:
            block, type_size = gguf.GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
        except (ValueError, KeyError):
            return f"tensor {name!r} has unknown GGML type id {type_id}"
        if not dims or dims[0] % block:
            return f"tensor {name!r} has dims {list(dims)}: not a whole number of {block}-element blocks per row"
        end = data_start + offset + math.prod(dims) // block * type_size
        if end > size:
            return (f"tensor {name!r} data ends at byte {end}, past the end of the file ({size} bytes): "
                    "truncated or corrupt GGUF file")
    return None


_MISSING = object()


def _meta(reader, key: str, kind: type, default: Any = _MISSING) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is _MISSING:
            raise GGUFError(f"missing metadata field {key!r}")
        return default
    if not field.types or field.types[0] not in _VALUE_TYPES[kind]:
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
    """The shortest decimal that round-trips through float32 (1e-05, not 9.999999747378752e-06): llama.cpp stores
    these floats as float32, and the HF config most likely had that decimal. A FLOAT64 value comes back unchanged."""
    f32 = np.float32(x)
    return float(str(f32)) if float(f32) == x else float(x)


def _kv_heads(reader, arch: str, n_head: int) -> int:
    key = f"{arch}.attention.head_count_kv"
    field = reader.fields.get(key)
    if field is not None and field.types and field.types[0] == GGUFValueType.ARRAY:  # per layer (llama.cpp allows it)
        values = _meta(reader, key, list)
        if not values or len(set(values)) != 1:
            raise GGUFError(f"metadata field {key!r}: per-layer KV head counts {values} are not supported")
        value = int(values[0])
    else:
        value = _meta(reader, key, int, n_head)  # n_head: llama.cpp's default
    if value <= 0 or n_head % value:
        raise GGUFError(f"metadata field {key!r} = {value} does not divide head_count {n_head}")
    return value


def _head_dim(reader, arch: str, hidden: int, n_head: int) -> int:
    key_len = f"{arch}.attention.key_length"
    if key_len not in reader.fields and hidden % n_head:
        raise GGUFError(f"missing metadata field {key_len!r} and embedding_length {hidden} is not divisible by "
                        f"head_count {n_head}")
    head_dim = _meta_pos_int(reader, key_len, hidden // n_head)  # the default: llama.cpp's n_embd_head_k
    for key in (f"{arch}.attention.value_length", f"{arch}.rope.dimension_count"):  # V heads, partial rotary
        if (value := _meta_pos_int(reader, key, head_dim)) != head_dim:
            raise GGUFError(f"metadata field {key!r} = {value} != head_dim {head_dim}: unsupported")
    return head_dim


def _vocab_size(reader, arch: str, tinfo: dict) -> int:
    if "token_embd.weight" not in tinfo:
        raise GGUFError("missing tensor 'token_embd.weight'")
    embd_ne = [int(d) for d in tinfo["token_embd.weight"].shape]
    if len(embd_ne) != 2:
        raise GGUFError(f"tensor 'token_embd.weight' has GGUF shape {embd_ne}, expected 2 dims")
    if (meta_vocab := _meta(reader, f"{arch}.vocab_size", int, embd_ne[1])) != embd_ne[1]:
        raise GGUFError(f"metadata field '{arch}.vocab_size' = {meta_vocab} disagrees with tensor "
                        f"'token_embd.weight' ({embd_ne[1]} rows)")
    return embd_ne[1]


def _llama3_factors(wavelen: np.ndarray, factor: float, high: float, orig: float) -> np.ndarray:
    """rope_freqs[i], the divisor of inv_freq[i], as llama.cpp's convert_hf_to_gguf.py and HF's
    _compute_llama3_parameters compute it, for low_freq_factor 1."""
    smooth = (orig / wavelen - 1.0) / (high - 1.0)
    mid = 1.0 / ((1.0 - smooth) / factor + smooth)
    return np.where(wavelen < orig / high, 1.0, np.where(wavelen > orig, factor, mid))


def _llama3_rope_scaling(factors: np.ndarray, head_dim: int, theta: float) -> dict | None:
    """HF's {"rope_type": "llama3", ...} recovered from llama.cpp's rope_freqs.weight tensor."""
    factors = np.asarray(factors, dtype=np.float64).reshape(-1)
    if factors.shape != (head_dim // 2,):
        raise GGUFError(f"tensor {_ROPE_FREQS!r} has {factors.size} entries, expected head_dim/2 = {head_dim // 2}")
    if not np.all(np.isfinite(factors)) or np.any(factors <= 0):
        raise GGUFError(f"tensor {_ROPE_FREQS!r} holds non-positive or non-finite values")
    if np.allclose(factors, 1.0, rtol=0, atol=1e-6):
        return None
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    factor = float(factors.max())
    # (original_max_position_embeddings, high_freq_factor); only the ratios orig/low and orig/high matter, so the fit
    # sets low_freq_factor to 1.
    candidates = [(8192.0, 4.0)]  # every official Llama 3.1/3.2/3.3 checkpoint
    mid = (factors > 1 + 1e-6) & (factors < factor * (1 - 1e-6))
    if mid.sum() >= 2:
        # smooth = (orig/wavelen - low)/(high - low) is linear in 1/wavelen.
        smooth = (1 / factors[mid] - 1 / factor) / (1 - 1 / factor)
        a, b = np.polyfit(1 / wavelen[mid], smooth, 1)
        if b < 0:
            high = float(1 - 1 / b)
            orig = float(a * (high - 1))
            candidates += [(float(round(orig)), round(high, 4)), (float(round(orig)), high), (orig, high)]
    for orig, high in candidates:
        if np.allclose(_llama3_factors(wavelen, factor, high, orig), factors, rtol=1e-4, atol=1e-6):
            return {"rope_type": "llama3", "factor": _f32_value(factor), "low_freq_factor": 1.0,
                    "high_freq_factor": high,
                    "original_max_position_embeddings": int(orig) if orig.is_integer() else orig}
    raise GGUFError(f"tensor {_ROPE_FREQS!r} does not match any llama3 rope scaling; refusing to guess the RoPE "
                    "frequencies")


def _build_config(reader, arch: str, tinfo: dict, path: Path) -> dict:
    hidden = _meta_pos_int(reader, f"{arch}.embedding_length")
    n_head = _meta_pos_int(reader, f"{arch}.attention.head_count")
    ffn_key = f"{arch}.feed_forward_length"
    if ffn_key in reader.fields and reader.fields[ffn_key].types[0] == GGUFValueType.ARRAY:
        raise GGUFError(f"metadata field {ffn_key!r}: per-layer feed-forward sizes are not supported")
    eps = _meta(reader, f"{arch}.attention.layer_norm_rms_epsilon", float)
    theta = _meta(reader, f"{arch}.rope.freq_base", float, 10000.0)  # llama.cpp's default
    if not (eps > 0 and theta > 0):
        raise GGUFError(f"metadata fields {arch}.attention.layer_norm_rms_epsilon / {arch}.rope.freq_base must be > 0")
    moe = _moe_fields(reader, arch, tinfo)
    kind = _meta(reader, f"{arch}.rope.scaling.type", str, "none")
    if kind != "none":
        raise GGUFError(f"metadata field '{arch}.rope.scaling.type' = {kind!r}: RoPE scaling is not supported "
                        "(Llama 3's, from tensor 'rope_freqs.weight', is)")
    if _meta(reader, f"{arch}.rope.scale_linear", float, 1.0) != 1.0:  # pre-2023 key
        raise GGUFError(f"metadata field '{arch}.rope.scale_linear': linear RoPE scaling is not supported")
    model_type, architecture = ("mixtral", "MixtralForCausalLM") if arch == "llama" and moe else _ARCHITECTURES[arch]
    cfg = dict(architectures=[architecture], model_type=model_type, hidden_size=hidden,
               intermediate_size=_meta_pos_int(reader, ffn_key),
               num_hidden_layers=_meta_pos_int(reader, f"{arch}.block_count"), num_attention_heads=n_head,
               num_key_value_heads=_kv_heads(reader, arch, n_head), head_dim=_head_dim(reader, arch, hidden, n_head),
               hidden_act="silu", rms_norm_eps=_f32_value(eps), rope_theta=_f32_value(theta),
               max_position_embeddings=_meta_pos_int(reader, f"{arch}.context_length"),
               vocab_size=_vocab_size(reader, arch, tinfo), tie_word_embeddings="output.weight" not in tinfo,
               bos_token_id=_meta(reader, "tokenizer.ggml.bos_token_id", int, None),
               eos_token_id=_meta(reader, "tokenizer.ggml.eos_token_id", int, None), torch_dtype=_torch_dtype(tinfo),
               **moe)
    if arch == "llama":
        if _ROPE_FREQS in tinfo:
            scaling = _llama3_rope_scaling(_read_tensor(path, tinfo[_ROPE_FREQS]), cfg["head_dim"], theta)
            if scaling:
                cfg["rope_scaling"] = scaling
        # llama.cpp writes (and permutes) attention biases when the HF model has them: all four.
        cfg["attention_bias"] = all(f"blk.0.attn_{p}.bias" in tinfo for p in ("q", "k", "v", "output"))
    if (pad := _meta(reader, "tokenizer.ggml.padding_token_id", int, None)) is not None:
        cfg["pad_token_id"] = pad
    return cfg


def _moe_fields(reader, arch: str, tinfo: dict) -> dict:
    """HF's MoE fields ({} if dense): Qwen3-MoE's or Qwen2-MoE's, or Mixtral's for llama with experts (sized
    feed_forward_length)."""
    count_key = f"{arch}.expert_count"
    experts = _meta_pos_int(reader, count_key) if arch in _MOE_ARCHITECTURES else _meta(reader, count_key, int, 0)
    if not experts:
        return {}
    if arch not in ("llama", *_MOE_ARCHITECTURES):
        raise GGUFError(f"metadata field {count_key!r} = {experts}: mixture-of-experts is not supported for {arch!r}")
    if "blk.0.ffn_gate.0.weight" in tinfo:
        raise GGUFError("tensors 'blk.N.ffn_gate.E.weight' hold one expert each, an older llama.cpp's Mixtral layout: "
                        "not supported; a current llama.cpp writes them stacked ('blk.N.ffn_gate_exps.weight')")
    top_k = _meta_pos_int(reader, f"{arch}.expert_used_count")
    if arch == "llama":
        return {"num_local_experts": experts, "num_experts_per_tok": top_k}
    # llama.cpp's converter writes no expert_weights_norm for qwen3moe and qwen2moe; its graph renormalizes the top-k
    # weights for qwen3moe (as every Qwen3-MoE's norm_topk_prob asks), not for qwen2moe: unless the file says otherwise.
    fields = {"num_experts": experts, "num_experts_per_tok": top_k,
              "moe_intermediate_size": _meta_pos_int(reader, f"{arch}.expert_feed_forward_length"),
              "norm_topk_prob": _meta(reader, f"{arch}.expert_weights_norm", bool, arch == "qwen3moe")}
    if arch == "qwen2moe":
        fields["shared_expert_intermediate_size"] = _meta_pos_int(reader, f"{arch}.expert_shared_feed_forward_length")
    return fields


def _torch_dtype(tinfo: dict) -> str:
    """f16 / bf16 where every matrix is stored that way, else float32 (quantized values are exact in float32 only;
    HF loads GGUF as float32 too). 1-D tensors do not count: llama.cpp keeps norms and biases in F32."""
    types = {t.tensor_type for t in tinfo.values() if len(t.shape) >= 2}
    names = {GGMLQuantizationType.F16: "float16", GGMLQuantizationType.BF16: "bfloat16"}
    return names[types.pop()] if len(types) == 1 and types <= names.keys() else "float32"


def dequantize(name: str, qtype: GGMLQuantizationType, shape: tuple[int, ...], raw: np.ndarray) -> np.ndarray:
    """raw: the tensor's bytes (uint8) -> C-contiguous float32 [shape] (numpy order: GGUF ne reversed), decoded and
    checked for NaN/Inf 16 MB at a time: gguf decodes through temporaries several times the float32 size."""
    if qtype not in SUPPORTED_TYPES:
        supported = ", ".join(sorted(q.name for q in SUPPORTED_TYPES))
        raise GGUFError(f"tensor {name!r} has unsupported type {qtype.name} (supported: {supported})")
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    row_len = shape[-1]
    rows = raw.reshape(-1, row_len // block * type_size)
    out = np.empty((rows.shape[0], row_len), np.float32)
    step = max(1, (1 << 22) // row_len)
    for start in range(0, rows.shape[0], step):
        chunk = out[start:start + step]
        try:
            chunk[...] = gguf.quants.dequantize(rows[start:start + step], qtype)
        except Exception as e:
            raise GGUFError(f"tensor {name!r} ({qtype.name}, shape {list(shape)}) could not be decoded: {e}") from e
        if not np.isfinite(chunk).all():
            raise GGUFError(f"tensor {name!r} contains NaN/Inf values: corrupt file?")
    return out.reshape(shape)


def _read_tensor(path: Path, t: gguf.ReaderTensor) -> np.ndarray:
    """A plain read rather than through the reader's memory map, whose pages would stay resident: a conversion would
    end up holding the whole file."""
    raw = np.fromfile(path, dtype=np.uint8, count=int(t.n_bytes), offset=int(t.data_offset))
    if raw.size != t.n_bytes:
        raise GGUFError(f"tensor {t.name!r} runs past the end of the file: truncated GGUF file; {recovery(path)}")
    return dequantize(t.name, t.tensor_type, tuple(int(d) for d in reversed(t.shape)), raw)


def _load(path: Path, t: gguf.ReaderTensor, rope_heads: int | None, head_dim: int) -> np.ndarray:
    """rope_heads: undo llama.cpp's Q/K row permutation for that many heads."""
    with _naming(path):
        array = _read_tensor(path, t)
    if rope_heads and array.shape[0] == rope_heads * head_dim:  # another shape: keys.py reports it
        array = interleaved_to_halves(array, rope_heads, head_dim)
    return array


def read_gguf(path: str | os.PathLike) -> tuple[dict, dict[str, Callable[[], np.ndarray]]]:
    """(an HF-style config.json dict, a loader of each float32 tensor by its HF name, in HF's shape). GGUFError,
    naming the file, for a bad file; a loader raises it for a bad tensor."""
    path = Path(path)
    with _naming(path):
        reader = _open(path)
        arch = _meta(reader, "general.architecture", str)
        if arch not in _ARCHITECTURES:
            raise GGUFError(f"metadata field 'general.architecture' = {arch!r}: unsupported architecture "
                            f"(supported: {', '.join(_ARCHITECTURES)})")
        tinfo = {t.name: t for t in reader.tensors}
        cfg = _build_config(reader, arch, tinfo, path)
    rope_heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}
    tensors = {}
    for name, t in tinfo.items():
        if arch == "llama" and name == _ROPE_FREQS:  # in the config now
            continue
        kind = name.split(".")[-2] if arch == "llama" and name.startswith("blk.") else None
        tensors[hf_name(name) or name] = functools.partial(_load, path, t, rope_heads.get(kind), cfg["head_dim"])
    return cfg, tensors


def save_gguf_tokenizer(path: str | os.PathLike, dst_dir: str | os.PathLike) -> bool:
    """Writes HF tokenizer files built from the GGUF's metadata into dst_dir, the chat template in
    tokenizer_config.json; True (Source.save_tokenizer's answer: written), a GGUFError if the metadata lacks them."""
    path = Path(path)
    with _naming(path):
        reader = _open(path)
        model = _meta(reader, "tokenizer.ggml.model", str)
        tokens = _meta(reader, "tokenizer.ggml.tokens", list)
        if tokens == []:
            raise GGUFError("metadata field 'tokenizer.ggml.tokens' is empty")
        template = _meta(reader, "tokenizer.chat_template", str, None)
        special = _special_token_ids(reader, len(tokens))
        pre = _meta(reader, "tokenizer.ggml.pre", str, None)
        if gguf_tokenizer.can_build(model, pre, "tokenizer.ggml.merges" in reader.fields):
            tok = _byte_level_tokenizer(reader, tokens, pre, special, template)
        else:
            tok = _transformers_tokenizer(path, model, pre)
    del reader
    if template is not None and tok.chat_template != template:
        tok.chat_template = template
    for attr, idx in special.items():
        if idx is not None and getattr(tok, attr) != tok.convert_ids_to_tokens(idx):
            setattr(tok, attr, tok.convert_ids_to_tokens(idx))
    os.makedirs(dst_dir, exist_ok=True)
    # Without save_jinja_files=False, transformers 5 writes the chat template to a chat_template.jinja of its own.
    tok.save_pretrained(os.fspath(dst_dir), save_jinja_files=False)
    return True


def _special_token_ids(reader, vocab_size: int) -> dict[str, int | None]:
    special = {}
    for attr, key in (("bos_token", "tokenizer.ggml.bos_token_id"), ("eos_token", "tokenizer.ggml.eos_token_id"),
                      ("unk_token", "tokenizer.ggml.unknown_token_id"),
                      ("pad_token", "tokenizer.ggml.padding_token_id")):
        special[attr] = _meta(reader, key, int, None)
        if special[attr] is not None and not 0 <= special[attr] < vocab_size:
            raise GGUFError(f"metadata field {key!r} = {special[attr]} is outside the vocabulary ({vocab_size} tokens)")
    return special


def _byte_level_tokenizer(reader, tokens: list[str], pre: str | None, special: dict, template: str | None):
    """Byte-level BPE, built here from the metadata (convert/gguf_tokenizer.py): no torch needed."""
    from transformers import PreTrainedTokenizerFast

    names = {attr: tokens[idx] for attr, idx in special.items() if idx is not None}
    backend = gguf_tokenizer.build(
        tokens, _meta(reader, "tokenizer.ggml.merges", list), _meta(reader, "tokenizer.ggml.token_type", list, None),
        pre, bos=names.get("bos_token"), eos=names.get("eos_token"),
        add_bos=_meta(reader, "tokenizer.ggml.add_bos_token", bool, False) and "bos_token" in names,
        add_eos=_meta(reader, "tokenizer.ggml.add_eos_token", bool, False) and "eos_token" in names)
    return PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=template, **names)


def _transformers_tokenizer(path: Path, model: str, pre: str | None):
    """Any other tokenizer through transformers' GGUF loader, which imports torch."""
    from transformers import AutoTokenizer

    if importlib.util.find_spec("torch") is None:
        raise GGUFError(f"its tokenizer (tokenizer.ggml.model {model!r}, pre {pre!r}) is built by transformers' GGUF "
                        "loader, which needs torch: pip install torch (byte-level BPE vocabularies are built without)")
    # A private folder holding only a link to the file: tokenizer files beside the GGUF cannot be mixed in.
    with tempfile.TemporaryDirectory(prefix="nanojax-gguf-tok-") as tmp:
        try:
            os.symlink(path.resolve(), Path(tmp) / path.name)
            src_dir = tmp
        except OSError:
            src_dir = str(path.parent)
        try:
            return AutoTokenizer.from_pretrained(src_dir, gguf_file=path.name, local_files_only=True)
        except Exception as e:
            raise GGUFError(f"transformers could not build a tokenizer from the GGUF metadata: {e}") from e
