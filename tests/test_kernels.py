"""Tests for ``zfunc_kernels``: fused Adam/AdamW and the overflow + sum-of-squares pass.

The CPU kernels are checked against a float64 Adam written here, against
``torch.optim.AdamW/Adam(fused=True)`` and against the plain-torch reference backend. The
CUDA kernels run in numba's CUDA simulator in a subprocess (``NUMBA_ENABLE_CUDASIM`` must be
set before numba is imported): this file is also a script, ``python tests/test_kernels.py
sim``, that runs those checks and prints a JSON summary.

Tolerances, per storage dtype of the compared tensor, against the float64 Adam (one step from
the same state, rounded to the storage dtype): float32 ``rtol=1e-5, atol=1e-6`` (float32
arithmetic error), bfloat16 ``rtol=2**-7`` and float16 ``rtol=2**-10, atol=2**-24`` (one
rounding step of the format). Against torch's fused CPU Adam, results are bitwise equal
except for torch's scalar tail (the last few elements of a chunk), so at least 99% of the
elements must be bit-identical and all must pass ``rtol=1e-6`` (float32) or one ulp
(bfloat16).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import torch

import zfunc_kernels

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
TOL = {
    F32: dict(rtol=1e-5, atol=1e-6),
    BF16: dict(rtol=2**-7, atol=1e-30),
    F16: dict(rtol=2**-10, atol=2**-24),
}
HYPER = dict(beta1=0.9, beta2=0.999, eps=1e-8)
TINY = {F32: 1e-40, BF16: 1e-39, F16: 6e-8}  # a subnormal of each format

# --------------------------------------------------------------------------- helpers


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a tensor (for bitwise comparisons)."""
    return t.view({4: torch.int32, 2: torch.int16, 8: torch.int64}[t.element_size()])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def scalars(lr: float = 0.01, inv_scale: float = 1.0, clip: float = 1.0, found: float = 0.0) -> dict:
    return dict(
        step=torch.tensor(0),
        lr=torch.tensor(lr),
        inv_scale=torch.tensor(inv_scale),
        clip_coef=torch.tensor(clip),
        found_inf=torch.tensor(found),
    )


def adam(vectors: dict, sc: dict, weight_decay: float, *, decoupled: bool = True, backend: str | None = None) -> None:
    """``zfunc_kernels.fused_adam`` with the vectors and scalars of these tests' dicts."""
    v = dict(vectors)
    zfunc_kernels.fused_adam(v.pop("master"), v.pop("grad"), v.pop("mu"), v.pop("nu"),
                             zfunc_kernels.StepScalars(**sc),
                             zfunc_kernels.AdamHyper(**HYPER, weight_decay=weight_decay, decoupled=decoupled),
                             backend=backend, **v)


def make_state(n: int, master: torch.dtype, grad: torch.dtype, moment: torch.dtype, seed: int = 0) -> dict:
    """Random Adam state with NaN, +-Inf, fp16 max and subnormals in the gradient."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen) * 4.0
    specials = [math.nan, math.inf, -math.inf, 65504.0, -65504.0, TINY[grad], -TINY[grad], 0.0, -0.0]
    g[: min(n, len(specials))] = torch.tensor(specials[:n])
    if n >= 12:
        p[-3:] = torch.tensor([65504.0, TINY[master], 0.0])
    return dict(
        master=p.to(master),
        grad=g.to(grad),
        mu=(torch.randn(n, generator=gen) * 0.1).to(moment),
        nu=(torch.rand(n, generator=gen) * 0.01).to(moment),
    )


def clone(state: dict) -> dict:
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}


def assert_same_values(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Bitwise equal, except that NaNs may differ in sign and payload."""
    nan = a.isnan()
    assert torch.equal(nan, b.isnan()), what
    assert same_bits(a[~nan], b[~nan]), what


def adam_f64(s: dict, sc: dict, *, weight_decay: float, decoupled: bool) -> tuple:
    """One Adam/AdamW step in float64 from the decoded state (independent of the kernels)."""
    b1, b2, eps = HYPER["beta1"], HYPER["beta2"], HYPER["eps"]
    t = int(sc["step"]) + 1
    lr = float(sc["lr"])
    p, m, v = (s[k].double() for k in ("master", "mu", "nu"))
    g = s["grad"].double() * float(sc["inv_scale"]) * float(sc["clip_coef"])
    if decoupled:
        p = p * (1.0 - lr * weight_decay)
    else:
        g = g + weight_decay * p
    m = m + (1.0 - b1) * (g - m)
    v = b2 * v + (1.0 - b2) * g * g
    p = p - lr / (1.0 - b1**t) * m / (v.sqrt() / math.sqrt(1.0 - b2**t) + eps)
    return p, m, v


