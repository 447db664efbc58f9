"""Per-step records: a line on stdout (or a progress bar on a terminal), a JSONL file, a plot.

Only rank 0 writes. `step_record` turns a state's device metrics into plain numbers (this is
where the host syncs, once per logged step).
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Sequence
from typing import IO, Any

from zfunc.core.state import TrainState

__all__ = ["MetricsLog", "step_record", "plot_run", "peak_memory_mib"]


def peak_memory_mib(device: Any = None) -> float:
    """Peak memory of this process so far: CUDA allocated on a GPU, resident set size on CPU.

    Examples:
        >>> from zfunc.tools.metrics import peak_memory_mib
        >>> peak_memory_mib() > 0
        True
    """
    import torch

    if device is not None and torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def step_record(state: TrainState) -> dict[str, float]:
    """The last step's metrics as Python numbers (reading them syncs with the device).

    Examples:
        >>> import torch, zfunc
        >>> from zfunc.tools.metrics import step_record
        >>> rec = step_record(zfunc.init(torch.nn.Linear(2, 1), zfunc.Config()))
        >>> sorted(rec)
        ['grad_norm', 'loss', 'loss_scale', 'lr', 'skipped', 'step']
    """
    m = state.metrics
    return {"step": int(state.step.item()), "loss": m.loss.item(), "grad_norm": m.grad_norm.item(),
            "loss_scale": m.loss_scale.item(), "skipped": int(m.skipped.item()), "lr": m.lr.item()}


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if math.isfinite(v) else str(v)
    return str(v)


class MetricsLog:
    """Writes per-step records on rank 0: JSONL to ``path``, a line per step to ``stream`` (a
    tqdm progress bar instead when ``stream`` is a terminal and tqdm is installed), and the
    numeric fields to TensorBoard under ``tensorboard`` when that package is installed.

    Examples:
        >>> import io
        >>> from zfunc.tools.metrics import MetricsLog
        >>> out = io.StringIO()
        >>> with MetricsLog(None, total=2, stream=out) as log:
        ...     log.write({"step": 1, "loss": 2.5})
        >>> print(out.getvalue().strip())
        step 1/2 | loss 2.5
    """

    def __init__(self, path: str | os.PathLike | None, *, rank: int = 0, total: int | None = None,
                 stream: IO[str] | None = None, bar: bool | None = None,
                 tensorboard: str | os.PathLike | None = None):
        self.rank, self.total = rank, total
        self.stream = stream if stream is not None else sys.stdout
        self.file = None
        self.bar = None
        self.tb = None
        if rank != 0:
            return
        if tensorboard is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard is optional
                pass
            else:
                self.tb = SummaryWriter(os.fspath(tensorboard))
        if path is not None:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self.file = open(path, "w")  # noqa: SIM115 - closed in close()
        if bar is None:
            bar = hasattr(self.stream, "isatty") and self.stream.isatty()
        if bar:
            try:
                from tqdm import tqdm
            except ImportError:
                bar = False
            else:
                self.bar = tqdm(total=total, file=self.stream, unit="step", dynamic_ncols=True)

    def write(self, record: dict[str, Any]) -> None:
        """Log one step's record (a no-op on ranks other than 0)."""
        if self.rank != 0:
            return
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        if self.tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.tb.add_scalar(f"train/{k}", v, record.get("step", 0))
        shown = " | ".join(f"{k} {_fmt(v)}" for k, v in record.items() if k != "step")
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix_str(shown)
        else:
            of = f"/{self.total}" if self.total else ""
            print(f"step {record.get('step', '?')}{of} | {shown}", file=self.stream, flush=True)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.tb is not None:
            self.tb.close()
        if self.bar is not None:
            self.bar.close()

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def plot_run(jsonl: str | os.PathLike, png: str | os.PathLike,
             keys: Sequence[str] = ("loss", "grad_norm", "loss_scale", "lr")) -> str:
    """Plot the ``keys`` of a JSONL run against its steps, one panel each, into ``png``.

    Needs matplotlib (``pip install zfunc[plot]``). Returns the PNG's path.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(jsonl) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    keys = [k for k in keys if any(k in r for r in rows)]
    fig, axes = plt.subplots(len(keys), 1, figsize=(7, 2.2 * len(keys)), sharex=True, squeeze=False)
    for ax, k in zip(axes[:, 0], keys):
        pts = [(r["step"], r[k]) for r in rows if k in r]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], lw=1.2)
        ax.set_ylabel(k)
        ax.grid(alpha=0.3)
        if k in ("loss_scale",) and all(p[1] > 0 for p in pts):
            ax.set_yscale("log", base=2)
    axes[-1, 0].set_xlabel("step")
    fig.suptitle(os.path.basename(str(jsonl)))
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return str(png)


def _main(argv: Sequence[str] | None = None) -> None:
    import argparse

    p = argparse.ArgumentParser(prog="python -m zfunc.tools.metrics", description="Plot a JSONL run to PNG.")
    p.add_argument("jsonl")
    p.add_argument("png", nargs="?")
    a = p.parse_args(argv)
    print(plot_run(a.jsonl, a.png or os.path.splitext(a.jsonl)[0] + ".png"))


if __name__ == "__main__":
    _main()
