"""Benchmark of zfunc's optimizer phase against the torch composition doing the same work.

For each size and thread count it times (median and minimum of ``--repeats`` after warm-up,
with ``time.perf_counter``; zfunc and torch runs alternate so both see the same machine load):

(a) zfunc's whole optimizer phase: ``overflow_sumsq`` over the scaled gradient, a clip
    coefficient from it (device ops), then ``fused_adam`` with unscale, clip, AdamW and the
    bf16 compute copy;
(b) the torch composition doing the same: ``torch._amp_foreach_non_finite_check_and_unscale_``
    (``GradScaler.unscale_``), ``clip_grad_norm_``, ``AdamW(fused=True)``, a copy to bf16;
(c) zfunc Adam alone against torch's fused AdamW alone;
(d) zfunc Adam over two parameter groups (weight decay on one half of the arena only): one
    fused pass per group's run, as ``apply_step`` does with ``zfunc.ParamGroup``s, against (c);
(e) DeepSpeedCPUAdam, when ``deepspeed`` imports;
(f) the floor: an njit parallel kernel that only moves the 28 bytes per parameter an fp32 Adam
    step must move (read p, g, m, v; write p, m, v).

With ``--muon`` it times Muon instead, on the matrices of a GPT (``--d-model``, ``--layers``):

(g) zfunc's Muon step (``apply_step`` at world 1: the overflow and norm pass, the momentum pass,
    Newton-Schulz per matrix, the update pass) against ``torch.optim.Muon.step()`` on the same
    matrices and gradients, Newton-Schulz in bfloat16 (torch's) and in float32 (``ns_dtype``);
(h) the distributed step's exchange, from the layouts alone (no processes): the bytes a rank
    receives per model parameter for the Muon matrices that cross a shard boundary, against a
    ZeRO-1 AdamW step's reduce-scatter of the gradient and all-gather of the parameters (fp32).

Effective GB/s divide the bytes the task must move by the time: 28 B/param for an Adam step,
34 B/param for the phase (4 to read the gradient for its norm, 28 for Adam, 2 for the bf16
copy), the same numerator for zfunc and torch. Gradients are restored from a copy before each
timed phase (untimed), so unscaling never drives them into subnormals. The thread count is
torch's (``torch.set_num_threads``), which ``zfunc_kernels`` passes on to numba.

Usage::

    PYTHONPATH=. python benchmarks/optimizer.py [--sizes 10M,50M] [--threads 1,2]
                                                [--repeats 10] [--device cpu|cuda]
    PYTHONPATH=. python benchmarks/optimizer.py --muon [--d-model 512] [--layers 4] [--repeats 10]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from collections.abc import Callable

import numba
import numpy as np
import torch

import zfunc_kernels
from machine import cpu_line

INV_SCALE = 2.0**-16
MAX_NORM = 1.0
HYPER = zfunc_kernels.AdamHyper(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
PHASE_BYTES = 34
ADAM_BYTES = 28


@numba.njit(cache=True, error_model="numpy")
def _traffic_block(p: np.ndarray, g: np.ndarray, m: np.ndarray, v: np.ndarray) -> None:
    for i in range(p.size):
        gi = g[i]
        m[i] = m[i] + gi
        v[i] = v[i] + gi
        p[i] = p[i] + gi


@numba.njit(parallel=True, cache=True, error_model="numpy")
def adam_traffic(p: np.ndarray, g: np.ndarray, m: np.ndarray, v: np.ndarray) -> None:
    """Reads p, g, m, v and writes p, m, v once: the memory floor of an fp32 Adam step."""
    block = 1 << 14
    n = p.size
    for b in numba.prange((n + block - 1) // block):
        lo = b * block
        hi = min(lo + block, n)
        _traffic_block(p[lo:hi], g[lo:hi], m[lo:hi], v[lo:hi])


def parse_size(text: str) -> int:
    """``"10M"`` -> 10_000_000, ``"512k"`` -> 512_000, ``"1000"`` -> 1000."""
    mult = {"k": 10**3, "m": 10**6, "g": 10**9}.get(text[-1].lower(), 1)
    return int(float(text[:-1] if mult > 1 else text) * mult)


class Setup:
    """Buffers for one size on one device: zfunc's and torch's, same initial values."""

    def __init__(self, n: int, device: str) -> None:
        gen = torch.Generator().manual_seed(0)
        init = torch.randn(n, generator=gen)
        self.g0 = (torch.randn(n, generator=gen) * 1e-3 / INV_SCALE).to(device)  # scaled grads
        self.n, self.device = n, device
        # zfunc
        self.p, self.g = init.to(device), self.g0.clone()
        self.mu, self.nu = torch.zeros_like(self.p), torch.zeros_like(self.p)
        self.bf16 = torch.empty(n, dtype=torch.bfloat16, device=device)
        self.stats = torch.empty(2, device=device)
        t = lambda v: torch.tensor(v, dtype=torch.float32, device=device)  # noqa: E731
        self.step = torch.tensor(0, device=device)
        self.step2 = torch.tensor(0, device=device)  # the second group's pass bumps its own copy
        self.lr, self.inv, self.one, self.zero = t(1e-3), t(INV_SCALE), t(1.0), t(0.0)
        # torch
        self.tp = torch.nn.Parameter(init.to(device))
        self.tp.grad = self.g0.clone()
        self.opt = torch.optim.AdamW([self.tp], lr=1e-3, weight_decay=0.01, fused=True)
        self.tbf16 = torch.empty(n, dtype=torch.bfloat16, device=device)
        self.found = t(0.0)
        self.tinv = t(INV_SCALE)

    def reset_zfunc_grads(self) -> None:
        self.g.copy_(self.g0)

    def reset_torch_grads(self) -> None:
        self.tp.grad.copy_(self.g0)

    # (a) zfunc phase
    def zfunc_phase(self) -> None:
        s = zfunc_kernels.overflow_sumsq(self.g, out=self.stats)
        norm = s[1].sqrt() * self.inv
        clip = torch.clamp(MAX_NORM / (norm + 1e-6), max=1.0)
        zfunc_kernels.fused_adam(
            self.p, self.g, self.mu, self.nu,
            zfunc_kernels.StepScalars(self.step, self.lr, self.inv, clip, s[0]), HYPER, compute=self.bf16,
        )

    # (b) torch composition
    def torch_phase(self) -> None:
        self.found.zero_()
        torch._amp_foreach_non_finite_check_and_unscale_([self.tp.grad], self.found, self.tinv)
        torch.nn.utils.clip_grad_norm_([self.tp], MAX_NORM)
        self.opt.step()
        self.tbf16.copy_(self.tp.detach())

    # (c) Adam alone
    def zfunc_adam(self) -> None:
        zfunc_kernels.fused_adam(
            self.p, self.g, self.mu, self.nu,
            zfunc_kernels.StepScalars(self.step, self.lr, self.one, self.one, self.zero), HYPER,
        )

    # (d) the same Adam over two parameter groups (weight decay on the first half only): what
    # apply_step does with zfunc.ParamGroup, one fused pass per group's run of the arena
    def zfunc_adam_groups(self) -> None:
        half = self.n // 2
        scalars = zfunc_kernels.StepScalars(self.step, self.lr, self.one, self.one, self.zero)
        for start, n, hyper in ((0, half, HYPER), (half, self.n - half, HYPER._replace(weight_decay=0.0))):
            part = [t.narrow(0, start, n) for t in (self.p, self.g, self.mu, self.nu)]
            zfunc_kernels.fused_adam(*part, scalars if start == 0 else scalars._replace(step=self.step2), hyper)

    def torch_adam(self) -> None:
        self.opt.step()

    # (f) floor
    def floor(self) -> None:
        adam_traffic(self.p.numpy(), self.g.numpy(), self.mu.numpy(), self.nu.numpy())


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_interleaved(
    fns: dict[str, tuple[Callable[[], None], Callable[[], None] | None]], repeats: int, device: str
) -> tuple[dict[str, float], dict[str, float]]:
    """Median and minimum milliseconds of each ``(function, untimed setup)``, in turn per round."""
    for f, before in fns.values():  # warm-up: compile, allocate optimizer state, fault pages in
        for _ in range(2):
            if before is not None:
                before()
            f()
    _sync(device)
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, (f, before) in fns.items():
            if before is not None:
                before()
            _sync(device)
            t0 = time.perf_counter()
            f()
            _sync(device)
            times[k].append((time.perf_counter() - t0) * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}, {k: min(v) for k, v in times.items()}


def deepspeed_adam(setup: Setup) -> Callable[[], None] | None:
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception:  # noqa: BLE001 - not installed or not buildable
        return None
    p = torch.nn.Parameter(setup.tp.detach().clone())
    p.grad = setup.g0.clone()
    opt = DeepSpeedCPUAdam([p], lr=1e-3, weight_decay=0.01, adamw_mode=True)
    return opt.step


def copy_bandwidth(n: int) -> float:
    """Device-to-device copy GB/s (read + write) with torch, for ``--device cuda``."""
    a = torch.empty(n, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    torch.cuda.synchronize()
    return 2 * 4 * n * 10 / (time.perf_counter() - t0) / 1e9


def gbps(nbytes_per_param: int, n: int, ms: float) -> float:
    return nbytes_per_param * n / (ms * 1e-3) / 1e9


HEADER = (
    "| params | threads | zfunc phase ms (GB/s) | torch phase ms (GB/s) | phase zfunc/torch "
    "| zfunc Adam ms (GB/s) | torch AdamW ms (GB/s) | Adam zfunc/torch | floor ms (GB/s) "
    "| Adam zfunc/floor | zfunc Adam 2 groups ms | 2 groups/1 group | DeepSpeedCPUAdam ms |"
)


def row(n: int, threads: int, ms: dict[str, float]) -> str:
    """One markdown table row from the per-function times."""
    floor = ms.get("floor")
    cells = [
        f"{n / 1e6:g}M",
        str(threads or "-"),
        f"{ms['zphase']:.1f} ({gbps(PHASE_BYTES, n, ms['zphase']):.1f})",
        f"{ms['tphase']:.1f} ({gbps(PHASE_BYTES, n, ms['tphase']):.1f})",
        f"{ms['zphase'] / ms['tphase']:.2f}",
        f"{ms['zadam']:.1f} ({gbps(ADAM_BYTES, n, ms['zadam']):.1f})",
        f"{ms['tadam']:.1f} ({gbps(ADAM_BYTES, n, ms['tadam']):.1f})",
        f"{ms['zadam'] / ms['tadam']:.2f}",
        "-" if floor is None else f"{floor:.1f} ({gbps(ADAM_BYTES, n, floor):.1f})",
        "-" if floor is None else f"{ms['zadam'] / floor:.2f}",
        f"{ms['zgroups']:.1f}",
        f"{ms['zgroups'] / ms['zadam']:.2f}",
        f"{ms['ds']:.1f}" if "ds" in ms else "not installed",
    ]
    return "| " + " | ".join(cells) + " |"


def muon_matrices(d: int, layers: int) -> torch.nn.Module:
    """The matrices Muon trains in a GPT block stack: qkv, attention out, MLP in and out."""
    shapes = [(3 * d, d), (d, d), (4 * d, d), (d, 4 * d)] * layers
    return torch.nn.ParameterList(torch.nn.Parameter(torch.randn(s) * 0.02) for s in shapes)


def muon_step_times(d: int, layers: int, repeats: int, ns_dtype: torch.dtype) -> tuple[float, float, int]:
    """Medians (ms) of zfunc's Muon step and ``torch.optim.Muon.step()``, interleaved, and the size."""
    import zfunc
    from unittest import mock

    torch.manual_seed(0)
    model = muon_matrices(d, layers)
    grads = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    ref = muon_matrices(d, layers)
    ref.load_state_dict(model.state_dict())
    opt = torch.optim.Muon(ref.parameters(), lr=0.02)
    state = zfunc.init(model, zfunc.Config(stage=0, clip=None, optimizer=zfunc.muon(lr=0.02, ns_dtype=ns_dtype)))
    patch = contextlib.nullcontext()
    if ns_dtype == torch.float32:  # torch's iteration, in float32 (what ns_dtype=float32 runs)
        from torch.optim import _muon
        original = _muon._zeropower_via_newtonschulz

        def in_float32(g, coefficients, steps, eps):
            with mock.patch.object(torch.Tensor, "bfloat16", lambda t: t.float()):
                return original(g, coefficients, steps, eps)
        patch = mock.patch.object(_muon, "_zeropower_via_newtonschulz", in_float32)
    times: dict[str, list[float]] = {"zfunc": [], "torch": []}
    with patch:
        for r in range(repeats + 2):
            for n, p in ref.named_parameters():
                p.grad = grads[n].clone()
            t0 = time.perf_counter()
            opt.step()
            t1 = time.perf_counter()
            staged = zfunc.accumulate(state, grads)
            t2 = time.perf_counter()
            state = zfunc.apply_step(staged, donate=True)
            t3 = time.perf_counter()
            if r >= 2:
                times["torch"].append(1e3 * (t1 - t0))
                times["zfunc"].append(1e3 * (t3 - t2))
    return statistics.median(times["zfunc"]), statistics.median(times["torch"]), state.layout.numel


