"""The compiled steps: embed -> layers -> final norm -> LM head -> sampling in one jit, the KV cache donated.

Two programs per power-of-two row bucket serve every request mix (sampling parameters are data): decode (decode_steps
steps per dispatch, each row taking its own number of them) and prefill (prompt chunks packed as rows of PREFILL_ROW
tokens; a mixed step adds one-token decode rows). Prompt logprobs run in a third program. Every program returns each
row's last sampled token on the device, the next dispatch's `prev` (`chained`): the engine dispatches a step before
it has read the previous one back."""
import dataclasses
import functools
import threading
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from convert.config import ModelConfig
from convert.quantize import is_quantized
from nanojax import executable_cache
from nanojax.cascade import CascadePlan, plan_cascade
from nanojax.config import EngineConfig
from nanojax.kv_cache import Batch, KVCache
from nanojax.model import forward, lm_logits
from nanojax.ops import get_ops
from nanojax.sampling import MAX_LOGPROBS, Sampled, SamplingBatch, TokenTables, limited_bias, sample, unmasked_tokens
from nanojax.sampling_params import DEVICE_FIELDS
from nanojax.speculative import speculative_decode
from pallas_kernels._compat import num_sms
from pallas_kernels.cascade_attention import cascade_members_per_item

# The largest decode bucket that speculates (docs/perf_notes.md, "Speculative decoding").
SPECULATIVE_MAX_ROWS = 16
# Query rows of a packed prefill: the prefill attention kernel's query tile holds 128 rows = 64 tokens x 2 query
# heads per KV head, so a chunk re-reads its KV no more often packed than unpacked (docs/perf_notes.md, "Prefill").
PREFILL_ROW = 64
_STATIC = ("config", "ops")
# XLA options per program on a GPU, instead of XLA's costly GEMM tuning (docs/perf_notes.md, "XLA's GEMM options per
# program"): cuBLAS from CUBLAS_MIN_ROWS GEMM rows on, below it one Triton tiling for decodes (`decode_tiling`) and the
# cost model's for prefills; FP8 weights (whose dequantizing dots cuBLAS cannot fuse) keep XLA's tuning for decodes.
COST_MODEL_TILING = {"xla_gpu_experimental_cost_model_gemm_tiling_default": True}
CUBLAS_GEMMS = {"xla_gpu_enable_triton_gemm": False}
CUBLAS_MIN_ROWS = 128


def decode_tiling(rows: int) -> dict:
    """One unprofiled tiling for every Triton GEMM of a `rows`-row decode (8-32 rows: where XLA's picks put them)."""
    return {"xla_gpu_override_gemm_autotuner": f"block_m: 64 block_n: {min(max(rows, 8), 32)} block_k: 128 split_k: 1 "
                                               "num_stages: 3 num_warps: 4 num_ctas: 1"}


def chained(prev, tokens, sources):
    """prev: [S], the previous dispatch's last tokens; tokens, sources: [N] -> prev[sources] where >= 0, else tokens."""
    return jnp.where(sources >= 0, prev[jnp.maximum(sources, 0)], tokens)


def last_tokens(tokens, size: int):
    """tokens: [N], each row's last sampled token -> [size] (zeros after N): the next dispatch's prev."""
    return jnp.zeros(size, jnp.int32).at[:tokens.shape[0]].set(tokens)


@functools.partial(jax.jit, static_argnames=(*_STATIC, "hidden_rows"), donate_argnums=(1, 2))
def prefill_step(params, cache, tables, prev, tokens, batch: Batch, sampling: SamplingBatch, decode=None, *,
                 config, ops, hidden_rows):
    """tokens: [R, T] -> (Sampled [1, R + D], hidden states [hidden_rows, T, H] (zeros after R: prompt_step's shape),
    last tokens [S], cache, tables). decode: None, or a mixed step's (tokens [D], sources [D], Batch) of one-token rows.
    Rows ending mid-prompt sample too, on the neutral slot; the host drops theirs."""
    if decode is None:
        hidden, cache = forward(params, tokens, cache, batch, config=config, ops=ops)
    else:
        decode_tokens, sources, decode_batch = decode
        (hidden, decoded), cache = forward(params, (tokens, chained(prev, decode_tokens, sources)), cache,
                                           (batch, decode_batch), config=config, ops=ops)
    last = jnp.take_along_axis(hidden, jnp.maximum(batch.q_lens - 1, 0)[:, None, None], axis=1)[:, 0]
    if decode is not None:
        last = jnp.concatenate([last, decoded])
    out = sample(lm_logits(params, last, ops), sampling, tables, 0, ops=ops)
    hidden = jnp.zeros((hidden_rows, *hidden.shape[1:]), hidden.dtype).at[:hidden.shape[0]].set(hidden)
    return (jax.tree.map(lambda x: x[None], out), hidden, last_tokens(out.tokens, prev.shape[0]), cache,
            tables.count(sampling.slots, out.tokens))


