"""Tool calls and reasoning parsed out of model output (nanojax/tool_calls.py, nanojax/reasoning.py), whole and in
streamed pieces: each output is also fed one character at a time, which splits every tag at every place."""
import json

import llguidance
import pytest

from nanojax.reasoning import ReasoningParser
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
