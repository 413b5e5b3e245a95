#!/usr/bin/env bash
# First device session: environment, GPU kernel tests, kernel benchmark, decode benchmark (Qwen3-0.6B).
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv
python3 -c "import jax, flax, orbax.checkpoint, transformers, triton; print(jax.__version__, flax.__version__, transformers.__version__, triton.__version__, jax.devices())"
timeout 150 python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/test_paged_attention.py tests/test_rmsnorm_matmul.py > $OUT/gpu_tests.log 2>&1; echo "gpu tests rc=$?"; tail -25 $OUT/gpu_tests.log
timeout 200 python3 scripts/bench_kernels.py --check --repeats 5 --out $OUT/kernels.json > $OUT/bench_kernels.log 2>&1; echo "bench_kernels rc=$?"; tail -45 $OUT/bench_kernels.log
timeout 200 python3 scripts/bench_decode.py --model qwen3-0.6b --batches 1 8 64 --contexts 512 --ttft 512 --out $OUT/decode.json > $OUT/decode.log 2>&1; echo "bench_decode rc=$?"; grep -v Warn $OUT/decode.log | tail -20
