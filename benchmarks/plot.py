"""Bar chart of step time per contender from ``e2e.py --json`` files (one panel per file);
whiskers span the middle half of the steps (quartiles) where the file has them.

    python benchmarks/plot.py benchmarks/results/<date>-<commit>/e2e_fp32.json -o benchmarks/e2e.png
"""

from __future__ import annotations

import argparse
import json
import statistics


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
        colors = ["#4c72b0" if n.startswith(("zero", "offload", "engine", "noprefetch", "atstep", "gloored")) else
                  "#dd8452" if n.startswith("ds") else "#8c8c8c" for n in names]
        spread = None
        if all("steps" in run["results"][n] and len(run["results"][n]["steps"]) > 1 for n in names):
            quart = [statistics.quantiles(run["results"][n]["steps"], n=4) for n in names]
            spread = [[m - q[0] for m, q in zip(med, quart)], [q[2] - m for m, q in zip(med, quart)]]
        ax.bar(names, med, color=colors, yerr=spread, capsize=3, ecolor="#333333")
        mode = {True: ", interleaved", False: ", a world each"}.get(run.get("interleave"), "")
        ax.set_title(f"{run['precision']}, grad_accum {run['grad_accum']}{mode} (median of {run['steps']} steps, "
                     "quartiles)")
        ax.set_ylabel("s/step, slowest rank")
        ax.tick_params(axis="x", rotation=45)
        for i, m in enumerate(med):  # inside the bar, clear of the whiskers
            ax.text(i, m * 0.03, f"{m:.2f}", ha="center", va="bottom", fontsize=8, color="white")
    fig.suptitle("zfunc (blue), DeepSpeed 0.19.8 (orange), torch DDP/FSDP2 (grey): 2 gloo ranks, GPT 4 x 512")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(args.out)


if __name__ == "__main__":
    main()
