"""Tool calls and reasoning parsed out of model output (nanojax/tool_calls.py, nanojax/reasoning.py), whole and in
streamed pieces: each output is also fed one character at a time, which splits every tag at every place. Then the
formats against real chat templates (tests/data/chat_templates, each naming its source on its first line)."""
import json
import re
from pathlib import Path
from types import SimpleNamespace

import llguidance
import pytest
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from nanojax.front import RequestFront
from nanojax.reasoning import ReasoningParser
from nanojax.serve_protocol import ChatMessage
from nanojax.tool_calls import ToolCallParser, call_text, forced_call_grammar, template_inputs, tool_format

HERMES = tool_format("{{ '<tool_call>' }}{% for tool in tools %}{% endfor %}")
LLAMA3 = tool_format("{% if tools %}Environment: ipython{% endif %}")
PLAIN = tool_format("{% for m in messages %}{{ m['content'] }}{% endfor %}")
WEATHER = {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}}, "required": ["city"]}}


def parsed(parser_type, arg, pieces: list[str]) -> list[tuple]:
    """What a parser_type(arg) returns for each of `pieces`, then at the end."""
    parser = parser_type(arg)
    return [parser.feed(p) for p in pieces] + [parser.feed("", final=True)]


def tool_calls(fmt, text, pieces=None):
    outs = parsed(ToolCallParser, fmt, pieces or [text])
    return "".join(t for t, _ in outs), [c["function"] for _, cs in outs for c in cs]


@pytest.mark.parametrize("split", [False, True])
def test_hermes_calls_between_text_whole_and_streamed(split):
    text = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call> done <tool')
    content, calls = tool_calls(HERMES, text, list(text) if split else None)
    assert content == "Let me check. \n done <tool"
    assert calls == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}, {"name": "get_time", "arguments": "{}"}]


def test_streamed_text_waits_only_for_what_may_be_a_tag():
    parser = ToolCallParser(HERMES)
    assert parser.feed("Hi <to") == ("Hi ", [])  # "<to" may begin a call
    assert parser.feed("p> <tool_call>") == ("<top> ", [])
    assert parser.feed('{"name": "f", "argu') == ("", [])  # inside a call: nothing until it closes
    text, calls = parser.feed('ments": {"x": 1}}</tool_call>!')
    assert text == "!" and calls[0]["function"] == {"name": "f", "arguments": '{"x": 1}'}
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function" and parser.calls == 1


def test_malformed_calls_stay_text_and_an_unclosed_last_call_is_read():
    bad = '<tool_call>\n{"name": "f", "arguments": {"x": }\n</tool_call>'
    no_name = '<tool_call>{"arguments": {}}</tool_call>'
    assert tool_calls(HERMES, bad + no_name) == (bad + no_name, [])
    assert tool_calls(HERMES, '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n') == (
        "", [{"name": "f", "arguments": '{"x": 1}'}])
    assert tool_calls(HERMES, '<tool_call>\n{"name": "f", "argu') == ('<tool_call>\n{"name": "f", "argu', [])


@pytest.mark.parametrize("split", [False, True])
def test_a_llama3_bare_json_call_only_as_the_whole_output(split):
    text = ' {"name": "get_weather", "parameters": {"city": "Oslo"}}'
    assert tool_calls(LLAMA3, text, list(text) if split else None) == (
        "", [{"name": "get_weather", "arguments": '{"city": "Oslo"}'}])
    prose = 'The call would be {"name": "f", "parameters": {}}'
    assert tool_calls(LLAMA3, prose, list(prose) if split else None) == (prose, [])
    assert parsed(ToolCallParser, LLAMA3, list(prose))[0] == ("T", [])  # plain text streams as it comes
    for not_one_call in (text + "; " + text, text + " and more"):
        assert tool_calls(LLAMA3, not_one_call) == (not_one_call, [])


def test_formats_come_from_the_chat_template():
    assert (HERMES.native, HERMES.open, HERMES.args_key) == (True, "<tool_call>\n", "arguments")
    assert (LLAMA3.native, LLAMA3.open, LLAMA3.args_key) == (True, "", "parameters")
    assert (PLAIN.native, PLAIN.open) == (False, "<tool_call>\n") and tool_format(None) == PLAIN


