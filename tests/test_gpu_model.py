"""On the GPU: the model with the Pallas kernels gives HF's greedy tokens (float32, random weights of the real
Qwen3-0.6B and Llama-3.2-1B architectures), as does the reference path. Run with `pytest -m gpu`."""
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import requires_gpu

sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
from random_model import loaded_model, random_hf_model  # noqa: E402

from nanojax import LLM, SamplingParams  # noqa: E402


@requires_gpu
@pytest.mark.parametrize("name", ["qwen3-0.6b", "llama-3.2-1b"])
def test_kernels_and_reference_give_hf_greedy_tokens(name):
    import torch

    hf = random_hf_model(name, "float32")
    prompts = np.random.default_rng(0).integers(0, 10000, (3, 45)).tolist()
    prompts[1] = prompts[1][:17]  # lengths 45, 17, 45: not multiples of the page size
    with torch.no_grad():
        expected = [hf.generate(torch.tensor([p], device=hf.device), max_new_tokens=12, min_new_tokens=12,
                                do_sample=False)[0, len(p):].tolist() for p in prompts]
    loaded = loaded_model(hf, "float32")
    del hf
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for kernels in ("pallas", "reference"):
        llm = LLM(loaded, dtype="float32", kernels=kernels, max_model_len=128, max_num_seqs=4, decode_steps=4,
                  chunk_size=16, max_num_batched_tokens=32)  # chunked prefill: cached-prefix attention too
        assert [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == expected, kernels
        # Alone, a sequence decodes with one row: the M = 1 path of the fused projections.
        assert llm.generate(prompts[1], greedy, use_tqdm=False)[0].token_ids == expected[1], kernels
        del llm
