"""`python -m convert` in bounded memory: converting a generated Q8_0 GGUF and a generated bf16 safetensors folder
(~110M parameters, ~220 MB of bf16 output each) peaks at most 1.5x the bf16 output above the peak of an interpreter
that imports the same modules and does nothing else. Both sources are read, converted and written part by part."""
import json
import subprocess
import sys

import gguf
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from convert.gguf_tokenizer import byte_alphabet

# Llama-shaped, no tensor large next to the whole (as in real models), untied LM head.
HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, VOCAB = 768, 2048, 16, 12, 4, 8192
HEAD_DIM = HIDDEN // HEADS
LIMIT = 1.5  # peak memory above the baseline, in units of the bf16 output

# The child's peak resident set (KiB) as its parent sees it; run in a fresh parent so that no other child counts.
_PEAK = ("import resource, subprocess, sys; rc = subprocess.run(sys.argv[1:]).returncode; "
         "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(rc)")
# What a conversion imports and starts, without converting anything.
_BASELINE = ("import jax, orbax.checkpoint, safetensors, gguf, transformers, convert.__main__, convert.gguf_source; "
             "from transformers import AutoConfig, PreTrainedTokenizerFast; jax.devices(); "
             "AutoConfig.for_model('llama')")


def _hf_shapes() -> dict[str, tuple[int, int]]:
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "lm_head.weight": (VOCAB, HIDDEN),
              "model.norm.weight": (HIDDEN,)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (HIDDEN,), p + "post_attention_layernorm.weight": (HIDDEN,),
            p + "self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
            p + "mlp.gate_proj.weight": (INTERMEDIATE, HIDDEN), p + "mlp.up_proj.weight": (INTERMEDIATE, HIDDEN),
            p + "mlp.down_proj.weight": (HIDDEN, INTERMEDIATE),
        })
    return shapes


def _hf_config() -> dict:
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": HIDDEN,
            "intermediate_size": INTERMEDIATE, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
            "num_key_value_heads": KV_HEADS, "vocab_size": VOCAB, "max_position_embeddings": 512,
            "rms_norm_eps": 1e-5, "tie_word_embeddings": False}


def _write_safetensors(folder, rng):
    folder.mkdir()
    pool = rng.standard_normal(1 << 20).astype(ml_dtypes.bfloat16)  # tiled: random enough, fast to make
    tensors = {name: np.resize(pool, shape) for name, shape in _hf_shapes().items()}
    save_file(tensors, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(_hf_config()))


def _gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight",
           "model.norm.weight": "output_norm.weight"}
    if hf in top:
        return top[hf]
    suffixes = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
                "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
                "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
                "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
                "mlp.down_proj.weight": "ffn_down.weight"}
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{suffixes[rest]}"


def _q8_0_blocks(rows: int, cols: int, rng) -> np.ndarray:
    """Random Q8_0 rows: per 32 values an f16 scale and 32 int8 quants."""
    blocks = rows * cols // 32
    raw = np.resize(rng.integers(-127, 128, 1 << 20, dtype=np.int8).view(np.uint8), (blocks, 34))
    raw[:, :2] = np.array([0.01], np.float16).view(np.uint8)
    return raw.reshape(rows, cols // 32 * 34)


def _write_gguf(path, rng):
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in {"llama.block_count": LAYERS, "llama.context_length": 512, "llama.embedding_length": HIDDEN,
                       "llama.feed_forward_length": INTERMEDIATE, "llama.attention.head_count": HEADS,
                       "llama.attention.head_count_kv": KV_HEADS}.items():
        w.add_uint32(key, value)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    tokens = [*byte_alphabet().values(), *(f"x{i}" for i in range(VOCAB - 256))]
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.merges", ["x 0"])
    for name, shape in _hf_shapes().items():
        if len(shape) == 1:
            w.add_tensor(_gguf_name(name), np.ones(shape, np.float32))
        else:
            w.add_tensor(_gguf_name(name), _q8_0_blocks(*shape, rng), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _peak_kib(args: list[str]) -> int:
    out = subprocess.run([sys.executable, "-c", _PEAK, *args], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return int(out.stdout.split()[-1])


@pytest.fixture(scope="module")
def baseline_kib() -> int:
    return _peak_kib([sys.executable, "-c", _BASELINE])


@pytest.mark.parametrize("kind", ["gguf", "safetensors"])
def test_convert_peak_memory_is_bounded(tmp_path, baseline_kib, kind):
    rng = np.random.default_rng(0)
    src = tmp_path / ("model.gguf" if kind == "gguf" else "model")
    (_write_gguf if kind == "gguf" else _write_safetensors)(src, rng)
    dst = tmp_path / "ckpt"
    peak = _peak_kib([sys.executable, "-m", "convert", str(src), str(dst), "--dtype", "bfloat16"])
    output_mib = json.loads((dst / "manifest.json").read_text())["num_parameters"] * 2 / 2**20
    above_mib = (peak - baseline_kib) / 1024
    print(f"{kind}: peak {above_mib:.0f} MiB above the baseline, bf16 output {output_mib:.0f} MiB")
    assert output_mib > 200
    assert above_mib <= LIMIT * output_mib, (above_mib, output_mib)
