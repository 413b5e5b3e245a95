"""The benchmarks' random weights drawn on the device (scripts/random_model.random_params) have the params tree that
converting the HF model gives: the same leaves, shapes and dtypes."""
import sys
from pathlib import Path

import jax
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
from random_model import loaded_model, random_hf_model, random_params  # noqa: E402


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3-moe", "tiny-qwen2-moe"])
def test_random_params_have_the_converted_tree(name):
    drawn = random_params(name)
    converted = loaded_model(random_hf_model(name, "bfloat16", device="cpu"), "bfloat16")
    assert drawn.config == converted.config
    shapes = lambda params: jax.tree.map(lambda x: (x.shape, str(x.dtype)), params)  # noqa: E731
    assert shapes(drawn.params) == shapes(converted.params)
