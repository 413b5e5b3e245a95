"""Structured outputs: a request's constraint (a JSON schema, any JSON object, a regular expression, a choice among
strings, or a Lark grammar) as an llguidance grammar, checked on construction (docs/perf_notes.md, "Structured
outputs: the token-mask library")."""
import collections
import copy
import dataclasses
import json
import os
import threading

import numpy as np

try:  # (not llguidance.hf: it imports transformers, which a start does not wait for)
    import llguidance
    import llguidance.numpy
except ImportError:  # a pip dependency; a machine without it runs everything but constraints
    llguidance = None

_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclasses.dataclass(frozen=True)
class StructuredOutputs:
    """Exactly one of: json, a JSON schema (a dict, or its JSON text); json_object, any JSON object; regex; choice,
    one of the strings; grammar, in llguidance's Lark syntax (which may embed a JSON schema: `%json { ... }`)."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self):
        if llguidance is None:
            raise ValueError("structured_outputs needs the llguidance package (pip install llguidance)")
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs must set exactly one of {', '.join(_KINDS)}; got {given or 'none'}")
        kind = given[0]
        if isinstance(self.json, str):
            try:
                object.__setattr__(self, "json", json.loads(self.json))
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs json is not JSON: {e}") from None
        checks = {"json": isinstance(self.json, dict), "json_object": self.json_object is True,
                  "regex": isinstance(self.regex, str),
                  "choice": bool(self.choice) and all(isinstance(c, str) and c for c in self.choice or ()),
                  "grammar": isinstance(self.grammar, str)}
        if not checks[kind]:
            what = {"json": "a JSON schema (an object)", "json_object": "true", "regex": "a string",
                    "choice": "a non-empty list of non-empty strings", "grammar": "a string"}[kind]
            raise ValueError(f"structured_outputs {kind} must be {what}, got {getattr(self, kind)!r}")
        if error := llguidance.LLMatcher.validate_grammar(self.grammar_text):
            raise ValueError(f"structured_outputs {kind} is not valid: {error.strip()}")

    @property
    def grammar_text(self) -> str:
        """The llguidance grammar (also the key under which its compiled form is cached)."""
        m = llguidance.LLMatcher
        if self.json is not None or self.json_object:
            # Whitespace between JSON tokens in runs of at most 32: a small model can loop on it forever otherwise.
            schema = {"x-guidance": {"whitespace_pattern": r"[\n\t ]{0,32}"}, **(self.json or {"type": "object"})}
            return m.grammar_from_json_schema(schema)
        if self.regex is not None:
            return m.grammar_from_regex(self.regex)
        if self.choice is not None:
            return m.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.choice))
        return m.grammar_from_lark(self.grammar)

    @classmethod
    def of(cls, value) -> "StructuredOutputs | None":
        """From None, a StructuredOutputs, or a dict of its fields (vLLM's `structured_outputs` request extra)."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"structured_outputs must be a dict, got {value!r}")
        if unknown := set(value) - set(_KINDS):
            raise ValueError(f"structured_outputs has unknown keys {sorted(unknown)}")
        return cls(**value)


class Grammars:
    """Matchers for requests' constraints over one tokenizer, compiled on the caller's thread (not the engine loop's)
    and copied per request; their next-token masks filled in parallel. Copies of one compiled matcher share its lexer
    under one lock and fill their masks one at a time: a grammar is compiled up to `roots` times (the executor's
    threads) for requests that run at once (docs/perf_notes.md, "Structured outputs: masks in the engine"). The last
    MAX_CACHED compiled matchers are kept."""

    MAX_CACHED = 256

    def __init__(self, tokenizer, roots: int | None = None):
        self._tokenizer, self._ll_tokenizer, self._executor = tokenizer, None, None  # built at the first constraint
        self.roots = roots or max(1, min(32, (os.cpu_count() or 1) * 4 // 5))  # (LLExecutor's default threads)
        self._compiled: collections.OrderedDict[str, list[list]] = collections.OrderedDict()
        self._live: dict[int, tuple] = {}  # id(a request's matcher) -> (the matcher, its root's entry)
        self._lock = threading.Lock()

    def prepare(self) -> None:
        """Builds llguidance's view of the vocabulary, which the first constraint would otherwise wait for (seconds on
        a large vocabulary: docs/perf_notes.md, "Structured outputs: masks in the engine"); without llguidance or a
        tokenizer, nothing."""
        if llguidance is None or self._tokenizer is None:
            return
        with self._lock:
            if self._ll_tokenizer is None:  # the fast tokenizer's JSON as llguidance.hf.from_tokenizer reads it
                backend = copy.copy(self._tokenizer.backend_tokenizer)
                backend.no_padding()
                backend.no_truncation()
                self._ll_tokenizer = llguidance.LLTokenizer(backend.to_str(), eos_token=self._tokenizer.eos_token_id)
                self._executor = llguidance.LLExecutor(self.roots)

    def matcher(self, constraint: StructuredOutputs) -> "llguidance.LLMatcher":
        """A copy of the grammar's compiled matcher that fewest live requests use; another is compiled when each is
        in use (up to `roots`), so requests one after another share one, whose lexer has warmed up."""
        if self._tokenizer is None:
            raise ValueError("structured_outputs needs the model's tokenizer; this LLM has none")
        text = constraint.grammar_text
        self.prepare()
        with self._lock:
            roots = self._compiled.pop(text, [])  # [compiled matcher, live copies]
            least = min(roots, key=lambda r: r[1], default=None)
            if least is None or (least[1] and len(roots) < self.roots):
                least = [llguidance.LLMatcher(self._ll_tokenizer, text), 0]
                if least[0].is_error():
                    raise ValueError(f"structured_outputs cannot be compiled: {least[0].get_error()}")
                roots.append(least)
            self._compiled[text] = roots
            while sum(map(len, self._compiled.values())) > self.MAX_CACHED:
                self._compiled.popitem(last=False)
            least[1] += 1
            matcher = least[0].deep_copy()
            self._live[id(matcher)] = (matcher, least)
        return matcher

    def release(self, matcher: "llguidance.LLMatcher | None") -> None:
        """Its request has ended (None, or a matcher released before: nothing)."""
        if matcher is None:  # (every unconstrained request ends here too: no lock)
            return
        with self._lock:
            if (live := self._live.pop(id(matcher), None)) is not None:
                live[1][1] -= 1

    def fill(self, matcher: "llguidance.LLMatcher", out: np.ndarray) -> None:
        """Writes the matcher's next-token bitmask into out [1, >= ceil(vocabulary / 32)] int32 (zeros after)."""
        llguidance.numpy.fill_next_token_bitmask(matcher, out[:, :-(-self._ll_tokenizer.vocab_size // 32)])

    def masks(self, matchers: list["llguidance.LLMatcher"]) -> np.ndarray:
        """-> [len(matchers), ceil(tokenizer vocabulary / 32)] int32: each one's next-token bitmask."""
        masks = llguidance.numpy.allocate_token_bitmask(len(matchers), self._ll_tokenizer.vocab_size)
        llguidance.numpy.fill_next_token_bitmask_par(self._executor, list(zip(matchers, range(len(matchers)))), masks)
        return masks


class MaskFeed:
    """The host side of a hosted decode (a constrained row alone, `EngineConfig.hosted_masks`): after each step, the
    row's grammar takes its token and, but after its last step, gives its next mask. `start` sets a dispatch's
    matcher and the row's steps (the program's may be more: their draws are not the row's); `stops`: {0: (the tokens
    its grammar took before it completed or refused one, the refusal or None)} once it did, read back by
    OutputProcessor.accept once the dispatch is done."""

    def __init__(self, grammars: Grammars, width: int):
        self.grammars, self.width, self.matcher, self.num_steps, self.stops = grammars, width, None, 0, {}

    def start(self, matcher: "llguidance.LLMatcher", num_steps: int) -> None:
        self.matcher, self.num_steps, self.stops = matcher, num_steps, {}

    def __call__(self, tokens: np.ndarray, step: np.ndarray) -> np.ndarray:
        """tokens [1], the step's draw -> [1, width] int32, the next step's mask. It never raises: an error would fail
        the program, which holds the donated KV cache."""
        # (io_callback hands over jax.Arrays on the CPU: indexing one would dispatch an op)
        step, token, mask = int(np.asarray(step)), int(np.asarray(tokens)[0]), np.zeros((1, self.width), np.int32)
        if self.stops or step >= self.num_steps:
            return mask
        try:
            if not self.matcher.consume_token(token):
                self.stops[0] = (step, f"its grammar rejects token {token}: {self.matcher.get_error()}")
            elif self.matcher.is_stopped():
                self.stops[0] = (step + 1, None)
            elif step + 1 < self.num_steps:
                self.grammars.fill(self.matcher, mask)
        except Exception as e:  # noqa: BLE001 -- (ends the row's request, not the program)
            self.stops[0] = (step + 1, f"its grammar failed: {e!r}")
        return mask
