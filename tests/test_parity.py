"""Token-exact parity with HF transformers (float32, CPU) for every architecture, through the converter and
the public API, prefill and decode both."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from conftest import TINY, hf_greedy, random_prompts

from convert import open_source, params_from_source
from nanojax import LLM, SamplingParams
from nanojax.kv_cache import Batch, KVCache
from nanojax.model import Decoder, Projection, forward, lm_logits
from nanojax.ops import PALLAS_NORMED_PROJECTION_MAX_ROWS, Ops, kernel_support

ARCHS = sorted(TINY)
# The model through the Pallas kernels (in Pallas' interpreter) too, for every architecture whose head_dim they take.
KERNEL_ARCHS = [n for n in ARCHS if n != "qwen2"]  # the tiny qwen2 has head_dim 8


@pytest.mark.parametrize("name,ops", [(n, Ops()) for n in ARCHS] + [(n, Ops(pallas=True, interpret=True))
                                                                     for n in KERNEL_ARCHS],
                         ids=[f"{n}-reference" for n in ARCHS] + [f"{n}-pallas_interpret" for n in KERNEL_ARCHS])
def test_logits_prefill_and_decode_match_hf(hf_model_dir, name, ops):
    folder, model = hf_model_dir(name)
    config, params = params_from_source(open_source(folder), "float32")
    assert (kernel_support(config) is None) == (name in KERNEL_ARCHS)
    prompts = np.array(random_prompts(config.vocab_size, [11, 11], seed=1))
    page_size = 4  # 11 tokens: not a multiple of the page size
    page_table = jnp.array([[9, 2, 7, 4, 0], [1, 8, 3, 6, 5]], jnp.int32)  # shuffled pages
    cache = KVCache.create(config, 10, page_size, jnp.float32)
    batch = Batch(page_table=page_table, seq_lens=jnp.array([11, 11]), q_lens=jnp.array([11, 11]))
    hidden, cache = forward(params, jnp.array(prompts), cache, batch, config=config, ops=ops)
    with torch.no_grad():
        ref = model(torch.tensor(prompts)).logits.numpy()
    np.testing.assert_allclose(np.asarray(lm_logits(params, hidden)), ref, atol=1e-4, rtol=1e-4)

    ids = prompts
    for step in range(3):  # decode through the paged cache
        nxt = ref[:, -1].argmax(-1)[:, None]
        ids = np.concatenate([ids, nxt], axis=1)
        batch = Batch(page_table=page_table, seq_lens=jnp.array([ids.shape[1]] * 2), q_lens=jnp.array([1, 1]))
        hidden, cache = forward(params, jnp.array(nxt), cache, batch, config=config, ops=ops)
        with torch.no_grad():
            ref = model(torch.tensor(ids)).logits.numpy()
        np.testing.assert_allclose(np.asarray(lm_logits(params, hidden))[:, -1], ref[:, -1],
                                   atol=1e-4, rtol=1e-4)

    # One row alone: the single-row decode, where every fused projection kernel runs (ops.PALLAS_PROJECTION_MAX_ROWS).
    nxt = ref[:1, -1].argmax(-1)[:, None]
    ids = np.concatenate([ids[:1], nxt], axis=1)
    batch = Batch(page_table=page_table[:1], seq_lens=jnp.array([ids.shape[1]]), q_lens=jnp.array([1]))
    hidden, cache = forward(params, jnp.array(nxt), cache, batch, config=config, ops=ops)
    with torch.no_grad():
        ref = model(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(np.asarray(lm_logits(params, hidden))[:, -1], ref[:, -1], atol=1e-4, rtol=1e-4)


def test_projection_kernel_rows():
    """The fused projection kernel runs for one row without a norm and up to PALLAS_NORMED_PROJECTION_MAX_ROWS with
    one (there it replaces XLA's norm and GEMM); more rows take XLA's GEMM (faster there on the H100)."""
    ops, w = Ops(pallas=True, interpret=True), Projection({"w": jnp.ones((32, 48))})
    for rows, norm_eps, kernel in ((1, None, True), (2, None, False), (1, 1e-6, True), (2, 1e-6, True),
                                   (PALLAS_NORMED_PROJECTION_MAX_ROWS, 1e-6, True),
                                   (PALLAS_NORMED_PROJECTION_MAX_ROWS + 1, 1e-6, False)):
        jaxpr = str(jax.make_jaxpr(lambda x: ops.project(x, w, norm_eps=norm_eps))(jnp.ones((rows, 32))))
        assert ("pallas_call" in jaxpr) == kernel, (rows, norm_eps)


@pytest.mark.parametrize("name", [n for n in ARCHS if n != "mixtral"])  # one MoE model through the engine
def test_greedy_tokens_match_hf(hf_model_dir, name):
    folder, model = hf_model_dir(name)
    llm = LLM(str(folder), dtype="float32", page_size=8, max_model_len=128, decode_steps=4)
    prompts = random_prompts(llm.config.vocab_size, [5, 17, 1], seed=2)
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    batched = llm.generate(prompts, greedy, use_tqdm=False)
    for prompt, out in zip(prompts, batched):
        assert out.token_ids == hf_greedy(model, prompt, 32)
        assert out.finish_reason == "length"
    one_by_one = [llm.generate([p], greedy, use_tqdm=False)[0].token_ids for p in prompts]
    assert one_by_one == [o.token_ids for o in batched]


@pytest.mark.parametrize("name", ["gpt2", "qwen3", "mixtral"])
def test_the_modules_state_is_the_converted_params(hf_model_dir, name):
    """The decoder's Flax NNX state holds the converted arrays themselves, at the paths of the params' keys (layers
    by index): loading is handing the params over, nothing copied or renamed."""
    config, params = params_from_source(open_source(hf_model_dir(name)[0]), "float32")
    state = nnx.to_pure_dict(nnx.state(Decoder(config, params)))
    state["layers"] = tuple(state["layers"][i] for i in range(config.num_layers))
    body = {k: v for k, v in params.items() if k != "lm_head"}
    assert jax.tree.structure(state) == jax.tree.structure(body)
    assert all(a is b for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(body), strict=True))
