"""A request's sampled tokens -> the tokens kept under its stops, logprobs, text and events (on the loop's thread)."""
import dataclasses
import time

import numpy as np

from nanojax.engine_io import RequestOutput, RequestStream, find_stop
from nanojax.runner import checked_row
from nanojax.sampling import BANNED, PROMPT
from nanojax.sampling_params import SamplingParams
from nanojax.sequence import Sequence
from nanojax.structured import Grammars

# Masked draws in a row that a constrained request's model would have drawn unmasked, after which it runs ahead alone.
RUN_AHEAD_AFTER = 4


@dataclasses.dataclass
class Request:
    """One choice of a request, as the engine loop tracks it (Sequence.request)."""
    output: RequestOutput
    params: SamplingParams
    stop_ids: frozenset[int]
    stream: RequestStream
    start: float
    detok: "Detokenizer | None" = None
    emitted_text: str = ""
    pin: bool = False  # pin the prompt's full pages when the request finishes (`LLM.pin_prefix`) ...
    pin_handle: int | None = None  # ... under this page-manager handle
    cut: bool = False  # a stop string ended it: its text is cut there
    stream_tokens: bool = False  # streamed without a tokenizer: an event for every step's new tokens
    slot: int | None = None  # its row of the runner's token tables, while it runs (bias, penalties, min_tokens, mask)
    matcher: object = None  # its structured output's llguidance matcher, at the tokens accepted so far
    agreed: int = 0  # its last masked draws in a row that its model would have drawn unmasked (`run_ahead`)
    device_row: dict | None = None  # its sampling fields as the step's dtypes hold them (sampling_row)
    siblings: list[Sequence["Request"]] = dataclasses.field(default_factory=list)  # n > 1: admitted once cached

    def sampling_row(self, generated: int, neutral_slot: int) -> dict:
        """Its sampling fields after `generated` tokens; its own cast once (checked_row: a misfit fails it alone)."""
        p = self.params
        if self.device_row is None:
            self.device_row = checked_row(dict(p.device_values(), seeds=p.seed))
        slot = neutral_slot if self.slot is None else self.slot
        return dict(self.device_row, counters=generated, slots=slot, ban_steps=max(0, p.min_tokens - generated),
                    mask_steps=int(self.matcher is not None))

    @property
    def run_ahead(self) -> bool:
        """Whether, alone, it takes the multi-step dispatch (its later draws kept while its grammar allows them): its
        model has kept to its grammar for its last RUN_AHEAD_AFTER masked draws (docs/perf_notes.md, "Structured
        outputs: masks in the engine")."""
        return self.speculative_constraint and self.agreed >= RUN_AHEAD_AFTER

    @property
    def speculative_constraint(self) -> bool:
        """Whether tokens drawn after its masked first one may be kept where its grammar allows them: it draws them
        as a masked draw would (no filter to apply after the mask, no penalty counting them on the device)."""
        p = self.params
        return p.top_k == 0 and p.top_p == 1 and p.min_p == 0 and not p.penalized

    def table_rows(self, vocab: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Its token-table rows: (token counts, PROMPT / BANNED flags, logit bias), each [vocab]."""
        counts = np.bincount(np.asarray(self.output.token_ids, np.int64), minlength=vocab).astype(np.int32)
        flags = np.zeros(vocab, np.int8)
        flags[self.output.prompt_token_ids] |= PROMPT
        flags[[t for t in self.stop_ids if t < vocab]] |= BANNED
        bias, logit_bias = np.zeros(vocab, np.float32), self.params.logit_bias or {}
        bias[list(logit_bias)] = list(logit_bias.values())
        return counts, flags, bias


class OutputProcessor:
    """Builds requests and turns their sampled tokens into text and events (tokenizer None: token ids only)."""

    def __init__(self, tokenizer, max_model_len: int, eos_ids, seed: int):
        self.tokenizer, self.max_model_len, self.eos_ids = tokenizer, max_model_len, frozenset(eos_ids)
        self.grammars = Grammars(tokenizer)
        self._rng = np.random.default_rng(seed)  # draws the seeds of requests that bring none

    def sequences(self, ids: list[int], params: SamplingParams, request_id: str, index: int, stream: RequestStream,
                  stream_text: bool) -> Sequence[Request]:
        """A validated request's first choice; the others are its siblings, sharing its prompt logprobs."""
        stream.expect(params.n)
        seqs = [self._sequence(ids, params, request_id, index, choice, stream, stream_text)
                for choice in range(params.n)]
        seqs[0].request.siblings = seqs[1:]
        for sibling in seqs[1:]:  # one list of prompt logprobs, filled by the first choice's prefill
            sibling.request.output.prompt_logprobs = seqs[0].request.output.prompt_logprobs
        return seqs[0]

    def _sequence(self, ids, params, request_id, index, choice, stream, stream_text) -> Sequence[Request]:
        seed = params.seed + choice if params.seed is not None else int(self._rng.integers(2**32))
        params = dataclasses.replace(params, seed=seed % 2**32)
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_ids)
        detok = Detokenizer(self.tokenizer) if self.tokenizer and (stream_text or params.stop) else None
        out = RequestOutput(index, list(ids), [], "", None, request_id=request_id, choice=choice,
                            logprobs=[] if params.logprobs is not None else None,
                            prompt_logprobs=None if params.prompt_logprobs is None else [None] * len(ids))
        req = Request(out, params, stop_ids, stream, time.perf_counter(), detok,
                      stream_tokens=stream_text and self.tokenizer is None,
                      matcher=params.structured_outputs and self.grammars.matcher(params.structured_outputs))
        # The first choice computes the prompt's logprobs; the others, admitted once its pages are committed, find
        # it cached. It ends at max_tokens or max_model_len tokens, and samples one token whatever the prompt's length.
        limit = max(len(ids) + 1, min(len(ids) + params.max_tokens, self.max_model_len))
        return Sequence(ids, request=req, reads_prefix_cache=params.prompt_logprobs is None or choice > 0,
                        max_num_tokens=limit)

    def accept(self, seq: Sequence[Request], pending, row: int, num_steps: int) -> list[int]:
        """The row's first num_steps tokens as far as the request keeps them; sets finish_reason at a stop."""
        req = seq.request
        out, known = req.output, seq.num_known
        kept, tokens = [], pending.tokens()[:num_steps, row].tolist()
        hosted = pending.stops is not None  # its grammar took the tokens during the dispatch (MaskFeed)
        grammar_end, refusal = pending.stops.get(row, (None, None)) if hosted else (None, None)
        if refusal:
            raise RuntimeError(f"request {out.request_id}: {refusal}")
        for tok in tokens:
            if req.matcher is not None and not hosted and not req.matcher.try_consume_tokens([tok]):
                if kept:  # a draw after the masked one that the grammar does not allow: drawn again, masked
                    break
                raise RuntimeError(f"request {out.request_id}: its grammar rejects token {tok}, which its mask "
                                   f"allowed ({req.matcher.get_error()})")
            kept.append(tok)
            out.token_ids.append(tok)
            if out.time_to_first_token is None:
                out.time_to_first_token = time.perf_counter() - req.start
            if (tok in req.stop_ids and len(out.token_ids) > req.params.min_tokens) or (req.matcher is not None and (
                    len(kept) == grammar_end if hosted else req.matcher.is_stopped())):
                out.finish_reason = "stop"
            elif len(out.token_ids) >= req.params.max_tokens or known + len(kept) >= self.max_model_len:
                out.finish_reason = "length"
            if out.finish_reason:
                break
        if req.matcher is not None:
            agrees = pending.agrees()
            if agrees is not None:  # a masked dispatch (one step, or hosted: its draws in turn)
                for agreed in agrees[:len(kept), row]:
                    req.agreed = req.agreed + 1 if agreed else 0
            elif len(kept) < num_steps and not out.finish_reason:  # its grammar cut the draws after the masked one
                req.agreed = 0
        if req.params.logprobs is not None:
            logprobs, top_ids, top_logprobs = pending.logprobs()
            for step in range(len(kept)):
                out.logprobs.append(logprob_entry(logprobs[step, row], top_ids[step, row], top_logprobs[step, row],
                                                  req.params.logprobs))
        return kept

    @staticmethod
    def accept_prompt_logprobs(c, pending, last_row: int) -> None:
        """Fills prompt_logprobs for the positions after chunk c's (a recomputed chunk fills the same values again)."""
        req: Request = c.seq.request
        p = pending.prompt_logprobs(last_row, c.end - c.start)
        for i, pos in enumerate(range(c.start, min(c.end, c.seq.num_prompt_tokens - 1))):
            req.output.prompt_logprobs[pos + 1] = logprob_entry(p.logprobs[i], p.top_ids[i], p.top_logprobs[i],
                                                                req.params.prompt_logprobs)

    def update_text(self, req: Request) -> None:
        """Brings the request's text up to its tokens, and ends it at a stop string."""
        out, stop = req.output, req.params.stop
        if req.detok is None:
            return
        before = len(out.text)
        out.text = req.detok.update(out.token_ids)
        if find_stop(out.text, stop, max(0, before - max(map(len, stop), default=0))) >= 0:
            # A multi-step decode samples past the token that completed the stop string: drop what follows it,
            # so the output is the same whatever decode_steps is.
            while len(out.token_ids) > 1 and find_stop(self.text(out.token_ids[:-1]), stop) >= 0:
                out.token_ids.pop()
                if out.logprobs:
                    out.logprobs.pop()
            text = self.text(out.token_ids)
            out.text, out.finish_reason, req.cut = text[:find_stop(text, stop)], "stop", True

    def event(self, seq: Sequence[Request]) -> RequestOutput | None:
        """The event for the last step's new tokens, built before the next is accepted (None: nothing visible new)."""
        req = seq.request
        out, stop = req.output, req.params.stop
        if out.finish_reason and self.tokenizer is not None and not req.cut:
            out.text = self.text(out.token_ids)  # the whole text decoded once, as a fresh decode gives it
        out.num_cached_tokens = seq.num_cached_tokens
        stable = out.text if out.finish_reason else out.text.rstrip("\ufffd")
        if stop and not out.finish_reason:  # hold back what may be the start of a stop string
            stable = stable[:max(0, len(stable) - max(map(len, stop)) + 1)]
        out.delta, req.emitted_text = stable[len(req.emitted_text):], stable
        if not out.delta and out.finish_reason is None and req.params.logprobs is None and not req.stream_tokens:
            return None
        return dataclasses.replace(out, token_ids=list(out.token_ids), text=stable,
                                   logprobs=None if out.logprobs is None else list(out.logprobs))

    def text(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)


