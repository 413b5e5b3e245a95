"""A reasoning model's thinking (between `<think>` and `</think>`: Qwen3's, DeepSeek-R1's) split from its answer, from
the whole output or a piece at a time as it streams."""
REASONING_PARSERS = ("qwen3", "deepseek_r1")  # vLLM's names: both think between the same tags
START, END = "<think>", "</think>"


def held_back(text: str, tag: str) -> int:
    """Where the longest end of `text` that may be the beginning of `tag` starts (len(text) if none): what is kept
    until the next piece shows whether the tag is there."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return len(text) - size
    return len(text)


class ReasoningParser:
    """Splits output text into (reasoning, content): up to `</think>` it is reasoning if the prompt ends inside a
    `<think>` (templates that open it for the model) or the output opens one; the rest is content."""

    def __init__(self, prompt_tail: str):
        self.state = "reasoning" if prompt_tail.rstrip().endswith(START) else "start"
        self.pending = ""  # text not yet returned: it may be part of a tag

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """-> the (reasoning, content) that `text` adds; final: the output has ended, nothing is kept back."""
        self.pending += text
        if self.state == "start":
            head = self.pending.lstrip()
            if head.startswith(START):
                self.state, self.pending = "reasoning", head[len(START):]
            elif not final and START.startswith(head):  # may still become the opening tag
                return "", ""
            else:
                self.state = "content"
        reasoning = ""
        if self.state == "reasoning":
            at = self.pending.find(END)
            if at < 0:
                keep = len(self.pending) if final else held_back(self.pending, END)
                reasoning, self.pending = self.pending[:keep], self.pending[keep:]
                return reasoning, ""
            reasoning, self.pending, self.state = self.pending[:at], self.pending[at + len(END):], "content"
        content, self.pending = self.pending, ""
        return reasoning, content
