"""Loading an HF folder: the second start in a fresh process takes the normalized config and the tokenizer's class
and length from the cache, without importing transformers' auto classes (they import torch: 3-6 s of a start), and
gets the same model and tokenizer."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TINY

from convert.sources import config_as_written
from nanojax import default_model

CONFIGS = Path(__file__).parents[1] / "scripts" / "configs"  # published config.json files of real models

CHILD = """
import json, sys
from nanojax.loader import load_model
known = []
loaded = load_model(sys.argv[1], "float32", on_config=lambda k: known.append(("transformers" in sys.modules,
                                                                              k.config)))
m = loaded.resolved()
print(json.dumps({"auto": "transformers.models.auto" in sys.modules, "vocab_limit": loaded.vocab_limit(),
                  "on_config": [(imported, config == loaded.config) for imported, config in known],
                  "config": repr(m.config), "class": type(m.tokenizer).__name__, "size": len(m.tokenizer),
                  "ids": m.tokenizer("The capital of France is Paris. ünï 123").input_ids,
                  "chat": m.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                          add_generation_prompt=True),
                  "eos": m.tokenizer.eos_token_id}))
"""


def test_second_load_needs_no_auto_classes(hf_model_dir, tmp_path):
    src, _ = hf_model_dir("qwen3")
    folder = tmp_path / "model"
    shutil.copytree(src, folder)
    tokenizer_dir = Path(default_model.default_checkpoint())  # SmolLM2's tokenizer files
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, folder / name)
    env = dict(os.environ, NANOJAX_CACHE=str(tmp_path / "cache"), PYTHONPATH=str(Path(__file__).parents[1]))
    runs = [json.loads(subprocess.run([sys.executable, "-c", CHILD, str(folder)], env=env, check=True,
                                      capture_output=True, text=True).stdout.splitlines()[-1]) for _ in range(2)]
    first, second = runs
    assert first["auto"], "the first load asks transformers' auto classes"
    assert not second["auto"]
    # The config as config.json states it comes first, before transformers is imported, and is the normalized one.
    assert first["on_config"] == second["on_config"] == [[False, True]]
    assert {k: v for k, v in first.items() if k != "auto"} == {k: v for k, v in second.items() if k != "auto"}
    assert first["vocab_limit"] == min(first["size"], 97)  # the tiny qwen3's embedding rows
    assert len(list((tmp_path / "cache" / "answers").rglob("*.json"))) == 2  # the config, the tokenizer's class


def test_a_changed_tokenizer_is_asked_again(hf_model_dir, tmp_path, monkeypatch):
    """The remembered class is keyed by the tokenizer files' contents: another tokenizer is not given a stale one."""
    from convert.sources import load_hf_tokenizer

    monkeypatch.setenv("NANOJAX_CACHE", str(tmp_path / "cache"))
    tokenizer_dir = Path(default_model.default_checkpoint())
    folder = tmp_path / "tok"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, folder / name)
    first = load_hf_tokenizer(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["model_max_length"] = 77
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    second = load_hf_tokenizer(folder)
    assert (first.model_max_length, second.model_max_length) == (first.model_max_length, 77)
    assert len(list((tmp_path / "cache" / "answers" / "tokenizer").glob("*.json"))) == 2


def test_placed_parts_equal_the_host_params(hf_model_dir):
    """place= sends each converted part to the device while the next ones convert (what LLM does on one device):
    every leaf is a device array, equal to the host conversion."""
    import jax
    import numpy as np

    from nanojax.loader import load_model

    src, _ = hf_model_dir("qwen3")
    placed_parts = []

    def place(part):
        placed_parts.append(part)
        return jax.device_put(part)

    host, placed = load_model(str(src), "float32").params, load_model(str(src), "float32", place=place).params
    assert len(placed_parts) == len(host["layers"]) + 1  # the layers, then the rest
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(placed))
    jax.tree.map(np.testing.assert_array_equal, host, placed)


def test_the_first_tokenizer_pick_does_not_hold_up_the_weights(hf_model_dir, tmp_path, monkeypatch):
    """At an empty cache AutoTokenizer picks the tokenizer's class on the tokenizer's thread: load_model converts the
    weights meanwhile, and the length is there once the pick is."""
    import threading

    import transformers

    from nanojax.loader import load_model

    monkeypatch.setenv("NANOJAX_CACHE", str(tmp_path / "cache"))
    src, _ = hf_model_dir("qwen3")
    folder = tmp_path / "model"
    shutil.copytree(src, folder)
    tokenizer_dir = Path(default_model.default_checkpoint())
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, folder / name)
    picking, go_on = threading.Event(), threading.Event()
    pick = transformers.AutoTokenizer.from_pretrained

    def held_pick(*args, **kwargs):
        picking.set()
        assert go_on.wait(60)
        return pick(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", held_pick)
    loaded = load_model(str(folder), "float32")  # returns with the pick still held
    assert picking.wait(60) and not loaded.tokenizer.done() and loaded.params["layers"]
    go_on.set()
    assert loaded.vocab_limit() == min(len(loaded.resolved().tokenizer), 97)


@pytest.mark.parametrize("name", sorted(TINY))
def test_config_as_written_is_the_normalized_one(hf_model_dir, name):
    """config.json as transformers writes it, read without transformers (for the compile workers' early hand-out),
    gives the config of transformers' normalized form."""
    folder, _ = hf_model_dir(name)
    assert config_as_written(folder) == _normalized(folder / "config.json")


def test_published_configs_as_written_are_the_normalized_ones(tmp_path):
    """So do real models' config.json files as published (transformers 4's rope fields); a file that leaves fields
    to transformers' defaults gives none (the hand-out then waits for the normalized config)."""
    published = sorted(CONFIGS.glob("*.json"))
    assert published
    for path in published:
        (tmp_path / "config.json").write_text(path.read_text())
        written = config_as_written(tmp_path)
        assert written == _normalized(path) or written is None and path.name == "tiny-llama.json", path.name


def _normalized(config_file: Path):
    from convert.config import ModelConfig
    from convert.sources import normalized_hf_config

    return ModelConfig.from_hf_config(normalized_hf_config(json.loads(config_file.read_text())))


def test_on_config_comes_before_the_weights(hf_model_dir, monkeypatch):
    """on_config gets the config and the tokenizer's length as they are before any weight is read (LLM hands compile
    workers their programs from them while the weights convert)."""
    import convert.checkpoint

    from nanojax.loader import load_model

    src, _ = hf_model_dir("qwen3")
    events, parts = [], convert.checkpoint._parts
    monkeypatch.setattr(convert.checkpoint, "_parts", lambda *a, **k: events.append("weights") or parts(*a, **k))
    known = []
    loaded = load_model(str(src), "float32", on_config=lambda k: events.append("config") or known.append(k))
    assert events == ["config", "weights"] and known[0].params is None
    assert known[0].config == loaded.config and known[0].vocab_limit() == loaded.vocab_limit()
