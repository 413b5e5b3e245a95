"""Sampling filters without a sort: per row, the tokens top-k / top-p / min-p keep, and the top-N logprob tokens.

A row keeps the prefix of its logits' descending order (ties by id) up to its last token: order keys above `cut_key`,
and those at it up to id `cut_id`. Cuts come from radix-select passes, whose partial sums the `splits` programs of a
row exchange through global memory, spinning on an arrival count: safe, as a row's programs are adjacent in launch
order (docs/perf_notes.md, "Sampling"). Partials are summed in a fixed order: the cut is the same in every run.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._compat import check_pow2, check_vector, load, store, triton_params

INT32_MIN = -(2**31)


@dataclasses.dataclass(frozen=True)
class FilterConfig:
    """splits: programs sharing a row (1 in interpret mode: one after another); block: logits a loop step reads."""
    splits: int = 32
    block: int = 512
    num_warps: int = 4
    num_stages: int = 3


# Exchange slots per row and phase (the filters, the top logprobs): the most passes a phase makes, 53 and 18 plus one
# per bit of the vocabulary for the ties' binary search (77 and 42 at the largest, 2**24 - 1).
MAX_EXCHANGES = 80


def order_keys(x):
    """f32 [...] -> int32 [...] in the same order (-0.0 and 0.0 equal, -inf below every number; no NaN)."""
    return _flip_negatives(lax.bitcast_convert_type(jnp.where(x == 0, 0.0, x), jnp.int32))


def key_value(keys):
    """int32 order keys -> the float32 values they came from (-0.0 comes back as 0.0)."""
    return lax.bitcast_convert_type(_flip_negatives(keys), jnp.float32)


def _flip_negatives(bits):
    """Reverses the order of the negative int32s, leaving the rest: float bits <-> order keys, both ways."""
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def no_filters(batch: int, vocab: int, num_top: int):
    """sampling_filters' results for rows that are neither filtered nor want logprobs: keep every token, no top."""
    return (jnp.full((batch,), INT32_MIN, jnp.int32), jnp.full((batch,), vocab, jnp.int32),
            jnp.zeros((batch, num_top), jnp.int32), jnp.full((batch, num_top), -jnp.inf))


def kept(logits, cut_key, cut_id):
    """logits [B, V], cut_key / cut_id [B] -> [B, V] bool, the kept tokens: elementwise, fused into the draw."""
    keys, ids = order_keys(logits), jnp.arange(logits.shape[1])[None, :]
    return (keys > cut_key[:, None]) | ((keys == cut_key[:, None]) & (ids <= cut_id[:, None]))


def is_filtered(temperature, top_k, top_p, min_p):
    """[B] bool: the rows whose draw is filtered (a greedy row ignores its filters)."""
    return (temperature > 0) & ((top_k > 0) | (top_p < 1) | (min_p > 0))


def sampling_filters_reference(logits, temperature, top_k, top_p, min_p, logprobs, *, num_top):
    """Plain jnp, by a full sort: top-k, top-p within top-k, min-p, always the top token -> cut_key, cut_id [B] (all
    kept: INT32_MIN, V); top_ids, top_logits [B, num_top] descending (ties by id), else 0 and -inf."""
    vocab = logits.shape[1]
    order = jnp.argsort(-logits, axis=-1)  # stable: ties in id order; temperature does not change the order
    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
    probs = jax.nn.softmax(jnp.take_along_axis(scaled, order, axis=-1), axis=-1)
    rank = jnp.arange(vocab)[None, :]
    keep = (top_k[:, None] <= 0) | (rank < top_k[:, None])
    kept_probs = jnp.where(keep, probs, 0.0)
    kept_probs = kept_probs / jnp.sum(kept_probs, axis=-1, keepdims=True)
    # top_p 1 disables the filter: a float32 cumsum reaches 1 before the tail of a peaked distribution
    keep &= (jnp.cumsum(kept_probs, axis=-1) - kept_probs < top_p[:, None]) | (top_p >= 1)[:, None]
    keep &= probs >= min_p[:, None] * probs[:, :1]
    last = jnp.take_along_axis(order, jnp.maximum(jnp.sum(keep, axis=-1), 1)[:, None] - 1, axis=-1)[:, 0]
    filtered = is_filtered(temperature, top_k, top_p, min_p)
    cut_key = jnp.where(filtered, order_keys(jnp.take_along_axis(logits, last[:, None], axis=-1)[:, 0]), INT32_MIN)
    cut_id = jnp.where(filtered, last, vocab).astype(jnp.int32)
    n = min(num_top, vocab)
    wanted = (logprobs > 0)[:, None]
    top_ids = jnp.where(wanted, order[:, :n], 0).astype(jnp.int32)
    top_logits = jnp.where(wanted, jnp.take_along_axis(logits, order[:, :n], axis=-1), -jnp.inf)
    pad = [(0, 0), (0, num_top - n)]
    return cut_key, cut_id, jnp.pad(top_ids, pad), jnp.pad(top_logits, pad, constant_values=-jnp.inf)


