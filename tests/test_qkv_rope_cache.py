"""qkv_rope_cache against qkv_rope_cache_reference, and the reference against the model's own ops.

CPU tests run the kernel in interpret mode at small shapes; the `gpu` variants run the Triton kernel at Qwen3-0.6B and
Llama-3.2-1B sizes. Every case takes its tokens from several sequences (prefill chunks and decode tokens) at positions
up to ~30000, with pages drawn from a shuffled pool, and mixes in padding tokens (position -1, their qkv rows NaN) and
live tokens without a cache slot (slot -1 or past the pool, their k and v columns NaN). The pools are NaN or random
everywhere but the target slots: after the kernel the target slots must hold the reference's k and v and every other
element must be bit-identical to the input (written in place, nothing else touched); q must be finite and exactly zero
on padding tokens. Interpret mode fills the q output with NaN before the kernel runs, so a row it fails to write shows.
"""
import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import requires_gpu

from pallas_kernels._compat import can_lower_for_cuda
from pallas_kernels.qkv_rope_cache import (
    DECODE_CONFIG,
    PREFILL_CONFIG,
    QkvRopeCacheConfig,
    qkv_rope_cache,
    qkv_rope_cache_reference,
    rope_cos_sin,
)

TOLERANCE = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 2e-2}
EPS = 1e-6
MAX_POSITION = 30000


def rope_inv_freq(head_dim, theta=1e6):
    """As nanojax.model.rope_inv_freq without scaling: frequencies from 1 rad/token down."""
    return (1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim))).astype(
        np.float32)


@dataclasses.dataclass
class Case:
    qkv: jax.Array  # [N, (Hq + 2 Hkv) D]; NaN rows on padding tokens, NaN k/v columns on tokens without a slot
    positions: jax.Array
    slots: jax.Array
    k_pages: jax.Array  # NaN or random outside the target slots
    v_pages: jax.Array
    cos_sin: jax.Array | None  # [N, D] the tokens' RoPE table (rope_cos_sin)
    q_norm: jax.Array | None
    k_norm: jax.Array | None
    target: np.ndarray  # [num_pages, page_size] bool: the slots the tokens write

    @property
    def args(self):
        return (self.qkv, self.positions, self.slots, self.k_pages, self.v_pages, self.cos_sin, self.q_norm,
                self.k_norm)


