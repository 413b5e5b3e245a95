"""Tool calls: the format a chat template writes them in, the prompt's tools for a template that renders none, the
grammar that forces a call, and the calls parsed out of the output (whole, or a piece at a time as it streams)."""
import dataclasses
import json
import secrets

from nanojax.reasoning import held_back


@dataclasses.dataclass(frozen=True)
class ToolFormat:
    """A call is JSON {"name": ..., args_key: {...}} between `open` and `close`; calls are joined by `separator` (None:
    one call only). native: the chat template renders the tools, the calls and their results itself."""

    open: str
    close: str
    args_key: str
    separator: str | None
    native: bool


def tool_format(chat_template: str | None) -> ToolFormat:
    """Hermes' `<tool_call>` tags (Qwen's), Llama 3's bare JSON, or for a template without tools, Hermes' in text."""
    template = chat_template or ""
    if "ipython" in template and "<tool_call>" not in template:
        return ToolFormat("", "", "parameters", None, native=True)  # its template renders one call a turn
    return ToolFormat("<tool_call>\n", "\n</tool_call>", "arguments", "\n", native="<tool_call>" in template)


# Qwen2.5's own words, for a template that does not render tools
_TOOLS_PROMPT = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided "
                 "with function signatures within <tools></tools> XML tags:\n<tools>\n{}\n</tools>\n\nFor each "
                 "function call, return a json object with function name and arguments within <tool_call></tool_call> "
                 'XML tags:\n<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')


def template_inputs(fmt: ToolFormat, messages: list[dict], tools: list[dict] | None) -> tuple[list[dict], list | None]:
    """(messages, tools) for the chat template: as given if it renders tools, each result named after its function
    (OpenAI's results carry only the call's id; Hermes' template wants the name); else the tools listed in the system
    message, the calls written out in their assistant's messages and the results as a user's `<tool_response>`."""
    if fmt.native:
        names = {c["id"]: c["function"]["name"] for m in messages for c in m.get("tool_calls", ())}
        return [{"name": names[m["tool_call_id"]], **m} if m.get("tool_call_id") in names else m
                for m in messages], tools
    as_text = [_as_text(fmt, m) for m in messages]
    if tools:
        listing = _TOOLS_PROMPT.format("\n".join(json.dumps(t) for t in tools))
        system = [m["content"] for m in as_text[:1] if m["role"] == "system"]
        as_text[:len(system)] = [{"role": "system", "content": "\n\n".join(system + [listing])}]
    return as_text, None


def _as_text(fmt: ToolFormat, message: dict) -> dict:
    if message["role"] == "tool":
        return {"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"}
    calls = [call_text(fmt, c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", ())]
    return {"role": message["role"], "content": "\n".join([message["content"], *calls]).strip()}


def call_text(fmt: ToolFormat, name: str, arguments: dict) -> str:
    return f"{fmt.open}{json.dumps({'name': name, fmt.args_key: arguments})}{fmt.close}"


def forced_call_grammar(fmt: ToolFormat, functions: list[dict], parallel: bool) -> str:
    """A Lark grammar (llguidance's) for a call of one of `functions` (OpenAI's: name, parameters), or with `parallel`
    one or more where the format allows, whose arguments follow the function's parameters schema."""
    schema = {"anyOf": [{"type": "object", "required": ["name", fmt.args_key], "additionalProperties": False,
                         "properties": {"name": {"const": f["name"]},
                                        fmt.args_key: f.get("parameters") or {"type": "object"}}}
                        for f in functions]}
    more = f" ({json.dumps(fmt.separator)} call)*" if parallel and fmt.separator is not None else ""
    return f"start: call{more}\ncall: {json.dumps(fmt.open)} %json {json.dumps(schema)} {json.dumps(fmt.close)}"


class ToolCallParser:
    """Splits output text into text and tool calls (OpenAI's: id, type, function: name and arguments as JSON text). A
    call whose JSON does not parse, or has no name, stays text. Tagged calls may be anywhere in the text; Llama 3's
    bare JSON only as the whole output."""

    def __init__(self, fmt: ToolFormat):
        self.fmt, self.pending = fmt, ""  # pending: text not yet returned, it may be (part of) a call
        self.open_tag, self.close_tag = fmt.open.strip(), fmt.close.strip()
        # inside a call's tags; bare: whether the output is JSON (None until its first visible character)
        self.in_call = False if self.open_tag else None
        self.calls = 0

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        """-> the text and the calls that `text` completes; final: the output has ended, nothing is kept back."""
        self.pending += text
        texts, calls = [], []
        while self.open_tag and (at := self.pending.find(tag := (self.open_tag, self.close_tag)[self.in_call])) >= 0:
            self._take(self.pending[:at], tag, texts, calls)
            self.pending = self.pending[at + len(tag):]
            self.in_call = not self.in_call
        if self.in_call is None and self.pending.strip():
            self.in_call = self.pending.lstrip().startswith("{")
        if final:  # an unclosed call is read too: models often end before its tag; a bare one ends with the output
            self._take(self.pending, "", texts, calls)
            self.pending = ""
        elif self.in_call is False:
            keep = held_back(self.pending, self.open_tag)
            texts.append(self.pending[:keep])
            self.pending = self.pending[keep:]
        self.calls += len(calls)
        return "".join(texts), calls

    def _take(self, piece: str, closed_by: str, texts: list[str], calls: list[dict]) -> None:
        call = _call(piece, self.fmt) if self.in_call else None
        text = self.open_tag + piece + closed_by if self.in_call else piece
        (calls if call else texts).append(call or text)


def _call(text: str, fmt: ToolFormat) -> dict | None:
    """The call OpenAI's way from its JSON text, or None where it is not one."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not (isinstance(value, dict) and isinstance(value.get("name"), str)
            and isinstance(arguments := value.get(fmt.args_key, {}), dict)):
        return None
    return {"id": f"call_{secrets.token_hex(12)}", "type": "function",
            "function": {"name": value["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}}
