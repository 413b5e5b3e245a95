"""Where a constrained batch-1 request's time goes: the engine loop's functions timed (totals per token), against
plain decoding with the default steps per dispatch and with one step per dispatch (the runner called directly).
--batch N: N rows of each kind at once. --trace (a GPU): a constrained run and the masked one-step alone on a profiler timeline, per loop step (or call) the
mean time of the host's events inside it and of the GPU kernels that start inside it.

    PYTHONPATH=$PWD python3 scripts/probe_structured.py --tokenizer DIR [--model qwen3-0.6b] [--trace]
"""
import argparse
import collections
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_structured import row_speeds, schema  # noqa: E402
from gpu_trace import trace_events  # noqa: E402

from nanojax import LLM, SamplingParams  # noqa: E402
from nanojax import engine as engine_module, output as output_module, runner as runner_module, structured  # noqa: E402
from nanojax import scheduler as scheduler_module  # noqa: E402

TIMES = collections.defaultdict(float)
CALLS = collections.Counter()


def timed(cls, name, label=None):
    fn = getattr(cls, name)
    label = label or f"{cls.__name__}.{name}"

    def wrapper(*args, **kw):
        start = time.perf_counter()
        try:
            with jax.profiler.TraceAnnotation(label):  # (--trace's timeline)
                return fn(*args, **kw)
        finally:
            TIMES[label] += time.perf_counter() - start
            CALLS[label] += 1
    setattr(cls, name, wrapper)


