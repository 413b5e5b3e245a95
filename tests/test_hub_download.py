"""`python -m convert org/name DST` downloads what the HF cache lacks, from a fake Hub on 127.0.0.1 (HF_ENDPOINT)
that serves a tiny random-weight repository the way huggingface_hub reads it: the revision's model info, the file
tree, and HEAD / GET on /{repo}/resolve/{revision}/{file}."""
import hashlib
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse

import numpy as np
import pytest

from convert import load_checkpoint, open_source, params_from_source

COMMIT = "0123456789abcdef0123456789abcdef01234567"
REPO = "acme/tiny-llama"
TOKEN = "hf_fake_test_token"


class FakeHub(ThreadingHTTPServer):
    def __init__(self, repos: dict[str, dict[str, bytes]]):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.repos, self.requests, self.cut = repos, [], set()  # cut: files whose download breaks midway

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # quiet
        pass

    def do_HEAD(self):
        self._serve(with_body=False)

    def do_GET(self):
        self._serve(with_body=True)

    def _serve(self, with_body: bool):
        path = urlparse(self.path).path.strip("/").split("/")
        self.server.requests.append((self.command, "/".join(path), {k.lower(): v for k, v in self.headers.items()}))
        if path[:2] == ["api", "models"]:  # /api/models/{org}/{name}/revision/{rev} or .../tree/{rev}
            files = self.server.repos.get("/".join(path[2:4]))
            if files is None:
                return self._send(404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"})
            if path[4] == "revision":
                info = {"id": "/".join(path[2:4]), "sha": COMMIT, "siblings": [{"rfilename": f} for f in files]}
            else:
                info = [{"type": "file", "path": f, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                        for f, data in files.items()]
            return self._send(200, json.dumps(info).encode(), {"Content-Type": "application/json"}, with_body)
        files = self.server.repos.get("/".join(path[:2]))
        name = "/".join(path[4:])
        if files is None or path[2:3] != ["resolve"] or name not in files:
            return self._send(404, b"not found", {"X-Error-Code": "EntryNotFound"})
        self._file(name, files[name], with_body)

    def _file(self, name: str, data: bytes, with_body: bool):
        headers = {"ETag": f'"{hashlib.sha256(data).hexdigest()}"', "X-Repo-Commit": COMMIT,
                   "Content-Type": "application/octet-stream"}
        if with_body and name in self.server.cut:
            if any(r[0] == "GET" and r[1].endswith(name) for r in self.server.requests[:-1]):
                return self._send(503, b"unavailable", {})  # a second try fails outright
            self.send_response(200)  # the first try: half the file, then the connection drops
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data[: len(data) // 2])
            self.wfile.flush()
            self.close_connection = True
            return None
        return self._send(200, data, headers, with_body)

    def _send(self, status: int, body: bytes, headers: dict, with_body: bool = True):
        self.send_response(status)
        for key, value in {**headers, "Content-Length": str(len(body))}.items():
            self.send_header(key, value)
        self.end_headers()
        if with_body:
            self.wfile.write(body)


@pytest.fixture
def hub(hf_model_dir):
    folder, _ = hf_model_dir("llama")
    files = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
    files["pytorch_model.bin"] = b"weights in a format nanojax does not read"  # must not be fetched
    server = FakeHub({REPO: files})
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server, folder
    server.shutdown()
    server.server_close()


def _convert(server, tmp_path, dst_name: str, repo: str = REPO, offline: bool = False):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_OFFLINE"))}
    env.update(HF_ENDPOINT=server.endpoint, HF_HOME=str(tmp_path / "hf-home"), HF_TOKEN=TOKEN,
               HF_HUB_OFFLINE="1" if offline else "0", HF_HUB_DISABLE_TELEMETRY="1")
    dst = tmp_path / dst_name
    out = subprocess.run([sys.executable, "-m", "convert", repo, str(dst), "--dtype", "float32"], env=env,
                         capture_output=True, text=True, timeout=120)
    return out, dst


def _assert_same_params(dst, folder):
    _, params, _ = load_checkpoint(dst)
    _, expected = params_from_source(open_source(folder), "float32")
    import jax

    assert jax.tree.structure(params) == jax.tree.structure(expected)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(expected)))


def test_model_id_is_downloaded_converted_and_then_read_offline(hub, tmp_path):
    server, folder = hub
    out, dst = _convert(server, tmp_path, "ckpt")
    assert out.returncode == 0, out.stderr[-3000:]
    _assert_same_params(dst, folder)
    fetched = {r[1].rsplit("/", 1)[-1] for r in server.requests if r[0] == "GET" and "/resolve/" in r[1]}
    assert fetched == {p.name for p in folder.iterdir()} and "pytorch_model.bin" not in fetched
    assert all(r[2].get("authorization") == f"Bearer {TOKEN}" for r in server.requests)
    snapshot = tmp_path / "hf-home" / "hub" / f"models--{REPO.replace('/', '--')}" / "snapshots" / COMMIT
    assert (snapshot / "model.safetensors").read_bytes() == (folder / "model.safetensors").read_bytes()

    seen = len(server.requests)
    out, dst = _convert(server, tmp_path, "ckpt-offline", offline=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert len(server.requests) == seen  # HF_HUB_OFFLINE=1: the cache alone
    _assert_same_params(dst, folder)


def test_missing_repo_is_a_clear_error(hub, tmp_path):
    out, dst = _convert(hub[0], tmp_path, "ckpt", repo="acme/no-such-model")
    assert out.returncode == 1
    assert "'acme/no-such-model': no such model on http://127.0.0.1" in out.stderr and "HF_TOKEN" in out.stderr
    assert not dst.exists()


def test_offline_and_not_cached_names_hf_hub_offline(hub, tmp_path):
    out, dst = _convert(hub[0], tmp_path, "ckpt", offline=True)
    assert out.returncode == 1
    assert "in the local Hugging Face cache" in out.stderr and "HF_HUB_OFFLINE=1" in out.stderr
    assert not dst.exists() and not hub[0].requests


def test_download_cut_midway_leaves_nothing_used_and_a_retry_succeeds(hub, tmp_path):
    server, folder = hub
    server.cut.add("model.safetensors")
    out, dst = _convert(server, tmp_path, "ckpt")
    assert out.returncode == 1 and "run again" in out.stderr, out.stderr[-3000:]
    assert not dst.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".ckpt")]
    snapshot = tmp_path / "hf-home" / "hub" / f"models--{REPO.replace('/', '--')}" / "snapshots" / COMMIT
    assert not (snapshot / "model.safetensors").exists()  # the half file never enters the snapshot

    out, _ = _convert(server, tmp_path, "ckpt", offline=True)  # what was cached is not taken for the model
    assert out.returncode == 1 and "HF_HUB_OFFLINE=1" in out.stderr

    server.cut.clear()
    out, dst = _convert(server, tmp_path, "ckpt")
    assert out.returncode == 0, out.stderr[-3000:]
    _assert_same_params(dst, folder)
