"""``python -m zfunc.convert``: a checkpoint's full weights as safetensors, streamed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
from safetensors.torch import load_file

import zfunc
from tests.helpers import run_ranks
from tests.test_weights import Normed
from zfunc.io import convert as convert_module
from zfunc.models.gpt import Block


def _saved(rank: int, where: str, stage: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    state = zfunc.init(Normed(), zfunc.Config(stage=stage, units=[Block] if stage == 3 else None))
    zfunc.save(state, where)
    return {**zfunc.full_params(state), **state.frozen, **state.buffers}


def test_convert_gives_the_full_weights_one_file_sharded_and_cast(tmp_path):
    for world, stage in ((3, 3), (2, 1)):
        ckpt = str(tmp_path / f"ckpt{world}")
        values = run_ranks(_saved, world, ckpt, stage)[0]
        reads = []
        original = convert_module.checkpoint_entries

        def counting(path):
            entries, read = original(path)
            return entries, lambda name: reads.append(name) or read(name)

        convert_module.checkpoint_entries = counting
        try:
            (one,) = convert_module.convert(ckpt, str(tmp_path / f"w{world}.safetensors"), progress=False)
        finally:
            convert_module.checkpoint_entries = original
        assert sorted(reads) == sorted(values) and len(reads) == len(set(reads))  # each tensor read once
        got = load_file(one)
        assert sorted(got) == sorted(values)
        assert all(torch.equal(got[n], t.cpu()) for n, t in values.items())

        out = tmp_path / f"sharded{world}"
        files = convert_module.convert(ckpt, str(out), dtype=torch.bfloat16, max_shard_size=400, progress=False)
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert len(files) > 2 and sorted(index["weight_map"]) == sorted(values)
        merged = {}
        for f in files:
            merged.update(load_file(f))
        for n, t in values.items():
            want = t.to(torch.bfloat16) if t.is_floating_point() else t
            assert merged[n].dtype == want.dtype and torch.equal(merged[n], want.cpu()), n
        # the same weights load back into a model of another world size
        state = zfunc.init(Normed(), zfunc.Config(stage=2), weights=str(out))
        assert torch.equal(zfunc.full_params(state)["gpt.tok.weight"], values["gpt.tok.weight"].to(torch.bfloat16).float())


def test_the_command_line(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    run_ranks(_saved, 1, ckpt, 2)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    done = subprocess.run([sys.executable, "-m", "zfunc.convert", ckpt, str(tmp_path / "out"), "--dtype", "fp16",
                           "--max-shard-size", "1KB"], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    files = done.stdout.split()
    assert len(files) > 1 and all(f.endswith(".safetensors") and os.path.exists(f) for f in files)
    bad = subprocess.run([sys.executable, "-m", "zfunc.convert", str(tmp_path / "nothing"), str(tmp_path / "x")],
                         capture_output=True, text=True, timeout=300, env=env)
    assert bad.returncode == 2 and "no such checkpoint" in bad.stderr
    size = subprocess.run([sys.executable, "-m", "zfunc.convert", ckpt, str(tmp_path / "y"), "--max-shard-size",
                           "lots"], capture_output=True, text=True, timeout=300, env=env)
    assert size.returncode == 2 and "is not a size" in size.stderr
