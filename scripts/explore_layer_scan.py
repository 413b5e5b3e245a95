"""Unrolled layers against a `lax.scan` over stacked layers: trace + lower, compile and step time of a multi-step
greedy decode (issue 19, item 1). The scan variant takes its params and KV pools already stacked ([L, ...]), as a
checkpoint and cache laid out for it would hold them; both run nanojax.model.layer with the same Ops.

    PYTHONPATH=$PWD python3 scripts/explore_layer_scan.py --model qwen3-0.6b --batch 8 --steps 8 [--kernels pallas]
"""
import argparse
import functools
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from random_model import loaded_model, random_hf_model  # noqa: E402

from nanojax.kv_cache import Batch, KVCache  # noqa: E402
from nanojax.model import forward, layer, lm_logits, norm  # noqa: E402
from nanojax.ops import get_ops  # noqa: E402

PAGE = 16


def decode_unrolled(params, cache, tokens, batch, *, config, ops, steps):
    def body(_, carry):
        tokens, cache, seq_lens = carry
        hidden, cache = forward(params, tokens[:, None], cache, batch.replace(seq_lens=seq_lens), config=config,
                                ops=ops)
        return jnp.argmax(lm_logits(params, hidden[:, 0], config), -1).astype(jnp.int32), cache, seq_lens + 1
    return jax.lax.fori_loop(0, steps, body, (tokens, cache, batch.seq_lens))


def decode_scan(params, stacked, k, v, tokens, batch, *, config, ops, steps):
    """stacked: the layers' params as one pytree of [L, ...] arrays; k, v: [L, num_pages, Hkv, page, D]."""
    def step(_, carry):
        tokens, k, v, seq_lens = carry
        b = batch.replace(seq_lens=seq_lens)
        positions = b.positions(1)
        slots = b.slots(positions, k.shape[3]).reshape(-1)
        positions = positions.reshape(-1)
        x = params["embed"][tokens]

        def one_layer(x, layer_in):
            lp, kp, vp = layer_in
            x, kp, vp = layer(ops, lp, x, positions, slots, kp, vp, b, config)
            return x, (kp, vp)

        x, (k, v) = jax.lax.scan(one_layer, x, (stacked, k, v))
        hidden = norm(x, params["final_norm"], config)
        return jnp.argmax(lm_logits(params, hidden, config), -1).astype(jnp.int32), k, v, seq_lens + 1
    return jax.lax.fori_loop(0, steps, step, (tokens, k, v, batch.seq_lens))


def decode_carry(params, stacked, k, v, tokens, batch, *, config, ops, steps):
    """As decode_scan, with the KV pools carried whole through a loop over the layer index (each layer's pool sliced
    out and written back), so that XLA may update them in place instead of stacking new ones."""
    def step(_, carry):
        tokens, k, v, seq_lens = carry
        b = batch.replace(seq_lens=seq_lens)
        positions = b.positions(1)
        slots = b.slots(positions, k.shape[3]).reshape(-1)
        positions = positions.reshape(-1)

        def one_layer(i, inner):
            x, k, v = inner
            lp = jax.tree.map(lambda a: a[i], stacked)
            x, kp, vp = layer(ops, lp, x, positions, slots, k[i], v[i], b, config)
            return x, k.at[i].set(kp), v.at[i].set(vp)

        x, k, v = jax.lax.fori_loop(0, k.shape[0], one_layer, (params["embed"][tokens], k, v))
        hidden = norm(x, params["final_norm"], config)
        return jnp.argmax(lm_logits(params, hidden, config), -1).astype(jnp.int32), k, v, seq_lens + 1
    return jax.lax.fori_loop(0, steps, step, (tokens, k, v, batch.seq_lens))


def timed(fn, *args):
    t = time.perf_counter()
    out = fn(*args)
    jax.block_until_ready(out)
    return out, time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--kernels", default="reference")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    loaded = loaded_model(random_hf_model(args.model, "float32", device="cpu"), args.dtype)
    c, ops = loaded.config, get_ops(args.kernels, loaded.config)
    params = jax.tree.map(jnp.asarray, loaded.params)
    pps = -(-(args.context + args.steps) // PAGE)
    cache = KVCache.create(c, args.batch * pps, PAGE, params["embed"].dtype)
    table = np.arange(args.batch * pps, dtype=np.int32).reshape(args.batch, pps)
    batch = Batch(page_table=jnp.asarray(table), seq_lens=jnp.full(args.batch, args.context, jnp.int32),
                  q_lens=jnp.ones(args.batch, jnp.int32))
    tokens = jnp.arange(args.batch, dtype=jnp.int32)
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *params["layers"])
    rest = {k: v for k, v in params.items() if k != "layers"}
    k, v = jnp.stack(cache.k), jnp.stack(cache.v)

    static = dict(config=c, ops=ops, steps=args.steps)
    rows = []
    for name, fn, fargs in (("unrolled", decode_unrolled, (params, cache, tokens, batch)),
                            ("scan", decode_scan, (rest, stacked, k, v, tokens, batch)),
                            ("carry", decode_carry, (rest, stacked, k, v, tokens, batch))):
        jitted = jax.jit(functools.partial(fn, **static))
        t = time.perf_counter()
        lowered = jitted.trace(*fargs).lower()
        lower_s = time.perf_counter() - t
        t = time.perf_counter()
        compiled = lowered.compile()
        compile_s = time.perf_counter() - t
        out, _ = timed(compiled, *fargs)
        step_s = min(timed(compiled, *fargs)[1] for _ in range(3)) / args.steps
        rows.append((name, lower_s, compile_s, step_s * 1e3, np.asarray(out[0])))
    same = all(np.array_equal(rows[0][4], row[4]) for row in rows[1:])
    print(f"\n{args.model} on {jax.devices()[0]}, kernels {args.kernels}, batch {args.batch}, {args.steps} steps, "
          f"context {args.context}; same tokens: {same}")
    print(f"{'layers':>9} {'trace+lower s':>13} {'compile s':>9} {'ms/step':>8}")
    for name, lower_s, compile_s, step_ms, _ in rows:
        print(f"{name:>9} {lower_s:>13.2f} {compile_s:>9.2f} {step_ms:>8.2f}")


if __name__ == "__main__":
    main()
