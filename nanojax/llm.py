"""The public engine: `LLM(model).generate(prompts, SamplingParams(...))`, streaming and chat.

Each step the scheduler picks what to compute (decodes first, then prefill chunks under the token budget); the
runner dispatches it as compiled steps; here the sampled tokens are checked against the stop conditions. The host
builds and streams the previous step's text while the GPU computes the next one: a step is dispatched, then the
previous step's events are yielded, then the step's tokens are fetched.
"""
import dataclasses
import time
from typing import Iterable, Iterator

import jax
import numpy as np
from tqdm import tqdm

from nanojax.block_manager import BlockManager
from nanojax.loader import LoadedModel, load_model
from nanojax.ops import get_ops
from nanojax.runner import ModelRunner
from nanojax.sampling import PAD_ID, SamplingMode
from nanojax.sampling_params import SamplingParams
from nanojax.scheduler import Scheduler, SchedulerConfig
from nanojax.sequence import Sequence


@dataclasses.dataclass
class RequestOutput:
    index: int  # position of the prompt in the call
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated tokens (a stop token included)
    text: str  # generated text, special tokens skipped, a stop string cut off (streamed: the deltas so far)
    finish_reason: str | None  # "stop" | "length" | None while running
    delta: str = ""  # text added since the previous streamed event
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    time_to_first_token: float | None = None


@dataclasses.dataclass
class _Request:
    output: RequestOutput
    params: SamplingParams
    stop_ids: frozenset[int]
    start: float
    emitted_text: str = ""
    pin: bool = False  # pin the prompt's full pages when the request finishes (`LLM.pin_prefix`) ...
    pin_handle: int | None = None  # ... under this block-manager handle

    def seen_counts(self) -> dict[int, int]:
        """Every token of prompt and output -> its count in the output (for the penalties)."""
        counts = dict.fromkeys(self.output.prompt_token_ids, 0)
        for t in self.output.token_ids:
            counts[t] = counts.get(t, 0) + 1
        return counts


def _ragged(rows: list[list[tuple[int, float]]], value_dtype=np.int32) -> tuple[np.ndarray, np.ndarray]:
    """Per-row (token id, value) lists -> ([B, W] ids padded with PAD_ID, [B, W] values); W a power of two so
    the compiled step sees few shapes."""
    width = 1 << (max(1, max(len(r) for r in rows)) - 1).bit_length()
    ids = np.full((len(rows), width), PAD_ID, np.int32)
    values = np.zeros((len(rows), width), value_dtype)
    for i, r in enumerate(rows):
        if r:
            ids[i, :len(r)], values[i, :len(r)] = zip(*r)
    return ids, values


