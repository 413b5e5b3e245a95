"""The key table from HF tensor names to nanojax params, per architecture: every tensor shape-checked, a missing or
unmapped one an error naming it. Params come out a layer at a time in the checkpoint's dtype, so a conversion holds
one layer in float32 at most. An RMSNorm's scale is folded into the rows of the projection after it, which then needs
only the norm's statistic (pallas_kernels/rmsnorm_matmul.py); GPT-2's LayerNorms, the final norm (the tied embedding
after it must stay unscaled), Qwen3's q/k norms and the norm before a MoE router stay as they are.
"""
import collections
import concurrent.futures
from typing import Callable, Iterator, Mapping

import numpy as np
from tqdm import tqdm

from convert.config import ModelConfig


class CheckpointError(ValueError):
    """A source checkpoint that does not match its config; the message names the tensor."""


# Tensors a checkpoint may hold that carry no weights (GPT-2's causal-mask buffers in old files).
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")


class _Reader:
    """Hands out tensors by HF name, checks their shapes and remembers which ones were used."""

    def __init__(self, tensors: Mapping[str, Callable[[], np.ndarray]], prefix: str, label: Callable[[str], str]):
        self.tensors, self.prefix, self.label, self.used = tensors, prefix, label, set()

    def has(self, name: str) -> bool:
        return self.prefix + name in self.tensors

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        full = self.prefix + name
        if full not in self.tensors:
            raise CheckpointError(f"missing tensor {self.label(full)} (expected shape {shape})")
        self.used.add(full)
        array = np.asarray(self.tensors[full]())
        if array.shape != shape:
            raise CheckpointError(f"tensor {self.label(full)} has shape {array.shape}, config expects {shape}")
        return array


def fold_norm_scale(scale: np.ndarray, w: np.ndarray) -> np.ndarray:
    """scale: [K], w: [K, N] -> diag(scale) @ w in f32 (rounded once, to the checkpoint's dtype, later): RMSNorm(x)
    with this scale, then @ w, equals rms_normalize(x) @ fold_norm_scale(scale, w)."""
    return scale.astype(np.float32)[:, None] * w.astype(np.float32)


