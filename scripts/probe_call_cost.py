"""A one-step dispatch's host cost, taken apart: the compiled program's call against its buffers' addresses (XLA
updates a program's CUDA graph where an argument's or result's address changed since its last run: its packed
inputs', its results' while the previous ones are held), against how XLA builds its graph (the scheduling mode, the
Pallas kernels left out of it), against its number of array arguments, and beside graphs of as many small kernels.

    PYTHONPATH=$PWD python3 scripts/probe_call_cost.py --tokenizer DIR

Qwen3-0.6B with random weights, the masked one-step decode of one row (a constrained row alone); medians, ms a token
(host: until the call returns; total: until its results are ready).
"""
import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

sys.path.insert(0, str(Path(__file__).parent))
from random_model import random_llm, saved_tokenizer  # noqa: E402

from nanojax import runner as R  # noqa: E402
from pallas_kernels._compat import triton_params  # noqa: E402


def timed(fn, calls=60, skip=10, hold=False) -> tuple[float, float]:
    """fn() -> (seconds until the call returned, its results) -> (host ms, total ms), medians. hold: each call's
    results kept until the next call has returned (as the engine held a step's results before 6e0a64f)."""
    host, total, held = [], [], None
    for _ in range(calls):
        start = time.perf_counter()
        seconds, results = fn()
        jax.block_until_ready(results)
        host.append(seconds)
        total.append(time.perf_counter() - start)
        held = results if hold else None  # noqa: F841 -- (what keeps them)
        del results
    return np.median(host[skip:]) * 1e3, np.median(total[skip:]) * 1e3


def _masked_step(r) -> tuple:
    """(the masked one-step Program of one row, runner.decode's arguments for it, a function packing its inputs)."""
    table, sampling = [list(range(4))], R.greedy_sampling(1, r.tables.neutral)
    masks = ([0], np.full((1, r.tables.allowed.shape[1]), -1, np.int32))
    p = R.Program(1, 1, masked=True)

    def packed():
        return R.pack((R._padded([5], 1), *r._inputs(p, R._stacked(table, 1, r.pages_per_seq), [40], [1], sampling),
                       R._padded([1], 1), R._padded((), 1, -1), r._mask_rows(1, *masks)))[0]
    return p, ([5], table, [40], sampling, 1), masks, packed


def _caller(r, program):
    """call(inputs) -> (seconds until program returned, its results), inputs() giving its packed inputs."""
    def call(inputs):
        start = time.perf_counter()
        *outs, r.last, r.cache, r.tables = program(r.params, r.cache, r.tables, r.last, inputs())
        return time.perf_counter() - start, outs
    return call


def address_cases(r) -> dict:
    """The masked one-step program, its packed inputs given as runner.decode gives them (a numpy buffer), already on
    the device at one address, put there afresh, or copied into one donated device buffer by a program of its own."""
    p, args, masks, packed = _masked_step(r)
    r.decode(*args, masks=masks).tokens()
    call, on_device, staged = _caller(r, r._program(p)), jax.device_put(packed()), [jax.device_put(packed())]
    stage = jax.jit(lambda buffer, host: buffer.at[:].set(host), donate_argnums=(0,))

    def staged_inputs():
        staged[0] = stage(staged[0], packed())
        return staged[0]

    def runner():
        start = time.perf_counter()
        out = r.decode(*args, masks=masks)._out
        return time.perf_counter() - start, out

    return {"runner.decode": runner, "inputs on the device, one address": lambda: call(lambda: on_device),
            "numpy inputs": lambda: call(packed), "a fresh device_put": lambda: call(lambda: jax.device_put(packed())),
            "a donated staging copy": lambda: call(staged_inputs)}


def graph_cases(r) -> dict:
    """The masked one-step program compiled with XLA's graph (command buffer) options changed, its inputs on the
    device at one address."""
    p, _, _, packed = _masked_step(r)
    on_device = jax.device_put(packed())
    options = {"scheduled SERIALIZE": {"xla_gpu_command_buffer_scheduling_mode": "SERIALIZE"},
               "scheduled CONCURRENT": {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"},
               "Pallas kernels outside the graph": {
                   "xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUDNN,DYNAMIC_SLICE_FUSION"}}
    calls = {label: _caller(r, r.lower(p).compile(compiler_options={**r.compiler_options(p), **option}))
             for label, option in options.items()}
    return {f"masked one-step, {label}": lambda call=call: call(lambda: on_device) for label, call in calls.items()}


def _sine(x_ref, o_ref):
    o_ref[...] = jnp.sin(x_ref[...]) * 1.001


def kernel_cases(n: int = 358) -> dict:
    """A program of n small kernels in a row (the masked one-step's count): XLA fusions, or Pallas (Triton) kernels."""
    interpret = jax.default_backend() != "gpu"
    kw = {} if interpret else {"compiler_params": triton_params(4, 1)}

    def chain(x, pallas):
        for i in range(n):
            x = (pl.pallas_call(_sine, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=interpret, **kw)(x)
                 if pallas else jax.lax.optimization_barrier(jnp.sin(x) * (1 + i * 1e-3)))
        return x
    x = jax.device_put(np.ones((1, 4096), np.float32))
    cases = {}
    for label, pallas in (("XLA fusions", False), ("Pallas kernels", True)):
        program = jax.jit(lambda x, pallas=pallas: chain(x, pallas)).lower(x).compile()

        def call(program=program):
            start = time.perf_counter()
            out = program(x)
            return time.perf_counter() - start, out
        cases[f"{n} {label} in a row"] = call
    return cases


def leaf_cases() -> dict:
    """A trivial program called with n arrays (unused but kept) beside a small state."""
    cases = {}
    for n in (1, 10, 50, 170, 400):
        params = {f"w{i}": jnp.full((256, 1024), i, jnp.bfloat16) for i in range(n)}
        program = jax.jit(lambda params, state, host: (state + host[0], host.sum()), keep_unused=True).lower(
            params, jnp.zeros(1024), np.zeros(4096, np.float32)).compile()
        state = [jnp.zeros(1024)]

        def call(program=program, params=params, state=state):
            start = time.perf_counter()
            state[0], total = program(params, state[0], np.zeros(4096, np.float32))
            return time.perf_counter() - start, total
        cases[f"{n} array arguments"] = call
    return cases


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--calls", type=int, default=60)
    args = ap.parse_args()
    llm = random_llm(args.model, saved_tokenizer(args.tokenizer), max_num_seqs=8, max_model_len=1024)
    skip = min(10, args.calls // 2)
    cases = [(label + held, run, bool(held)) for held in ("", ", results held") for label, run in
             address_cases(llm.runner).items()] + [(label, run, False) for label, run in (
                 *graph_cases(llm.runner).items(), *kernel_cases().items(), *leaf_cases().items())]
    rows = [(label, *timed(run, args.calls, skip, hold)) for _ in range(2) for label, run, hold in cases]
    print(f"{'case':<52} {'host ms':>8} {'total ms':>9}")
    for label, host, total in rows:
        print(f"{label:<52} {host:8.3f} {total:9.3f}")


if __name__ == "__main__":
    main()
