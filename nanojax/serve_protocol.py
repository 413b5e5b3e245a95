"""The OpenAI-compatible request bodies the server accepts (pydantic; vLLM's extra fields too), and OpenAI's errors.

Unknown fields and loose types (numeric strings, booleans as numbers, infinities, NaN) are refused rather than
ignored or guessed at: a client that sends a field this server does not do learns so.
"""
import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, Strict, model_validator


def _valid_unicode(text: str) -> str:
    # JSON's \u escapes can spell a lone UTF-16 surrogate: no tokenizer can encode it
    try:
        text.encode()
    except UnicodeEncodeError:
        raise ValueError("the text holds a lone surrogate (\\ud800-\\udfff), which is not valid Unicode") from None
    return text


def _json_object(text: str) -> str:
    if not isinstance(json.loads(text), dict):  # a JSONDecodeError is a ValueError too
        raise ValueError("not a JSON object")
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]  # text that reaches the tokenizer
JsonObjectText = Annotated[str, AfterValidator(_json_object)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False


class JsonSchemaFormat(_Body):
    name: str
    description: str | None = None
    json_schema: dict = Field(alias="schema")  # `schema` would shadow pydantic's method
    strict: bool | None = None  # accepted: the schema is always enforced


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema goes with type 'json_schema', and only with it")
        return self

    def constraint(self) -> dict | None:
        """As StructuredOutputs' fields (None: any text)."""
        if self.type == "json_schema":
            return {"json": self.json_schema.json_schema}
        return {"json_object": True} if self.type == "json_object" else None


class _Sampling(_Body):
    """Fields shared by completions and chat completions (their defaults are OpenAI's)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stop: Text | list[Text] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[Annotated[int, Strict(False)], float] | None = None  # token ids, parsed from JSON's string keys
    user: str | None = None  # accepted and ignored
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extras
    top_k: int = 0  # -1 (vLLM's "off") is taken as 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    return_token_ids: bool = False  # vLLM's: each choice also carries its token ids (prompt's in the first chunk)
    structured_outputs: dict | None = None  # vLLM's: StructuredOutputs' fields
    response_format: ResponseFormat | None = None  # vLLM takes it on completions too


class CompletionRequest(_Sampling):
    prompt: Text | list[int] | list[Text] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False


class TextPart(_Body):
    type: Literal["text"]
    text: Text


class FunctionCall(_Body):
    name: str
    arguments: JsonObjectText


class ToolCall(_Body):  # an assistant's, sent back in the history
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's
    tool_call_id: str | None = None  # a tool's result: of which call

    def as_template_input(self) -> dict:
        """The message as chat templates take it: text content, calls' arguments as dicts (vLLM's)."""
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        message = {"role": self.role, "content": text}
        if self.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": c.type, "function": {
                "name": c.function.name, "arguments": json.loads(c.function.arguments)}} for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class Function(_Body):
    name: str
    description: str | None = None
    parameters: dict | None = None  # a JSON schema
    strict: bool | None = None  # accepted: a forced call's arguments always follow the schema


class Tool(_Body):
    type: Literal["function"]
    function: Function


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | Tool = "auto"  # a Tool: a call of that function (by name)
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _consistent(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        if self.tool_choice not in ("none", "auto") and not self.forced_functions():
            raise ValueError("tool_choice asks for a call of a function not among tools")
        return self

    def forced_functions(self) -> list[dict]:
        """The functions of which tool_choice makes the model call one (none: it may answer in text)."""
        if self.tool_choice in ("none", "auto"):
            return []
        named = None if self.tool_choice == "required" else self.tool_choice.function.name
        return [t.function.model_dump(exclude_none=True) for t in self.tools or () if named in (None, t.function.name)]


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None, code: str | None = None):
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