class Detokenizer:
    """Text of a growing token list, each update decoding only its last few tokens (not the whole text again), appended
    once it no longer ends in an incomplete character (U+FFFD). Decoding from the previous update's tokens on (as vLLM
    does) keeps right the tokenizers that strip a leading space."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.prefix_offset = self.read_offset = 0
        self.text = ""

    def update(self, token_ids: list[int]) -> str:
        prefix = self._decode(token_ids[self.prefix_offset:self.read_offset])
        new = self._decode(token_ids[self.prefix_offset:])
        if len(new) > len(prefix) and not new.endswith("\ufffd"):
            self.text += new[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(token_ids)
        return self.text

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True) if token_ids else ""


def logprob_entry(logprob, top_ids, top_logprobs, n: int) -> tuple[float, dict[int, float]]:
    """A token's (logprob, {token id: logprob} of the n most likely); top_ids, top_logprobs: [MAX_LOGPROBS]."""
    return float(logprob), {int(i): float(v) for i, v in zip(top_ids[:n], top_logprobs[:n])}


def prompt_targets(c) -> list[int] | None:
    """The prompt token after each of the chunk's positions, -1 past it; None unless it computes prompt logprobs."""
    seq = c.seq
    if seq.request.params.prompt_logprobs is None or seq.reads_prefix_cache:
        return None
    last = seq.num_prompt_tokens - 1
    return [seq.token_ids[pos + 1] if pos < last else -1 for pos in range(c.start, c.end)]