@functools.partial(jax.jit, static_argnames=_STATIC)
def prompt_step(params, tables, hidden, targets, *, config, ops) -> "PromptLogprobs":
    """hidden: [R, T, H], a prefill's; targets: [R, T], the next prompt token where its logprob is wanted, else -1 ->
    PromptLogprobs [R, T](, MAX_LOGPROBS), only on rows with targets. Its own program: its conditional syncs with the
    host (docs/perf_notes.md, "Dispatch and host overhead")."""
    def row(args):
        h, target = args
        logits = lm_logits(params, h, ops) + tables.bias[tables.neutral]  # 0, and -inf past the vocabulary limit
        log_probs = jax.nn.log_softmax(logits, axis=-1)
        top_logprobs, top_ids = jax.lax.top_k(log_probs, MAX_LOGPROBS)
        chosen = jnp.take_along_axis(log_probs, jnp.maximum(target, 0)[:, None], axis=-1)[:, 0]
        return PromptLogprobs(chosen, top_ids.astype(jnp.int32), top_logprobs)

    def none(args):
        t = args[1].shape[0]
        return PromptLogprobs(jnp.zeros(t), jnp.zeros((t, MAX_LOGPROBS), jnp.int32), jnp.zeros((t, MAX_LOGPROBS)))

    return jax.lax.map(lambda args: jax.lax.cond(jnp.any(args[1] >= 0), row, none, args), (hidden, targets))


@functools.partial(jax.jit, static_argnames=(*_STATIC, "num_steps", "spec", "draft", "feed"), donate_argnums=(1, 2))
def decode_step(params, cache, tables, prev, tokens, batch: Batch, sampling: SamplingBatch, row_steps, sources,
                masks=None, *, config, ops, num_steps, spec=None, draft=None, feed=None):
    """num_steps decode steps in one dispatch. tokens: [B], or from prev [S] where sources [B] >= 0 (`chained`); batch:
    the first step's; row_steps: [B], the steps row b takes, after which it writes no KV and counts no token. ->
    (Sampled [num_steps, B], last tokens [S]: row b's step row_steps[b], cache, tables). spec: the same tokens in
    fewer forwards (nanojax.speculative), its stats [3] returned after Sampled. masks: set_masks's arguments, written
    first (constrained rows alone: one dispatch a token, not two); then after Sampled, [num_steps, B] whether each
    draw is the one the row would make unmasked (`unmasked_tokens`: whether its model keeps to its grammar). feed: the
    later steps' masks from the host between steps (nanojax.structured.MaskFeed: a hosted decode)."""
    tokens = chained(prev, tokens, sources)
    if masks is not None:
        tables = set_masks(tables, *masks)
    if feed is not None:  # every step masked, each by the mask the feed gave after the step before
        sampling = sampling.replace(mask_steps=jnp.where(sampling.mask_steps > 0, num_steps, 0))
    shape = (num_steps, tokens.shape[0])
    out = Sampled(jnp.zeros(shape, jnp.int32), jnp.zeros(shape), jnp.zeros((*shape, MAX_LOGPROBS), jnp.int32),
                  jnp.zeros((*shape, MAX_LOGPROBS)))
    agrees = jnp.zeros(shape, jnp.bool_)
    if spec is not None:
        out, cache, tables, stats = speculative_decode(params, cache, tables, tokens, batch, sampling, row_steps, out,
                                                       config=config, ops=ops, spec=spec, draft=draft)
        return out, stats, _last_of(out, row_steps, prev.shape[0]), cache, tables

    def body(i, carry):
        tokens, cache, tables, seq_lens, out, agrees = carry
        active = jnp.where(i < row_steps, batch.q_lens, 0)
        hidden, cache = forward(params, tokens[:, None], cache, batch.replace(seq_lens=seq_lens, q_lens=active),
                                config=config, ops=ops)
        logits = lm_logits(params, hidden[:, 0], ops)
        new = sample(logits, sampling, tables, i, ops=ops)
        out = jax.tree.map(lambda o, n: o.at[i].set(n), out, new)
        if masks is not None:
            agrees = agrees.at[i].set(unmasked_tokens(logits, sampling, tables, i) == new.tokens)
        tables = tables.count(jnp.where(active > 0, sampling.slots, tables.neutral), new.tokens)
        if feed is not None:
            tables = set_masks(tables, masks[0], io_callback(  # (a side effect: the grammars advance)
                feed, jax.ShapeDtypeStruct(masks[1].shape, jnp.int32), new.tokens, i))
        return new.tokens, cache, tables, seq_lens + active, out, agrees

    _, cache, tables, _, out, agrees = jax.lax.fori_loop(0, num_steps, body,
                                                         (tokens, cache, tables, batch.seq_lens, out, agrees))
    last = _last_of(out, row_steps, prev.shape[0])
    return (out, agrees, last, cache, tables) if masks is not None else (out, last, cache, tables)


