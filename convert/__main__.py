"""python -m convert SRC DST [--dtype bfloat16|float32] [--quantize fp8] [--overwrite]"""
import argparse
import sys

from convert.checkpoint import DTYPES, QUANTIZATIONS, convert


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m convert", description=__doc__.splitlines()[0])
    parser.add_argument("src", help="HF model folder, 'org/name' on the Hugging Face Hub (downloaded into its cache; "
                                    "HF_HUB_OFFLINE=1: the cache only), or a .gguf file")
    parser.add_argument("dst", help="output folder (written atomically)")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--quantize", default=None, choices=[q for q in QUANTIZATIONS if q],
                        help="projection weights in FP8 (E4M3, per-output-channel scales); the LM head stays in dtype")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing destination")
    args = parser.parse_args(argv)
    try:
        out = convert(args.src, args.dst, dtype=args.dtype, overwrite=args.overwrite, quantization=args.quantize)
    except ValueError as e:  # CheckpointError, ConfigError, GGUFError: each names what is wrong
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