def assert_close_dtype(actual: torch.Tensor, expected64: torch.Tensor, what: str) -> None:
    expected = expected64.to(actual.dtype)
    torch.testing.assert_close(
        actual.double(), expected.double(), equal_nan=True, msg=lambda m: f"{what}: {m}", **TOL[actual.dtype]
    )


def check_against_f64(
    backend: str,
    master: torch.dtype,
    grad: torch.dtype,
    moment: torch.dtype,
    compute: torch.dtype | None,
    *,
    decoupled: bool,
    steps: int = 3,
    n: int = 1000,
) -> None:
    """Runs ``steps`` kernel steps; after each, compares with one float64 step from the same state."""
    s = make_state(n, master, grad, moment, seed=n)
    if compute is not None:
        s["compute"] = torch.empty(n, dtype=compute)
    sc = scalars(lr=0.01, inv_scale=1.0 / 1024, clip=0.37)
    wd = 0.1
    for k in range(steps):
        s["grad"] = make_state(n, master, grad, moment, seed=100 + k)["grad"] * 1024
        p, m, v = adam_f64(s, sc, weight_decay=wd, decoupled=decoupled)
        step_before = int(sc["step"])
        adam(s, sc, wd, decoupled=decoupled, backend=backend)
        assert int(sc["step"]) == step_before + 1
        assert_close_dtype(s["master"], p, f"master step {k}")
        assert_close_dtype(s["mu"], m, f"mu step {k}")
        assert_close_dtype(s["nu"], v, f"nu step {k}")
        if compute is not None:
            assert_same_values(s["compute"], s["master"].to(compute), "compute is master cast")


def torch_fused(dtype: torch.dtype, *, decoupled: bool, steps: int, n: int) -> tuple[dict, dict, float]:
    """Runs ``fused_adam`` (cpu) and torch's fused Adam(W) side by side from the same state."""
    s = make_state(n, dtype, dtype, dtype, seed=7)
    s["mu"].zero_(), s["nu"].zero_()  # torch starts its moments at zero
    s["compute"] = torch.empty(n, dtype=BF16 if dtype == F32 else F32)  # reuses ADAM_CASES kernels
    inv, clip = (1.0 / 1024, 0.37) if dtype == F32 else (2.0**-10, 0.5)  # exact in bf16
    sc = scalars(lr=0.01, inv_scale=inv, clip=clip)
    lr = float(sc["lr"])  # the float32 value, as the kernel sees it
    param = s["master"].clone().requires_grad_(True)
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    opt = cls([param], lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, fused=True)
    for k in range(steps):
        s["grad"] = make_state(n, dtype, dtype, dtype, seed=200 + k)["grad"] * 1024
        param.grad = (s["grad"].float() * sc["inv_scale"] * sc["clip_coef"]).to(dtype)
        opt.step()
        adam(s, sc, 0.1, decoupled=decoupled, backend="cpu")
    st = opt.state[param]
    theirs = {"master": param.detach(), "mu": st["exp_avg"], "nu": st["exp_avg_sq"]}
    return {**s, "step": sc["step"]}, theirs, float(st["step"])


