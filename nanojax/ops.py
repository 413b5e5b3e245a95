"""The kernel switch: each fused step of the decoder and sampler is either a plain jnp reference (XLA fuses it) or a
Pallas kernel (pallas_kernels/, whose `*_reference` functions the HF parity tests run), chosen by one static, hashable
`Ops` value that the compiled steps take."""
import dataclasses
import functools

import jax
import jax.numpy as jnp

from nanojax.moe import few_rows, moe_mlp, route
from pallas_kernels.cascade_attention import cascade_decode_attention, cascade_decode_attention_reference
from pallas_kernels.expert_matmul import (expert_combine, expert_combine_reference, expert_swiglu,
                                          expert_swiglu_reference)
from pallas_kernels.grouped_matmul import grouped_matmul, grouped_matmul_reference
from pallas_kernels.paged_attention import paged_attention_reference, paged_decode_attention, paged_prefill_attention
from pallas_kernels.qkv_rope_cache import qkv_rope_cache, qkv_rope_cache_reference
from pallas_kernels.rmsnorm_matmul import rmsnorm_matmul, rmsnorm_matmul_reference
from pallas_kernels.sampling_filters import is_filtered, no_filters, sampling_filters, sampling_filters_reference
from pallas_kernels.topk_routing import rmsnorm_router, rmsnorm_router_reference, topk_routing, topk_routing_reference

NAMES = ("auto", "reference", "pallas", "interpret")
# Rows up to which a projection takes the fused kernel (docs/perf_notes.md, "Fused projections: which rows take the
# kernel"): without a norm (o, down) it beats XLA's GEMV fusion at one row only; with one (QKV, gate/up) it replaces
# XLA's norm and GEMM kernels by one and stays ahead up to batched decode sizes.
PALLAS_PROJECTION_MAX_ROWS = 1
PALLAS_NORMED_PROJECTION_MAX_ROWS = 64
# FP8 weights take the kernel for one row of a weight up to this many elements (latency-bound steps); the rest go
# through XLA's dot, fewer rows padded to FP8_XLA_MIN_ROWS to take its GEMM (docs/perf_notes.md, "FP8 weights").
PALLAS_FP8_MAX_WEIGHT = 8 << 20
FP8_XLA_MIN_ROWS = 2


