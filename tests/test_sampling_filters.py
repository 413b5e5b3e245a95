"""sampling_filters (the Pallas kernel, interpreted on CPU; on the GPU at Qwen3's vocabulary) against its sorting
reference: the same kept set for every row, the same top logprob tokens; and sample() drawing the same tokens through
either.

Rows mix every filter alone and together at random strengths, greedy rows with filters (unfiltered), logprob rows;
logits have many ties (a kept prefix may end inside one: token ids break it, as the stable sort does), -inf entries
(banned tokens), +-0.0, a row of one value; vocabularies that are not a multiple of the kernel's block, and smaller
than the number of top tokens.
"""
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import requires_gpu
from test_sampling import reference

from nanojax.ops import Ops
from nanojax.runner import sampling_batch
from nanojax.sampling import TokenTables, sample
from pallas_kernels._compat import can_lower_for_cuda
from pallas_kernels.sampling_filters import (
    FilterConfig,
    kept,
    sampling_filters,
    sampling_filters_reference,
)

NUM_TOP = 20


def random_rows(rng, batch, vocab, ties=True):
    """(logits [B, V] f32, {temperature, top_k, top_p, min_p, logprobs: [B]})."""
    if ties:
        logits = rng.integers(-6, 6, (batch, vocab)).astype(np.float32) / 2
        logits[rng.random((batch, vocab)) < 0.1] = -np.inf
        logits[:, 0] = np.where(rng.random(batch) < 0.5, -0.0, 0.0)
        logits[batch // 2] = 1.0  # one tie over the whole row
    else:
        logits = rng.normal(0, 4, (batch, vocab)).astype(np.float32)
    which = rng.integers(0, 8, batch)  # bit 0: top-k, 1: top-p, 2: min-p
    rows = {"temperature": rng.choice([0.0, 0.5, 1.0, 1.7], batch).astype(np.float32),
            "top_k": np.where(which & 1, rng.integers(1, vocab + 20, batch), 0).astype(np.int32),
            "top_p": np.where(which & 2, rng.uniform(0.05, 1.0, batch), 1.0).astype(np.float32),
            "min_p": np.where(which & 4, rng.uniform(0.0, 0.9, batch), 0.0).astype(np.float32),
            "logprobs": rng.choice([0, 0, 1, NUM_TOP], batch).astype(np.int32)}
    return logits, rows


def check(logits, rows, got, want):
    """The kernel's results `got` against the reference's `want`: the same kept set and cut key in every row, the
    same top tokens and logits; and the kept sets of filtered rows against numpy's float64 semantics."""
    x = jnp.asarray(logits)
    got_keep, want_keep = (np.asarray(kept(x, r[0], r[1])) for r in (got, want))
    np.testing.assert_array_equal(got_keep, want_keep)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(got[2]), np.asarray(want[2]))
    np.testing.assert_array_equal(np.asarray(got[3]), np.asarray(want[3]))
    filtered = (rows["temperature"] > 0) & ((rows["top_k"] > 0) | (rows["top_p"] < 1) | (rows["min_p"] > 0))
    for i in np.flatnonzero(filtered):
        numpy_keep = reference(logits[i], *(rows[f][i] for f in ("temperature", "top_k", "top_p", "min_p"))) > 0
        # the sort keeps -inf tokens that a top-k larger than the finite ones reaches; they are never drawn
        np.testing.assert_array_equal(got_keep[i] & (logits[i] > -np.inf), numpy_keep, err_msg=f"row {i}")
    assert got_keep[~filtered].all()


def run_both(logits, rows, **kw):
    args = (jnp.asarray(logits), *(jnp.asarray(rows[f]) for f in ("temperature", "top_k", "top_p", "min_p",
                                                                   "logprobs")))
    want = jax.jit(sampling_filters_reference, static_argnames="num_top")(*args, num_top=NUM_TOP)
    got = sampling_filters(*args, num_top=NUM_TOP, **kw)
    return got, want


@pytest.mark.parametrize("batch, vocab, block, ties, seed", [
    (1, 300, 64, True, 0), (37, 300, 64, True, 1), (37, 300, 64, False, 2), (9, 1000, 256, False, 3),
    (13, 5, 64, True, 4), (16, 128, 128, True, 5), (7, 129, 2048, False, 6)])
def test_kernel_matches_the_sorting_reference(batch, vocab, block, ties, seed):
    logits, rows = random_rows(np.random.default_rng(seed), batch, vocab, ties)
    got, want = run_both(logits, rows, config=FilterConfig(block=block), interpret=True)
    check(logits, rows, got, want)