def token_kinds(n):
    """'L' live token with a slot, 'N' live without a slot, 'P' padding, 'S' padding with a stale slot (an unowned
    page's: it must not be written either). Decode-sized batches keep every token live."""
    if n == 1:
        return "L"
    if n == 3:
        return "NPL"
    kinds = ["L"] * n
    for t in (1, n // 2, n - 1):
        kinds[t] = "P"
    kinds[n - 3], kinds[n // 2 + 1] = "N", "S"
    return "".join(kinds)


def make_case(seed, *, n, num_q_heads, num_kv_heads, head_dim, page_size, dtype=jnp.float32, norm=True, rope=True,
              kinds=None):
    rng = np.random.default_rng(seed)
    kinds = kinds or token_kinds(n)
    # Live tokens come in runs of 1..6 consecutive positions (a decode token or a prefill chunk) of one sequence each;
    # a run's pages come from a shuffled pool, one per page-sized block of positions it touches.
    positions, block_of = np.full(n, -1, np.int64), {}
    t = 0
    while t < n:
        run = range(t, min(n, t + int(rng.integers(1, 7))))
        start = int(rng.integers(0, MAX_POSITION))
        for j, i in enumerate(i for i in run if kinds[i] in "LN"):
            positions[i] = start + j
            block_of[i] = (t, (start + j) // page_size)  # (sequence, block of its page table)
        t = run.stop
    page_ids = {block: i for i, block in enumerate(dict.fromkeys(block_of.values()))}
    num_pages = len(page_ids) + 3  # three pages nobody owns
    pages = rng.permutation(num_pages)
    slots = np.full(n, -1, np.int64)
    target = np.zeros((num_pages, page_size), bool)
    for i, block in block_of.items():
        page, offset = pages[page_ids[block]], positions[i] % page_size
        if kinds[i] == "L":
            slots[i] = page * page_size + offset
            target[page, offset] = True
        else:  # live without a slot: -1, or just past the pool (also dropped)
            slots[i] = -1 if i % 2 else num_pages * page_size
    for i in (i for i, kind in enumerate(kinds) if kind == "S"):
        slots[i] = pages[-1] * page_size + i % page_size

    width = (num_q_heads + 2 * num_kv_heads) * head_dim
    qkv = 2.0 * rng.standard_normal((n, width), np.float32)  # not unit RMS, so the norm matters
    kv_cols = slice(num_q_heads * head_dim, None)
    for i, kind in enumerate(kinds):
        if kind in "PS":
            qkv[i] = np.nan
        elif kind == "N":
            qkv[i, kv_cols] = np.nan

    def pool():
        x = rng.standard_normal((num_pages, num_kv_heads, page_size, head_dim), np.float32)
        poison = np.where(rng.random(x.shape) < 0.5, np.nan, x)
        return jnp.asarray(np.where(target[:, None, :, None], x, poison), dtype)

    def weight():
        return jnp.asarray(1.0 + 0.1 * rng.standard_normal(head_dim, np.float32), dtype) if norm else None

    positions = jnp.asarray(positions, jnp.int32)
    cos_sin = rope_cos_sin(positions, jnp.asarray(rope_inv_freq(head_dim)), dtype) if rope else None
    return Case(jnp.asarray(qkv, dtype), positions, jnp.asarray(slots, jnp.int32), pool(), pool(), cos_sin, weight(),
                weight(), target)


def bits(x):
    x = np.asarray(x)
    return x.view(f"u{x.dtype.itemsize}")


def check(case, out, ref, interpret=True):
    """In interpret mode the kernel runs the reference's XLA ops on the same values: bf16 results must be bit-identical
    (any change of rounding shows); f32 ones differ by a few ulps (the order of the sum of squares). On the GPU, Triton
    and XLA:GPU may contract or keep excess precision differently: one bf16 ulp."""
    (q, k_pages, v_pages), (q_ref, k_ref, v_ref) = out, ref
    assert q.shape == q_ref.shape and q.dtype == case.qkv.dtype
    tol = 0.0 if interpret and case.qkv.dtype == jnp.bfloat16 else TOLERANCE[case.qkv.dtype]
    qf = np.asarray(q.astype(jnp.float32))
    assert np.isfinite(qf).all(), "NaN/inf in q"
    padding = np.asarray(case.positions) < 0
    assert (qf[padding] == 0).all(), "q must be zero on padding tokens"
    np.testing.assert_allclose(qf, np.asarray(q_ref.astype(jnp.float32)), rtol=tol, atol=tol)
    target = np.broadcast_to(case.target[:, None, :, None], k_pages.shape)
    for name, new, want, old in (("k", k_pages, k_ref, case.k_pages), ("v", v_pages, v_ref, case.v_pages)):
        assert new.shape == old.shape and new.dtype == old.dtype
        np.testing.assert_array_equal(bits(new)[~target], bits(old)[~target],
                                      err_msg=f"{name}_pages changed outside the target slots")
        new_f, want_f = (np.asarray(a.astype(jnp.float32))[target] for a in (new, want))
        assert np.isfinite(new_f).all(), f"a target slot of {name}_pages was not written"
        np.testing.assert_allclose(new_f, want_f, rtol=tol, atol=tol)


reference = jax.jit(qkv_rope_cache_reference, static_argnames="eps")


def run(case, config=None, interpret=True):
    out = qkv_rope_cache(*case.args, eps=EPS, config=config, interpret=interpret)
    check(case, out, reference(*case.args, eps=EPS), interpret)


# (Hq, Hkv, D, page_size, N, dtype, norm): every GQA ratio (1, 2, 4, 7, 8), D, page size, N and dtype, with and
# without q/k norm, each at least once; DECODE_CONFIG gives 8 // next_pow2(ratio) tokens per program, so N = 17 spans
# several ragged token blocks.
CASES = [
    (4, 4, 64, 16, 17, jnp.float32, True),
    (4, 2, 64, 8, 17, jnp.float32, False),
    (7, 1, 64, 32, 17, jnp.float32, True),
    (16, 2, 64, 16, 17, jnp.float32, True),
    (4, 1, 64, 16, 3, jnp.float32, True),
    (2, 2, 128, 8, 3, jnp.float32, True),
    (8, 1, 128, 32, 1, jnp.float32, False),
    (14, 2, 128, 16, 3, jnp.bfloat16, True),
    (4, 2, 64, 32, 17, jnp.bfloat16, False),
    (8, 1, 64, 8, 1, jnp.bfloat16, True),
    (4, 4, 128, 16, 17, jnp.bfloat16, True),
]


@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim,page_size,n,dtype,norm", CASES)
def test_matches_reference(num_q_heads, num_kv_heads, head_dim, page_size, n, dtype, norm):
    run(make_case(n + num_q_heads, n=n, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                  page_size=page_size, dtype=dtype, norm=norm))


@pytest.mark.parametrize("config", [PREFILL_CONFIG, QkvRopeCacheConfig(block_rows=1, num_warps=1),
                                    QkvRopeCacheConfig(block_rows=64)])
def test_configs(config):
    # block_rows 1: one token per program; 64 with ratio 2: 32 tokens per program, more than N.
    run(make_case(1, n=17, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16), config)


def test_without_rope():
    run(make_case(2, n=5, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=8, rope=False))


def test_only_padding():
    case = make_case(4, n=3, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=8, kinds="PPP")
    q, k_pages, v_pages = qkv_rope_cache(*case.args, eps=EPS, interpret=True)
    assert not case.target.any() and (np.asarray(q) == 0).all()
    np.testing.assert_array_equal(bits(k_pages), bits(case.k_pages))
    np.testing.assert_array_equal(bits(v_pages), bits(case.v_pages))


def test_donated_pools_are_updated_in_place():
    """With the pools donated, the outputs live in the input buffers (the custom call's operand aliasing)."""
    case = make_case(5, n=3, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=8)
    ref = reference(*case.args, eps=EPS)
    k_in, v_in = jnp.copy(case.k_pages), jnp.copy(case.v_pages)
    pointers = k_in.unsafe_buffer_pointer(), v_in.unsafe_buffer_pointer()
    fn = jax.jit(functools.partial(qkv_rope_cache, eps=EPS, interpret=True), donate_argnums=(3, 4))
    args = list(case.args)
    args[3:5] = k_in, v_in
    out = fn(*args)
    assert (out[1].unsafe_buffer_pointer(), out[2].unsafe_buffer_pointer()) == pointers
    assert k_in.is_deleted() and v_in.is_deleted()
    check(case, out, ref)


def _inputs():
    """Valid inputs: N=3, Hq=4, Hkv=2, D=64, page_size=8 (each test breaks one thing)."""
    pages = jnp.zeros((6, 2, 8, 64))
    ids = jnp.zeros((3,), jnp.int32)
    return {"qkv": jnp.zeros((3, 8 * 64)), "positions": ids, "slots": ids, "k_pages": pages, "v_pages": pages,
            "cos_sin": jnp.zeros((3, 64)), "q_norm": jnp.ones((64,)), "k_norm": jnp.ones((64,))}


@pytest.mark.parametrize("change,message", [
    ({"qkv": jnp.zeros((3, 8, 64))}, "qkv must be"),
    ({"qkv": jnp.zeros((0, 8 * 64))}, "qkv must be"),
    ({"qkv": jnp.zeros((3, 8 * 64 + 32))}, "qkv must be"),
    ({"qkv": jnp.zeros((3, 7 * 64))}, "query heads"),
    ({"qkv": jnp.zeros((3, 4 * 64))}, "query heads"),
    ({"qkv": jnp.zeros((3, 8 * 64), jnp.int32)}, "share one float dtype"),
    ({"k_pages": jnp.zeros((6, 2, 8, 48)), "v_pages": jnp.zeros((6, 2, 8, 48)), "qkv": jnp.zeros((3, 8 * 48))},
     "head_dim"),
    ({"v_pages": jnp.zeros((6, 2, 16, 64))}, "k_pages and v_pages"),
    ({"v_pages": jnp.zeros((6, 2, 8, 64), jnp.bfloat16)}, "float dtype"),
    ({"positions": jnp.zeros((4,), jnp.int32)}, "positions"),
    ({"positions": jnp.zeros((3,), jnp.float32)}, "positions"),
    ({"slots": jnp.zeros((3, 1), jnp.int32)}, "slots"),
    ({"cos_sin": jnp.zeros((3, 32))}, "cos_sin"),
    ({"cos_sin": jnp.zeros((4, 64))}, "cos_sin"),
    ({"cos_sin": jnp.zeros((3, 64), jnp.bfloat16)}, "cos_sin"),
    ({"q_norm": jnp.ones((32,))}, "q_norm"),
    ({"k_norm": jnp.ones((64,), jnp.int32)}, "k_norm"),
    ({"k_pages": jnp.zeros((6, 2, 8, 64), jnp.bfloat16)}, "share one float dtype"),
    ({"qkv": jnp.zeros((3, 8 * 64), jnp.bfloat16)}, "share one float dtype"),
])
def test_rejects_bad_inputs(change, message):
    with pytest.raises(ValueError, match=message):
        qkv_rope_cache(**{**_inputs(), **change}, eps=EPS, interpret=True)


def test_norm_needs_eps():
    with pytest.raises(ValueError, match="eps"):
        qkv_rope_cache(**_inputs(), interpret=True)
    qkv_rope_cache(**{**_inputs(), "q_norm": None, "k_norm": None}, interpret=True)  # no norm: no eps needed


@pytest.mark.parametrize("field,value", [("block_rows", 24), ("block_rows", 0), ("num_warps", 3)])
def test_config_rejects_bad_values(field, value):
    with pytest.raises(ValueError):
        dataclasses.replace(DECODE_CONFIG, **{field: value})


# Qwen3-0.6B: 16 query heads, 8 KV heads, head_dim 128, q/k norm; Llama-3.2-1B: 32 / 8, head_dim 64, no norm.
MODELS = {"qwen3-0.6b": {"num_q_heads": 16, "num_kv_heads": 8, "head_dim": 128, "norm": True},
          "llama-3.2-1b": {"num_q_heads": 32, "num_kv_heads": 8, "head_dim": 64, "norm": False}}


def _abstract_args(model, n, dtype=jnp.bfloat16, num_pages=1000, page_size=16):
    hq, hkv, d, norm = (MODELS[model][key] for key in ("num_q_heads", "num_kv_heads", "head_dim", "norm"))
    shape = jax.ShapeDtypeStruct
    pages = shape((num_pages, hkv, page_size, d), dtype)
    ids = shape((n,), jnp.int32)
    weight = shape((d,), dtype) if norm else None
    return (shape((n, (hq + 2 * hkv) * d), dtype), ids, ids, pages, pages, shape((n, d), dtype), weight, weight)


@pytest.mark.skipif(not can_lower_for_cuda(), reason="this jaxlib compiles Triton kernels while lowering")
@pytest.mark.parametrize("model", MODELS)
def test_lowers_to_triton_with_aliased_pools(model):
    """The Triton lowering rules (power-of-two tensors, supported primitives), checked on CPU by lowering for cuda;
    and the pools are the custom call's aliased operands 3 and 4, so a donated pool is updated in place."""
    for n in (1, 64, 2048):
        fn = jax.jit(lambda *a: qkv_rope_cache(*a, eps=EPS), donate_argnums=(3, 4))
        text = fn.trace(*_abstract_args(model, n)).lower(lowering_platforms=("cuda",)).as_text()
        assert "triton" in text
        aliases = re.findall(r"output_tuple_indices = \[(\d)\], operand_index = (\d)", text)
        assert sorted(aliases) == [("1", "3"), ("2", "4")], aliases
        assert text.count("tf.aliasing_output") == 2  # the jit's donated arguments


# ------------------------------------------------------------------------------------------------ GPU, model sizes
@requires_gpu
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("n", [1, 64, 2048])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_gpu(model, n, dtype):
    case = make_case(n, n=n, page_size=16, dtype=dtype, **MODELS[model])
    run(case, interpret=False)
    if dtype == jnp.bfloat16:  # the other preset at this size too
        run(case, config=PREFILL_CONFIG if n <= 256 else DECODE_CONFIG, interpret=False)


@requires_gpu
@pytest.mark.parametrize("model", MODELS)
def test_gpu_in_place(model):
    """Donated pools: the outputs are the input buffers and the compiled program copies no pool."""
    case = make_case(7, n=64, page_size=16, dtype=jnp.bfloat16, **MODELS[model])
    ref = reference(*case.args, eps=EPS)
    fn = jax.jit(functools.partial(qkv_rope_cache, eps=EPS), donate_argnums=(3, 4))
    compiled = fn.lower(*case.args).compile().as_text()
    pool_shape = ",".join(map(str, case.k_pages.shape))
    assert not re.search(rf"\[{pool_shape}\]\S* copy\(", compiled), "the pool is copied"
    args = list(case.args)
    args[3:5] = jnp.copy(case.k_pages), jnp.copy(case.v_pages)
    pointers = args[3].unsafe_buffer_pointer(), args[4].unsafe_buffer_pointer()
    out = fn(*args)
    assert (out[1].unsafe_buffer_pointer(), out[2].unsafe_buffer_pointer()) == pointers
    check(case, out, ref, interpret=False)