def _last_of(out: Sampled, row_steps, size: int):
    """Row b's token of step row_steps[b], as `last_tokens` [size]."""
    num_steps, rows = out.tokens.shape
    return last_tokens(out.tokens[jnp.clip(row_steps - 1, 0, num_steps - 1), jnp.arange(rows)], size)


@functools.partial(jax.jit, static_argnames=("step", "layout", "static"), donate_argnums=(1, 2, 3))
def packed_step(params, cache, tables, prev, packed, *, step, layout, static):
    """step(params, cache, tables, prev, *host_args, **static), the host arguments sent as one byte buffer (`pack`'s,
    read by its layout): one host-to-device copy per dispatch (docs/perf_notes.md, "Dispatch and host overhead")."""
    treedef, specs = layout
    leaves, offset = [], 0
    for shape, dtype in specs:
        dtype = np.dtype(dtype)
        size = int(np.prod(shape)) * dtype.itemsize
        raw = packed[offset:offset + size]
        offset += size
        leaves.append(jax.lax.bitcast_convert_type(raw.reshape(-1, dtype.itemsize), dtype).reshape(shape))
    return step(params, cache, tables, prev, *jax.tree.unflatten(treedef, leaves), **dict(static))


def pack(host_args) -> tuple[np.ndarray, tuple]:
    """A pytree of numpy arrays -> ([nbytes] uint8 holding every leaf's bytes, their `layout_of`)."""
    leaves, treedef = jax.tree.flatten(host_args)
    leaves = [np.asarray(x, order="C") for x in leaves]  # (ascontiguousarray would make a 0-d array 1-d)
    return np.concatenate([x.reshape(-1).view(np.uint8) for x in leaves]), layout_of(treedef.unflatten(leaves))


def layout_of(host_args) -> tuple:
    """(treedef, each leaf's shape and dtype) of host_args, which may hold ShapeDtypeStructs (a compiled program's)."""
    leaves, treedef = jax.tree.flatten(host_args)
    return treedef, tuple((tuple(x.shape), np.dtype(x.dtype).str) for x in leaves)


@functools.partial(jax.jit, donate_argnums=(0,))
def _set_slot(tables: TokenTables, slot, counts, flags, bias) -> TokenTables:
    return tables.replace(counts=tables.counts.at[slot].set(counts), flags=tables.flags.at[slot].set(flags),
                          bias=tables.bias.at[slot].set(bias))


@functools.partial(jax.jit, donate_argnums=(0,))
def set_masks(tables: TokenTables, slots, masks) -> TokenTables:
    """slots [M] (out of range: dropped), masks [M, W]: the constraints' next-token bitmasks (TokenTables.allowed)."""
    return tables.replace(allowed=tables.allowed.at[slots].set(masks, mode="drop"))


def _shape(shape: tuple, dtype=jnp.int32) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype)


def _shapes_of(make, sharding):
    """The ShapeDtypeStructs of make()'s arrays, with `sharding`: what a runner given its params' shapes holds."""
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding, weak_type=s.weak_type),
                        jax.eval_shape(make))


def bucket(n: int, buckets: tuple[int, ...]) -> int:
    if n > buckets[-1]:
        raise ValueError(f"{n} is larger than the largest bucket {buckets[-1]}")
    return next(b for b in buckets if n <= b)


def pow2_buckets(hi: int) -> tuple[int, ...]:
    """The powers of two below hi, then hi."""
    return tuple(1 << i for i in range((hi - 1).bit_length())) + (hi,)


# Per-row sampling fields: (dtype, the value a row without a request takes: greedy, no adjustments), the request's
# own (SamplingParams) and the engine's state of the row (slots: the neutral slot, filled in by _sampling_fill).
_SAMPLING_FIELDS = {**DEVICE_FIELDS, "seeds": (np.dtype(np.uint32), 0),
                    **{name: (np.dtype(np.int32), 0) for name in ("counters", "ban_steps", "mask_steps")},
                    "slots": (np.dtype(np.int32), None)}


def checked_row(fields: dict) -> dict:
    """One row's sampling fields as their device dtypes hold them (Python scalars); ValueError naming a field whose
    value does not fit (the engine fails that row's request, not the step)."""
    out = {}
    for name, value in fields.items():
        dtype = _SAMPLING_FIELDS[name][0]
        try:
            with np.errstate(over="ignore", invalid="ignore"):
                cast = np.asarray(value).astype(dtype)
            if not (np.isfinite(cast) and (dtype.kind == "f" or cast == value)):
                raise ValueError
            out[name] = cast.item()
        except (OverflowError, TypeError, ValueError):
            raise ValueError(f"{name}={value!r} does not fit the step's {dtype}") from None
    return out