def test_sample_draws_the_same_tokens_and_logprobs_through_the_kernel():
    """sample() with the kernel (interpreted) and with the reference: the same tokens, logprobs and top logprobs,
    for one step of a mixed batch (the same noise: the keep mask decides alone)."""
    rng = np.random.default_rng(7)
    batch, vocab = 23, 200
    logits, rows = random_rows(rng, batch, vocab, ties=False)
    fields = {k: v.tolist() for k, v in rows.items()}
    fields.update(seeds=rng.integers(0, 2**31, batch).tolist(), counters=rng.integers(0, 100, batch).tolist(),
                  slots=[batch] * batch)
    tables = TokenTables.create(batch, vocab, vocab)
    s = jax.tree.map(jnp.asarray, sampling_batch(fields, batch, tables.neutral))
    outs = [jax.jit(lambda x, s, ops=ops: sample(x, s, tables, 3, ops=ops))(jnp.asarray(logits), s)
            for ops in (Ops(), Ops(pallas=True, interpret=True))]
    for want, got in zip(*map(jax.tree.leaves, outs)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_rejects_bad_inputs():
    x = jnp.zeros((2, 16))
    ok = dict(temperature=jnp.ones(2), top_k=jnp.zeros(2, jnp.int32), top_p=jnp.ones(2), min_p=jnp.zeros(2),
              logprobs=jnp.zeros(2, jnp.int32))
    with pytest.raises(ValueError, match="logits"):
        sampling_filters(x.astype(jnp.bfloat16), **ok, num_top=NUM_TOP, interpret=True)
    with pytest.raises(ValueError, match="top_k"):
        sampling_filters(x, **{**ok, "top_k": jnp.zeros(3, jnp.int32)}, num_top=NUM_TOP, interpret=True)
    with pytest.raises(ValueError, match="block"):
        sampling_filters(x, **ok, num_top=NUM_TOP, config=FilterConfig(block=48), interpret=True)
    with pytest.raises(ValueError, match="vocabulary"):
        one = {k: v[:1] for k, v in ok.items()}
        sampling_filters(jax.ShapeDtypeStruct((1, 2**24), jnp.float32), **one, num_top=NUM_TOP, interpret=True)


@pytest.mark.skipif(not can_lower_for_cuda(), reason="this jaxlib compiles Triton kernels while lowering")
def test_a_multi_step_sampling_loop_has_no_conditional_on_the_gpu():
    """With the kernel, the decode loop's sampling has no lax.cond (whose predicate the host would read every step,
    making a multi-step dispatch synchronous); with the reference it has one. Lowered for cuda on the CPU."""
    batch, vocab = 64, 151936
    tables = TokenTables.create(batch, vocab, vocab)
    fields = {"temperature": [0.7] * batch, "top_p": [0.9] * batch, "slots": [batch] * batch}
    s = jax.tree.map(jnp.asarray, sampling_batch(fields, batch, tables.neutral))

    def text(ops):
        def loop(x, s):
            def body(i, acc):
                return acc + sample(x, s, tables, i, ops=ops).tokens
            return jax.lax.fori_loop(0, 8, body, jnp.zeros((batch,), jnp.int32))
        x = jax.ShapeDtypeStruct((batch, vocab), jnp.float32)
        return jax.jit(loop).trace(x, s).lower(lowering_platforms=("cuda",)).as_text()

    kernel, reference = text(Ops(pallas=True)), text(Ops())
    assert "triton" in kernel and not any(op in kernel for op in ("stablehlo.case", "stablehlo.if"))
    assert any(op in reference for op in ("stablehlo.case", "stablehlo.if"))


@requires_gpu
@pytest.mark.parametrize("batch, ties, splits", [(1, False, 16), (64, False, 16), (67, True, 16), (67, True, 1),
                                                 (256, False, 32)])
def test_kernel_matches_the_reference_on_the_gpu(batch, ties, splits):
    """Qwen3's vocabulary (151,936: not a multiple of the block), the Triton kernel, its rows split over several
    programs that exchange partial sums (and one)."""
    logits, rows = random_rows(np.random.default_rng(batch), batch, 151936, ties)
    got, want = run_both(logits, rows, config=FilterConfig(splits=splits))
    check(logits, rows, got, want)



@pytest.mark.skipif(not can_lower_for_cuda(), reason="this jaxlib compiles Triton kernels while lowering")
def test_lowering_the_kernel_looks_no_dialect_module_up():
    """Lowering a Triton kernel imports nothing (pallas_kernels._compat names the Triton dialect's module where
    MLIR's bindings look for it; before, they tried to import it anew at every value they wrapped)."""
    asked = []

    class Record:  # first in the meta path: sees every import of a module not yet in sys.modules
        def find_spec(self, name, path=None, target=None):
            asked.append(name)
            return None

    x = jax.ShapeDtypeStruct((8, 1000), jnp.float32)
    rows = [jax.ShapeDtypeStruct((8,), d) for d in (jnp.float32, jnp.int32, jnp.float32, jnp.float32, jnp.int32)]
    traced = jax.jit(functools.partial(sampling_filters, num_top=4)).trace(x, *rows)
    sys.meta_path.insert(0, Record())
    try:
        traced.lower(lowering_platforms=("cuda",))
    finally:
        sys.meta_path.pop(0)
    assert not [n for n in asked if n.endswith(".tt")], sorted(set(asked))
