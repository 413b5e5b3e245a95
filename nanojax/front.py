"""What every way into the engine does before a request reaches its loop (prompts encoded, requests checked), shared
by `LLM` and `EngineProcess` (an LLM in another process, as the server sees it) so that each check is written once."""
import dataclasses

from nanojax.engine_io import RequestStream
from nanojax.sampling_params import SamplingParams


@dataclasses.dataclass(frozen=True)
class EngineLimits:
    max_model_len: int
    page_size: int
    num_pages: int  # KV pages in the pool
    max_num_seqs: int


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """The engine's load when asked (the server's /metrics)."""
    running: int  # sequences being computed
    waiting: int  # sequences waiting for KV pages or a batch slot
    kv_pages_total: int
    kv_pages_used: int
    stalled_s: float = 0.0  # seconds since the engine loop last finished a turn while it has work (0: idle)


class RequestFront:
    """Needs `config` (a ModelConfig), `tokenizer` (or None), `limits` (EngineLimits), `close()` and `_submit(ids,
    params, request_id, index, stream, stream_text)`, which hands a checked request to the engine."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len

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

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            template_kwargs: dict | None = None) -> list[int]:
        """tools: OpenAI's function tools, for a template that renders them; template_kwargs: the template's own
        variables (vLLM's chat_template_kwargs, e.g. Qwen3's enable_thinking)."""
        if self.tokenizer is None or not self.tokenizer.chat_template:
            raise ValueError("this model's tokenizer has no chat template")
        if taken := set(template_kwargs or ()) & {"tools", "add_generation_prompt", "tokenize", "return_dict",
                                                   "conversation", "messages"}:
            raise ValueError(f"chat_template_kwargs may not set {sorted(taken)}")
        from jinja2 import TemplateError  # here, not at the top: the rendering imports jinja2 anyway, a start need not

        try:
            return self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                                      tokenize=True, return_dict=False, **(template_kwargs or {}))
        except TemplateError as e:  # its raise_exception (e.g. Llama 3.1's one call a turn): the messages' fault
            raise ValueError(f"the chat template refused these messages: {e}") from None

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, *,
                    request_id: str | None = None, index: int = 0, stream: RequestStream | None = None,
                    stream_text: bool = True) -> RequestStream:
        """Queues a request (ValueError if bad); its stream gets a RequestOutput whenever one of its n choices gains
        text or finishes. stream: one to share between requests; stream_text=False: text only at the end."""
        params = params or SamplingParams()
        ids = self.encode(prompt)
        self.check(index, ids, params)
        stream = stream or RequestStream()
        self._submit(ids, params, request_id, index, stream, stream_text)
        return stream

    def check(self, index: int, ids: list[int], params: SamplingParams) -> None:
        """ValueError naming what is wrong when prompt `index` (encoded) cannot run with `params`."""
        limits, vocab = self.limits, self.config.vocab_size
        if len(ids) >= limits.max_model_len:
            raise ValueError(f"prompt {index} has {len(ids)} tokens; max_model_len={limits.max_model_len} "
                             "leaves no room to generate")
        total = min(len(ids) + params.max_tokens, limits.max_model_len)
        pages = -(-total // limits.page_size)
        if pages > limits.num_pages:
            raise ValueError(f"prompt {index} needs up to {pages} KV pages ({total} tokens) but the pool has only "
                             f"{limits.num_pages}: lower max_tokens or raise num_pages")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer, and this checkpoint has none: use stop_token_ids")
        if params.n > limits.max_num_seqs:
            raise ValueError(f"n={params.n} is more than max_num_seqs={limits.max_num_seqs}")
        if params.top_k > vocab:
            raise ValueError(f"top_k must be <= vocab_size={vocab} (0 disables it), got {params.top_k}")
        if bad := [t for t in (params.logit_bias or {}) if t >= vocab]:
            raise ValueError(f"logit_bias token ids must be < vocab_size={vocab}, got {bad[:4]}")
