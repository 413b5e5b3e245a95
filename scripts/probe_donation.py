"""Whether a dispatch that donates (or reads) a buffer a running program is still producing waits for it on the host:
the host time of a small program called right after a ~4.5 ms one, on the GPU.

    python3 scripts/probe_donation.py
"""
import time

import jax
import jax.numpy as jnp
import numpy as np

n = 4096
w = jnp.full((n, n), 1e-4, jnp.float32)


def heavy(x, w):
    for _ in range(12):
        x = jnp.tanh(x @ w)
    return x


h = jax.jit(heavy)
reads = jax.jit(lambda x, y: (x + 1, y.sum()))
donates = jax.jit(lambda x, y: (x + 1, y.sum()), donate_argnums=0)


def run(program, other, reps=15):
    hosts = []
    for _ in range(reps):
        x = jnp.ones((n, n), jnp.float32)
        jax.block_until_ready(x)
        y = h(x, w)  # pending for the device time of heavy
        t = time.perf_counter()
        out = program(y, other)
        hosts.append((time.perf_counter() - t) * 1e3)
        jax.block_until_ready(out)
    return np.median(hosts[3:])


x = jnp.ones((n, n), jnp.float32)
for _ in range(3):
    jax.block_until_ready(h(x, w))
t = time.perf_counter()
for _ in range(10):
    jax.block_until_ready(h(x, w))
print(f"heavy device time {(time.perf_counter() - t) / 10 * 1e3:.3f} ms")
for other, other_input in (("a device", jnp.zeros(8)), ("a numpy", np.zeros(8, np.float32))):
    for verb, program in (("reads", reads), ("donates", donates)):
        host_ms = run(program, other_input)
        print(f"second program {verb} the pending buffer, {other} input beside it: host {host_ms:.3f} ms")
