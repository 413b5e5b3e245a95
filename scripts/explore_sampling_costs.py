"""Experiment (removed in the next commit): what each piece of on-device sampling costs inside a 32-step loop of an
LM-head matmul on the H100 (docs/perf_notes.md, "Sampling"). Run with XLA_FLAGS=--xla_gpu_enable_command_buffer=
+WHILE,+CONDITIONAL for the command-buffer variant.

    PYTHONPATH=$PWD python3 scripts/explore_sampling_costs.py
"""
import json
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

OUT = Path(os.environ.get("OUT", "/tmp"))
res = {}


def med(f, n=7):
    f()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


V, H, STEPS = 151936, 1024, 32
def micro():
    key = jax.random.key(0)
    w = jax.random.normal(key, (H, V), jnp.bfloat16) * 0.02
    def make(kind):
        def loop(h, temp, flag):
            def body(i, c):
                h, out = c
                logits = jnp.dot(h, w, preferred_element_type=jnp.float32)
                if kind == "argmax":
                    t = jnp.argmax(logits, -1)
                elif kind == "gumbel":
                    g = jax.random.gumbel(jax.random.fold_in(key, i), logits.shape)
                    t = jnp.argmax(logits / temp[:, None] + g, -1)
                elif kind == "cond_gumbel":
                    t = jax.lax.cond(jnp.any(temp > flag), lambda: jnp.argmax(logits / temp[:, None] + jax.random.gumbel(jax.random.fold_in(key, i), logits.shape), -1), lambda: jnp.argmax(logits, -1))
                elif kind == "cond4":
                    t = jnp.argmax(logits, -1)
                    for j in range(4):
                        t = jax.lax.cond(jnp.any(temp > flag + j), lambda: t + 1, lambda: t)
                elif kind == "sort":
                    o = jnp.argsort(-logits, -1); t = o[:, 0]
                elif kind == "logsoftmax_top20":
                    lp = jax.nn.log_softmax(logits, -1); v, ix = jax.lax.top_k(lp, 20); t = ix[:, 0] + (v[:, 0] > 0)
                elif kind == "logsoftmax":
                    lp = jax.nn.log_softmax(logits, -1); t = jnp.argmax(logits, -1) + (jnp.take_along_axis(lp, jnp.argmax(logits,-1)[:,None],1)[:,0] > 0)
                t = t.astype(jnp.int32)
                return h + (t[:, None] % 3).astype(h.dtype) * 1e-3, out.at[i].set(t)
            return jax.lax.fori_loop(0, STEPS, body, (h, jnp.zeros((STEPS, h.shape[0]), jnp.int32)))[1]
        return jax.jit(loop)
    rows = []
    for B in (1, 64, 256):
        h = jax.random.normal(key, (B, H), jnp.bfloat16)
        temp = jnp.ones((B,), jnp.float32)
        for kind in ("argmax", "gumbel", "cond_gumbel", "cond4", "sort", "logsoftmax", "logsoftmax_top20"):
            f = make(kind)
            flag = jnp.float32(2.0)  # conds take the cheap branch
            t = med(lambda: f(h, temp, flag).block_until_ready())
            rows.append((B, kind, t / STEPS * 1e6))
            print(f"micro B={B} {kind}: {t / STEPS * 1e6:.1f} us/step", flush=True)
    res["micro"] = rows


micro()
(OUT / 'sampling_costs.json').write_text(json.dumps(res, indent=1))