def test_a_template_without_tools_gets_them_in_the_system_message_and_the_history_as_hermes_text():
    tools = [{"type": "function", "function": WEATHER}]
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"},
               {"role": "assistant", "content": "", "tool_calls": [call]},
               {"role": "tool", "content": "-3 C", "tool_call_id": "call_1"}]
    messages, template_tools = template_inputs(PLAIN, history, tools)
    assert template_tools is None and [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[0]["content"].startswith("Be brief.\n\n# Tools") and json.dumps(tools[0]) in messages[0]["content"]
    assert messages[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert messages[3]["content"] == "<tool_response>\n-3 C\n</tool_response>"
    assert template_inputs(PLAIN, history[1:2], tools)[0][0]["role"] == "system"  # a system message of its own
    # a template that renders tools gets them as they are, each result named after the function its call called
    assert template_inputs(HERMES, history, tools) == ([*history[:3], {**history[3], "name": "get_weather"}], tools)


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3])
def test_the_forced_call_grammar_takes_valid_calls_only(fmt):
    time = {"name": "get_time", "parameters": {"type": "object", "properties": {}}}
    valid = [call_text(fmt, "get_weather", {"city": "Oslo", "unit": "c"}), call_text(fmt, "get_time", {})]
    invalid = [call_text(fmt, "get_weather", {"unit": "c"}), call_text(fmt, "get_wether", {"city": "Oslo"}),
               call_text(fmt, "get_weather", {"city": "Oslo", "unit": "k"}), "Sure! " + valid[0]]
    single = forced_call_grammar(fmt, [WEATHER, time], parallel=False)
    several = forced_call_grammar(fmt, [WEATHER, time], parallel=True)
    assert accepts(single, valid[0]) and accepts(single, valid[1]) and not any(accepts(single, t) for t in invalid)
    if fmt.separator is None:  # Llama 3's: one call
        assert several == single
        return
    both = fmt.separator.join(valid)
    assert accepts(several, both) and not accepts(single, both)
    assert tool_calls(fmt, both)[1] == [{"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'},
                                        {"name": "get_time", "arguments": "{}"}]


def accepts(lark: str, text: str) -> bool:
    """Whether the grammar matches the whole text (checked byte by byte, with no tokenizer)."""
    grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    assert llguidance.LLMatcher.validate_grammar(grammar) == ""
    tokenizer = llguidance.LLTokenizer("byte")
    matcher = llguidance.LLMatcher(tokenizer, grammar)
    return matcher.consume_tokens(tokenizer.tokenize_str(text)) and matcher.is_accepting()


# ----- reasoning -----
def reasoning_split(prompt_tail, text, pieces=None):
    outs = parsed(ReasoningParser, prompt_tail, pieces or [text])
    return "".join(r for r, _ in outs), "".join(c for _, c in outs)


@pytest.mark.parametrize("split", [False, True])
def test_reasoning_opened_by_the_output_or_by_the_prompt(split):
    def split_of(prompt_tail, text):
        return reasoning_split(prompt_tail, text, list(text) if split else None)

    assert split_of("<|im_start|>assistant\n", "<think>\nHmm, 2+2.\n</think>\n\n4") == ("\nHmm, 2+2.\n", "\n\n4")
    assert split_of("<|im_start|>assistant\n<think>\n", "Hmm.</think>4") == ("Hmm.", "4")  # Qwen3-2507, DeepSeek-R1
    assert split_of("assistant\n", "4, no <think> here") == ("", "4, no <think> here")
    assert split_of("<think>\n\n</think>\n\n", "4") == ("", "4")  # Qwen3 with thinking turned off
    assert split_of("<think>\n", "cut off while thinking") == ("cut off while thinking", "")


def test_streamed_reasoning_waits_only_for_what_may_be_a_tag():
    parser = ReasoningParser("")
    assert parser.feed(" <thi") == ("", "")
    assert parser.feed("nk>Hmm </th") == ("Hmm ", "")
    assert parser.feed("ink> 4") == ("", " 4")
    assert parser.feed("</think>") == ("", "</think>")


# ----- real chat templates -----
TOOLS = [{"type": "function", "function": {**WEATHER, "description": "The weather in a city."}}]  # Hermes' needs it
QUESTION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris and Oslo?"}]
TEMPERATURES = {"Paris": "18 C", "Oslo": "-3 C"}
END_OF_TURN = re.compile(r"(<\|im_end\|>|<\|eot_id\|>)\s*$")  # special tokens: not in the decoded output


def chat_tokenizer(name: str) -> PreTrainedTokenizerFast:
    """A tokenizer with the real chat template `name` (its one-word vocabulary is of no matter: prompts are read as
    text)."""
    template = (Path(__file__).parent / "data" / "chat_templates" / f"{name}.jinja").read_text()
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]")),
                                   unk_token="[UNK]", bos_token="<|begin_of_text|>", chat_template=template)


