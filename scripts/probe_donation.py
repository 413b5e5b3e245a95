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
small_keep = jax.jit(lambda x, y: (x + 1, y.sum()))
small_don = jax.jit(lambda x, y: (x + 1, y.sum()), donate_argnums=0)
read_don = jax.jit(lambda x, y: (x * 2, y.sum()), donate_argnums=1)  # donates y's sibling, reads the pending one


def run(second, reps=15):
    hosts = []
    for _ in range(reps):
        x = jnp.ones((n, n), jnp.float32)
        jax.block_until_ready(x)
        y = h(x, w)  # pending for the device time of heavy
        t = time.perf_counter()
        out = second(y)
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
z = jnp.zeros(8)
print(f"second program reads the pending buffer:        host {run(lambda y: small_keep(y, z)):.3f} ms")
print(f"second program donates the pending buffer:      host {run(lambda y: small_don(y, z)):.3f} ms")
print(f"second program numpy input, reads pending:      host {run(lambda y: small_keep(y, np.zeros(8, np.float32))):.3f} ms")
print(f"second program numpy input, donates pending:    host {run(lambda y: small_don(y, np.zeros(8, np.float32))):.3f} ms")
