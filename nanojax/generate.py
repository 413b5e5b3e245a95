"""python -m nanojax.generate [--model M] --prompt "..." | --chat  — streams the reply, then one stats line.

On several hosts, the same command on each with --coordinator HOST:PORT --num-processes N --process-id I (or the
NANOJAX_* variables of nanojax.distributed): process 0 prompts and prints, the others run its steps."""
import argparse
import sys
import time

import jax

from nanojax import distributed
from nanojax.config import EngineConfig, add_model_flags
from nanojax.llm import LLM
from nanojax.sampling_params import SamplingParams


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m nanojax.generate", description=__doc__.split("—")[0].strip())
    add_model_flags(p)
    p.add_argument("--prompt", help="the prompt (required unless --chat)")
    p.add_argument("--chat", action="store_true", help="interactive multi-turn chat")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template to --prompt")
    for flag, kind, default in (("--max-tokens", int, 256), ("--temperature", float, 0.0), ("--top-k", int, 0),
                                ("--top-p", float, 1.0), ("--seed", int, None)):
        p.add_argument(flag, type=kind, default=default)
    p.add_argument("--tensor-parallel-size", type=int, default=None,
                   help="split the model over this many devices (default: one device; on several processes, "
                   "every device of every process)")
    p.add_argument("--coordinator", default=None, help=f"HOST:PORT of process 0, to run one model on several "
                   f"processes (default: ${distributed.ENV_COORDINATOR})")
    p.add_argument("--num-processes", type=int, default=None,
                   help=f"processes in the job (default: ${distributed.ENV_NUM_PROCESSES})")
    p.add_argument("--process-id", type=int, default=None,
                   help=f"this process's index, 0 prompts and prints (default: ${distributed.ENV_PROCESS_ID})")
    args = p.parse_args(argv)
    if not args.chat and args.prompt is None:
        p.error("--prompt is required unless --chat is given")
    return args


def stream_reply(llm: LLM, prompt_ids: list[int], params: SamplingParams) -> str:
    """Prints the reply as it is generated, then the stats line; returns the reply text."""
    start, final = time.perf_counter(), None
    for final in llm.stream([prompt_ids], params):
        print(final.delta, end="", flush=True)
    elapsed = time.perf_counter() - start
    ttft = final.time_to_first_token or elapsed
    decoded = max(len(final.token_ids) - 1, 0)
    rate = decoded / (elapsed - ttft) if elapsed > ttft and decoded else 0.0
    print(f"\n[prompt tokens {len(prompt_ids)} | generated {len(final.token_ids)} | time to first token "
          f"{ttft * 1e3:.0f} ms | decode {rate:.1f} tok/s | finish {final.finish_reason}]", file=sys.stderr)
    return final.text


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                max_tokens=args.max_tokens, seed=args.seed)
        distributed.initialize(args.coordinator, args.num_processes, args.process_id)
        llm = LLM(args.model, EngineConfig(dtype=args.dtype, max_model_len=args.max_model_len, max_num_seqs=1,
                                           tensor_parallel_size=args.tensor_parallel_size,
                                           quantization=args.quantization, speculative_config=args.speculative_config))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if jax.process_index() != 0:
        llm.follow()
        return 0
    try:
        return converse(llm, args, params)
    finally:
        llm.close()  # the other processes' follow() returns


def converse(llm: LLM, args, params: SamplingParams) -> int:
    """Streams the reply to --prompt, or chats until /exit or end of input."""
    templated = llm.tokenizer is not None and bool(llm.tokenizer.chat_template) and not args.raw
    if not args.chat:
        user = [{"role": "user", "content": args.prompt}]
        stream_reply(llm, llm.apply_chat_template(user) if templated else llm.encode(args.prompt), params)
        return 0
    messages = []
    while True:
        try:
            user = input("> ")
        except EOFError:
            return 0
        if user.strip() in ("/exit", "/quit"):
            return 0
        messages.append({"role": "user", "content": user})
        reply = stream_reply(llm, llm.apply_chat_template(messages), params)
        messages.append({"role": "assistant", "content": reply})


if __name__ == "__main__":
    sys.exit(main())