def _filters_kernel(logits_ref, temperature_ref, top_k_ref, top_p_ref, min_p_ref, logprobs_ref, arrivals_ref,
                    cut_key_ref, cut_id_ref, top_ids_ref, top_logits_ref, partials_ref, arrivals_out_ref, *, vocab,
                    block, splits, num_top, interpret):
    # logits_ref: [V] f32; temperature_ref, top_k_ref, top_p_ref, min_p_ref, logprobs_ref: []
    # arrivals_ref (aliased by arrivals_out_ref): [2] int32 arrivals per phase, 0 at the start
    # cut_key_ref, cut_id_ref: [] int32; top_ids_ref: [num_top] int32; top_logits_ref: [num_top] f32
    # partials_ref: [2, MAX_EXCHANGES, splits, 4] f32 each program's partial results of each exchange
    del arrivals_out_ref
    row = _Row(logits_ref, partials_ref, arrivals_ref, vocab, block, splits, interpret, pl.program_id(0))
    temperature, top_k, top_p, min_p = (ref[...] for ref in (temperature_ref, top_k_ref, top_p_ref, min_p_ref))
    cut_key_ref[...] = jnp.int32(INT32_MIN)
    cut_id_ref[...] = jnp.int32(vocab)
    slots = jnp.arange(pl.next_power_of_2(num_top))
    store(top_ids_ref.at[slots], jnp.zeros(slots.shape, jnp.int32), mask=slots < num_top)
    store(top_logits_ref.at[slots], jnp.full(slots.shape, -jnp.inf, jnp.float32), mask=slots < num_top)

    @pl.when(is_filtered(temperature, top_k, top_p, min_p))
    def _():
        key, cut_id = _filter_cut(row, temperature, top_k, top_p, min_p)

        @pl.when(row.split == 0)
        def _():
            cut_key_ref[...] = key
            cut_id_ref[...] = cut_id

    @pl.when(logprobs_ref[...] > 0)
    def _():
        _write_top(row, top_ids_ref, top_logits_ref, num_top)


def _filter_cut(row: "_Row", temperature, top_k, top_p, min_p):
    """(cut key, cut id) of a filtered row: the k-th of the tightest of top-k, top-p within top-k, and min-p."""
    vocab = row.vocab
    own_max = row.over_chunk(lambda m, x, keys, ids, valid: jnp.maximum(m, x), jnp.full((row.block,), -jnp.inf))
    every, seq = row.exchange(jnp.full((4,), jnp.max(own_max)), (0, jnp.int32(0)), pad=-jnp.inf)
    row_max = jnp.max(every)
    inv_t = 1.0 / jnp.maximum(temperature, 1e-6)

    def mass(x, valid):  # unnormalized probabilities: the top token's is 1
        return jnp.where(valid, jnp.exp((x - row_max) * inv_t), 0.0)

    def mass_at(key, tied):  # the mass of a token at this key, 0 if there is none
        return jnp.where(tied > 0, jnp.exp((key_value(key) - row_max) * inv_t), 0.0)

    k_top = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    t_top, seq = row.search(_count, k_top.astype(jnp.float32), seq, run=top_k > 0)
    above_top, mass_above_top, at_top, seq = row.at_key(t_top, mass, seq)
    target = top_p * (mass_above_top + (k_top - above_top).astype(jnp.float32) * mass_at(t_top, at_top))
    t_p, seq = row.search(mass, target, seq, run=top_p < 1)
    above_p, mass_above_p, at_p, seq = row.at_key(t_p, mass, seq)
    # at least one tied token: the search's sums and at_key's may round apart
    tied_needed = jnp.ceil((target - mass_above_p) / jnp.maximum(mass_at(t_p, at_p), jnp.finfo(jnp.float32).tiny))
    k_p = jnp.where(top_p < 1, above_p + jnp.maximum(tied_needed, 1).astype(jnp.int32), vocab)
    k_min, seq = row.count_in_row(lambda x, keys, ids, valid: valid & (mass(x, valid) >= min_p), seq, run=min_p > 0)
    k = jnp.maximum(1, jnp.minimum(jnp.minimum(k_top, k_p), jnp.where(min_p > 0, k_min, vocab)))
    key, cut_id, _ = row.kth_cut(k, [(t_top, above_top, at_top), (t_p, above_p, at_p)], seq)
    return key, cut_id


