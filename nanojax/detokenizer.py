"""Incremental detokenization: each update decodes only the tokens since the last complete text, not the whole
output again (which is quadratic in its length)."""


class Detokenizer:
    """Text of a growing token list. Tokens are decoded from `prefix_offset`, and the text they add beyond the
    decode of [prefix_offset, read_offset) is appended once it no longer ends in an incomplete character (U+FFFD);
    decoding from a few tokens back keeps tokenizers that strip a leading space right (as vLLM's detokenizer)."""

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
