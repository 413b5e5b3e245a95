"""Reading a model folder's or checkpoint's files with errors that name the damaged one and how to get it whole."""
import json
from pathlib import Path

from convert.cache import default_checkpoint_path, default_gguf_path
from convert.keys import CheckpointError

MANIFEST = "manifest.json"


def read_json(path: Path) -> dict:
    """The JSON object in `path`; a missing, damaged or non-object file is a CheckpointError naming it."""
    try:
        value = json.loads(path.read_text())
        problem = None if isinstance(value, dict) else "not a JSON object"
    except FileNotFoundError:
        problem = "missing"
    except ValueError as e:  # UnicodeDecodeError too
        problem = f"not valid JSON ({e}): cut short or damaged"
    except OSError as e:
        problem = f"unreadable ({e.strerror})"
    if problem:
        raise CheckpointError(f"{path}: {problem}; {recovery(path.parent)}")
    return value


def recovery(path: Path) -> str:
    """How to get a whole copy of the damaged folder or file `path`."""
    path = Path(path).absolute()
    if path in (default_checkpoint_path().absolute(), default_gguf_path().absolute()):  # the default model's
        return f"delete {path} and run again: nanojax makes it again"
    if (path / MANIFEST).is_file():
        return f"convert it again: {convert_command(path)}"
    if path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        return f"delete {path.parent.parent} and run again with the model id: it is downloaded again"
    return f"copy or download {path} again"


def convert_command(path: Path) -> str:
    """The command that converts the checkpoint at `path` again, as its manifest records (SRC if it cannot say)."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):  # read_json would call back here
        manifest = {}
    manifest = manifest if isinstance(manifest, dict) else {}
    options = [f"--dtype {manifest['dtype']}"] if "dtype" in manifest else []
    options += [f"--quantize {manifest['quantization']}"] if manifest.get("quantization") else []
    return " ".join(["python -m convert", str(manifest.get("source", "SRC")), str(path), *options, "--overwrite"])
