"""The throughput benchmark draws nano-vllm's workload exactly, so its tok/s compares with nano-vllm's numbers."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
from bench_throughput import nano_vllm_workload  # noqa: E402


def test_workload_is_nano_vllms():
    prompts, max_tokens = nano_vllm_workload(256, 1024, 1024)
    assert len(prompts) == len(max_tokens) == 256
    assert sum(max_tokens) == 133_966  # the output total nano-vllm's README reports for this benchmark
    assert all(100 <= len(p) <= 1024 for p in prompts) and all(100 <= n <= 1024 for n in max_tokens)
    assert all(0 <= t <= 10_000 for p in prompts for t in p)