def muon_exchange(d: int, layers: int, world: int, stage: int) -> tuple[float, float]:
    """Bytes a rank receives per model parameter: Muon's exchange (the largest rank's), and a
    ZeRO-1 AdamW step's reduce-scatter plus all-gather, for a GPT with Muon on its block matrices."""
    import zfunc
    from zfunc.core import opt_state
    from zfunc.core.create import trainable_params, units_of
    from zfunc.core.muon import plan
    from zfunc.distributed.layout import make_layout
    from zfunc.models import GPT, GPTConfig

    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=32000, block_size=1024, n_layer=layers, n_head=8, d_model=d))
    rule = zfunc.ParamGroup(lambda n, p: p.ndim == 2 and n.startswith("blocks."), optimizer=zfunc.muon())
    cfg = zfunc.Config(stage=stage, param_groups=[rule])
    units, names = units_of(model, cfg, trainable_params(model, cfg))
    lay = make_layout(units, world=world, rank=0, align=cfg.align, names=names)
    muon_runs = opt_state.runs(cfg, lay)[1]
    received = (world - 1) * plan(lay, False, (1,), muon_runs).send * 4
    zero1 = 2 * (world - 1) / world * 4 * lay.full_numel  # reduce-scatter of grads + all-gather of params, fp32
    return received / lay.numel, zero1 / lay.numel