def server_inputs(tokenizer, messages: list[dict]) -> tuple[list[dict], list]:
    """(messages, tools) as the server hands a chat request's to the template (nanojax/serve.py's chat_prompt)."""
    inputs = [ChatMessage(**m).as_template_input() for m in messages]
    return template_inputs(tool_format(tokenizer.chat_template), inputs, TOOLS)


def prompt(tokenizer, messages: list[dict], add_generation_prompt=True, **template_kwargs) -> str:
    return tokenizer.apply_chat_template(*server_inputs(tokenizer, messages), tokenize=False,
                                         add_generation_prompt=add_generation_prompt, **template_kwargs)


def history(cities: list[str]) -> list[dict]:
    """The assistant's calls of get_weather for `cities` and their results, as a client sends them back."""
    calls = [{"id": f"call_{c}", "type": "function",
              "function": {"name": "get_weather", "arguments": json.dumps({"city": c})}} for c in cities]
    return [{"role": "assistant", "content": None, "tool_calls": calls},
            *({"role": "tool", "tool_call_id": f"call_{c}", "content": TEMPERATURES[c]} for c in cities)]


def test_the_real_templates_formats():
    assert tool_format(chat_tokenizer("qwen3").chat_template) == HERMES
    assert tool_format(chat_tokenizer("hermes").chat_template) == HERMES
    assert tool_format(chat_tokenizer("llama3.1").chat_template) == LLAMA3


# Each template's prompt for QUESTION and history(): its start, its listing of the tools (where it puts them) and its
# end: the calls and their results in the template's own form, then the generation prompt.
ROUND_TRIPS = {
    "qwen3": ("<|im_start|>system\nBe brief.\n\n# Tools\n\n", f"<tools>\n{json.dumps(TOOLS[0])}\n</tools>",
              '<|im_start|>user\nWeather in Paris and Oslo?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n{"name": '
              '"get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", '
              '"arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n18 C\n'
              "</tool_response>\n<tool_response>\n-3 C\n</tool_response><|im_end|>\n<|im_start|>assistant\n"),
    "hermes": ("<|begin_of_text|>You are a function calling AI model.",
               f'"parameters": {json.dumps(WEATHER["parameters"])}}} </tools>',
               '<|im_start|>user\nWeather in Paris and Oslo?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n{ '
               '"arguments": {"city": "Paris"}, "name": "get_weather"}\n</tool_call> \n<tool_call>\n{ "arguments": '
               '{"city": "Oslo"}, "name": "get_weather"}\n</tool_call> <|im_end|>\n<|im_start|>tool\n<tool_response>\n'
               '{"name": "get_weather", "content": "18 C"}\n</tool_response> <|im_end|>\n<|im_start|>tool\n'
               '<tool_response>\n{"name": "get_weather", "content": "-3 C"}\n</tool_response> <|im_end|>\n'
               "<|im_start|>assistant\n"),
    # in the user's message; one call a turn
    "llama3.1": ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n",
                 f"{json.dumps(TOOLS[0], indent=4)}\n\nWeather in Paris and Oslo?<|eot_id|>",
                 '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", "parameters": {"city": '
                 '"Paris"}}<|eot_id|><|start_header_id|>ipython<|end_header_id|>\n\n"18 C"<|eot_id|>'
                 "<|start_header_id|>assistant<|end_header_id|>\n\n"),
}


