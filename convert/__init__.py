"""HF safetensors (folder or hub cache) and GGUF to the nanojax checkpoint."""
from convert.checkpoint import convert, is_checkpoint, load_checkpoint, params_from_source
from convert.keys import CheckpointError
from convert.sources import open_source

__all__ = ["convert", "is_checkpoint", "load_checkpoint", "params_from_source", "open_source", "CheckpointError"]