def muon_main(args: argparse.Namespace) -> None:
    torch.set_num_threads(int(args.threads.split(",")[0]))
    print(f"# machine: {cpu_line()}, {os.cpu_count()} cores; torch "
          f"{torch.__version__}; {torch.get_num_threads()} threads; GPT matrices d_model={args.d_model}, "
          f"{args.layers} layers; median of {args.repeats}")
    print("\n| Newton-Schulz in | matrices | parameters | zfunc Muon step ms | torch.optim.Muon ms | zfunc / torch |")
    print("|---|---|---|---|---|---|")
    for dtype in (torch.bfloat16, torch.float32):
        z, t, n = muon_step_times(args.d_model, args.layers, args.repeats, dtype)
        print(f"| {str(dtype)[6:]} | {4 * args.layers} | {n / 1e6:.2f}M | {z:.1f} | {t:.1f} | {z / t:.3f} |",
              flush=True)
    print("\nBytes a rank receives per model parameter in one step (GPT, vocab 32000, Muon on the block "
          "matrices, AdamW on the rest)\n")
    print("| world | stage | Muon exchange B/param | ZeRO-1 AdamW step B/param | Muon extra / ZeRO-1 |")
    print("|---|---|---|---|---|")
    for world in (2, 4, 8):
        for stage in (1, 3):
            extra, zero1 = muon_exchange(args.d_model, args.layers, world, stage)
            print(f"| {world} | {stage} | {extra:.4f} | {zero1:.3f} | {extra / zero1:.4f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="10M,50M")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--muon", action="store_true", help="time Muon (g, h) instead of Adam")
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()
    if args.muon:
        return muon_main(args)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    threads = [int(t) for t in args.threads.split(",")] if args.device == "cpu" else [0]

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"# machine: {cpu_line()}, {os.cpu_count()} cores, load average {load:.2f}; "
        f"torch {torch.__version__}, numba {numba.__version__}; device {args.device} "
        f"(zfunc_kernels backend {zfunc_kernels.backend() if args.device == 'cuda' else 'cpu'}); "
        f"{args.repeats} repeats"
    )
    if args.device == "cuda":
        print(f"# {torch.cuda.get_device_name()}: device copy {copy_bandwidth(sizes[-1]):.0f} GB/s")
    tables: dict[str, list[str]] = {"median": [], "min": []}
    has_ds = None
    for n in sizes:
        setup = Setup(n, args.device)
        for k in threads:
            if k:
                torch.set_num_threads(k)  # zfunc_kernels follows torch's thread count
            fns: dict[str, tuple[Callable[[], None], Callable[[], None] | None]] = {
                "zphase": (setup.zfunc_phase, setup.reset_zfunc_grads),
                "tphase": (setup.torch_phase, setup.reset_torch_grads),
                "zadam": (setup.zfunc_adam, None),
                "zgroups": (setup.zfunc_adam_groups, None),
                "tadam": (setup.torch_adam, None),
            }
            if args.device == "cpu":
                numba.set_num_threads(k)
                fns["floor"] = (setup.floor, None)
                ds = deepspeed_adam(setup)
                has_ds = ds is not None
                if ds is not None:
                    fns["ds"] = (ds, None)
            med, low = time_interleaved(fns, args.repeats, args.device)
            tables["median"].append(row(n, k, med))
            tables["min"].append(row(n, k, low))
            print(tables["median"][-1], flush=True)
        del setup
    for stat, rows in tables.items():
        print(f"\n{stat} of {args.repeats} runs\n")
        print(HEADER)
        print("|" + "---|" * (HEADER.count("|") - 1))
        print("\n".join(rows))
    if has_ds is False:
        print("\n# DeepSpeedCPUAdam: not installed (deepspeed does not import)")


if __name__ == "__main__":
    main()
