"""Where nanojax keeps files between runs: `NANOJAX_CACHE` (default ~/.cache/nanojax) holds the default model, JAX's
compilation cache (`xla/`), compiled programs (`executables/`) and transformers' answers (`answers/`).

Files and conversions are written into a temporary folder `.NAME.tmp-*` and renamed into place. Its writer holds an
flock on the folder's WRITER_LOCK until done, which the kernel drops when the writer dies (kill -9 too), so the next
writer beside it removes what a killed one left; unlike a pid, a lock holds across pid namespaces and is not reused.
"""
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from importlib.metadata import version
from pathlib import Path
from typing import Any

TMP = ".tmp-"
WRITER_LOCK = ".writer.lock"
# A temporary folder without a lock file is being locked, or its writer died before locking it, or an older nanojax
# left it: abandoned once this old.
UNLOCKED_FOLDER_AGE_S = 60
# The default model (nanojax/default_model.py fetches and converts it).
MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    return Path(os.environ.get("NANOJAX_CACHE", "~/.cache/nanojax")).expanduser()


def default_checkpoint_path() -> Path:
    return cache_dir() / MODEL_NAME


def default_gguf_path() -> Path:
    return cache_dir() / "gguf" / GGUF_NAME


def remembered(kind: str, key: bytes, compute: Callable[[], Any]) -> Any:
    """compute()'s JSON value, kept per kind, key and transformers version: it saves importing transformers' auto
    classes, with torch (docs/perf_notes.md, "Transformers and the tokenizer"). An unwritable cache is no error."""
    digest = hashlib.sha256(key + version("transformers").encode()).hexdigest()
    path = cache_dir() / "answers" / kind / f"{digest}.json"
    with contextlib.suppress(OSError, ValueError):
        return json.loads(path.read_text())
    value = json.loads(json.dumps(compute()))  # as a later start reads it back (tuples become lists)
    with contextlib.suppress(OSError):
        write_whole(path, json.dumps(value).encode())
    return value


def write_whole(path: Path, data: bytes) -> None:
    """Writes `data` to `path` whole or not at all: a reader never sees half a file."""
    with temporary_folder(path.parent, path.name) as tmp:
        (tmp / path.name).write_bytes(data)
        os.replace(tmp / path.name, path)


@contextlib.contextmanager
def temporary_folder(parent: Path, name: str) -> Iterator[Path]:
    """A new folder `.NAME.tmp-HEX` in `parent`, locked while the block runs and removed after it unless
    `move_into_place` renamed it; what killed writers left in `parent` is removed first."""
    parent.mkdir(parents=True, exist_ok=True)
    for path in parent.glob(f".*{TMP}????????"):
        if path.is_dir() and _abandoned(path):  # folders only: a destination may lie among the user's own files
            shutil.rmtree(path, ignore_errors=True)
    tmp = parent / f".{name}{TMP}{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        with open(os.open(tmp / f"{WRITER_LOCK}.new", os.O_CREAT | os.O_WRONLY, 0o600), "wb") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            # Renamed once held: a lock file another process finds under its name is never one not yet locked.
            os.replace(tmp / f"{WRITER_LOCK}.new", tmp / WRITER_LOCK)
            yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def move_into_place(tmp: Path, dst: Path) -> None:
    """Renames the temporary folder `tmp` to `dst`, replacing it, without its lock file."""
    if dst.exists():
        shutil.rmtree(dst)
    (tmp / WRITER_LOCK).unlink()
    os.replace(tmp, dst)


def _abandoned(folder: Path) -> bool:
    try:
        # Opened for writing: NFS implements flock with fcntl locks, whose exclusive ones need it.
        fd = os.open(folder / WRITER_LOCK, os.O_RDWR)
    except FileNotFoundError:
        try:
            return time.time() - folder.stat().st_mtime > UNLOCKED_FOLDER_AGE_S
        except FileNotFoundError:  # renamed into place or removed meanwhile
            return False
    except OSError:  # e.g. another user's: not ours to remove
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held (BlockingIOError), or a file system that cannot tell
        return False
    finally:
        os.close(fd)
    return True
