"""bench_kernels.py end to end on CPU (interpret mode, tiny shapes): every kernel matches its reference (--check)
and every section yields its rows."""
import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[1] / "scripts" / "bench_kernels.py"


def test_tiny_run_checks_and_reports_every_section(tmp_path):
    out = tmp_path / "bench.json"
    subprocess.run([sys.executable, str(SCRIPT), "--interpret", "--tiny", "--check", "--out", str(out)], check=True,
                   capture_output=True, text=True)
    rows = json.loads(out.read_text())["rows"]
    assert {r["kernel"] for r in rows} == {"rmsnorm_qkv", "o_proj_residual", "norm_gate_up_silu", "down_residual",
                                           "prefill_attention", "decode_attention"}
    assert all(r["ours_ms"] > 0 for r in rows)

