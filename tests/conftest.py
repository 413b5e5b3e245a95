"""Shared fixtures: tiny random HF models saved with save_pretrained (float32), and the HF greedy oracle."""
import gc
import os

# The tests' programs (tiny models') compile for seconds and run for milliseconds: XLA's older elemental emitters
# without LLVM's optimizations compile them several times faster, in the tests' processes and those they start. Not
# where there is an NVIDIA GPU: the optimization level is the GPU backend's too, and the GPU tests run real kernels.
FAST_COMPILE_XLA_FLAGS = "" if os.path.exists("/dev/nvidiactl") else (
    "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false")
# NANOJAX_TEST_DEVICES: host devices for the tensor-parallel tests (test_tensor_parallel.py runs itself with 8).
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={os.environ.get('NANOJAX_TEST_DEVICES', '1')}"
                                   f" {FAST_COMPILE_XLA_FLAGS}")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One thread per process for torch's operators (the HF references) and the processes tests start: CI runs two workers
# on two cores, and an operator split over two threads waited at each of its joins for a core the other worker held.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

# Small configs covering each architecture's flags: GQA ratios 1..4, head_dim from config or hidden/heads,
# tied and untied embeddings, odd vocabulary sizes, biases, Llama 3 rope scaling, top-2 of 8 experts with and without
# the top-k weights renormalized, a shared expert (Qwen2-MoE).
TINY = {
    "llama": dict(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=101, tie_word_embeddings=False,
                  max_position_embeddings=256),
    "llama3": dict(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                   num_attention_heads=8, num_key_value_heads=2, head_dim=16, vocab_size=131,
                   tie_word_embeddings=True, max_position_embeddings=256, attention_bias=True,
                   rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 32}),
    "qwen2": dict(model_type="qwen2", hidden_size=56, intermediate_size=80, num_hidden_layers=2,
                  num_attention_heads=7, num_key_value_heads=1, vocab_size=103, tie_word_embeddings=True,
                  max_position_embeddings=256),
    "qwen3": dict(model_type="qwen3", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, head_dim=32, vocab_size=97,
                  tie_word_embeddings=False, max_position_embeddings=256),
    "ernie4_5": dict(model_type="ernie4_5", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=1, head_dim=16, vocab_size=99, use_bias=True,
                     max_position_embeddings=256),
    "gpt2": dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=95, n_positions=256),
    "qwen3_moe": dict(model_type="qwen3_moe", hidden_size=64, moe_intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=89, num_experts=8,
                      num_experts_per_tok=2, norm_topk_prob=False, tie_word_embeddings=False,
                      max_position_embeddings=256),
    "qwen2_moe": dict(model_type="qwen2_moe", hidden_size=64, moe_intermediate_size=32, num_hidden_layers=2,
                      shared_expert_intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, vocab_size=79,
                      num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, tie_word_embeddings=False,
                      max_position_embeddings=256),
    "mixtral": dict(model_type="mixtral", hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=83, num_local_experts=8,
                    num_experts_per_tok=2, tie_word_embeddings=False, max_position_embeddings=256),
}


def pytest_collection_modifyitems(items):
    """The modules with a test marked `long` first, each led by its long tests: pytest-xdist hands tests out in this
    order, and a long one handed out last ran alone on one of CI's two cores for its last ~5 minutes. A module's tests
    stay together, so that its module-scoped fixtures (a compiled LLM) are built once."""
    long_modules = {item.module for item in items if item.get_closest_marker("long")}
    first = {}
    for i, item in enumerate(items):
        first.setdefault(item.module, i)
    items.sort(key=lambda item: (item.module not in long_modules, first[item.module],
                                 item.get_closest_marker("long") is None))


@pytest.fixture(autouse=True, scope="module")
def free_compiled_programs():
    """Frees each module's compiled programs after it: every XLA:CPU executable keeps its JIT code in memory maps of
    its own (~90 for an interpret-mode kernel), and a worker that kept a whole run's passed the kernel's
    vm.max_map_count (65,530), where the next compile segfaulted."""
    yield
    jax.clear_caches()
    gc.collect()


def requires_gpu(test):
    """Marks a test `gpu` and skips it unless jax runs on a GPU."""
    return pytest.mark.gpu(pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")(test))


def build_hf_model(spec: dict, seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(spec)
    config = AutoConfig.for_model(kw.pop("model_type"), **kw)
    config.bos_token_id = config.eos_token_id = config.pad_token_id = None
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():  # larger than HF's init so logits are well separated and greedy has no near-ties
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model


@pytest.fixture(scope="session")
def hf_model_dir(tmp_path_factory):
    """hf_model_dir(name) -> (folder with config.json + model.safetensors, the torch model)."""
    made = {}

    def make(name: str):
        if name not in made:
            model = build_hf_model(TINY[name])
            folder = tmp_path_factory.mktemp(name)
            model.save_pretrained(folder)
            made[name] = (folder, model)
        return made[name]

    return make


def hf_greedy(model, prompt: list[int], num_tokens: int) -> list[int]:
    """The oracle: greedy continuation by full HF forwards (no HF cache involved)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(num_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(torch.argmax(logits)))
    return ids[len(prompt):]


def random_prompts(vocab: int, lengths, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lengths]
