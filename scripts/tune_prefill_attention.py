"""Sweep the prefill attention tiling (PagedAttentionConfig) at 2048 tokens, Qwen3-0.6B heads, against cuDNN's
flash attention in the same command; print the five best and the default.

    PYTHONPATH=$PWD python3 scripts/tune_prefill_attention.py > $OUT/tune_prefill.log

Every config is checked against cuDNN's output first; timing is bench_kernels' harness.
"""
import itertools
import sys
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))
from bench_kernels import QWEN3_06B, paged_inputs, time_per_call  # noqa: E402

from pallas_kernels.paged_attention import PagedAttentionConfig, paged_prefill_attention  # noqa: E402

TOKENS = 2048
GRID = {"block_m": (64, 128), "block_k": (32, 64, 128), "num_warps": (4, 8), "num_stages": (2, 3, 5)}


def main():
    model, rng = QWEN3_06B, np.random.default_rng(0)
    q, k, v, table, lens = paged_inputs(rng, 1, TOKENS, TOKENS, model, 16)
    scale = model["head_dim"] ** -0.5
    contiguous = [a[table[0]].transpose(0, 2, 1, 3).reshape(1, -1, model["num_kv_heads"], model["head_dim"])
                  for a in (k, v)]
    flops = 2 * 2 * TOKENS * TOKENS // 2 * model["num_q_heads"] * model["head_dim"]  # QK^T and PV, causal half
    kw = {"work_seconds": flops / 700e12, "repeats": 5}

    def cudnn(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True, implementation="cudnn")

    t_cudnn = time_per_call(cudnn, [(q, *contiguous)], **kw)
    expected = np.asarray(cudnn(q, *contiguous), np.float32)
    results = []
    for config in [None] + [PagedAttentionConfig(**dict(zip(GRID, values)))
                            for values in itertools.product(*GRID.values())]:
        def ours(q, k, v, t, s, config=config):
            return paged_prefill_attention(q, k, v, t, s, s, scale=scale, config=config)
        try:
            err = float(np.abs(np.asarray(ours(q, k, v, table, lens), np.float32) - expected).max())
            if err > 3e-2:
                print(f"{config}: WRONG, max abs err {err}")
                continue
            t = time_per_call(ours, [(q, k, v, table, lens)], **kw)
        except Exception as e:  # noqa: BLE001 - a tiling that does not fit shared memory is skipped
            print(f"{config}: {type(e).__name__} {str(e)[:80]}", flush=True)
            continue
        results.append((t, config))
        print(f"{config}: {t * 1e3:.4f} ms, x{t / t_cudnn:.2f} of cuDNN", flush=True)
    print(f"\nT={TOKENS}, cuDNN {t_cudnn * 1e3:.4f} ms; five best and the default (ours / cuDNN):")
    results.sort(key=lambda r: r[0])
    for t, c in results[:5] + [next(r for r in results if r[1] is None)]:
        label = "default" if c is None else f"bm{c.block_m} bk{c.block_k} w{c.num_warps} st{c.num_stages}"
        print(f"{label:<22} {t * 1e3:.4f} ms  x{t / t_cudnn:.2f}  {flops / t / 1e12:.0f} TFLOP/s")


if __name__ == "__main__":
    main()