def interleaved_to_halves(w: np.ndarray, heads: int, head_dim: int) -> np.ndarray:
    """Rows of a [heads*D, ...] projection from (x0, x1) RoPE pairs to (first half, second half): ERNIE's layout, and
    the inverse of llama.cpp's permutation of Llama's q/k rows in a GGUF."""
    rest = w.shape[1:]
    return w.reshape(heads, head_dim // 2, 2, *rest).swapaxes(1, 2).reshape(heads * head_dim, *rest)


def _llama_layer(r: _Reader, c: ModelConfig, i: int, model_type: str) -> dict:
    p, h, d = f"model.layers.{i}.", c.hidden_size, c.head_dim

    def qkv(kind: str, *in_dims: int) -> np.ndarray:  # q, k, v concatenated; q, k rows in the decoder's RoPE layout
        q, k, v = (r.get(f"{p}self_attn.{name}_proj.{kind}", (size, *in_dims))
                   for name, size in (("q", c.q_size), ("k", c.kv_size), ("v", c.kv_size)))
        if model_type == "ernie4_5":
            q, k = interleaved_to_halves(q, c.num_heads, d), interleaved_to_halves(k, c.num_kv_heads, d)
        return np.concatenate([q, k, v])

    layer = {
        "qkv": {"w": fold_norm_scale(r.get(p + "input_layernorm.weight", (h,)), qkv("weight", h).T)},
        "o": {"w": r.get(p + "self_attn.o_proj.weight", (h, c.q_size)).T},
        **(_experts(r, c, p, model_type == "mixtral") if c.moe else _mlp(r, c, p)),
    }
    if c.qkv_bias:
        layer["qkv"]["b"] = qkv("bias")
    if c.o_bias:
        layer["o"]["b"] = r.get(p + "self_attn.o_proj.bias", (h,))
    if c.qk_norm:
        layer["q_norm"] = r.get(p + "self_attn.q_norm.weight", (d,))
        layer["k_norm"] = r.get(p + "self_attn.k_norm.weight", (d,))
    return layer


def _mlp(r: _Reader, c: ModelConfig, p: str) -> dict:
    """The dense SwiGLU MLP: {up {w [H, 2I] (gate | up, the norm's scale folded in), b?}, down {w [I, H], b?}}."""
    h, i = c.hidden_size, c.intermediate_size
    gate_up = np.concatenate([r.get(p + f"mlp.{n}_proj.weight", (i, h)) for n in ("gate", "up")])
    mlp = {"up": {"w": fold_norm_scale(r.get(p + "post_attention_layernorm.weight", (h,)), gate_up.T)},
           "down": {"w": r.get(p + "mlp.down_proj.weight", (h, i)).T}}
    if c.mlp_bias:
        mlp["up"]["b"] = np.concatenate([r.get(p + f"mlp.{n}_proj.bias", (i,)) for n in ("gate", "up")])
        mlp["down"]["b"] = r.get(p + "mlp.down_proj.bias", (h,))
    return mlp


def _experts(r: _Reader, c: ModelConfig, p: str, mixtral: bool) -> dict:
    """The routed experts: {mlp_norm {scale [H]}, router {w [E, H]}, experts {up {w [E, 2I, H]}, down {w [E, H, I]}}}
    ([N, K] as HF holds them: the kernels read a column's K contiguous), from one tensor per expert (Mixtral's w1 / w3
    / w2 under block_sparse_moe), stacked [E, ...] as transformers 5 holds them, or stacked with gate and up apart as a
    GGUF does; a shared expert adds up {w [H, 2S]}, down {w [S, H]} and shared_gate [H]. The norm stays apart: the
    router reads its output."""
    e, h, i = c.moe.num_experts, c.hidden_size, c.intermediate_size
    gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    # Stacked unless expert 0 has tensors of its own: a stacked tensor missing is then named as such.
    stacked = not r.has(f"{p}{'block_sparse_moe' if mixtral else 'mlp'}.experts.0.{gate}.weight")
    mlp = p + ("block_sparse_moe." if mixtral and not stacked else "mlp.")
    if stacked:
        if r.has(mlp + "experts.gate_up_proj"):
            gate_up = r.get(mlp + "experts.gate_up_proj", (e, 2 * i, h))
        else:  # a GGUF's
            gate_up = np.concatenate([r.get(f"{mlp}experts.{n}", (e, i, h)) for n in ("gate_proj", "up_proj")], axis=1)
        down = r.get(mlp + "experts.down_proj", (e, h, i))
    else:
        def stack(name, shape):
            return np.stack([r.get(f"{mlp}experts.{j}.{name}.weight", shape) for j in range(e)])

        gate_up = np.concatenate([stack(gate, (i, h)), stack(up, (i, h))], axis=1)
        down = stack(down, (h, i))
    layer = {"mlp_norm": {"scale": r.get(p + "post_attention_layernorm.weight", (h,))},
             "router": {"w": r.get(mlp + "gate.weight", (e, h))},
             "experts": {"up": {"w": gate_up}, "down": {"w": down}}}
    if s := c.moe.shared_size:  # Qwen2-MoE's shared expert: up and down as a dense MLP's, the norm not folded in
        shared_up = np.concatenate([r.get(f"{mlp}shared_expert.{n}_proj.weight", (s, h)) for n in ("gate", "up")])
        layer.update(up={"w": shared_up.T}, down={"w": r.get(mlp + "shared_expert.down_proj.weight", (h, s)).T},
                     shared_gate=r.get(mlp + "shared_expert_gate.weight", (1, h))[0])
    return layer


def _gpt2_layer(r: _Reader, c: ModelConfig, i: int) -> dict:
    p, h, f = f"h.{i}.", c.hidden_size, c.intermediate_size

    def ln(name):
        return {"scale": r.get(p + name + ".weight", (h,)), "bias": r.get(p + name + ".bias", (h,))}

    def conv1d(name, n_in, n_out):
        return {"w": r.get(p + name + ".weight", (n_in, n_out)), "b": r.get(p + name + ".bias", (n_out,))}

    return {"attn_norm": ln("ln_1"), "qkv": conv1d("attn.c_attn", h, 3 * h), "o": conv1d("attn.c_proj", h, h),
            "mlp_norm": ln("ln_2"), "up": conv1d("mlp.c_fc", h, f), "down": conv1d("mlp.c_proj", f, h)}


def param_parts(config: ModelConfig, model_type: str, tensors: Mapping[str, Callable[[], np.ndarray]], dtype,
                progress: bool = False, label: Callable[[str], str] = repr,
                threads: int = 1) -> Iterator[tuple[str, dict]]:
    """Yields ("layers/{i}", layer) for each layer, then ("top", the rest), in `dtype`; unmapped tensors are an error
    after the last. threads: layers converted at once (numpy releases the GIL), and held at a time."""
    c, h, vh = config, config.hidden_size, (config.vocab_size, config.hidden_size)
    gpt2 = model_type == "gpt2"
    prefix = "transformer." if gpt2 and any(n.startswith("transformer.") for n in tensors) else ""
    r = _Reader(tensors, prefix, label)

    def layer(i: int) -> dict:
        return _cast(_gpt2_layer(r, c, i) if gpt2 else _llama_layer(r, c, i, model_type), dtype)

    layers = tqdm(_in_order(layer, c.num_layers, threads), total=c.num_layers, desc="converting layers",
                  disable=not progress)
    for i, part in enumerate(layers):
        yield f"layers/{i}", part
    if gpt2:
        top = {"embed": r.get("wte.weight", vh), "pos_embed": r.get("wpe.weight", (c.max_position_embeddings, h)),
               "final_norm": {"scale": r.get("ln_f.weight", (h,)), "bias": r.get("ln_f.bias", (h,))}}
    else:
        top = {"embed": r.get("model.embed_tokens.weight", vh),
               "final_norm": {"scale": r.get("model.norm.weight", (h,))}}
    r.prefix = ""  # GPT-2's lm_head.weight is outside "transformer."
    if not c.tie_word_embeddings:
        top["lm_head"] = r.get("lm_head.weight", vh).T
    elif r.has("lm_head.weight") and not np.array_equal(r.get("lm_head.weight", vh), top["embed"]):
        raise CheckpointError("lm_head.weight differs from the embedding but the config ties them")
    unmapped = sorted(n for n in set(tensors) - r.used if not (gpt2 and n.endswith(_IGNORED_SUFFIXES)))
    if unmapped:
        raise CheckpointError(f"{len(unmapped)} unmapped tensor(s) in the checkpoint: "
                              f"[{', '.join(map(label, unmapped[:8]))}]")
    yield "top", _cast(top, dtype)


def _in_order(fn: Callable[[int], dict], n: int, threads: int) -> Iterator[dict]:
    """fn(0), ..., fn(n - 1) in order, computed on `threads` threads with at most that many results held."""
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        running = collections.deque()
        for i in range(n):
            running.append(pool.submit(fn, i))
            if len(running) == threads:
                yield running.popleft().result()
        while running:
            yield running.popleft().result()


def param_shapes(config: ModelConfig, dtype) -> dict:
    """The params pytree param_parts yields for `config`, as (shape, dtype) leaves, known before a tensor is read: a
    compile can start while the weights convert."""
    c, d = config, np.dtype(dtype)
    h, q, kv, i, layer_norm = c.hidden_size, c.q_size, c.kv_size, c.intermediate_size, c.norm == "layer"

    def projection(n_in, n_out, bias):
        return {"w": ((n_in, n_out), d), **({"b": ((n_out,), d)} if bias else {})}

    norm = {"scale": ((h,), d), **({"bias": ((h,), d)} if layer_norm else {})}
    up = 2 * i if c.mlp == "swiglu" else i
    mlp = {"up": projection(h, up, c.mlp_bias), "down": projection(i, h, c.mlp_bias)}
    if c.moe:
        e = c.moe.num_experts
        mlp = {"mlp_norm": norm, "router": {"w": ((e, h), d)},
               "experts": {"up": {"w": ((e, up, h), d)}, "down": {"w": ((e, h, i), d)}}}
        if s := c.moe.shared_size:
            mlp.update(up=projection(h, 2 * s, False), down=projection(s, h, False), shared_gate=((h,), d))
    layer = {"qkv": projection(h, q + 2 * kv, c.qkv_bias), "o": projection(q, h, c.o_bias), **mlp}
    if layer_norm:  # an RMSNorm's scale is folded into the projection after it
        layer.update(attn_norm=norm, mlp_norm=norm)
    if c.qk_norm:
        layer.update(q_norm=((c.head_dim,), d), k_norm=((c.head_dim,), d))
    top = {"embed": ((c.vocab_size, h), d), "final_norm": norm}
    if c.rope_theta is None:  # learned positions
        top["pos_embed"] = ((c.max_position_embeddings, h), d)
    if not c.tie_word_embeddings:
        top["lm_head"] = ((h, c.vocab_size), d)
    return {**top, "layers": (layer,) * c.num_layers}


def params_from_parts(parts: Iterator[tuple[str, dict]], num_layers: int) -> dict:
    """The params pytree of nanojax.model from param_parts' (name, part) pairs."""
    by_name = dict(parts)
    return {**by_name.pop("top"), "layers": tuple(by_name[f"layers/{i}"] for i in range(num_layers))}


def hf_to_params(config: ModelConfig, model_type: str, tensors: Mapping[str, Callable[[], np.ndarray]], dtype) -> dict:
    """The nanojax params pytree in `dtype` (numpy), from HF name -> loader of the array."""
    return params_from_parts(param_parts(config, model_type, tensors, dtype), config.num_layers)


def _cast(tree, dtype):
    if isinstance(tree, dict):
        return {k: _cast(v, dtype) for k, v in tree.items()}
    if tree.ndim == 2 and tree.flags.f_contiguous and not tree.flags.c_contiguous:
        return _transposed_copy(tree, dtype)
    return np.array(tree, dtype=dtype, order="C")  # one copy


def _transposed_copy(x: np.ndarray, dtype, band: int = 256) -> np.ndarray:
    """x: a transposed view (an HF [out, in] weight as [in, out]) -> a C-contiguous copy in dtype, `band` source rows
    at a time to keep both sides in cache (docs/perf_notes.md, "Conversion and placement")."""
    source = x.T.astype(dtype, copy=False)  # C-contiguous, cast first: the copy below then moves plain bits
    bits = np.dtype(f"u{source.itemsize}")
    out = np.empty(x.shape, bits)
    source = source.view(bits)
    for i in range(0, source.shape[0], band):
        out[:, i:i + band] = source[i:i + band].T
    return out.view(dtype)
