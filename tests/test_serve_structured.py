"""Structured outputs, tool calls and reasoning through the server (nanojax.serve) with the official `openai` client,
on the embedded default model (SmolLM2-135M-Instruct, greedy), whose chat template renders no tools: they go in a
system message, and calls come back in Hermes' `<tool_call>` tags.

The tests of the model's outputs (the first four) need the engine to enforce the constraints (llguidance's masks).
Calls and reasoning parsed out of text, and the refusals, run on replies scripted in place of the model's.
"""
import asyncio
import json
import re
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from convert.cache import MODEL_NAME
from nanojax import LLM
from nanojax.engine_io import RequestOutput
from nanojax.serve import BackgroundServer, build_app


def obj(props: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False}


def text(max_length: int = 12) -> dict:  # every string bounded: a small model's outputs end soon
    return {"type": "string", "maxLength": max_length}


def integer(lo: int, hi: int) -> dict:
    return {"type": "integer", "minimum": lo, "maximum": hi}


# (what to describe, its schema); llguidance refuses uniqueItems (test_bad_constraints_are_400s)
SCHEMAS = [
    ("a person", obj({"name": text(), "age": integer(0, 120)})),
    ("a point on a plane", obj({"x": {"type": "number", "minimum": -10, "maximum": 10},
                                "y": {"type": "number", "minimum": -10, "maximum": 10}})),
    ("the color of the sky", obj({"color": {"enum": ["red", "green", "blue"]}})),
    ("tags for a post about cats", obj({"tags": {"type": "array", "items": text(10), "minItems": 1, "maxItems": 3}})),
    ("a user account", obj({"user": obj({"id": integer(1, 999), "active": {"type": "boolean"}})})),
    ("a book", obj({"title": text(20), "subtitle": text(20)}, required=["title"])),
    ("a score, or 'none'", obj({"value": {"anyOf": [integer(0, 100), {"enum": ["none"]}]}})),
    ("today's date", obj({"date": {"type": "string", "format": "date"}})),
    ("a contact", obj({"email": {"type": "string", "format": "email", "maxLength": 30}})),
    ("a flight code", obj({"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"}})),
    ("a shopping list", obj({"items": {"type": "array", "maxItems": 2, "items": obj({"name": text(10)})}})),
    ("whether water is wet", obj({"answer": {"type": "boolean"}})),
    ("a nickname, or null", obj({"nickname": {"type": ["string", "null"], "maxLength": 10}})),
    ("a versioned record", obj({"version": {"const": 1}, "name": text()})),
    ("test scores", obj({"scores": {"type": "array", "items": integer(0, 10), "minItems": 2, "maxItems": 3}})),
    ("a price", obj({"price": {"type": "number", "exclusiveMinimum": 0, "maximum": 100}})),
    ("a pixel", {"$defs": {"coordinate": integer(0, 9)},
                 **obj({"x": {"$ref": "#/$defs/coordinate"}, "y": {"$ref": "#/$defs/coordinate"}})}),
    ("two pairs of numbers", obj({"pairs": {"type": "array", "minItems": 2, "maxItems": 2, "items": {
        "type": "array", "minItems": 2, "maxItems": 2, "items": integer(0, 9)}}})),
    ("a meeting's start", obj({"start": {"type": "string", "format": "date-time"}})),
    ("a pet", obj({"pet": {"oneOf": [obj({"kind": {"const": "dog"}, "barks": {"type": "boolean"}}),
                                     obj({"kind": {"const": "fish"}, "fins": integer(0, 8)})]}})),
]
WEATHER = {"name": "get_weather", "description": "The current weather in a city",
           "parameters": obj({"city": text(20), "unit": {"enum": ["celsius", "fahrenheit"]}}, required=["city"])}
TIME = {"name": "get_time", "description": "The local time in a city", "parameters": obj({"city": text(20)})}
TOOLS = [{"type": "function", "function": f} for f in (WEATHER, TIME)]
GREEDY = dict(model=MODEL_NAME, temperature=0)


def valid(instance, schema: dict) -> bool:
    return jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker()).is_valid(instance)


@pytest.fixture(scope="module")
def llm():
    # 20 rows: the 20 schemas' requests in one batch of the largest decode bucket, none padded
    with LLM(None, dtype="float32", max_model_len=768, max_num_seqs=20) as llm:
        yield llm


@pytest.fixture(scope="module")
def server(llm):
    server = BackgroundServer(build_app(llm, MODEL_NAME, reasoning_parser="qwen3"))
    yield server
    server.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


def test_20_json_schemas_batched_every_output_valid(server):
    async def ask(client, what: str, schema: dict):
        reply = await client.chat.completions.create(**GREEDY, max_tokens=120, messages=[
            {"role": "user", "content": f"Give {what} as JSON with this schema: {json.dumps(schema)}"}],
            response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema,
                                                                    "strict": True}})
        return reply.choices[0].message.content

    async def ask_all():  # concurrent: the engine batches them
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0,
                                      timeout=300) as client:
            return await asyncio.gather(*(ask(client, what, schema) for what, schema in SCHEMAS))

    for (what, schema), content in zip(SCHEMAS, asyncio.run(ask_all())):
        assert valid(json.loads(content), schema), (what, content)


