"""HF transformers peers for the benchmarks, timed on the same random weights as nanojax (scripts/random_model.py).

- `decode_tok_s(model, batch, context, steps, compiled=False)`: decode tokens/s at a batch size and context.
  Eager: `model.generate` (dynamic cache), the time of `steps` more new tokens (two generate calls differenced, so
  the prefill cancels). Compiled: a static KV cache (`transformers.StaticCache`) and one greedy decode step under
  `torch.compile(mode="reduce-overhead")` (CUDA graphs). HF's own generate + static cache + reduce-overhead fails
  on this stack ("accessing tensor output of CUDAGraphs that has been overwritten by a subsequent run": generate
  keeps the logits of the previous step), so the loop is written here: each step marks a new CUDA-graph step and
  clones the token it keeps.
- `generate_tok_s(model, prompts, max_tokens, temperature, batch)`: nano-vllm's throughput workload through
  `model.generate` (eager, left-padded batches, sampling, EOS ignored); output tokens counted as nano-vllm does
  (sum of max_tokens) over the wall time, prefill included.
"""
import time

import torch


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@torch.no_grad()
def decode_tok_s(model, batch: int, context: int, steps: int, compiled: bool = False, seed: int = 0) -> float:
    ids = torch.randint(0, 10000, (batch, context), generator=torch.Generator().manual_seed(seed)).to(model.device)
    if not compiled:
        def run(n):
            _sync()
            t0 = time.perf_counter()
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0)
            _sync()
            return time.perf_counter() - t0

        run(2)  # warm-up
        return batch * steps / (run(steps + 1) - run(1))
    return batch * steps / _static_compiled_decode_seconds(model, ids, steps)


def _static_compiled_decode_seconds(model, ids, steps: int) -> float:
    from transformers import StaticCache

    batch, context = ids.shape
    cache = StaticCache(config=model.config, max_cache_len=context + steps + 8)
    logits = model(ids, past_key_values=cache, cache_position=torch.arange(context, device=ids.device),
                   use_cache=True, logits_to_keep=1).logits
    token = logits[:, -1].argmax(-1, keepdim=True)

    def step(token, position):
        out = model(token, past_key_values=cache, cache_position=position, position_ids=position[None].expand(
            token.shape[0], 1), use_cache=True)
        return out.logits[:, -1].argmax(-1, keepdim=True)

    fn = torch.compile(step, mode="reduce-overhead", fullgraph=True) if ids.is_cuda else torch.compile(step)
    position = context

    def run(n):
        nonlocal token, position
        for _ in range(n):
            if ids.is_cuda:
                torch.compiler.cudagraph_mark_step_begin()
            token = fn(token, torch.tensor([position], device=ids.device)).clone()
            position += 1

    run(3)  # compile, record the CUDA graph, replay
    _sync()
    t0 = time.perf_counter()
    run(steps - 3)
    _sync()
    return (time.perf_counter() - t0) / (steps - 3) * steps


@torch.no_grad()
def generate_tok_s(model, prompts: list[list[int]], max_tokens: list[int], temperature: float,
                   batch: int) -> tuple[float, float]:
    """-> (output tokens per second, wall seconds). Requests run in batches of `batch`, each batch generating up
    to its longest max_tokens (HF has no per-request stop in one batch), left-padded."""
    _sync()
    t0 = time.perf_counter()
    for start in range(0, len(prompts), batch):
        group = prompts[start:start + batch]
        width = max(map(len, group))
        ids = torch.zeros((len(group), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(group):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        n = max(max_tokens[start:start + batch])
        model.generate(ids.to(model.device), attention_mask=mask.to(model.device), max_new_tokens=n,
                       min_new_tokens=n, do_sample=True, temperature=temperature, top_k=None, top_p=None,
                       pad_token_id=0)
    _sync()
    seconds = time.perf_counter() - t0
    return sum(max_tokens[:len(prompts)]) / seconds, seconds