class PromptLogprobs(NamedTuple):
    """Per prompt position: logprobs [R, T] of the next prompt token, top_ids / top_logprobs [R, T, MAX_LOGPROBS]."""
    logprobs: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array


@dataclasses.dataclass(frozen=True)
class Program:
    """One compiled shape: `rows` rows of decode (num_steps steps) or of packed prefill (num_steps 0); cascade: a
    decode reading shared prefixes once (nanojax.cascade); decode_rows: a mixed step's one-token decode rows;
    speculative: a decode through nanojax.speculative; masked: a decode that writes its rows' constraint masks first;
    hosted: a masked decode of several steps, the later masks from the host (compiled in-process: `hosted_ready`)."""
    rows: int
    num_steps: int
    cascade: bool = False
    decode_rows: int = 0
    speculative: bool = False
    masked: bool = False
    hosted: bool = False


class ModelRunner:
    """Holds params, the KV cache and the token tables on device, and runs padded steps. vocab_limit: ids from it on
    are never drawn (the tokenizer's length: data in the tables, so that no program depends on it). tensor_parallel:
    a nanojax.sharding.TensorParallel. executable_dir: where nanojax.compilation keeps the programs (None: nowhere).
    draft: the draft model's config (speculative "draft_model"), its params under params["draft"]."""

    def __init__(self, config: ModelConfig, engine: EngineConfig, params, *, num_pages: int,
                 vocab_limit: int | None = None, tensor_parallel=None, executable_dir=None,
                 draft: ModelConfig | None = None):
        tp = tensor_parallel
        self.config, self.engine, self.executable_dir = config, engine, executable_dir
        self.vocab_limit = config.vocab_size if vocab_limit is None else vocab_limit
        # What a compile worker needs to build this runner again from the params' shapes (nanojax.compilation).
        self.rebuild_kwargs = dict(engine=engine, num_pages=num_pages, draft=draft)
        self.page_size, self.pages_per_seq, dtype = engine.page_size, engine.pages_per_seq, jnp.dtype(engine.dtype)
        # Params as ShapeDtypeStructs (a compile worker, or keys wanted early): the device state is shapes too.
        shapes_only = all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params))
        if shapes_only and tp is not None:
            raise ValueError("a tensor-parallel runner needs its params")
        build = functools.partial(_shapes_of, sharding=jax.tree.leaves(params)[0].sharding) if shapes_only else (
            lambda make: make())
        ops = get_ops(engine.kernels, config)
        self.ops = ops if tp is None else tp.ops(ops)
        self._inputs_sharding = None if tp is None else tp.replicated  # host inputs: on every device of the mesh
        self.sharded = tp is not None  # not rebuilt from the params' shapes (rebuild_kwargs) by a compile worker
        self.params = params if shapes_only else jax.device_put(params) if tp is None else tp.place(params)
        self.spec, self.draft = engine.speculative_config, draft
        tokens = self.spec is not None  # the cache holds each position's token, for the lookup and the draft's
        self.cache = (build(functools.partial(KVCache.create, config, num_pages, self.page_size, dtype, tokens, draft))
                      if tp is None else tp.create_cache(num_pages, self.page_size, dtype, tokens, draft))
        self.tables = build(lambda: jax.device_put(
            TokenTables.create(engine.max_num_seqs, config.vocab_size, self.vocab_limit), self._inputs_sharding))
        self.decode_rows = pow2_buckets(engine.max_num_seqs)
        self.prefill_rows = pow2_buckets(-(-engine.max_num_batched_tokens // PREFILL_ROW))
        self.decode_steps = engine.decode_steps
        # A mixed step's decode rows: one bucket, the largest, so that mixed steps add one program per prefill bucket
        # (padding rows cost their share of the projections, nothing in attention).
        self.mixed_rows = self.decode_rows[-1]
        # The last tokens a dispatch returns (`last_tokens`): a prefill's R rows and mixed_rows decode rows at most.
        self.last = build(lambda: jax.device_put(np.zeros(self.prefill_rows[-1] + self.mixed_rows, np.int32),
                                                 self._inputs_sharding))
        self.cascade_rules = rules = engine.cascade_rules
        self.cascade_members = cascade_members_per_item(config.num_heads, config.num_kv_heads)
        # Items whose programs fill the SMs twice (two waves beat one with the 64-row tiles: CASCADE_CONFIG).
        self.cascade_wave = 2 * -(-num_sms() // (config.num_kv_heads if tp is None else tp.local_config.num_kv_heads))
        self.cascade_rows = () if rules is None else tuple(b for b in self.decode_rows if b >= rules.min_batch)
        self.cascade_dispatches = self.cascade_saved_tokens = 0  # saved: KV tokens per layer and KV head, all steps
        # The decode buckets that speculate, and the sum of their dispatches' stats (`speculation_stats`).
        self.spec_rows = () if self.spec is None else tuple(b for b in self.decode_rows if b <= SPECULATIVE_MAX_ROWS)
        self.spec_stats, self._spec_pending = np.zeros(3, np.int64), []
        self._compiled: dict[Program, object] = {}
        self.feed, self._hosting = None, None  # a MaskFeed (EngineConfig.hosted_masks); the hosted decode's compile
        self._layouts: dict[Program, tuple] = {}  # the host arrays each program was lowered for (pack's layout)
        self.compiles = self.loaded = 0  # programs compiled, and loaded from the executable cache (`install`)
        self.compile_seconds, self.worker_seconds = {}, []  # where compile_all's time went, and each worker's

    # ----- programs -----
    def programs(self) -> list:
        """Every program the engine runs (masked one-step decodes: for constrained rows alone)."""
        return [Program(b, self.decode_steps) for b in self.decode_rows] + [
            Program(b, 1, masked=True) for b in self.decode_rows] + [
            Program(b, self.decode_steps, True) for b in self.cascade_rows] + [
            Program(b, self.decode_steps, speculative=True) for b in self.spec_rows] + [
            Program(r, 0, decode_rows=d) for r in self.prefill_rows for d in (0, self.mixed_rows)] + [
            "prompt", "set_slot"] + [("set_masks", b) for b in self.decode_rows]

    def missing(self, programs) -> list:
        return [p for p in programs if p not in self._compiled]

    def install(self, p, executable, cached: bool = False) -> None:
        self._compiled[p] = executable
        self.loaded += cached
        self.compiles += not cached

    def _call(self, p) -> tuple:
        """(jitted step, its arguments, its static keywords) of program p; arguments as arrays or shapes. Records a
        Program's layout of host arrays (after params, cache, tables and prev), which _run checks every dispatch."""
        kw = dict(config=self.config, ops=self.ops)
        if p == "set_slot":
            v = (self.config.vocab_size,)
            return _set_slot, (self.tables, np.int32(0), _shape(v), _shape(v, jnp.int8), _shape(v, jnp.float32)), {}
        if isinstance(p, tuple):  # ("set_masks", rows)
            return set_masks, (self.tables, *self._mask_rows(p[1], [], [])), {}
        if p == "prompt":
            r = self.prefill_rows[-1]
            hidden = _shape((r, PREFILL_ROW, self.config.hidden_size), self.params["embed"].dtype)
            return prompt_step, (self.params, self.tables, hidden, _shape((r, PREFILL_ROW))), kw
        tokens = _shape((p.rows,) if p.num_steps else (p.rows, PREFILL_ROW))
        table = np.zeros((p.rows, self.pages_per_seq), np.int32)
        plan = self._plan(p.rows, table[:0], []) if p.cascade else None
        host, rows = (tokens, *self._inputs(p, table, [], [], {}, plan)), _shape((p.rows,))
        if p.num_steps:
            spec = dict(spec=self.spec, draft=self.draft) if p.speculative else {}
            masks = [self._mask_rows(p.rows, [], [])] if p.masked else []
            spec |= {"feed": self.feed} if p.hosted else {}
            fn, kw, host = decode_step, {**kw, "num_steps": p.num_steps, **spec}, (*host, rows, rows, *masks)
        else:
            decode = self._decode_segment(p, [], [], [], []) if p.decode_rows else None
            fn, kw, host = prefill_step, {**kw, "hidden_rows": self.prefill_rows[-1]}, (*host, decode)
        self._layouts[p] = layout_of(host)
        return fn, (self.params, self.cache, self.tables, self.last, *host), kw

    def key_parts(self, p) -> tuple:
        """What program p's executable depends on besides the environment, read without tracing."""
        fn, args, kw = self._call(p)
        return fn.__name__, p, kw, executable_cache.signature(args)

    def lower(self, p) -> jax.stages.Lowered:
        return self.trace(p).lower()

    def trace(self, p) -> jax.stages.Traced:
        """Program p traced as it is dispatched: a Program through packed_step (its layout as _call recorded it)."""
        fn, args, kw = self._call(p)
        if not isinstance(p, Program):
            return fn.trace(*args, **kw)
        layout = self._layouts[p]
        nbytes = sum(int(np.prod(shape)) * np.dtype(dtype).itemsize for shape, dtype in layout[1])
        return packed_step.trace(*args[:4], jax.ShapeDtypeStruct((nbytes,), jnp.uint8), step=fn, layout=layout,
                                 static=tuple(sorted(kw.items())))

    def compiler_options(self, p) -> dict:
        """XLA options for program p on a GPU (CUBLAS_GEMMS, COST_MODEL_TILING, decode_tiling); none on the CPU."""
        if jax.default_backend() != "gpu" or not isinstance(p, Program):
            return {}
        quantized = is_quantized(self.params["layers"][0]["o"])
        if p.rows * (1 if p.num_steps else PREFILL_ROW) + p.decode_rows >= CUBLAS_MIN_ROWS and not quantized:
            return dict(CUBLAS_GEMMS)
        if not p.num_steps:
            return dict(COST_MODEL_TILING)
        return {} if quantized else decode_tiling(p.rows)

    def hosted(self, matcher, row_steps: int) -> int:
        """Starts a hosted decode's feed for one constrained row (row_steps: its own) -> its steps (0: not compiled)."""
        if not self.hosted_ready():
            return 0
        self.feed.start(matcher, row_steps)
        return self.decode_steps

    def hosted_ready(self, wait: bool = False) -> bool:
        """Whether the hosted decode is compiled (after its compile, if `wait`); if not, starts its compile on a thread.
        It compiles in this process: XLA bakes the host callback in, so no worker or executable cache holds it. One
        row only: more rows' masks cost more than the steps they save (docs/perf_notes.md, "Structured outputs")."""
        p = Program(1, self.decode_steps, masked=True, hosted=True)
        if self.feed is None or self.sharded or p in self._compiled:
            return p in self._compiled
        if self._hosting is None:
            self._hosting = threading.Thread(target=self._program, args=(p,), name="nanojax-hosted", daemon=True)
            self._hosting.start()
        if wait:
            self._hosting.join()
        return p in self._compiled

    def _program(self, p):
        if p not in self._compiled:  # lazily, when nanojax.compilation did not compile it ahead (CPU tests)
            self.install(p, self.lower(p).compile(compiler_options=self.compiler_options(p)))
        return self._compiled[p]

    def _run(self, p: Program, tokens: np.ndarray, table: np.ndarray, seq_lens, q_lens, sampling: dict,
             plan: CascadePlan | None = None, extra: tuple = ()) -> list:
        """extra: a decode's row_steps and sources [B], a prefill's decode segment (or None). -> [Sampled] for a
        decode, [Sampled, hidden] for a prefill; `last` becomes its last tokens."""
        packed, layout = pack((tokens, *self._inputs(p, table, seq_lens, q_lens, sampling, plan), *extra))
        program = self._program(p)
        if layout != self._layouts[p]:  # recorded when p was keyed (`key_parts`) or traced
            raise AssertionError(f"program {p} was compiled for other host arrays: {self._layouts[p]} != {layout}")
        if self._inputs_sharding is not None:  # else the program takes the numpy buffer as it is (one device)
            packed = jax.device_put(packed, self._inputs_sharding)
        *outs, self.last, self.cache, self.tables = program(self.params, self.cache, self.tables, self.last, packed)
        return outs

    def _inputs(self, p: Program, table: np.ndarray, seq_lens, q_lens, sampling: dict,
                plan: CascadePlan | None = None) -> tuple[Batch, SamplingBatch]:
        """Host arrays of a step, padded to the program's rows (padding rows: q_len 0, greedy, neutral slot)."""
        batch = Batch(table, _padded(seq_lens, p.rows), _padded(q_lens, p.rows), plan and plan.arrays())
        return batch, sampling_batch(sampling, p.rows + p.decode_rows, self.tables.neutral)

    def _decode_segment(self, p: Program, last_tokens, page_tables, seq_lens, sources) -> tuple:
        """A mixed step's decode rows, padded to p.decode_rows: (tokens [D], sources [D], Batch of one token each)."""
        rows, lens = p.decode_rows, _padded(seq_lens, p.decode_rows)
        table = _stacked(page_tables, rows, self.pages_per_seq)
        return _padded(last_tokens, rows), _padded(sources, rows, -1), Batch(table, lens, (lens > 0).astype(np.int32))

    def _plan(self, rows: int, page_tables, seq_lens) -> CascadePlan:
        return plan_cascade(page_tables, seq_lens, batch=rows, page_size=self.page_size,
                            members_per_item=self.cascade_members, rules=self.cascade_rules,
                            wave_items=self.cascade_wave)

    # ----- steps -----
    def decode(self, last_tokens: list[int], page_tables: list[list[int]], seq_lens: list[int],
               sampling: dict[str, list], num_steps: int = 1, row_steps: list[int] | None = None,
               sources: list[int] | None = None, masks: tuple[list[int], np.ndarray] | None = None) -> "Pending":
        """Dispatches num_steps decode steps (seq_lens counts the last token), of which row b keeps row_steps[b]
        (default: all). sources: per row -1 (its token is last_tokens') or the row of the previous dispatch whose last
        sampled token it takes on the device. Rows sharing prefix pages read them once where the cascade rules say.
        masks: set_masks's arguments for one step of constrained rows, sent with the step's inputs."""
        n = len(last_tokens)
        p = Program(bucket(n, self.decode_rows), num_steps, masked=masks is not None,
                    hosted=masks is not None and num_steps > 1)
        table = _stacked(page_tables, p.rows, self.pages_per_seq)
        plan, mask_inputs = None, ()
        if p.masked:
            mask_inputs = (self._mask_rows(p.rows, *masks),)
        elif num_steps == self.decode_steps and p.rows in self.spec_rows:
            p = dataclasses.replace(p, speculative=True)
        elif num_steps == self.decode_steps and p.rows in self.cascade_rows:
            plan = self._plan(p.rows, table[:len(seq_lens)], seq_lens)
        if plan is not None and plan.use_cascade:
            p = dataclasses.replace(p, cascade=True)
            self.cascade_dispatches += 1
            self.cascade_saved_tokens += plan.saved_tokens * num_steps
        steps = _padded([num_steps] * n if row_steps is None else row_steps, p.rows)
        outs = self._run(p, _padded(last_tokens, p.rows), table, seq_lens, [1] * n, sampling,
                         plan if p.cascade else None, extra=(steps, _padded(sources or (), p.rows, -1), *mask_inputs))
        if p.speculative:
            self._spec_pending.append(outs.pop())
            if len(self._spec_pending) >= 256:  # folded in now and then: a server never asks
                self.speculation_stats()
        out, *agrees = outs
        return Pending(out, agrees=agrees[0] if agrees else None, stops=self.feed.stops if p.hosted else None)

    def speculation_stats(self) -> np.ndarray:
        """[3] int64 since the start: speculative forwards, row-forwards verifying proposals, the tokens those gave."""
        self.spec_stats += np.sum(jax.device_get(self._spec_pending), axis=0, dtype=np.int64)
        self._spec_pending.clear()
        return self.spec_stats.copy()

    def prefill(self, chunks: list[tuple], decodes: tuple | None = None, sources: list[int] | None = None
                ) -> list[tuple["Pending", int]]:
        """Dispatches prompt chunks (tokens, page_table, seq_len after the chunk, sampling fields or None[, targets:
        per token the next prompt token whose logprob is wanted, else -1]) in as few dispatches as the largest bucket
        allows -> each chunk's (Pending, row), its token Pending.tokens()[0, row]. decodes: None, or (last_tokens,
        page_tables, seq_lens, sampling fields) run in the first dispatch, sources as decode's, their rows last."""
        results, batch = [], []
        rows_in = lambda cs: sum(-(-len(c[0]) // PREFILL_ROW) for c in cs)  # noqa: E731
        for chunk in chunks:
            if batch and rows_in(batch + [chunk]) > self.prefill_rows[-1]:
                results += self._prefill_packed(batch, decodes, sources)
                batch, decodes = [], None
            batch.append(chunk)
        return results + self._prefill_packed(batch, decodes, sources)

    def _prefill_packed(self, chunks, decodes=None, sources=None) -> list[tuple["Pending", int]]:
        tokens, tables, lens, row_fields, last_rows, targets = [], [], [], [], [], []
        for ids, table, seq_len, fields, *wanted in chunks:
            if wanted and wanted[0]:  # the chunk's targets, from its first row's first token on
                targets.append((len(tokens) * PREFILL_ROW, wanted[0]))
            for r in range(0, len(ids), PREFILL_ROW):
                tokens.append(ids[r:r + PREFILL_ROW])
                tables.append(table)
                lens.append(seq_len - len(ids) + r + len(tokens[-1]))
                row_fields.append((fields or {}) if r + PREFILL_ROW >= len(ids) else {})  # the chunk's last row samples
            last_rows.append(len(tokens) - 1)
        fills = _sampling_fill(self.tables.neutral)
        sampling = {name: [f.get(name, fill) for f in row_fields] for name, fill in fills.items()}
        p = Program(bucket(max(len(tokens), 1), self.prefill_rows), 0, decode_rows=decodes and self.mixed_rows or 0)
        segment = None
        if decodes:
            last_tokens, page_tables, seq_lens, fields = decodes
            segment = self._decode_segment(p, last_tokens, page_tables, seq_lens, sources or ())
            for name, fill in fills.items():  # the decode rows' sampling fields after the prompt rows' padding
                sampling[name] += [fill] * (p.rows - len(tokens)) + list(fields.get(name, [fill] * len(last_tokens)))
            last_rows += [p.rows + i for i in range(len(last_tokens))]
        sampled, hidden = self._run(p, _stacked(tokens, p.rows, PREFILL_ROW), _stacked(
            tables, p.rows, self.pages_per_seq), lens, [len(t) for t in tokens], sampling, extra=(segment,))
        prompt = None
        if targets:  # (first position in the flattened rows, each target from there) per chunk that wants them
            flat = np.full(self.prefill_rows[-1] * PREFILL_ROW, -1, np.int32)  # prompt_step's rows
            for first, values in targets:
                flat[first:first + len(values)] = values
            prompt = self._program("prompt")(self.params, self.tables, hidden, flat.reshape(-1, PREFILL_ROW))
        pending = Pending(sampled, prompt)
        return [(pending, row) for row in last_rows]

    def release(self, keep: frozenset[int] = frozenset()) -> None:
        """Deletes the device state, the params but those whose buffer addresses are in `keep`, and the programs."""
        arrays = [x for x in jax.tree.leaves((self.cache, self.tables, self.last, self.params))
                  if isinstance(x, jax.Array) and not x.is_deleted()]
        jax.block_until_ready(arrays)  # a step still running holds them: their memory is free once this returns
        for x in arrays:
            if not buffer_addresses(x) & keep:
                x.delete()
        self._compiled.clear()

    def set_slot(self, slot: int, counts: np.ndarray, flags: np.ndarray, bias: np.ndarray) -> None:
        """Writes one request's token tables ([V] each) into `slot`, queued before the next step."""
        self.tables = self._program("set_slot")(self.tables, np.int32(slot), counts, flags,
                                                limited_bias(bias, self.vocab_limit))

    def set_masks(self, slots: list[int], masks: np.ndarray) -> None:
        """Writes constraints' next-token bitmasks (masks [M, <= W] int32, zeros after) into their slots."""
        rows = bucket(len(slots), self.decode_rows)
        self.tables = self._program(("set_masks", rows))(self.tables, *self._mask_rows(rows, slots, masks))

    def _mask_rows(self, rows: int, slots: list[int], masks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """set_masks's arguments padded to rows (padding rows' slot out of range: dropped)."""
        return _padded(slots, rows, self.tables.neutral + 1), _stacked(masks, rows, self.tables.allowed.shape[1])


def buffer_addresses(tree) -> frozenset[int]:
    """The addresses of the device buffers under tree's jax.Arrays."""
    return frozenset(shard.data.unsafe_buffer_pointer() for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)
                     for shard in x.addressable_shards)


class Pending:
    """A dispatched step's results on device: the host goes on while the GPU computes, and waits when it reads them."""

    def __init__(self, out: Sampled, prompt: PromptLogprobs | None = None, agrees=None, stops=None):
        self._out, self._prompt, self._tokens, self._logprobs, self._agrees = out, prompt, None, None, agrees
        self.stops = stops  # a hosted decode's MaskFeed.stops (complete once its tokens are read)

    def tokens(self) -> np.ndarray:
        """-> [num_steps, rows] int32 (waits for the step; copied to the host once)."""
        if self._tokens is None:
            self._tokens, self._agrees = jax.device_get((self._out.tokens, self._agrees))
        return self._tokens

    def agrees(self) -> np.ndarray | None:
        """A masked step's [num_steps, rows] bools: each draw is the one its row would make unmasked; else None."""
        self.tokens()
        return self._agrees

    def logprobs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """-> (logprobs [num_steps, rows], top_ids and top_logprobs [num_steps, rows, MAX_LOGPROBS]), fetched once."""
        if self._logprobs is None:
            self._logprobs = jax.device_get((self._out.logprobs, self._out.top_ids, self._out.top_logprobs))
        return self._logprobs

    def prompt_logprobs(self, last_row: int, num_tokens: int) -> PromptLogprobs:
        """The PromptLogprobs [num_tokens](, MAX_LOGPROBS) of the chunk packed up to row last_row, fetched once."""
        if not isinstance(self._prompt.logprobs, np.ndarray):
            self._prompt = jax.device_get(self._prompt)
        rows = slice(last_row + 1 - -(-num_tokens // PREFILL_ROW), last_row + 1)
        return PromptLogprobs(*(x[rows].reshape(-1, *x.shape[2:])[:num_tokens] for x in self._prompt))


def _padded(values, rows: int, fill=0, dtype=np.int32) -> np.ndarray:
    """[rows]: values, then fill."""
    out = np.full(rows, fill, dtype)
    out[:len(values)] = values
    return out


def _stacked(lists, rows: int, width: int) -> np.ndarray:
    """[rows, width] int32: each of `lists`, zeros after it and on the rows after them."""
    out = np.zeros((rows, width), np.int32)
    for i, values in enumerate(lists):
        out[i, :len(values)] = values
    return out


def sampling_batch(fields: dict[str, list], rows: int, neutral_slot: int) -> SamplingBatch:
    """Per-row sampling fields (of the first rows; absent fields and the rows after: the fill values) -> numpy."""
    return SamplingBatch(**{name: _padded(fields.get(name, ()), rows, fill, _SAMPLING_FIELDS[name][0])
                            for name, fill in _sampling_fill(neutral_slot).items()})


def _sampling_fill(neutral_slot: int) -> dict:
    return {name: neutral_slot if name == "slots" else fill for name, (_, fill) in _SAMPLING_FIELDS.items()}


def greedy_sampling(rows: int, neutral_slot: int) -> dict[str, list]:
    """Sampling fields for `rows` greedy rows with no adjustments, on the neutral token-table slot (benchmarks)."""
    return {name: [fill] * rows for name, fill in _sampling_fill(neutral_slot).items()}
