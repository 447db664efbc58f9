"""Bar chart of step time per contender from ``e2e.py --json`` files (one panel per file).

    python benchmarks/plot.py benchmarks/e2e_fp32.json benchmarks/e2e_bf16.json -o benchmarks/e2e.png
"""

from __future__ import annotations

import argparse
import json


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("files", nargs="+")
    p.add_argument("-o", "--out", default="benchmarks/e2e.png")
    args = p.parse_args(argv)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [json.load(open(f)) for f in args.files]
    cols = min(2, len(runs))
    rows = -(-len(runs) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 4 * rows), squeeze=False)
    for ax, run in zip(axes.flat, runs):
        names = list(run["results"])
        med = [run["results"][n]["median"] for n in names]
        colors = ["#4c72b0" if n.startswith(("zero", "offload", "engine", "noprefetch", "atstep")) else
                  "#dd8452" if n.startswith("ds") else "#8c8c8c" for n in names]
        ax.bar(names, med, color=colors)
        ax.set_title(f"{run['precision']}, grad_accum {run['grad_accum']} (median of {run['steps']} steps)")
        ax.set_ylabel("s/step, slowest rank")
        ax.tick_params(axis="x", rotation=45)
        for i, m in enumerate(med):
            ax.text(i, m, f"{m:.2f}", ha="center", va="bottom", fontsize=8)
    fig.suptitle("zfunc (blue), DeepSpeed 0.19.8 (orange), torch DDP/FSDP2 (grey): one interleaved gloo world of 2")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(args.out)


if __name__ == "__main__":
    main()
