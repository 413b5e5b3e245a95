"""A GGUF file's byte-level BPE tokenizer (`tokenizer.ggml.model` "gpt2") as an HF fast tokenizer, built with
`tokenizers` alone: transformers' GGUF reader imports torch, which nanojax does not depend on. The rules are
transformers' (integrations/gguf); tests/test_gguf_source.py checks that both give the same ids.
"""
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

# Token types in `tokenizer.ggml.token_type` (llama.cpp's llama_token_type).
CONTROL, USER_DEFINED = 3, 4

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")  # digits one at a time
# `tokenizer.ggml.pre` -> the regex that splits text before BPE; None: GPT-2's own, which transformers uses for
# every name it does not map. Other names are left to transformers.
PRE_TOKENIZER_SPLITS = {
    "default": None, "gpt2": None, "smollm": None, "gpt-2": None, "starcoder": None, "refact": None,
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT, "falcon3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT, "megrez": _QWEN2_SPLIT,
}


def can_build(model: str, pre: str | None, has_merges: bool) -> bool:
    """Whether build() handles this vocabulary (else transformers' GGUF loader must, which needs torch)."""
    return model == "gpt2" and has_merges and (pre or "default") in PRE_TOKENIZER_SPLITS


def byte_alphabet() -> dict[int, str]:
    """GPT-2's map from bytes to printable characters, in which byte-level vocabularies are spelled."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(others)}}


def build(tokens: list[str], merges: list[str], token_types: list[int] | None, pre: str | None, *,
          bos: str | None, eos: str | None, add_bos: bool, add_eos: bool) -> Tokenizer:
    """The backend tokenizer of a byte-level BPE vocabulary (can_build must hold); bos / eos: the tokens add_bos /
    add_eos put around every encoded sequence."""
    spelling = byte_alphabet()
    alphabet = set(spelling.values())
    # A token written in plain UTF-8 (some converters do that for added tokens) is respelled to keep its id.
    vocab = {token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8")): index
             for index, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges], dropout=None,
                                     continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    split = PRE_TOKENIZER_SPLITS[pre or "default"]
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False) if split is None else \
        pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    types = token_types or []
    # A CONTROL token spelled outside the byte alphabet is a llama.cpp mislabel; adding it would grow the vocabulary.
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t, kind in zip(tokens, types)
                                  if kind == CONTROL and set(t) <= alphabet])
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t, kind in zip(tokens, types)
                          if kind == USER_DEFINED and t in vocab])
    if add_bos or add_eos:
        def around(sequence, type_id):  # e.g. "<s>:0 $A:0"
            return [f"{bos}:{type_id}"] * add_bos + [f"{sequence}:{type_id}"] + [f"{eos}:{type_id}"] * add_eos

        specials = {t: vocab[t] for t, on in ((bos, add_bos), (eos, add_eos)) if on}
        tokenizer.post_processor = processors.TemplateProcessing(
            single=" ".join(around("$A", 0)), pair=" ".join(around("$A", 0) + around("$B", 1)),
            special_tokens=list(specials.items()))
    return tokenizer