def check_overflow_sumsq(
    backend: str, dtype: torch.dtype, n: int, special: float | None, twice: bool = True
) -> None:
    x = (torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3).to(dtype)
    if special is not None and n:
        x[n // 2] = special
    out = zfunc_kernels.overflow_sumsq(x, backend=backend)
    assert out.dtype == F32 and out.shape == (2,)
    assert out[0].item() == (0.0 if bool(torch.isfinite(x).all()) else 1.0)
    if special is None:
        expected = torch.linalg.vector_norm(x.double()) ** 2
        torch.testing.assert_close(out[1].double(), expected, rtol=1e-6, atol=0.0)
    if twice:
        again = zfunc_kernels.overflow_sumsq(x, out=torch.empty(2), backend=backend)
        assert same_bits(out, again), "deterministic"


# --------------------------------------------------------------------------- CPU tests

# (master, grad, moments, compute): every dtype in every slot, five compiled kernels.
ADAM_CASES = [
    (F32, F32, F32, BF16),
    (F32, BF16, F32, BF16),
    (BF16, BF16, BF16, F32),
    (F16, F16, F32, F16),
    (F16, F32, BF16, None),
]


@pytest.mark.parametrize("case", ADAM_CASES, ids=lambda c: "-".join(str(d)[6:] for d in c))
@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_fused_adam_matches_float64(backend: str, case: tuple) -> None:
    check_against_f64(backend, *case, decoupled=case[0] != F16)  # fp16 masters: L2 Adam

def test_fused_adam_l2_matches_float64() -> None:
    check_against_f64("cpu", F32, F32, F32, BF16, decoupled=False)

@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam"])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
def test_fused_adam_matches_torch_fused(dtype: torch.dtype, decoupled: bool) -> None:
    n = 4099  # not a multiple of torch's 16-element cache-line chunks
    ours, theirs, torch_step = torch_fused(dtype, decoupled=decoupled, steps=3, n=n)
    # bf16: torch rounds the pre-scaled gradient to bf16 (subnormals may flush), we do not.
    tol = dict(rtol=1e-6, atol=1e-7) if dtype == F32 else dict(rtol=2**-7, atol=1e-37)
    for key in ("master", "mu", "nu"):
        a, b = ours[key], theirs[key]
        torch.testing.assert_close(a, b, equal_nan=True, **tol)
        nan = a.isnan() & b.isnan()
        identical = ((bits(a) == bits(b)) | nan).float().mean().item()
        assert identical >= 0.99, f"{key}: only {identical:.4f} bit-identical"
    assert int(ours["step"]) == torch_step == 3

@pytest.mark.parametrize("found", [1.0, 2.0, math.nan])
@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_found_inf_skips_the_whole_step(backend: str, found: float) -> None:
    s = make_state(257, F32, F32, F32)
    s["compute"] = torch.randn(257).to(BF16)
    sc = scalars(found=found)
    sc["step"].fill_(5)
    before = clone(s)
    adam(s, sc, 0.1, backend=backend)
    for key in ("master", "mu", "nu", "compute", "grad"):
        assert same_bits(s[key], before[key]), key
    assert int(sc["step"]) == 5
    sc["found_inf"].zero_()
    adam(s, sc, 0.1, backend=backend)
    assert int(sc["step"]) == 6 and not same_bits(s["master"], before["master"])

@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_empty_vectors_and_autograd_versions(backend: str) -> None:
    s = make_state(0, F32, F32, F32)
    sc = scalars()
    adam(s, sc, 0.1, backend=backend)
    assert int(sc["step"]) == 1
    s = make_state(5, F32, F32, F32)
    s["compute"] = torch.empty(5, dtype=BF16)
    versions = {k: v._version for k, v in s.items()}
    adam(s, scalars(), 0.1, backend=backend)
    for key in ("master", "mu", "nu", "compute"):  # autograd sees the in-place writes
        assert s[key]._version > versions[key], key
    assert s["grad"]._version == versions["grad"]


def test_cpu_matches_torch_reference() -> None:
    s = make_state(3001, F32, BF16, F32)
    s["compute"] = torch.empty(3001, dtype=BF16)
    r, sc, rc = clone(s), scalars(inv_scale=0.25, clip=0.6), scalars(inv_scale=0.25, clip=0.6)
    for _ in range(3):
        adam(s, sc, 0.1, backend="cpu")
        adam(r, rc, 0.1, backend="torch")
    for key in ("master", "mu", "nu", "compute"):
        torch.testing.assert_close(s[key], r[key], equal_nan=True, rtol=1e-6, atol=1e-7)
    assert int(sc["step"]) == int(rc["step"]) == 3

def test_fused_adam_is_deterministic() -> None:
    s = make_state(70_001, F32, BF16, F32)
    s["compute"] = torch.empty(70_001, dtype=BF16)
    a, b = clone(s), clone(s)
    for t in (a, b):
        adam(t, scalars(inv_scale=0.5), 0.1)
    for key in ("master", "mu", "nu", "compute"):
        assert same_bits(a[key], b[key]), key

SPECIALS = [None, math.nan, math.inf, -math.inf]


@pytest.mark.parametrize("special", SPECIALS, ids=["finite", "nan", "inf", "-inf"])
@pytest.mark.parametrize("n", [0, 1, 7, 1001, 3 * 16384 + 5])
@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_overflow_sumsq(backend: str, dtype: torch.dtype, n: int, special: float | None) -> None:
    check_overflow_sumsq(backend, dtype, n, special)

def test_overflow_sumsq_same_bytes_for_any_thread_count() -> None:
    x = torch.randn(5 * 16384 + 3) * 1e3
    threads = torch.get_num_threads()
    try:
        results = []
        for k in (1, 2):
            torch.set_num_threads(k)
            results.append(zfunc_kernels.overflow_sumsq(x))
    finally:
        torch.set_num_threads(threads)
    assert same_bits(results[0], results[1])

def test_overflow_sumsq_huge_finite_values_are_not_overflow() -> None:
    x = torch.full((4,), 3e38)
    out = zfunc_kernels.overflow_sumsq(x)
    assert out[0].item() == 0.0 and out[1].item() == math.inf

@pytest.mark.parametrize("fmt", [BF16, F16], ids=["bf16", "fp16"])
def test_16bit_codecs_match_torch(fmt: torch.dtype) -> None:
    from zfunc_kernels import _adapt, _cpu

    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(fmt)
    decoded = torch.empty(every.numel())
    _cpu.convert_kernel(_adapt.as_numpy(every), _adapt.as_numpy(decoded))
    nan = every.isnan()
    assert torch.equal(decoded.isnan(), nan)
    assert same_bits(decoded[~nan], every[~nan].float())

    gen = torch.Generator().manual_seed(1)
    pattern = torch.randint(-(2**31), 2**31, (1 << 18,), generator=gen, dtype=torch.int64)
    x = pattern.to(torch.int32).view(F32)
    edges = [65504.0, 65519.996, 65520.0, 2.0**-14, 2.0**-24, 2.0**-25, 1.5 * 2**-25]
    edges = torch.tensor(edges + [1 + 2**-8, 1 + 3 * 2**-8])  # the last two: bf16 ties
    x = torch.cat([x, edges, -edges, torch.tensor([math.inf, -math.inf, math.nan])])
    x = torch.cat([x, x * (1 + 2**-11), x * (1 - 2**-12)])
    encoded = torch.empty(x.numel(), dtype=fmt)
    _cpu.convert_kernel(_adapt.as_numpy(x), _adapt.as_numpy(encoded))
    expected = x.to(fmt)
    nan = x.isnan()
    assert torch.equal(encoded.isnan(), nan)
    assert same_bits(encoded[~nan], expected[~nan])

def test_software_16bit_codecs_match_torch() -> None:
    """The Python bodies: what the simulator runs and CUDA compiles (the CPU may use hardware)."""
    from zfunc_kernels import _codec

    from zfunc_kernels import _adapt, _cpu, _shared

    every = torch.arange(-(2**15), 2**15, 7, dtype=torch.int32).to(torch.int16)
    for fmt, decode in ((BF16, _codec.bf16_to_f32), (F16, _codec.f16_to_f32)):
        decoded = [_shared.f32_to_bits(decode(int(h))) for h in every.tolist()]  # bits: keep NaNs
        got = torch.tensor(decoded, dtype=torch.int64).to(torch.int32).view(F32)
        assert_same_values(got, every.view(fmt).float(), f"decode {fmt}")
        compiled = torch.empty(every.numel())
        _cpu.convert_kernel(_adapt.as_numpy(every.view(fmt)), _adapt.as_numpy(compiled))
        assert same_bits(got, compiled), f"software and compiled {fmt} decoding differ (NaNs too)"
    gen = torch.Generator().manual_seed(2)
    x = torch.randint(-(2**31), 2**31, (4000,), generator=gen, dtype=torch.int64).to(torch.int32).view(F32)
    x = torch.cat([x, x * 2.0**-100, x * 2.0**-110, torch.tensor([65519.996, 65520.0, 2.0**-25, 1 + 2**-8])])
    for fmt, encode in ((BF16, _codec.f32_to_bf16), (F16, _codec.f32_to_f16)):
        codes = [encode(np.float32(v)) for v in x.numpy()]
        got = torch.tensor(codes, dtype=torch.int32).to(torch.int16).view(fmt)
        assert_same_values(got, x.to(fmt), f"encode {fmt}")
        compiled = torch.empty(x.numel(), dtype=fmt)
        _cpu.convert_kernel(_adapt.as_numpy(x), _adapt.as_numpy(compiled))
        assert same_bits(got, compiled), f"software and compiled {fmt} encoding differ (NaNs too)"


def test_bad_arguments_raise() -> None:
    s = make_state(8, F32, F32, F32)
    sc = scalars()
    with pytest.raises(TypeError):
        adam({**s, "mu": s["mu"].half()}, sc, 0.0)
    with pytest.raises(ValueError):
        adam({**s, "grad": s["grad"][:4]}, sc, 0.0)
    with pytest.raises(ValueError):
        bad_lr = {**sc, "lr": torch.tensor(0.1, dtype=torch.float64)}
        adam(s, bad_lr, 0.0)
    with pytest.raises(ValueError):
        adam(s, sc, 0.0, backend="tpu")
    with pytest.raises(RuntimeError):
        adam(s, sc, 0.0, backend="sim")
    with pytest.raises(ValueError):
        zfunc_kernels.overflow_sumsq(torch.zeros(3, 3))
    with pytest.raises(ValueError):
        zfunc_kernels.overflow_sumsq(torch.zeros(3), out=torch.zeros(3))

def test_backend_probe() -> None:
    assert zfunc_kernels.backend() in ("cpu", "cuda")
    if not torch.cuda.is_available():
        assert zfunc_kernels.backend() == "cpu"

def test_every_public_function_has_an_example() -> None:
    for name in zfunc_kernels.__all__:
        assert ">>>" in (getattr(zfunc_kernels, name).__doc__ or ""), name

def _python(*args: str, **env: str) -> subprocess.CompletedProcess:
    """Runs ``python -W error *args`` from the repository root with a clean simulator flag."""
    full_env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    full_env.update(PYTHONPATH=ROOT, **env)
    return subprocess.run(
        [sys.executable, "-W", "error", *args],
        cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip

def test_import_is_quiet_and_does_not_load_numba_cuda() -> None:
    code = (
        "import sys, torch, zfunc_kernels\n"
        "assert 'numba.cuda' not in sys.modules\n"
        "zfunc_kernels.overflow_sumsq(torch.ones(3))\n"
        "assert zfunc_kernels.backend() == 'cpu' or torch.cuda.is_available()\n"
        "assert 'numba.cuda' not in sys.modules or torch.cuda.is_available()\n"
    )
    proc = _python("-c", code)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr

def test_cuda_kernels_in_the_simulator() -> None:
    proc = _python(os.path.join("tests", "test_kernels.py"), "sim", NUMBA_ENABLE_CUDASIM="1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["backend"] == "sim"
    assert summary["adam_cases"] >= 4 and summary["sumsq_cases"] >= 15

@pytest.mark.skipif(zfunc_kernels.backend() != "cuda", reason="needs a GPU and numba.cuda")
def test_cuda_matches_cpu_on_gpu() -> None:  # pragma: no cover - GPU only
    for case in ADAM_CASES:
        s = make_state(100_003, *case[:3])
        if case[3] is not None:
            s["compute"] = torch.empty(100_003, dtype=case[3])
        d = {k: v.cuda() for k, v in s.items()}
        sc = scalars(inv_scale=0.5, clip=0.7)
        dc = {k: v.cuda() for k, v in scalars(inv_scale=0.5, clip=0.7).items()}
        adam(s, sc, 0.1)
        adam(d, dc, 0.1)
        for key in s:
            torch.testing.assert_close(d[key].cpu(), s[key], equal_nan=True, **TOL[s[key].dtype])
        assert int(dc["step"]) == 1
    for dtype in (F32, BF16, F16):
        x = torch.randn(3_000_001).to(dtype)
        a = zfunc_kernels.overflow_sumsq(x.cuda())
        assert same_bits(a, zfunc_kernels.overflow_sumsq(x.cuda()))
        torch.testing.assert_close(a.cpu(), zfunc_kernels.overflow_sumsq(x), rtol=1e-6, atol=0.0)


# --------------------------------------------------------------------------- simulator script


def run_simulator_checks() -> dict[str, Any]:
    """Checks the CUDA kernels under the simulator (``NUMBA_ENABLE_CUDASIM=1``), tiny sizes."""
    import warnings

    # The simulator evaluates float32 math with numpy scalars, which warn on overflow/NaN.
    warnings.filterwarnings("ignore", category=RuntimeWarning, message=".*encountered in")
    assert zfunc_kernels.backend() == "sim"
    cases = [(F32, F32, F32, BF16), (BF16, BF16, BF16, F32), (F16, F16, F32, F16), (F16, F32, BF16, None)]
    n = 150  # > grid of 4 blocks x 8 threads: exercises the grid-stride loop
    for master, grad, moment, compute in cases:
        check_against_f64("sim", master, grad, moment, compute, decoupled=master != F16, steps=2, n=n)
        s = make_state(n, master, grad, moment, seed=3)
        if compute is not None:
            s["compute"] = torch.empty(n, dtype=compute)
        c, sc, cc = clone(s), scalars(inv_scale=0.5, clip=0.8), scalars(inv_scale=0.5, clip=0.8)
        adam(s, sc, 0.1, backend="sim")
        adam(c, cc, 0.1, backend="cpu")
        for key in s:
            assert same_bits(s[key], c[key]), f"sim and cpu differ in {key} for {master}"
    # An overflow step changes nothing.
    s = make_state(n, F32, F32, F32)
    s["compute"] = torch.zeros(n, dtype=BF16)
    before, sc = clone(s), scalars(found=1.0)
    adam(s, sc, 0.1, backend="sim")
    assert all(same_bits(s[k], before[k]) for k in s) and int(sc["step"]) == 0
    sumsq_cases = 0
    for dtype in (F32, BF16, F16):
        for size in (0, 1, n):
            for special in (None, math.nan, -math.inf) if size == n else (None,):
                check_overflow_sumsq("sim", dtype, size, special, twice=size == n and special is None)
                sumsq_cases += 1
    return {"backend": zfunc_kernels.backend(), "adam_cases": len(cases), "sumsq_cases": sumsq_cases}


if __name__ == "__main__" and sys.argv[1:] == ["sim"]:
    print(json.dumps(run_simulator_checks()))


def test_kernels_leave_torchs_thread_count_alone():
    """numba's OpenMP layer shares the runtime with torch; a kernel must not change torch's
    thread count (it changed torch's reduction order after the first step, and oversubscribed)."""
    code = ("import torch, zfunc_kernels as k; torch.set_num_threads(1); "
            "k.overflow_sumsq(torch.randn(100)); print(torch.get_num_threads())")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "1", out.stdout + out.stderr


def test_the_kernel_cache_tracks_the_shared_math(monkeypatch) -> None:
    """numba keys cached kernels on their own file; zfunc's locators add the shared math files,
    so an edit of ``_math.py`` alone cannot load stale machine code."""
    from numba.core import caching

    from zfunc_kernels import _cache, _cpu

    assert _cpu.CACHED  # tracking is installed, so the kernels are cached
    impl = getattr(caching, "CacheImpl", None) or caching._CacheImpl
    ours = [c for c in impl._locator_classes if getattr(c, "zfunc_tracks_math", False)]
    assert ours, "the zfunc locators are not in numba's list"
    locator = next(c.from_function(_cpu.adam_kernel.py_func, _cpu.__file__) for c in ours
                   if c.from_function(_cpu.adam_kernel.py_func, _cpu.__file__) is not None)
    stamp = locator.get_source_stamp()
    monkeypatch.setattr(_cache, "_digest", lambda: "edited")
    assert locator.get_source_stamp() != stamp  # a changed _math.py changes the cache key
    assert ours[0].from_function(torch.add, torch.__file__) is None  # other packages' caches untouched


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("overwrite", [False, True])
def test_accumulate_widens_exactly(dtype: torch.dtype, overwrite: bool) -> None:
    # Every finite value of x, specials included, widened exactly and added once: the bytes of
    # torch's own add_/copy_ (float32 sums of the same two operands round the same way).
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(70_001, generator=g) * 10.0 ** torch.randint(-30, 30, (70_001,), generator=g)).to(dtype)
    x[:4] = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0])
    start = torch.randn(70_001, generator=g)
    for backend in ("cpu", "torch"):
        out = start.clone()
        zfunc_kernels.accumulate(out, x, overwrite=overwrite, backend=backend)
        expected = x.float().clone() if overwrite else start + x.float()
        assert torch.equal(out.view(torch.int32)[3:], expected.view(torch.int32)[3:]), backend
        assert out[:3].isinf().tolist()[:2] == [True, True] and out[2].isnan()
    with pytest.raises(TypeError, match="out has dtype"):
        zfunc_kernels.accumulate(torch.zeros(3, dtype=torch.bfloat16), torch.zeros(3))
    with pytest.raises(ValueError, match="x must have 3 elements"):
        zfunc_kernels.accumulate(torch.zeros(3), torch.zeros(4))