def test_regex_choice_and_json_object_on_chat_and_completions(client):
    phone = r"\(\d{3}\) \d{3}-\d{4}"
    reply = client.chat.completions.create(**GREEDY, max_tokens=20, messages=[
        {"role": "user", "content": "Make up a US phone number."}], extra_body={"structured_outputs": {"regex": phone}})
    assert re.fullmatch(phone, reply.choices[0].message.content)
    reply = client.completions.create(**GREEDY, max_tokens=5, prompt="Is the sky blue? Answer:",
                                      extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert reply.choices[0].text in ("yes", "no")
    reply = client.completions.create(**GREEDY, max_tokens=100, prompt="A cat's name and age as a JSON object:",
                                      extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(reply.choices[0].text), dict)


class CityWeather(BaseModel):
    city: str = Field(max_length=20)
    temperature_c: int = Field(ge=-50, le=60)
    sky: Literal["sunny", "cloudy", "rainy"]


def test_parse_into_a_pydantic_model(client):
    reply = client.chat.completions.parse(**GREEDY, max_tokens=60, response_format=CityWeather, messages=[
        {"role": "user", "content": "Describe the weather in Paris today."}])
    assert isinstance(reply.choices[0].message.parsed, CityWeather)


def test_tool_call_round_trip(client):
    """tool_choice "required" and a named one: a call with valid arguments; then its result, and an answer. One call
    each: allowed more, this small model goes on calling until max_tokens."""
    question = [{"role": "user", "content": "What is the weather like in Paris?"}]
    ask = dict(**GREEDY, max_tokens=60, messages=question, tools=TOOLS, parallel_tool_calls=False)
    reply = client.chat.completions.create(**ask, tool_choice="required")
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[call.function.name]
    assert valid(json.loads(call.function.arguments), schema), call.function.arguments

    chunks = list(client.chat.completions.create(**ask, stream=True, tool_choice={"type": "function", "function": {
        "name": "get_time"}}))
    (streamed,) = [c for chunk in chunks for c in chunk.choices[0].delta.tool_calls or ()]
    finish = chunks[-1].choices[0].finish_reason
    assert (streamed.index, streamed.function.name, finish) == (0, "get_time", "tool_calls")
    assert valid(json.loads(streamed.function.arguments), TIME["parameters"])

    history = question + [choice.message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"}]
    answer = client.chat.completions.create(**GREEDY, max_tokens=24, messages=history, tools=TOOLS,
                                            tool_choice="none")
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls


@pytest.fixture
def scripted(llm, monkeypatch):
    """scripted(reply): the model answers every request with `reply`, three characters per event."""
    def script(reply: str):
        def add_request(ids, params, *, request_id, index, stream, stream_text):
            stream.expect(params.n)
            for end in range(3, len(reply) + 3, 3):
                stream.put(RequestOutput(index, ids, [0] * (end // 3), reply[:end], None if end < len(reply) else
                                         "stop", delta=reply[end - 3:end], request_id=request_id))
        monkeypatch.setattr(llm, "add_request", add_request)
    return script


def test_calls_and_reasoning_parsed_whole_and_streamed(client, scripted):
    scripted('<think>\nThe user wants the weather.\n</think>\n\nLet me check. <tool_call>\n{"name": "get_weather", '
             '"arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
             '{"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": broken}\n</tool_call>')
    broken = '<tool_call>\n{"name": broken}\n</tool_call>'
    ask = dict(**GREEDY, messages=[{"role": "user", "content": "Weather and time in Paris?"}], tools=TOOLS)
    choice = client.chat.completions.create(**ask).choices[0]
    message = choice.message
    assert message.reasoning_content == "\nThe user wants the weather.\n" and choice.finish_reason == "tool_calls"
    assert message.content == f"Let me check. \n\n{broken}"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"city": "Paris"})]

    deltas = [c.choices[0].delta for c in client.chat.completions.create(**ask, stream=True)]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == message.reasoning_content
    assert "".join(d.content or "" for d in deltas).strip() == message.content
    calls = [(c.index, c.function.name, c.function.arguments) for d in deltas for c in d.tool_calls or ()]
    assert calls == [(k, c.function.name, c.function.arguments) for k, c in enumerate(message.tool_calls)]
    # tool_choice "none": calls are left as text
    assert client.chat.completions.create(**ask, tool_choice="none").choices[0].message.tool_calls is None


@pytest.mark.parametrize("extra,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "uniqueItems": True}}}}, "response_format"),  # llguidance cannot enforce it
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, None),
    ({"tool_choice": "required"}, None),
])
def test_bad_constraints_are_400s(client, extra, param):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(**GREEDY, messages=[{"role": "user", "content": "x"}], extra_body=extra)
    assert refused.value.body["param"] == param, refused.value.body


def test_bad_tool_call_arguments_in_the_history_are_400s(client):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{oops"}}
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(**GREEDY, messages=[{"role": "assistant", "tool_calls": [call]}])
    assert refused.value.body["param"] == "messages"
