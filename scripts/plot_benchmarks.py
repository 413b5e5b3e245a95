"""Plots decode tok/s against batch size from bench_decode.py's JSON: nanojax (Pallas, XLA reference) and the HF
peers of the same run, one panel per context.

    python scripts/plot_benchmarks.py decode.json --out docs/decode_qwen3-0.6b.png   # needs matplotlib
"""
import argparse
import json
from pathlib import Path


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("decode_json")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = json.loads(Path(args.decode_json).read_text())
    points = results["points"] + [p for p in results.get("peers", []) if "tok_s" in p]
    steps = max(p.get("steps", 0) for p in results["points"])
    points = [p for p in points if p.get("steps", steps) == steps]
    contexts = sorted({p["context"] for p in points})
    fig, axes = plt.subplots(1, len(contexts), figsize=(6 * len(contexts), 4.5), squeeze=False)
    labels = {"pallas": "nanojax (Pallas kernels)", "reference": "nanojax (XLA reference)",
              "hf-eager": "HF transformers generate (eager)", "hf-compiled": "HF static cache + torch.compile"}
    for ax, context in zip(axes[0], contexts):
        for kind, label in labels.items():
            series = sorted((p["batch"], p["tok_s"]) for p in points
                            if p["kernels"] == kind and p["context"] == context)
            if series:
                ax.plot(*zip(*series), marker="o", label=label)
        ax.set(xscale="log", yscale="log", xlabel="batch size", ylabel="decode tokens/s",
               title=f"{results['model']}, context {context}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{results['device']}, {steps} decode steps per dispatch", fontsize=9)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