@dataclasses.dataclass(frozen=True)
class Ops:
    """pallas: run the Pallas kernels (interpret: in Pallas' interpreter, for CPU tests) instead of the references."""

    pallas: bool = False
    interpret: bool = False

    def project(self, x, p, *, norm_eps=None, residual=None, activation=None, bias=True):
        """x: [N, K]; p: a nanojax.model.Projection -> [N, N_out]; see rmsnorm_matmul_reference. bias=False leaves
        p's bias out."""
        b = p.b[...] if bias and p.b is not None else None
        w, rows = (p.w_t if p.quantized else p.w)[...], x.shape[0]
        kw = {"norm_eps": norm_eps, "residual": residual, "activation": activation,
              "w_scale": p.scale[...] if p.quantized else None}
        max_rows = PALLAS_PROJECTION_MAX_ROWS if norm_eps is None else PALLAS_NORMED_PROJECTION_MAX_ROWS
        kernel_fits = (rows == 1 and w.size <= PALLAS_FP8_MAX_WEIGHT) if p.quantized else rows <= max_rows
        if self.pallas and kernel_fits:
            return rmsnorm_matmul(x, w, b, interpret=self.interpret, **kw)
        if p.quantized and rows < FP8_XLA_MIN_ROWS:
            pad = lambda a: jnp.pad(a, ((0, FP8_XLA_MIN_ROWS - rows), (0, 0)))  # noqa: E731
            kw["residual"] = None if residual is None else pad(residual)
            return rmsnorm_matmul_reference(pad(x), w, b, **kw)[:rows]
        return rmsnorm_matmul_reference(x, w, b, **kw)

    def row_project(self, x, p, *, residual):
        """o_proj / down_proj: x @ w [+ b] + residual (tensor-parallel: partial products summed over the devices)."""
        return self.project(x, p, residual=residual)

    @property
    def unsharded(self) -> "Ops":
        """These kernels on whole arrays (a tensor-parallel Ops's base)."""
        return self

    def _kernel(self, kernel, reference):
        return functools.partial(kernel, interpret=self.interpret) if self.pallas else reference

    def route(self, x, scale, router, moe, eps):
        """x: [N, H] rows before the RMSNorm of weight scale, router: [E, H] -> (the normalized rows, their top-k
        experts' weights and ids); see nanojax.moe.route. Rows past the few of a decode take XLA's norm and GEMM."""
        router_logits = (self._kernel(rmsnorm_router, rmsnorm_router_reference)
                         if few_rows(x.shape[0], moe.top_k, moe.num_experts) else rmsnorm_router_reference)
        return route(x, scale, router, moe, eps, router_logits, self._kernel(topk_routing, topk_routing_reference))

    def experts(self, experts, x, weights, ids, residual):
        """residual + experts (a nanojax.model.Experts) on x [N, H], each row's k experts -> [N, H]; see
        moe.moe_mlp (residual None: the experts' sum alone)."""
        kernels = (self._kernel(expert_swiglu, expert_swiglu_reference),
                   self._kernel(expert_combine, expert_combine_reference),
                   self._kernel(grouped_matmul, grouped_matmul_reference))
        return moe_mlp(x, weights, ids, experts.up.experts(), experts.down.experts(), residual, kernels)

    def run_layer(self, layer, x, positions, cos_sin, slots, k_pages, v_pages, batch, config):
        """Runs layer (a nanojax.model.DecoderLayer) on x; a tensor-parallel Ops runs it per shard."""
        return layer(self, x, positions, cos_sin, slots, k_pages, v_pages, batch, config)

    def embed(self, table, ids):
        """table: [V, H]; ids: [N] -> rows [N, H] (a tensor-parallel Ops looks each id up on the device holding it)."""
        return table[ids]

    def vocab_head(self, head, hidden):
        """head (a nanojax.model.LMHead)(hidden) -> logits [..., V] over the whole vocabulary."""
        return head(hidden)

    def qkv_rope_cache(self, qkv, positions, slots, k_pages, v_pages, cos_sin, q_norm, k_norm, *, eps):
        """qkv: [N, (Hq + 2 Hkv) D] -> (q [N, Hq, D], k_pages, v_pages); see qkv_rope_cache_reference."""
        kernel = self._kernel(qkv_rope_cache, qkv_rope_cache_reference)
        return kernel(qkv, positions, slots, k_pages, v_pages, cos_sin, q_norm, k_norm, eps=eps)

    def attention(self, q, k_pages, v_pages, page_table, seq_lens, q_lens, *, scale, cascade=None):
        """q: [B, T, Hq, D] -> [B, T, Hq, D]; see paged_attention_reference. cascade: a decode step's shared-prefix
        plan (nanojax.cascade.CascadePlan.arrays(), on the device), read once per item instead of once per row."""
        if cascade is not None:
            if q.shape[1] != 1:
                raise ValueError(f"a cascade plan is for decode (one token per row), got {q.shape[1]} tokens")
            kernel = self._kernel(cascade_decode_attention, cascade_decode_attention_reference)
            return kernel(q[:, 0], k_pages, v_pages, page_table, seq_lens, *cascade, scale=scale)[:, None]
        if self.pallas and q.shape[1] == 1:  # decode: one new token per row (q_lens 1, or 0 and seq_lens 0: padding)
            return paged_decode_attention(q[:, 0], k_pages, v_pages, page_table, seq_lens, scale=scale,
                                          interpret=self.interpret)[:, None]
        kernel = self._kernel(paged_prefill_attention, paged_attention_reference)
        return kernel(q, k_pages, v_pages, page_table, seq_lens, q_lens, scale=scale)

    def sampling_filters(self, logits, s, *, num_top):
        """logits [B, V] f32, s: a SamplingBatch -> (cut_key, cut_id [B], top_ids, top_logits [B, num_top]). Rows
        needing neither filters nor logprobs skip the work on the device (a host branch would make a dispatch wait)."""
        args = (logits, s.temperature, s.top_k, s.top_p, s.min_p, s.logprobs)
        if self.pallas:
            return sampling_filters(*args, num_top=num_top, interpret=self.interpret)
        needed = jnp.any(is_filtered(*args[1:5]) | (s.logprobs > 0))
        return jax.lax.cond(needed, functools.partial(sampling_filters_reference, num_top=num_top),
                            lambda *_: no_filters(*logits.shape, num_top), *args)


def kernel_support(config) -> str | None:
    """Why the Pallas kernels cannot run this model, or None: they need a power-of-two head_dim >= 16."""
    d = config.head_dim
    return f"head_dim={d} (the Pallas kernels need a power of two >= 16)" if d < 16 or d & (d - 1) else None


@functools.lru_cache(maxsize=None)
def get_ops(name: str, config) -> Ops:
    """name: "reference", "pallas" (GPU), "interpret" (the kernels in Pallas' interpreter), or "auto": the kernels on
    a GPU when the model's shapes allow them, else the reference."""
    if name not in NAMES:
        raise ValueError(f"kernels={name!r} is not one of {list(NAMES)}")
    unsupported = kernel_support(config)
    if name == "auto":
        name = "pallas" if jax.default_backend() == "gpu" and unsupported is None else "reference"
    if name != "reference" and unsupported:
        raise ValueError(f"kernels={name!r} cannot run {config.architecture}: {unsupported}; use 'reference'")
    return Ops(pallas=name != "reference", interpret=name == "interpret")
