"""python -m nanojax.serve [--model M] [--host 127.0.0.1] [--port 8000] — an OpenAI-compatible HTTP server.

/v1/completions, /v1/chat/completions (both streamable), /v1/models, /health, /metrics, /tokenize and /detokenize
over one `LLM`. The port opens once the model is compiled, so /health answers only when requests can be served.
"""
import argparse
import asyncio
import contextlib
import dataclasses
import functools
import html
import itertools
import json
import math
import os
import re
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from convert.cache import MODEL_NAME
from nanojax.config import EngineConfig, add_model_flags
from nanojax.engine_io import RequestOutput, RequestStream
from nanojax.engine_process import EngineProcess, freeze_startup_heap
from nanojax.front import EngineStats
from nanojax.llm import LLM
from nanojax.reasoning import REASONING_PARSERS, ReasoningParser
from nanojax.sampling_params import SamplingParams
from nanojax.scheduler import CapacityError
from nanojax.serve_metrics import ServeMetrics
from nanojax.serve_protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
                                    error_body)
from nanojax.tool_calls import ToolCallParser, ToolFormat, forced_call_grammar, template_inputs, tool_format


@dataclasses.dataclass(frozen=True)
class ServerLimits:
    """What one request may ask for (past them: 413 for the body, 400 for the rest; max_tokens None: max_model_len),
    and how long the engine may leave a stats query unanswered, or have work and begin no turn, before /health fails."""

    max_body_bytes: int = 8 << 20
    max_n: int = 16
    max_tokens: int | None = None
    max_prompts: int = 64
    stats_timeout_s: float = 2.0
    stall_timeout_s: float = 60.0


