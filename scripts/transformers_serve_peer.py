"""`transformers serve` as the serving benchmark's peer: HF's own OpenAI-compatible server over its continuous
batching, run as a subprocess on the random-weight model that nanojax serves.

What transformers 5.17's serve takes (read from transformers/cli/serve.py and cli/serving/): `/v1/completions`
accepts a text `prompt` only (no token ids) and refuses any field outside OpenAI's schema (ignore_eos,
return_token_ids: 422); `--attn-implementation` must be eager|sdpa|flash_attention_*|flex_attention (continuous
batching turns sdpa into `paged|sdpa` itself); `--device` is a `device_map`, which needs `accelerate`; its import
needs fastapi, uvicorn, pydantic and openai (`openai.types`). So the model is saved with a tokenizer whose ids
round-trip through text (token i is the word "ti", a WordLevel over the model's whole vocabulary) and without an
EOS token (its continuous batching then disables EOS: every request runs to max_tokens, as `ignore_eos` does for
nanojax).
"""
import os
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path


def prompt_text(token_ids: list[int]) -> str:
    """The text the peer's tokenizer (save_peer_folder) turns back into exactly these ids."""
    return " ".join(f"t{i}" for i in token_ids)


def save_peer_folder(hf_model, folder: Path) -> Path:
    """Saves the HF model (EOS removed) and a round-trip tokenizer over its vocabulary into `folder`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab_size = hf_model.config.vocab_size
    # No special tokens (the server's streaming decoder skips those): the unknown word is none of the ids' words,
    # and prompts hold none.
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf_model.config.eos_token_id = hf_model.generation_config.eos_token_id = None
    hf_model.save_pretrained(folder)
    PreTrainedTokenizerFast(tokenizer_object=words).save_pretrained(folder)
    return folder


# `transformers serve` itself (its Serve command under typer, as the CLI registers it) without the rest of the CLI,
# whose `chat` command imports packages serving does not need (requests, yaml).
SERVE = "import typer; from transformers.cli.serve import Serve; typer.run(Serve)"


class TransformersServe:
    """`transformers serve FOLDER --continuous-batching` on a free port of 127.0.0.1, its output in `log`."""

    def __init__(self, folder: Path, log: Path, dtype: str, device: str, extra_args: str = "",
                 start_timeout: float = 300.0):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url, self.log = f"http://127.0.0.1:{port}", log
        command = [sys.executable, "-c", SERVE, str(folder),
                   "--continuous-batching", "--attn-implementation", "sdpa", "--device", device, "--dtype", dtype,
                   "--host", "127.0.0.1", "--port", str(port), *shlex.split(extra_args)]
        # Offline: no Hub look-ups, no PyPI update check.
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_UPDATE_CHECK": "1"}
        self.command = shlex.join(command)
        with open(log, "w") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        self._wait_healthy(start_timeout)

    def _wait_healthy(self, timeout: float) -> None:
        """The forced model is loaded before the port opens, so /health answering means it can serve."""
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"`{self.command}` exited ({self.process.returncode}):\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"`{self.command}` did not answer /health in {timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
