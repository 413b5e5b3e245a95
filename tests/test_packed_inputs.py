"""A step's host arrays travel as one byte buffer (nanojax.runner.pack / packed_step): every leaf comes back inside
the jit bit for bit, in its shape, dtype and place in the pytree, and the layout read from shapes alone (what a
program is compiled for) equals the one packing computes."""
import jax
import jax.numpy as jnp
import numpy as np

from nanojax.kv_cache import Batch
from nanojax.runner import layout_of, pack, packed_step


def _host(rng):
    batch = Batch(page_table=rng.integers(0, 1 << 30, (3, 5)).astype(np.int32),
                  seq_lens=rng.integers(-9, 9, 3).astype(np.int32), q_lens=np.array([1, 0, 7], np.int32))
    floats = rng.normal(size=(3, 2)).astype(np.float32)
    floats[0, 0], floats[1, 1] = np.nan, -0.0
    return (np.arange(3, dtype=np.int32), batch, floats, rng.integers(0, 1 << 32, 4, dtype=np.uint32),
            np.array([-128, 5, 127], np.int8), np.float32(2.5), None)


def _echo(params, cache, tables, prev, *host, scale):
    """A step that returns its host arguments (scaled where it can), beside the device ones."""
    return params * scale, cache, tables, prev, host


def test_every_leaf_comes_back_bit_for_bit():
    host = _host(np.random.default_rng(0))
    packed, layout = pack(host)
    assert packed.dtype == np.uint8 and packed.ndim == 1
    assert packed.nbytes == sum(np.asarray(x).nbytes for x in jax.tree.leaves(host))
    params, cache, tables, prev, back = packed_step(jnp.float32(3), jnp.zeros(2), jnp.ones(1), jnp.arange(4),
                                                    jnp.asarray(packed), step=_echo, layout=layout,
                                                    static=(("scale", 2.0),))
    assert float(params) == 6.0
    assert jax.tree.structure(back) == jax.tree.structure(host)
    for got, want in zip(jax.tree.leaves(back), jax.tree.leaves(host)):
        want = np.asarray(want)
        got = np.asarray(got)
        assert got.shape == want.shape and got.dtype == want.dtype
        assert got.tobytes() == want.tobytes()  # NaN payloads and -0.0 included


def test_layout_from_shapes_equals_packings():
    host = _host(np.random.default_rng(1))
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), host)
    assert layout_of(shapes) == pack(host)[1]
    other = (*host[:2], host[2].view(np.int32), *host[3:])  # the same bytes as another dtype: another layout
    assert pack(other)[1] != pack(host)[1]