class LLM:
    """An inference engine over one model.

    model: a nanojax checkpoint folder, an HF folder, an 'org/name' in the local HF cache, a .gguf file, None
    for the embedded default (SmolLM2-135M-Instruct), or a `LoadedModel` already in memory.
    dtype: "bfloat16" (default on GPU) or "float32" (default on CPU).
    num_pages: KV pages in the pool; None sizes it from free device memory (`memory_fraction`).
    decode_steps: decode steps run on device per dispatch when a step is decode-only. None: 32 on GPU (on the H100,
    batch 1 ran at 2.27 / 1.72 / 1.43 / 1.33 / 1.28 ms per step with 4 / 8 / 16 / 32 / 64; docs/benchmarks.md),
    8 on CPU, where a step takes ~65 ms and text streams in bursts of decode_steps tokens (the default model,
    2 cores: 13.9 tok/s and 0.6 s between streamed events at 8, 15.8 tok/s and 2.1 s at 32).
    kernels: "reference" (jnp), "pallas", "interpret" (the Pallas kernels interpreted, for CPU tests), or "auto"
    (the Pallas kernels on a GPU where the model's shapes allow them).
    """

    def __init__(self, model: "str | LoadedModel | None" = None, *, dtype: str | None = None,
                 max_model_len: int | None = None, page_size: int = 16, num_pages: int | None = None,
                 memory_fraction: float = 0.85,
                 max_num_seqs: int = 64, max_num_batched_tokens: int | None = None, chunk_size: int | None = None,
                 decode_steps: int | None = None, kernels: str = "auto", seed: int = 0):
        on_gpu = jax.default_backend() == "gpu"
        self.dtype = dtype or ("bfloat16" if on_gpu else "float32")
        loaded = load_model(model, self.dtype)
        self.config, params, self.tokenizer = loaded.config, loaded.params, loaded.tokenizer
        self.max_model_len = min(max_model_len or 4096, self.config.max_position_embeddings)
        if max_model_len and max_model_len > self.config.max_position_embeddings:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's max_position_embeddings="
                             f"{self.config.max_position_embeddings}")
        decode_steps = (32 if on_gpu else 8) if decode_steps is None else decode_steps
        if decode_steps < 1:
            raise ValueError(f"decode_steps must be >= 1, got {decode_steps}")
        self.decode_steps = decode_steps
        max_num_batched_tokens = max_num_batched_tokens or max(2048, self.max_model_len)
        pages_per_seq = -(-self.max_model_len // page_size)
        if num_pages is None:
            num_pages = self._pages_that_fit(page_size, memory_fraction, max_num_seqs * pages_per_seq)
        vocab_limit = min(len(self.tokenizer), self.config.vocab_size) if self.tokenizer else self.config.vocab_size
        self.runner = ModelRunner(
            self.config, params, num_pages=num_pages, page_size=page_size, pages_per_seq=pages_per_seq,
            dtype=params["embed"].dtype, ops=get_ops(kernels, self.config), vocab_limit=vocab_limit,
            max_num_seqs=max_num_seqs,
            max_tokens_per_row=min(max_num_batched_tokens, chunk_size or self.max_model_len, self.max_model_len))
        self.block_manager = BlockManager(num_pages, page_size)
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=self.max_model_len, chunk_size=chunk_size, block_size=page_size), self.block_manager)
        self.eos_ids = frozenset(self.config.eos_token_ids)
        self._rng = np.random.default_rng(seed)

    def _pages_that_fit(self, page_size: int, fraction: float, wanted: int) -> int:
        c = self.config
        itemsize = np.dtype(self.dtype).itemsize if self.dtype != "bfloat16" else 2
        page_bytes = 2 * c.num_layers * c.num_kv_heads * page_size * c.head_dim * itemsize
        stats = jax.devices()[0].memory_stats() or {}
        if "bytes_limit" in stats:
            budget = stats["bytes_limit"] * fraction - stats.get("bytes_in_use", 0)
        else:  # CPU: no allocator limit to read, keep the pool modest
            budget = 2 << 30
        return int(max(1, min(wanted, budget // page_bytes)))

    def warmup(self, sampled: bool = True) -> None:
        """Compile every step shape now (greedy, and random sampling unless sampled=False), not on first use."""
        modes = [SamplingMode(random=False, filtered=False, adjusted=False)]
        if sampled:
            modes.append(SamplingMode(random=True, filtered=False, adjusted=False))
        self.runner.warmup(self.decode_steps, modes)

    # ----- requests -----
    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this checkpoint has no tokenizer: pass prompts as lists of token ids")
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("empty prompt")
        if min(ids) < 0 or max(ids) >= self.config.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.config.vocab_size}), got {min(ids)}..{max(ids)}")
        return ids

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        if self.tokenizer is None or not self.tokenizer.chat_template:
            raise ValueError("this model's tokenizer has no chat template")
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False)

    # ----- pinned prefixes -----
    def pin_prefix(self, prompt: str | list[int]) -> int:
        """Computes the prompt's KV once and pins its full pages (len(prompt) // page_size of them): every later
        request that starts with this prompt, and is longer than the pinned pages, reuses them
        (RequestOutput.num_cached_tokens), however much else is evicted meanwhile. Returns a handle for `unpin`.
        """
        ids = self.encode(prompt)
        page_size = self.block_manager.block_size
        if len(ids) < page_size:
            raise ValueError(f"the prefix has {len(ids)} tokens, less than one KV page ({page_size} tokens): "
                             "nothing to pin")
        added = []  # one request with max_tokens=1: the prefill computes the KV, the pin is taken as it finishes
        once = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        for _ in self._run(lambda: added.append(self._add(0, ids, once, pin=True)), stream_text=False):
            pass
        return added[0].pin_handle

    def unpin(self, handle: int) -> None:
        """Releases a pinned prefix: its pages become ordinary cached pages, evicted under memory pressure."""
        self.block_manager.unpin(handle)

    def _add(self, index: int, prompt_ids: list[int], params: SamplingParams, pin: bool = False) -> _Request:
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"prompt {index} has {len(prompt_ids)} tokens; max_model_len={self.max_model_len} "
                             "leaves no room to generate")
        total = min(len(prompt_ids) + params.max_tokens, self.max_model_len)
        pages = -(-total // self.block_manager.block_size)
        if pages > self.block_manager.num_blocks:
            raise ValueError(f"prompt {index} needs up to {pages} KV pages ({total} tokens) but the pool has only "
                             f"{self.block_manager.num_blocks}: lower max_tokens or raise num_pages")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer, and this checkpoint has none: use stop_token_ids")
        if params.seed is None:
            params = dataclasses.replace(params, seed=int(self._rng.integers(2**32)))
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_ids)
        request = _Request(RequestOutput(index, prompt_ids, [], "", None), params, stop_ids, time.perf_counter(),
                           pin=pin)
        self.scheduler.add(Sequence(prompt_ids, params=request))
        return request

    # ----- the loop -----
    def stream(self, prompts: Iterable[str | list[int]],
               sampling_params: SamplingParams | list[SamplingParams] | None = None) -> Iterator[RequestOutput]:
        """Runs the prompts together; yields a RequestOutput each time a request gains text or finishes."""
        return self._run_requests(prompts, sampling_params, stream_text=True)

    def _run_requests(self, prompts, sampling_params, stream_text: bool) -> Iterator[RequestOutput]:
        """stream_text=False detokenizes a request only when it finishes (or to look for its stop strings)."""
        prompts = list(prompts)
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        ids = [self.encode(p) for p in prompts]
        yield from self._run(lambda: [self._add(i, p, sp) for i, (p, sp) in enumerate(zip(ids, params))],
                             stream_text)

    def _run(self, add, stream_text: bool) -> Iterator[RequestOutput]:
        """Runs the requests `add()` queues until all finish. If the caller stops early (a stream closed, an
        error) they are aborted, so they never run inside a later call."""
        if self.scheduler.has_unfinished():
            raise RuntimeError("the engine is still running another stream's requests: exhaust or close it first")
        try:
            add()
            sampled = []  # the sequences that gained tokens in the previous step; their events are not built yet
            while self.scheduler.has_unfinished():
                pending = self._dispatch()
                # While the GPU computes this step, the host detokenizes and streams the previous one.
                yield from self._events(sampled, stream_text)
                sampled = self._complete(*pending)
            yield from self._events(sampled, stream_text)
        finally:
            for seq in [*self.scheduler.running, *self.scheduler.waiting]:
                self.scheduler.finish(seq)

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Outputs in prompt order. A single prompt (str or token-id list) may be passed as is."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        done: dict[int, RequestOutput] = {}
        with tqdm(total=len(prompts), desc="generating", disable=not use_tqdm) as bar:
            for out in self._run_requests(prompts, sampling_params, stream_text=False):
                if out.finish_reason is not None:
                    done[out.index] = out
                    bar.update(1)
        return [done[i] for i in range(len(prompts))]

    def _dispatch(self):
        """Schedules a step and dispatches all of its computations: the decodes in one call, each prefill chunk
        in its own, all queued on the GPU back to back. -> (chunks, {seq_id: (runner.Pending, row)})."""
        # The penalties count the output so far, so their requests decode one step per dispatch.
        penalized = any(seq.params.params.penalized for seq in self.scheduler.running)
        chunks = self.scheduler.schedule(decode_steps=1 if penalized else self.decode_steps)
        pending = {}
        decodes = [c for c in chunks if c.num_tokens == 1 and c.sample]
        if decodes:  # num_steps > 1 only in a decode-only step
            arrays, mode = self._sampling_arrays(decodes)
            out = self.runner.decode([c.seq.token_ids[c.start] for c in decodes], [c.seq.block_table for c in decodes],
                                     [c.end for c in decodes], arrays, mode, decodes[0].num_steps)
            pending.update({c.seq.seq_id: (out, i) for i, c in enumerate(decodes)})
        for c in chunks:  # prefill chunks one row each, so their shapes stay [1, T]
            if not (c.num_tokens == 1 and c.sample):
                arrays, mode = self._sampling_arrays([c])
                out = self.runner.prefill(c.seq.token_ids[c.start:c.end], c.seq.block_table, c.end, arrays, mode)
                if c.sample:  # a chunk that ends mid-prompt samples nothing: its result is never fetched
                    pending[c.seq.seq_id] = (out, 0)
        return chunks, pending

    def _complete(self, chunks, pending) -> list[Sequence]:
        """Waits for the step's tokens, applies the stop conditions and frees finished requests (before the next
        step is scheduled). -> the sequences that gained tokens."""
        sampled = {seq_id: out.get()[:, row].tolist() for seq_id, (out, row) in pending.items()}
        accepted = {c.seq.seq_id: self._accept(c.seq, sampled[c.seq.seq_id]) for c in chunks if c.sample}
        self.scheduler.update(chunks, accepted)
        seqs = [c.seq for c in chunks if c.sample]
        for seq in seqs:
            self._apply_stop_strings(seq)
            req: _Request = seq.params
            if req.output.finish_reason is not None:
                if req.pin:
                    req.pin_handle = self.block_manager.pin_blocks(seq, len(req.output.prompt_token_ids))
                self.scheduler.finish(seq)
        return seqs

    def _events(self, seqs: list[Sequence], stream_text: bool) -> list[RequestOutput]:
        return [e for e in (self._event(seq, stream_text) for seq in seqs) if e is not None]

    def _sampling_arrays(self, chunks) -> tuple[dict[str, np.ndarray], SamplingMode]:
        reqs: list[_Request] = [c.seq.params for c in chunks]
        params = [r.params for r in reqs]
        generated = [len(r.output.token_ids) for r in reqs]
        banned = [sorted(r.stop_ids) if p.min_tokens > n else [] for r, p, n in zip(reqs, params, generated)]
        bias = [sorted((p.logit_bias or {}).items()) for p in params]
        seen = [sorted(r.seen_counts().items()) if p.penalized else [] for r, p in zip(reqs, params)]
        mode = SamplingMode(random=any(p.temperature > 0 for p in params),
                            filtered=any(p.top_k > 0 or p.top_p < 1 or p.min_p > 0 for p in params),
                            adjusted=any(bias) or any(p.penalized for p in params))
        arrays = {
            "temperature": np.array([p.temperature for p in params], np.float32),
            "top_k": np.array([p.top_k for p in params], np.int32),
            "top_p": np.array([p.top_p for p in params], np.float32),
            "min_p": np.array([p.min_p for p in params], np.float32),
            "seeds": np.array([p.seed for p in params], np.uint32),
            "counters": np.array(generated, np.int32),
            "banned_ids": _ragged([[(i, 0) for i in b] for b in banned])[0],
            "ban_steps": np.array([max(0, p.min_tokens - n) for p, n in zip(params, generated)], np.int32),
            "repetition_penalty": np.array([p.repetition_penalty for p in params], np.float32),
            "presence_penalty": np.array([p.presence_penalty for p in params], np.float32),
            "frequency_penalty": np.array([p.frequency_penalty for p in params], np.float32),
        }
        arrays["bias_ids"], arrays["bias_values"] = _ragged(bias, np.float32)
        arrays["seen_ids"], arrays["seen_counts"] = _ragged(seen, np.int32)
        return arrays, mode

    def _accept(self, seq: Sequence, new_tokens: list[int]) -> list[int]:
        """The prefix of new_tokens the request keeps; marks it finished when a stop condition is met."""
        req: _Request = seq.params
        out = req.output
        kept = []
        for tok in new_tokens:
            kept.append(tok)
            out.token_ids.append(tok)
            if out.time_to_first_token is None:
                out.time_to_first_token = time.perf_counter() - req.start
            if tok in req.stop_ids and len(out.token_ids) > req.params.min_tokens:
                out.finish_reason = "stop"
            elif len(out.token_ids) >= req.params.max_tokens or seq.num_tokens + len(kept) >= self.max_model_len:
                out.finish_reason = "length"
            if out.finish_reason:
                break
        return kept

    def _apply_stop_strings(self, seq: Sequence) -> None:
        req: _Request = seq.params
        out, stop = req.output, req.params.stop
        if not stop:  # (stop strings come with a tokenizer: `_add` checks)
            return
        out.text = self._text(out.token_ids)
        if _find_stop(out.text, stop) >= 0:
            # A multi-step decode samples past the token that completed the stop string: drop what follows it,
            # so the output is the same whatever decode_steps is.
            while len(out.token_ids) > 1 and _find_stop(self._text(out.token_ids[:-1]), stop) >= 0:
                out.token_ids.pop()
            out.text = self._text(out.token_ids)
            out.text, out.finish_reason = out.text[:_find_stop(out.text, stop)], "stop"

    def _event(self, seq: Sequence, stream_text: bool) -> RequestOutput | None:
        """The request's event for the tokens it gained in its last step (None if its visible text did not
        change); run before the request's next step is accepted."""
        req: _Request = seq.params
        out, stop = req.output, req.params.stop
        if self.tokenizer is not None and not stop and (stream_text or out.finish_reason):
            out.text = self._text(out.token_ids)  # (with stop strings, _apply_stop_strings set it)
        out.num_cached_tokens = seq.num_cached_tokens
        stable = out.text if out.finish_reason else out.text.rstrip("\ufffd")
        if stop and not out.finish_reason:  # hold back what may be the start of a stop string
            stable = stable[:max(0, len(stable) - max(map(len, stop)) + 1)]
        out.delta, req.emitted_text = stable[len(req.emitted_text):], stable
        if not out.delta and out.finish_reason is None:
            return None
        return dataclasses.replace(out, token_ids=list(out.token_ids), text=stable)

    def _text(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)


def _find_stop(text: str, stop: tuple[str, ...]) -> int:
    """Where the first stop string found in text starts, or -1."""
    return min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