def _write_top(row: "_Row", top_ids_ref, top_logits_ref, num_top: int) -> None:
    """Writes the row's num_top largest logits and ids in id order, each program after the programs before it."""
    key, cut_id, seq = row.kth_cut(jnp.int32(min(num_top, row.vocab)), [], (1, jnp.int32(0)))

    def taken(x, keys, ids, valid):
        return valid & ((keys > key) | ((keys == key) & (ids <= cut_id)))

    every, seq = row.counts(taken, seq)
    before = jnp.sum(jnp.where(jnp.arange(every.shape[0])[:, None] < row.split, every, 0.0)).astype(jnp.int32)

    def write(written, x, keys, ids, valid):  # the block's taken tokens, in id order
        def one(carry):
            w, take = carry
            i = jnp.min(jnp.where(take, ids, row.vocab))
            store(top_ids_ref.at[w], i)
            store(top_logits_ref.at[w], jnp.max(jnp.where(ids == i, x, -jnp.inf)))
            return w + 1, take & (ids != i)

        return lax.while_loop(lambda c: jnp.sum(c[1].astype(jnp.int32)) > 0, one,
                              (written, taken(x, keys, ids, valid)))[0]

    row.over_chunk(write, before)


def _count(x, valid):
    return valid.astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class _Row:
    """The passes over one row, `seq` (phase, exchanges so far) threaded through. Skippable work loops zero times (a
    Triton branch cannot return a constant); loops carry [block] partials (a reduction a step stalled them)."""

    logits_ref: object  # [V] f32
    partials_ref: object  # [2, MAX_EXCHANGES, splits, 4] f32
    arrivals_ref: object  # [2] int32
    vocab: int
    block: int
    splits: int
    interpret: bool
    split: jax.Array

    def over_chunk(self, fn, init, run=True):
        """fn(carry, x, keys, ids, valid), each [block], over this program's blocks of the row (if run)."""
        blocks = pl.cdiv(pl.cdiv(self.vocab, self.block), self.splits)

        def body(i, carry):
            ids = (self.split * blocks + i) * self.block + jnp.arange(self.block, dtype=jnp.int32)
            valid = ids < self.vocab
            x = load(self.logits_ref.at[ids], mask=valid, other=-jnp.inf)
            return fn(carry, x, order_keys(x), ids, valid)

        return _loop(blocks, run, body, init)

    def exchange(self, values, seq, pad=0.0):
        """values [4] f32, this program's partials -> (every program's [splits', 4], padded with pad; seq after)."""
        (phase, n), lanes = seq, jnp.arange(4)
        store(self.partials_ref.at[phase, n, self.split, lanes], values)
        if not self.interpret:  # every thread's store is done (and seen by the arrival's release) before reading
            plgpu.debug_barrier()
        if self.splits > 1:  # (one program per row, as in interpret mode, has no one to wait for)
            arrivals = self.arrivals_ref.at[phase]
            plgpu.atomic_add(arrivals, (), 1)  # acquire-release: the slot is seen by whoever sees the count
            target = self.splits * (n + 1)
            lax.while_loop(lambda seen: seen < target, lambda seen: plgpu.atomic_add(arrivals, (), 0), n - n)
            plgpu.debug_barrier()
        rows = jnp.arange(pl.next_power_of_2(self.splits))
        every = load(self.partials_ref.at[phase, n, rows[:, None], lanes[None, :]],
                     mask=(rows < self.splits)[:, None], other=pad, volatile=True)
        return every, (phase, n + 1)

    def search(self, weigh, target, seq, run=True):
        """(The largest key T with sum(weigh(x, valid)[keys >= T]) >= target, seq after), INT32_MIN if not run: T's
        bits two at a time from the top, over unsigned offsets from INT32_MIN (int32 adds wrap)."""
        def next_digits(p, t_seq):
            t, seq = t_seq
            shift = 30 - 2 * p
            candidates = t + (jnp.arange(4) << shift)  # [4]; the first, t, reaches the target

            def weigh_block(sums, x, keys, ids, valid):
                return sums + jnp.where(keys[:, None] >= candidates[None, :], weigh(x, valid)[:, None], 0.0)

            every, seq = self.exchange(jnp.sum(self.over_chunk(weigh_block, jnp.zeros((self.block, 4))), axis=0), seq)
            reached = jnp.sum((jnp.sum(every, axis=0) >= target).astype(jnp.int32))
            return t + ((reached - 1) << shift), seq

        return _loop(16, run, next_digits, (jnp.int32(INT32_MIN), seq))

    def at_key(self, t, weigh, seq):
        """(count of keys above t, their weight, count of keys equal to t, seq after)."""
        def step(acc, x, keys, ids, valid):
            above, at = valid & (keys > t), valid & (keys == t)
            return acc[0] + above.astype(jnp.float32), acc[1] + jnp.where(above, weigh(x, valid), 0.0), acc[2] + at

        zeros, lanes = jnp.zeros((self.block,)), jnp.arange(4)
        above, mass_above, at = self.over_chunk(step, (zeros, zeros, jnp.zeros((self.block,), jnp.int32)))
        values = jnp.where(lanes == 0, jnp.sum(above), jnp.where(lanes == 1, jnp.sum(mass_above),
                                                                 jnp.sum(at).astype(jnp.float32)))
        every, seq = self.exchange(values, seq)
        total = jnp.sum(every, axis=0)
        pick = lambda lane: jnp.sum(jnp.where(lanes == lane, total, 0.0))
        return pick(0).astype(jnp.int32), pick(1), pick(2).astype(jnp.int32), seq

    def counts(self, fn, seq, run=True):
        """Every program's count of fn(x, keys, ids, valid) -> [block] bool (exchange's result, lane 0), seq after."""
        n = jnp.sum(self.over_chunk(lambda c, x, keys, ids, valid: c + fn(x, keys, ids, valid).astype(jnp.float32),
                                    jnp.zeros((self.block,)), run))
        return self.exchange(jnp.where(jnp.arange(4) == 0, n, 0.0), seq)

    def count_in_row(self, fn, seq, run=True):
        """The row's count of fn(x, keys, ids, valid) -> [block] bool, seq after."""
        every, seq = self.counts(fn, seq, run)
        return jnp.sum(every).astype(jnp.int32), seq

    def cut_in_ties(self, t, needed, tied, seq):
        """(The id of the needed-th token (from 1) at key t, seq after): a binary search unless all are needed."""
        def halve(_, carry):
            lo, hi, seq = carry
            mid = (lo + hi) // 2
            n, seq = self.count_in_row(lambda x, keys, ids, valid: valid & (keys == t) & (ids <= mid), seq)
            return jnp.where(n >= needed, lo, mid + 1), jnp.where(n >= needed, mid, hi), seq

        steps = max(1, (self.vocab - 1).bit_length())
        lo, _, seq = _loop(steps, needed < tied, halve, (jnp.int32(0), jnp.int32(self.vocab - 1), seq))
        return jnp.where(needed < tied, lo, self.vocab - 1), seq

    def kth_cut(self, k, known, seq):
        """(key, id, seq after) of the k-th token, unsearched if a known (key, count above, count at) holds it."""
        key, found = jnp.int32(INT32_MIN), False
        for t, above, at in reversed(known):  # the first that holds the k-th wins
            hit = (above < k) & (k <= above + at)
            key, found = jnp.where(hit, t, key), found | hit
        searched, seq = self.search(_count, k.astype(jnp.float32), seq, run=~found if known else True)
        key = jnp.where(found, key, searched)
        above, _, at, seq = self.at_key(key, _count, seq)
        cut_id, seq = self.cut_in_ties(key, k - above, at, seq)
        return key, cut_id, seq


