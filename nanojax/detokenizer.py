"""Incremental detokenization: each update decodes only the last few tokens, not the whole output again (quadratic)."""


class Detokenizer:
    """Text of a growing token list, appended once it no longer ends in an incomplete character (U+FFFD). Decoding
    from the previous update's tokens on (as vLLM does) keeps right the tokenizers that strip a leading space."""

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
