"""The examples run and pass their own checks, with warnings as errors; the docs site builds.

Each example runs as a subprocess with small flags (``python -W error examples/<name>.py ...``),
as a user would run it. Each script asserts what it prints ("check: ..."), so a zero exit code
means its checks held. zfunc.launch's spawned ranks inherit ``-W error``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).absolute().parents[1]


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):  # never one rank of an outer job
        env.pop(var, None)
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _example(name: str, *flags: str, timeout: float = 120.0) -> str:
    proc = _run([sys.executable, "-W", "error", str(ROOT / "examples" / name), *flags], timeout)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    assert proc.stderr.strip() == "", f"{name} wrote to stderr:\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.mark.timeout(180)
def test_functional_loop():
    out = _example("functional_loop.py", "--steps", "6", "--d-model", "32", "--block", "16")
    assert "check: the loss fell" in out
    assert "check: all 2 ranks hold the same full weights" in out


@pytest.mark.timeout(180)
def test_engine_loop():
    out = _example("engine_loop.py", "--steps", "10", "--hidden", "32")
    assert "check: 10 optimizer steps from 20 micro-steps, none skipped" in out
    assert "check: the held-out loss fell" in out


@pytest.mark.timeout(180)
def test_two_models_vjp():
    out = _example("two_models_vjp.py", "--steps", "3", "--width", "32")
    assert "check: both models match one joint backward and AdamW step" in out


@pytest.mark.timeout(240)
def test_rl_weight_sync():
    out = _example("rl_weight_sync.py", "--steps", "16", "--sync-every", "2", timeout=200.0)
    assert "check: after each of 8 pushes the generator held the trainer's weights bitwise" in out
    assert "check: the mean reward rose" in out


@pytest.mark.timeout(300)
def test_hf_causal_lm():
    pytest.importorskip("transformers")
    out = _example("hf_causal_lm.py", "--steps", "8", "--seq", "16", timeout=240.0)
    assert "check: the loss fell" in out


@pytest.mark.timeout(300)
def test_docs_site_builds_strict(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    pytest.importorskip("mkdocstrings")
    site = tmp_path / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
         "-d", str(site)],
        cwd=ROOT, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "WARNING" not in proc.stderr, proc.stderr[-5000:]
    for page in ("index.html", "functional/index.html", "deepspeed/index.html", "vjp/index.html",
                 "stages/index.html", "precision/index.html", "checkpoints/index.html",
                 "multinode/index.html", "api/index.html"):
        assert (site / page).is_file(), page
    assert 'id="zfunc.backward_step"' in (site / "api" / "index.html").read_text()