class RequestError(HTTPException):
    """A request the server refuses, answered in OpenAI's error shape."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(status, message)
        self.body = error_body(message, kind, param, code)


# ----- requests to engine inputs -----
_PROMPT_ERRORS = ("prompt", "empty prompt", "token ids", "this checkpoint has no tokenizer", "this model's tokenizer")
_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


@contextlib.contextmanager
def _engine_errors(prompt_field: str, renames: dict[str, str] | None = None):
    """ValueErrors of the engine or SamplingParams as 400s naming the field (their messages start with it, or with one
    of _PROMPT_ERRORS); RuntimeErrors (it has died) as 503s."""
    try:
        yield
    except ValueError as e:
        word = re.match(r"[a-z_]*", str(e)).group()
        param = (renames or {}).get(word, word) if word in _SAMPLING_FIELDS else None
        raise RequestError(400, str(e), prompt_field if str(e).startswith(_PROMPT_ERRORS) else param) from None
    except RuntimeError as e:
        raise RequestError(503, str(e), kind="server_error") from None


def _completion_prompts(llm, prompt, limits: ServerLimits) -> tuple[list[list[int]], list[str | None]]:
    """-> (token ids, the text as given or None) per prompt (no token ids: one empty prompt, which encode refuses)."""
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        prompt = [prompt]
    if len(prompt) > limits.max_prompts:
        raise RequestError(400, f"{len(prompt)} prompts in one request; this server allows {limits.max_prompts}",
                           "prompt")
    return [llm.encode(p) for p in prompt], [p if isinstance(p, str) else None for p in prompt]


# ----- engine outputs to response fields -----
_ID_PREFIX = secrets.token_hex(8)  # response ids: a counter under a random prefix, unique like a uuid4 and cheaper
_response_numbers = itertools.count()


def _token_text(llm, token_id: int) -> str:
    # Without a tokenizer, vLLM's spelling of a bare token id.
    return llm.tokenizer.decode([token_id]) if llm.tokenizer else f"token_id:{token_id}"


def _finite(logprob: float | None) -> float | None:
    # vLLM's -9999.0 for a logprob of -inf (or NaN): JSON has no such numbers
    return logprob if logprob is None or math.isfinite(logprob) else -9999.0


def _completion_logprobs(llm, entries, offset: int) -> dict:
    tokens = [_token_text(llm, token_id) for token_id, _, _ in entries]
    return {"tokens": tokens, "token_logprobs": [_finite(lp) for _, lp, _ in entries],
            "top_logprobs": [None if top is None else {_token_text(llm, t): _finite(v) for t, v in top.items()}
                             for _, _, top in entries],
            "text_offset": list(itertools.accumulate(map(len, tokens), initial=offset))[:-1]}


def _chat_logprobs(llm, entries) -> dict:
    def item(token_id, logprob):
        text = _token_text(llm, token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode())}

    return {"content": [{**item(t, lp), "top_logprobs": [item(i, v) for i, v in top.items()]}
                        for t, lp, top in entries]}


def _json(value) -> str:
    """Compact JSON, refusing NaN and infinities (not JSON: clients' parsers reject them)."""
    return json.dumps(value, separators=(",", ":"), allow_nan=False)


class _MessageParser:
    """A chat choice's text as its message's fields (a delta's, streamed): reasoning_content, content, tool_calls."""

    def __init__(self, prompt_tail: str | None, tools: ToolFormat | None):  # prompt_tail: for a reasoning model
        self.reasoning = None if prompt_tail is None else ReasoningParser(prompt_tail)
        self.tools = None if tools is None else ToolCallParser(tools)

    def fields(self, text: str, streamed: bool, final: bool) -> dict:
        """The fields for `text`, the choice's new text (streamed) or all of it; final: the choice has ended."""
        reasoning, content = self.reasoning.feed(text, final) if self.reasoning else ("", text)
        content, calls = self.tools.feed(content, final) if self.tools else (content, [])
        fields = {"content": content}
        if streamed:  # a delta carries what it adds; a call, whole, under its index among the choice's calls
            if reasoning:
                fields["reasoning_content"] = reasoning
            if calls:
                first = self.tools.calls - len(calls)
                fields["tool_calls"] = [{"index": k, **call} for k, call in enumerate(calls, first)]
            return fields
        if self.reasoning:
            fields["reasoning_content"] = reasoning or None
        if calls:
            fields.update(content=content.strip() or None, tool_calls=calls)
        return fields


class _Response:
    """Builds one HTTP request's choices (completions or chat) from the engine's events, whole or as chunks."""

    def __init__(self, llm, body, model: str, prompts: list[list[int]], arrival: float,
                 echo: list[str | None] | None = None, message_parser=None):  # echo: a completion's prompts' text
        self.llm, self.body, self.prompts, self.echo, self.arrival = llm, body, prompts, echo, arrival
        self.chat = chat = message_parser is not None  # message_parser(): a new _MessageParser, for a chat
        self.message_parser, self.parsers = message_parser, {}  # parsers: choice -> its streamed text's parser
        self.logprobs = bool(body.logprobs) if chat else body.logprobs is not None
        self.head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{_ID_PREFIX}{next(_response_numbers):08x}",
                     "created": int(time.time()), "model": model}
        chunk_head = {**self.head, "object": "chat.completion.chunk" if chat else "text_completion"}
        self.chunk_head = f"data: {_json(chunk_head)[:-1]},\"choices\":"  # encoded once
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        self.sent: dict[int, int] = {}  # choice -> its tokens already streamed
        self.text_len: dict[int, int] = {}  # choice -> the length of its text already streamed
        self.finals: dict[int, RequestOutput] = {}

    def choice_index(self, event: RequestOutput) -> int:
        return event.index * self.body.n + event.choice

    def choice(self, event: RequestOutput, streamed: bool) -> dict:
        """The choice's fields for the event's new tokens and text (streamed) or for all of them (then `sent` is
        empty: a response is streamed or whole)."""
        i = self.choice_index(event)
        first = i not in self.sent
        start = self.sent.get(i, 0)
        self.sent[i] = max(start, len(event.token_ids))
        text = event.delta if streamed else event.text
        # (token id, its logprob, {id: logprob} of the top N) per token from `start` on
        entries = [(t, *lp) for t, lp in zip(event.token_ids[start:], event.logprobs[start:])] if self.logprobs else []
        fields = {"index": i, "finish_reason": event.finish_reason, "logprobs": None}
        if self.body.return_token_ids:
            fields["token_ids"] = event.token_ids[start:]
            if first:
                fields["prompt_token_ids"] = self.prompts[event.index]
        if self.chat:
            parser = self.parsers.setdefault(i, self.message_parser())
            message = parser.fields(text, streamed, final=event.finish_reason is not None)
            fields["delta" if streamed else "message"] = {"role": "assistant", **message} if first else message
            if parser.tools and parser.tools.calls and event.finish_reason == "stop":
                fields["finish_reason"] = "tool_calls"
            if self.logprobs:
                fields["logprobs"] = _chat_logprobs(self.llm, entries)
            return fields
        echo = self.echo[event.index] if first and self.body.echo else ""
        if self.logprobs:
            if echo:  # the prompt's tokens with their logprobs (SamplingParams.prompt_logprobs), the first's null
                prompt_lps = event.prompt_logprobs or [None] * len(self.prompts[event.index])
                entries = [(t, *(lp or (None, None))) for t, lp in zip(self.prompts[event.index], prompt_lps)] + entries
            fields["logprobs"] = _completion_logprobs(self.llm, entries, self.text_len.get(i, 0))
        fields["text"] = echo + text
        self.text_len[i] = self.text_len.get(i, 0) + len(fields["text"])
        return fields

    def usage(self) -> dict:
        by_prompt = {e.index: e for e in self.finals.values()}
        prompt = sum(len(self.prompts[i]) for i in by_prompt)
        completion = sum(len(e.token_ids) for e in self.finals.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(e.num_cached_tokens for e in by_prompt.values())}}

    def whole(self) -> dict:
        choices = [self.choice(self.finals[i], streamed=False) for i in sorted(self.finals)]
        return {**self.head, "object": "chat.completion" if self.chat else "text_completion", "choices": choices,
                "usage": self.usage()}

    def chunk(self, choices: list[dict], usage: dict | None = None) -> str:
        usage = f",\"usage\":{_json(usage)}" if self.include_usage else ""
        return f"{self.chunk_head}{_json(choices)}{usage}}}\n\n"