def print_timeline(trace_dir: str, marker: str) -> None:
    """Per host event named `marker` (but the first 10 and last 5): the mean time of the host events that start inside
    it (over 15 us), of the GPU kernels that start inside it, and their first start to last end."""
    kernels, host = trace_events(trace_dir)
    spans = [(start, end) for name, start, end in host if name == marker][10:-5]
    per = collections.defaultdict(float)
    for s, e in spans:
        for name, start, end in host:
            if s <= start < e:
                per[f"host {name[:60]}"] += end - start
        inside = [(start, end) for _, start, end in kernels if s <= start < e]
        per["GPU kernels, busy"] += sum(end - start for start, end in inside)
        per["GPU kernels, first start to last end"] += inside[-1][1] - inside[0][0] if inside else 0
    print(f"\n{marker}: mean us over {len(spans)}")
    for label, ns in sorted(per.items(), key=lambda kv: -kv[1]):
        if label.startswith("GPU") or ns / len(spans) > 15e3:
            print(f"  {label:<70} {ns / len(spans) / 1e3:9.1f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--tiny", action="store_true", help="2 layers of width 64 (a CPU run: the host's share shows)")
    ap.add_argument("--trace", action="store_true", help="the profiler timeline (a GPU)")
    ap.add_argument("--batch", type=int, default=1, help="rows of each kind at once (above 1: the loop's timers only)")
    args = ap.parse_args()
    from random_model import loaded_model, random_hf_model, saved_tokenizer

    tokenizer = saved_tokenizer(args.tokenizer)
    if args.tiny:
        import torch
        from random_model import hf_config
        from transformers import AutoModelForCausalLM
        torch.manual_seed(0)
        hf = AutoModelForCausalLM.from_config(hf_config(args.model, hidden_size=64, intermediate_size=128,
                                                        num_hidden_layers=2, num_attention_heads=4,
                                                        num_key_value_heads=2, head_dim=16)).eval()
    else:
        hf = random_hf_model(args.model, torch_dtype="bfloat16")
    loaded = loaded_model(hf)
    llm = LLM(type(loaded)(loaded.config, loaded.params, tokenizer), dtype="bfloat16", max_num_seqs=max(8, args.batch),
              max_model_len=1024)
    for cls, names in ((engine_module.EngineCore, ["_step", "_dispatch", "_prepare", "_constrain", "_complete",
                                                   "_publish"]),
                       (runner_module.ModelRunner, ["decode", "set_masks", "_run", "_inputs"]),
                       (runner_module.Pending, ["tokens"]),
                       (structured.Grammars, ["masks"]),
                       (output_module.OutputProcessor, ["accept", "update_text", "event"]),
                       (output_module.Request, ["sampling_row"]),
                       (scheduler_module.Scheduler, ["schedule", "advance", "fill"])):
        for name in names:
            timed(cls, name)
    prompts = np.random.default_rng(0).integers(0, len(tokenizer) - 1000, (args.batch, 32)).tolist()
    free = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    bound = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True,
                           structured_outputs={"json": schema()})
    for params in (free, bound, free, bound):
        TIMES.clear(), CALLS.clear()
        start = time.perf_counter()
        speed = np.mean(row_speeds(llm, prompts, [params] * args.batch))
        wall = time.perf_counter() - start
        host = TIMES["EngineCore._step"] - TIMES["Pending.tokens"]
        print(f"\n{'constrained' if params is bound else 'plain'}: {speed:.1f} tok/s a row, wall {wall * 1e3:.1f} ms, "
              f"{CALLS['EngineCore._step']} loop steps, host {host / max(CALLS['Scheduler.fill'], 1) * 1e6:.0f} us "
              f"a dispatch besides waiting for tokens ({args.batch} rows)")
        for label in sorted(TIMES, key=TIMES.get, reverse=True):
            print(f"  {label:<28} {TIMES[label] * 1e3:9.2f} ms  {CALLS[label]:5d} calls  "
                  f"{TIMES[label] / max(CALLS[label], 1) * 1e6:8.1f} us/call")
    if args.batch > 1:
        return
    prompt = prompts[0]
    # One step of a constrained row through the runner alone (dispatch, device, read back): its mask sent with the
    # step's inputs (the masked program), or written by set_masks first (two dispatches); then a plain step.
    r = llm.runner
    table, sampling = [list(range(4))], runner_module.greedy_sampling(1, r.tables.neutral)
    masks = ([0], np.full((1, r.tables.allowed.shape[1]), -1, np.int32))
    cases = {"masked one-step": lambda: r.decode([5], table, [40], sampling, 1, masks=masks),
             "set_masks + one-step": lambda: (r.set_masks(*masks), r.decode([5], table, [40], sampling, 1))[1],
             f"{r.decode_steps}-step, per step": lambda: r.decode([5], table, [40], sampling, r.decode_steps)}
    # The masked program again, compiled without XLA's command buffers (CUDA graphs): its kernels launched one by one.
    masked = runner_module.Program(1, 1, masked=True)
    graphs = r._program(masked)
    no_graphs = r.lower(masked).compile(compiler_options={**r.compiler_options(masked),
                                                          "xla_gpu_enable_command_buffer": ""})

    def without_graphs():
        r.install(masked, no_graphs)
        out = r.decode([5], table, [40], sampling, 1, masks=masks)
        r.install(masked, graphs)
        return out
    cases["masked one-step, no command buffers"] = without_graphs
    for _ in range(2):
        for label, run in cases.items():
            times = []
            for _ in range(40):
                t = time.perf_counter()
                run().tokens()
                times.append(time.perf_counter() - t)
            per = r.decode_steps if label.endswith("per step") else 1
            print(f"{label:<24} {np.median(times[10:]) / per * 1e3:.3f} ms")
    if args.trace:  # Python's own tracing off: it would slow the loop it measures
        options = jax.profiler.ProfileOptions()
        options.python_tracer_level = 0

        def alone():
            for _ in range(40):
                with jax.profiler.TraceAnnotation("masked one-step"):  # the call and its read back
                    cases["masked one-step"]().tokens()
        for marker, run in (("EngineCore._step", lambda: row_speeds(llm, [prompt], [bound])),
                            ("masked one-step", alone)):
            trace_dir = tempfile.mkdtemp()
            with jax.profiler.trace(trace_dir, profiler_options=options):
                run()
            print_timeline(trace_dir, marker)


if __name__ == "__main__":
    main()