@pytest.mark.parametrize("name", ROUND_TRIPS)
def test_tools_calls_and_results_through_the_real_template(name):
    tokenizer = chat_tokenizer(name)
    start, listing, end = ROUND_TRIPS[name]
    one_call = tool_format(tokenizer.chat_template).separator is None
    text = prompt(tokenizer, QUESTION + history(["Paris"] if one_call else ["Paris", "Oslo"]))
    assert text.startswith(start) and listing in text and text.endswith(end)
    if one_call:  # parallel calls in the history: the template refuses them, a ValueError (the server's 400)
        with pytest.raises(ValueError, match="the chat template refused these messages: This model only supports"):
            RequestFront.apply_chat_template(SimpleNamespace(tokenizer=tokenizer),
                                             *server_inputs(tokenizer, QUESTION + history(["Paris", "Oslo"])))


def reply(fmt, prompt_tail: str, pieces: list[str]) -> tuple[str, str, list[dict]]:
    """(reasoning, content, calls) of an output fed in `pieces`, read as the server reads a chat's: its reasoning split
    off first (nanojax/serve.py's _MessageParser)."""
    thinking, calling = ReasoningParser(prompt_tail), ToolCallParser(fmt)
    reasoning, content, calls = "", "", []
    for k, piece in enumerate(pieces + [""]):
        more_reasoning, more_content = thinking.feed(piece, final=k == len(pieces))
        more_content, more_calls = calling.feed(more_content, final=k == len(pieces))
        reasoning, content, calls = reasoning + more_reasoning, content + more_content, calls + more_calls
    return reasoning, content, [c["function"] for c in calls]


QWEN3_CALLS = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')


# Outputs as each model writes them after its template's prompt (given template_kwargs). Llama 3.1 may open a call
# with <|python_tag|>: a special token, not in the output's text (decoded without special tokens).
@pytest.mark.parametrize("name, template_kwargs, output, reasoning, cities", [
    ("qwen3", {}, f"<think>\nThe user wants two cities' weather.\n</think>\n\n{QWEN3_CALLS}",
     "\nThe user wants two cities' weather.\n", ["Paris", "Oslo"]),
    ("qwen3", {"enable_thinking": False}, QWEN3_CALLS, "", ["Paris", "Oslo"]),
    ("qwen3", {"enable_thinking": False}, QWEN3_CALLS.split("\n<tool_call>")[0], "", ["Paris"]),
    ("hermes", {}, '<tool_call>\n{"arguments": {"city": "Paris"}, "name": "get_weather"}\n</tool_call>', "",
     ["Paris"]),
    ("llama3.1", {}, '{"name": "get_weather", "parameters": {"city": "Paris"}}', "", ["Paris"]),
], ids=["qwen3-thinking", "qwen3-parallel", "qwen3", "hermes", "llama3.1"])
def test_calls_as_the_models_write_them_whole_and_streamed(name, template_kwargs, output, reasoning, cities):
    tokenizer = chat_tokenizer(name)
    fmt = tool_format(tokenizer.chat_template)
    tail = prompt(tokenizer, QUESTION, **template_kwargs)[-24:]  # the prompt's end (the server decodes 4 tokens)
    whole = reply(fmt, tail, [output])
    assert whole[0] == reasoning and whole[1].strip() == ""
    assert whole[2] == [{"name": "get_weather", "arguments": json.dumps({"city": c})} for c in cities]
    for size in (1, 3, 7):  # streamed in pieces that split the tags at every place
        assert reply(fmt, tail, [output[i:i + size] for i in range(0, len(output), size)]) == whole


@pytest.mark.parametrize("name", ROUND_TRIPS)
def test_a_forced_call_rendered_back_through_the_real_template_parses_the_same(name):
    """tool_choice "required": what the grammar lets the model write is parsed into calls; sent back in the history,
    they render in the template's form, which parses into the same calls."""
    tokenizer = chat_tokenizer(name)
    fmt = tool_format(tokenizer.chat_template)
    forced = [call_text(fmt, "get_weather", {"city": c}) for c in ("Paris", "Oslo")]
    output = forced[0] if fmt.separator is None else fmt.separator.join(forced)
    assert accepts(forced_call_grammar(fmt, [WEATHER], parallel=True), output)
    _, calls = ToolCallParser(fmt).feed(output, final=True)
    asked = prompt(tokenizer, QUESTION)
    turn = prompt(tokenizer, [*QUESTION, {"role": "assistant", "content": None, "tool_calls": calls}],
                  add_generation_prompt=False)
    assert turn.startswith(asked)
    assert tool_calls(fmt, END_OF_TURN.sub("", turn[len(asked):]))[1] == [c["function"] for c in calls]