def _loop(n: int, run, body, init):
    """fori_loop of n trips if run, else none; a traced run makes int32 trips (Triton's select between constants took
    the predicate's type) and a traced start (Triton's loop needs one type)."""
    trips = n if run is True else n * run.astype(jnp.int32)
    return lax.fori_loop(0 if run is True else trips - trips, trips, body, init)


@functools.partial(jax.jit, static_argnames=("num_top", "config", "interpret"))
def sampling_filters(logits, temperature, top_k, top_p, min_p, logprobs, *, num_top: int,
                     config: FilterConfig = FilterConfig(), interpret: bool = False):
    """sampling_filters_reference's arguments and results. The top tokens leave the kernel in id order and are ranked
    here; the exchange slots are a scratch output that only the rows doing work write."""
    _check_inputs(logits, temperature, top_k, top_p, min_p, logprobs, num_top, config)
    batch, vocab = logits.shape
    splits = 1 if interpret else config.splits
    row = pl.BlockSpec((None,), lambda s, b: (b,))
    tops = pl.BlockSpec((None, num_top), lambda s, b: (b, 0))
    arrivals = pl.BlockSpec((None, 2), lambda s, b: (b, 0))
    kernel = functools.partial(_filters_kernel, vocab=vocab, block=min(config.block, pl.next_power_of_2(vocab)),
                               splits=splits, num_top=num_top, interpret=interpret)
    cut_key, cut_id, ids, top, _, _ = pl.pallas_call(
        kernel,
        grid=(splits, batch),  # a row's programs next to each other in launch order (see the module docstring)
        in_specs=[pl.BlockSpec((None, vocab), lambda s, b: (b, 0))] + 5 * [row] + [arrivals],
        out_specs=[row, row, tops, tops,
                   pl.BlockSpec((None, 2, MAX_EXCHANGES, splits, 4), lambda s, b: (b, 0, 0, 0, 0)), arrivals],
        out_shape=[jax.ShapeDtypeStruct((batch, *shape), dtype) for shape, dtype in (
            ((), jnp.int32), ((), jnp.int32), ((num_top,), jnp.int32), ((num_top,), jnp.float32),
            ((2, MAX_EXCHANGES, splits, 4), jnp.float32), ((2,), jnp.int32))],
        input_output_aliases={6: 5},
        compiler_params=triton_params(config.num_warps, config.num_stages),
        interpret=interpret,
        name="sampling_filters",
    )(logits, temperature, top_k, top_p, min_p, logprobs, jnp.zeros((batch, 2), jnp.int32))
    # rank: the entries before each (a larger logit, or the same with a smaller id; -inf pads last)
    before = (top[:, None, :] > top[:, :, None]) | ((top[:, None, :] == top[:, :, None]) & (
        jnp.arange(num_top)[None, :] < jnp.arange(num_top)[:, None])[None])
    rank = jnp.sum(before, axis=-1)
    rows = jnp.arange(batch)[:, None]
    return cut_key, cut_id, *(jnp.zeros_like(x).at[rows, rank].set(x) for x in (ids, top))


def _check_inputs(logits, temperature, top_k, top_p, min_p, logprobs, num_top, config):
    if logits.ndim != 2 or logits.dtype != jnp.float32:
        raise ValueError(f"logits must be [B, V] float32, got {logits.shape} {logits.dtype}")
    for name, x, dtype in (("temperature", temperature, jnp.float32), ("top_k", top_k, jnp.int32),
                           ("top_p", top_p, jnp.float32), ("min_p", min_p, jnp.float32),
                           ("logprobs", logprobs, jnp.int32)):
        check_vector(name, x, logits.shape[0], dtype)
    if logits.shape[1] >= 2**24:  # counts are exchanged as float32, exact below 2**24 (and MAX_EXCHANGES holds)
        raise ValueError(f"the vocabulary must be below 2**24 tokens, got {logits.shape[1]}")
    if num_top < 1:
        raise ValueError(f"num_top must be >= 1, got {num_top}")
    check_pow2(config, ("block",))
    if config.splits < 1:
        raise ValueError(f"FilterConfig.splits must be >= 1, got {config.splits}")