class _AbortOnClose(StreamingResponse):
    """A streamed response that aborts its requests however it ends (the client gone mid-stream included)."""

    def __init__(self, body, on_close):
        super().__init__(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


# ----- the app -----
# Answered without the API key: probes and scrapers do not have it; the chat page asks for it
_OPEN_PATHS = ("/", "/health", "/metrics")
CHAT_PAGE = Path(__file__).parent / "static" / "chat.html"


class _Guard:
    """ASGI middleware, before a body is read: 401 on every route but _OPEN_PATHS without the API key (if one is
    set); 413 for a body over max_bytes (declared, or found so while it streams in)."""

    def __init__(self, app, max_bytes: int, api_key: str | None):
        self.app, self.max_bytes, self.too_large = app, max_bytes, f"request body is over {max_bytes} bytes"
        self.expected = None if api_key is None else f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.expected and scope["path"] not in _OPEN_PATHS and not secrets.compare_digest(
                headers.get(b"authorization", b""), self.expected):
            refusal = error_body("missing or wrong API key (Authorization: Bearer KEY)", code="invalid_api_key")
            return await JSONResponse(refusal, status_code=401)(scope, receive, send)
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            return await JSONResponse(error_body(self.too_large), status_code=413)(scope, receive, send)
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise HTTPException(413, self.too_large)
            return message

        await self.app(scope, limited_receive, send)


async def _http_error(_, e: HTTPException):
    body = e.body if isinstance(e, RequestError) else error_body(str(e.detail))
    return JSONResponse(body, status_code=e.status_code)


async def _unexpected(_, e: Exception):
    """A bug in a handler: a 500 in OpenAI's shape, which clients parse, rather than plain text."""
    return JSONResponse(error_body(f"the server failed on this request: {e!r}", "server_error"), status_code=500)


async def _invalid(_, e: RequestValidationError):
    """A body pydantic refused: 400 naming the first field it is about (a failed check of a value before a
    mismatched type: of a union's members, the one the value was meant for)."""
    err = next((x for x in e.errors() if x["type"] == "value_error"), e.errors()[0])
    # past "body"; without the labels of a union's members (list[int], function-after[...]), which are not fields
    where = [str(x) for x in err["loc"][1:] if "[" not in str(x)]
    if err["type"] == "json_invalid":
        return JSONResponse(error_body(f"the body is not valid JSON: {err['ctx']['error']}"), status_code=400)
    if err["type"] == "extra_forbidden":
        message = f"unknown field {'.'.join(where)!r}: this server does not support it"
    else:
        message = f"{'.'.join(where) or 'body'}: {err['msg']}"
    return JSONResponse(error_body(message, param=where[0] if where else None), status_code=400)


class _Server:
    """One LLM served under one name (and its aliases): the routes' handlers and what they share."""

    def __init__(self, llm, model_name: str, aliases: tuple[str, ...], limits: ServerLimits,
                 reasoning_parser: str | None):
        self.llm, self.model_name, self.limits, self.reasoning_parser = llm, model_name, limits, reasoning_parser
        self.tool_format = tool_format(llm.tokenizer and llm.tokenizer.chat_template)
        self.token_limit = limits.max_tokens or llm.max_model_len
        self.names = {model_name, *aliases}
        self.metrics = ServeMetrics()
        self.started = int(time.time())
        # Tokenizing a long prompt holds a thread: off the event loop, and in a pool of its own so that a flood of
        # them leaves the default pool to /health's stats query.
        self.tokenizing = ThreadPoolExecutor(thread_name_prefix="nanojax-tokenize")
        self.stats_query: asyncio.Future | None = None

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.names:
            raise RequestError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                               "model", "NotFoundError", "model_not_found")

    async def tokenized(self, fn, prompt_field: str):
        with _engine_errors(prompt_field):
            return await asyncio.get_running_loop().run_in_executor(self.tokenizing, fn)

    async def chat_prompt(self, body) -> list[int]:
        """The prompt of a chat request, or of /tokenize's messages: its messages, tools and template variables."""
        tools = body.tools and [t.model_dump(exclude_none=True) for t in body.tools]
        inputs = [m.as_template_input() for m in body.messages]
        return await self.tokenized(lambda: self.llm.apply_chat_template(
            *template_inputs(self.tool_format, inputs, tools), body.chat_template_kwargs), "messages")

    # ----- generation -----
    async def completions(self, body: CompletionRequest, request: Request):
        arrival = time.perf_counter()
        self.check_model(body.model)
        prompts, texts = await self.tokenized(lambda: _completion_prompts(self.llm, body.prompt, self.limits), "prompt")
        if body.echo:
            if self.llm.tokenizer is None:
                raise RequestError(400, "echo needs a tokenizer, and this model has none", "echo")
            texts = [t if t is not None else self.llm.tokenizer.decode(ids) for ids, t in zip(prompts, texts)]
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        prompt_logprobs = body.logprobs if body.echo else None  # the echoed prompt's
        response = _Response(self.llm, body, self.model_name, prompts, arrival, echo=texts)
        return await self.respond(request, response, max_tokens, body.logprobs, prompt_logprobs)

    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        arrival = time.perf_counter()
        self.check_model(body.model)
        ids = await self.chat_prompt(body)
        # its last tokens show whether the template opened a <think> for the model
        prompt_tail = self.llm.tokenizer.decode(ids[-4:]) if self.reasoning_parser else None
        call_format = self.tool_format if body.tools and body.tool_choice != "none" else None  # "none": calls as text
        parser = functools.partial(_MessageParser, prompt_tail, call_format)
        max_tokens = body.max_tokens if body.max_completion_tokens is None else body.max_completion_tokens
        if max_tokens is None:  # what is left of the context, within the server's limit
            max_tokens = min(max(1, self.llm.max_model_len - len(ids)), self.token_limit)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        response = _Response(self.llm, body, self.model_name, [ids], arrival, message_parser=parser)
        return await self.respond(request, response, max_tokens, logprobs)

    async def respond(self, request: Request, response: _Response, max_tokens: int, logprobs: int | None,
                      prompt_logprobs: int | None = None):
        """Adds one engine request per prompt; answers with their events streamed (SSE) or collected whole."""
        body, prompt_field, renames = response.body, "prompt", {}
        if response.chat:  # errors name the chat request's fields
            prompt_field, renames = "messages", {"logprobs": "top_logprobs"}
            if body.max_completion_tokens is not None:
                renames["max_tokens"] = "max_completion_tokens"
        # StructuredOutputs' errors name the field that asked for the constraint
        renames["structured_outputs"], constraint = self.constraint(body, response.chat)
        stream = RequestStream(loop=asyncio.get_running_loop())
        request_ids = [f"{response.head['id']}-{i}" for i in range(len(response.prompts))]
        close = functools.partial(self.close, stream, request_ids)
        with _engine_errors(prompt_field, renames):
            params = self.sampling_params(body, max_tokens, logprobs, prompt_logprobs, constraint)
            try:  # a refused prompt aborts those added before it
                for i, (ids, request_id) in enumerate(zip(response.prompts, request_ids)):
                    self.llm.add_request(ids, params, request_id=request_id, index=i, stream=stream,
                                         stream_text=body.stream)
            except (ValueError, RuntimeError):
                close()
                raise
        events = _events(stream, response, self.metrics)
        if body.stream:
            return _AbortOnClose(_sse(events, response), close)
        return await _collect(request, events, response, close)

    def constraint(self, body, chat: bool) -> tuple[str, dict | None]:
        """(the field that asks for a constraint on the output, the constraint as StructuredOutputs' fields or None):
        at most one of structured_outputs, response_format and tool_choice ("required" or a named function) may."""
        asked = {"structured_outputs": body.structured_outputs,
                 "response_format": body.response_format and body.response_format.constraint()}
        if chat and (functions := body.forced_functions()):
            asked["tool_choice"] = {"grammar": forced_call_grammar(self.tool_format, functions,
                                                                   body.parallel_tool_calls)}
        asked = {field: value for field, value in asked.items() if value is not None}
        if len(asked) > 1:
            raise RequestError(400, f"{' and '.join(asked)} each constrain the output: give one", list(asked)[1])
        return next(iter(asked.items()), ("structured_outputs", None))

    def sampling_params(self, body, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None,
                        constraint: dict | None) -> SamplingParams:
        if max_tokens > self.token_limit:  # a ValueError: _engine_errors names a chat request's field
            raise ValueError(f"max_tokens={max_tokens} is more than this server allows ({self.token_limit})")
        if body.n > self.limits.max_n:
            raise RequestError(400, f"n={body.n} is more than this server allows ({self.limits.max_n})", "n")
        # Body fields named as SamplingParams fields go through as given (SamplingParams checks them); these differ.
        given = {name: getattr(body, name) for name in _SAMPLING_FIELDS if getattr(body, name, None) is not None}
        return SamplingParams(**{**given, "top_k": 0 if body.top_k == -1 else body.top_k, "max_tokens": max_tokens,
                                 "stop": body.stop or (), "logprobs": logprobs, "prompt_logprobs": prompt_logprobs,
                                 "structured_outputs": constraint})

    def close(self, stream: RequestStream, request_ids: list[str]) -> None:
        """Aborts the requests unless all have finished; counted as aborted if the stream had not finished."""
        if not stream.finished:
            self.metrics.aborted.inc()
        if not stream.all_finished:  # else nothing to abort: no message for the engine loop
            for request_id in request_ids:
                self.llm.abort(request_id)

    # ----- the rest -----
    async def models(self):
        return {"object": "list", "data": [await self.model(self.model_name)]}

    async def model(self, model: str):
        self.check_model(model)
        return {"id": self.model_name, "object": "model", "created": self.started, "owned_by": "nanojax",
                "max_model_len": self.llm.max_model_len}

    async def engine_state(self) -> tuple[EngineStats | None, str | None]:
        """(the engine's load or None; why it cannot serve, or None): it has stopped, it leaves a stats query
        unanswered for stats_timeout_s (hung), or it has work and has begun no turn for stall_timeout_s."""
        if self.llm.dead is not None:
            return None, f"the engine has stopped: {self.llm.dead!r}"
        if self.stats_query is None or self.stats_query.done():
            self.stats_query = asyncio.ensure_future(asyncio.to_thread(self.llm.stats))
            # marked retrieved: its callers may all have given up on it before it fails
            self.stats_query.add_done_callback(lambda query: query.cancelled() or query.exception())
        try:  # callers share the query in flight: a hung engine does not pile up threads waiting on it
            stats = await asyncio.wait_for(asyncio.shield(self.stats_query), self.limits.stats_timeout_s)
        except TimeoutError:
            return None, f"the engine did not answer a stats query within {self.limits.stats_timeout_s} s"
        except RuntimeError as e:  # it stopped meanwhile
            return None, str(e)
        if stats.stalled_s > self.limits.stall_timeout_s:
            return stats, f"the engine has had work and no new turn for {stats.stalled_s:.1f} s"
        return stats, None

    async def health(self):
        _, trouble = await self.engine_state()
        if trouble is not None:
            return JSONResponse(error_body(trouble, "server_error"), status_code=503)
        return Response(status_code=200)

    async def prometheus(self):
        stats, trouble = await self.engine_state()
        return Response(self.metrics.exposition(stats, up=trouble is None),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    async def tokenize(self, body: TokenizeRequest):
        self.check_model(body.model)
        if body.messages is not None:
            ids = await self.chat_prompt(body)
        elif (tokenizer := self.llm.tokenizer) is None:
            raise RequestError(400, "this model has no tokenizer", "prompt")
        else:
            encode = functools.partial(tokenizer.encode, body.prompt, add_special_tokens=body.add_special_tokens)
            ids = await self.tokenized(encode, "prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": self.llm.max_model_len}

    async def detokenize(self, body: DetokenizeRequest):
        self.check_model(body.model)
        if self.llm.tokenizer is None:
            raise RequestError(400, "this model has no tokenizer", "tokens")
        vocab_size = self.llm.config.vocab_size
        if any(not 0 <= t < vocab_size for t in body.tokens):
            raise RequestError(400, f"token ids must be in [0, {vocab_size})", "tokens")
        return {"prompt": await self.tokenized(lambda: self.llm.tokenizer.decode(body.tokens), "tokens")}


def build_app(llm, model_name: str, *, aliases: tuple[str, ...] = (), api_key: str | None = None,
              limits: ServerLimits = ServerLimits(), reasoning_parser: str | None = None, on_shutdown=None) -> FastAPI:
    """The app serving `llm` (an LLM or an EngineProcess) as `model_name` or one of `aliases`; reasoning_parser: one of
    REASONING_PARSERS; on_shutdown() runs when the server shuts down (uvicorn then re-raises the signal)."""
    server = _Server(llm, model_name, aliases, limits, reasoning_parser)

    @contextlib.asynccontextmanager
    async def lifespan(_):
        try:
            yield
        finally:  # its threads would otherwise outlive the app; a tokenize in flight finishes on its own
            server.tokenizing.shutdown(wait=False, cancel_futures=True)
        if on_shutdown is not None:
            await asyncio.to_thread(on_shutdown)

    app = FastAPI(title="nanojax", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.add_middleware(_Guard, max_bytes=limits.max_body_bytes, api_key=api_key)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(Exception, _unexpected)
    for path, handler in (("/v1/completions", server.completions), ("/v1/chat/completions", server.chat_completions),
                          ("/tokenize", server.tokenize), ("/detokenize", server.detokenize)):
        app.post(path)(handler)
    for path, handler in (("/v1/models", server.models), ("/v1/models/{model:path}", server.model),
                          ("/health", server.health), ("/metrics", server.prometheus)):
        app.get(path)(handler)
    page = CHAT_PAGE.read_text().replace("__MODEL__", html.escape(model_name))  # its name without a keyed call
    app.get("/", response_class=HTMLResponse)(lambda: page)
    return app


async def _events(stream: RequestStream, response: _Response, metrics: ServeMetrics):
    """The stream's events, a list per wakeup, one event per choice: its last with the text deltas of all (a loop
    behind the engine sends fewer, larger chunks rather than falling further behind); records them as they end."""
    last: dict[int, float] = {}  # choice -> when its previous events came
    async for batch in stream.batches():
        now = time.perf_counter()
        merged: dict[int, RequestOutput] = {}  # choice -> its last event, with the deltas of all
        for event in batch:
            i = response.choice_index(event)
            merged[i] = dataclasses.replace(event, delta=merged[i].delta + event.delta) if i in merged else event
        for i, event in merged.items():
            if i in last:
                metrics.itl.observe(now - last[i])
            last[i] = now
            if event.finish_reason is not None:
                response.finals[i] = event
                metrics.choice_done(event)
        yield list(merged.values())
    metrics.e2e.observe(time.perf_counter() - response.arrival)  # every choice has ended


async def _sse(events, response: _Response):
    """Server-sent events: a chunk per choice that changed, the usage chunk if asked, then [DONE]. An engine error
    mid-stream goes as an error event: the status line has gone out already."""
    try:
        async for batch in events:
            chunks = [response.chunk([response.choice(event, streamed=True)]) for event in batch
                      if event.delta or event.finish_reason
                      or len(event.token_ids) != response.sent.get(response.choice_index(event))]
            if chunks:
                yield "".join(chunks)
        if response.include_usage:
            yield response.chunk([], response.usage())
    except Exception as e:  # noqa: BLE001
        kind = "invalid_request_error" if isinstance(e, CapacityError) else "server_error"
        yield f"data: {json.dumps(error_body(f'the engine failed this request: {e}', kind))}\n\n"
    yield "data: [DONE]\n\n"


async def _collect(request: Request, events, response: _Response, close) -> dict:
    """Waits for all the events, aborting the requests if the client goes away; -> the whole response."""
    async def abort_on_disconnect():
        while not await request.is_disconnected():
            await asyncio.sleep(0.5)
        close()

    watcher = asyncio.create_task(abort_on_disconnect())
    try:
        async for _ in events:
            pass
    except CapacityError as e:
        raise RequestError(400, str(e), "max_tokens") from None
    except Exception as e:  # noqa: BLE001 -- a failed step: this request's error, the server goes on
        raise RequestError(500, f"the engine failed this request: {e!r}", kind="server_error") from None
    finally:
        watcher.cancel()
        close()
    return response.whole()


class BackgroundServer:
    """uvicorn serving `app` from a thread of this process on a free port of 127.0.0.1 (tests, benchmarks)."""

    def __init__(self, app):
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, name="nanojax-serve", daemon=True)
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


# ----- command line -----
def served_names(model: str | None, served_model_name: str | None = None) -> tuple[str, ...]:
    """The names clients use, the one in responses first: --served-model-name if given; else the default model's,
    or --model as given (vLLM's) and, for a folder or a file, its name."""
    if served_model_name is not None:
        return (served_model_name,)
    if model is None:
        return (MODEL_NAME,)
    path = Path(model)
    alias = path.stem if path.suffix == ".gguf" else path.name if path.exists() else model
    return tuple(dict.fromkeys((model, alias)))


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m nanojax.serve", description=__doc__.split("—")[1].strip())
    add_model_flags(p)
    p.add_argument("--served-model-name", default=None, help="the name clients pass as `model`")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 exposes the server)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("NANOJAX_API_KEY"),
                   help="require `Authorization: Bearer KEY` on every route but /, /health and /metrics (default: "
                   "$NANOJAX_API_KEY)")
    for flag in ("--max-num-seqs", "--max-num-batched-tokens", "--num-pages"):
        p.add_argument(flag, type=int, default=None)
    # 8, not LLM's offline 32: lower latencies and more throughput under load (docs/perf_notes.md, "Serving")
    p.add_argument("--decode-steps", type=int, default=8, help="decode steps per dispatch (tokens stream in "
                   "bursts of this many; default 8)")
    p.add_argument("--kernels", default="auto", choices=["auto", "pallas", "reference", "interpret"])
    p.add_argument("--tensor-parallel-size", type=int, default=None,
                   help="split the model over this many GPUs (default: one)")
    p.add_argument("--max-body-bytes", type=int, default=ServerLimits.max_body_bytes)
    p.add_argument("--max-n", type=int, default=ServerLimits.max_n)
    p.add_argument("--max-tokens-limit", type=int, default=None, help="largest max_tokens (default: max_model_len)")
    p.add_argument("--max-prompts", type=int, default=ServerLimits.max_prompts, help="prompts per completions request")
    p.add_argument("--engine-in-process", action="store_true", help="run the engine loop in the server's process "
                   "(default: a process of its own, so that HTTP work and the loop do not share one GIL)")
    p.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                   help="return a reasoning model's <think> text as reasoning_content (default: as content)")
    p.add_argument("--log-level", default="info")
    return p.parse_args(argv)


def engine_options(args) -> EngineConfig:
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    return EngineConfig(**{name: value for name, value in vars(args).items() if name in fields})


def main(argv=None) -> None:
    args = parse_args(argv)
    engine = (LLM if args.engine_in_process else EngineProcess)(args.model, config=engine_options(args))
    engine.prepare_structured_outputs()
    limits = ServerLimits(args.max_body_bytes, args.max_n, args.max_tokens_limit, args.max_prompts)
    name, *aliases = served_names(args.model, args.served_model_name)
    app = build_app(engine, name, aliases=tuple(aliases), api_key=args.api_key, limits=limits,
                    reasoning_parser=args.reasoning_parser,
                    on_shutdown=engine.close if isinstance(engine, EngineProcess) else None)
    freeze_startup_heap()
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)


if __name__ == "__main__":
    main()
