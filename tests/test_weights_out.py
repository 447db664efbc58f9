"""Weights out of the shards, a unit at a time: `zfunc.iter_full_params`, `zfunc.load_weights`,
`zfunc.save_pretrained`."""

from __future__ import annotations

import gc
import json
import os

import pytest
import torch

import zfunc
from zfunc.tools.memory import peak_allocated
from tests.helpers import bitwise_equal, run_ranks, zfunc_run
from zfunc.models.gpt import Block

# zoo: "a" shares its weight (root); "side" runs on some ranks only, so at stage 3 it stays in root
UNITS = {"zoo": ["inp", "a", "side", "out"], "gpt": [Block]}
UNITS3 = {"zoo": ["inp", "a", "out"], "gpt": [Block]}


def _iterated(rank: int, name: str, stage: int, shard_size: int | None, precision: str, dst: int | None):
    """After two steps (stages 1-2 then hold an ungathered compute copy): what every form of the
    iterator yields on this rank, and `full_params`, frozen parameters and the model's order."""
    cfg = zfunc.Config(stage=stage, clip=1.0, precision=precision, shard_size=shard_size,
                       units=(UNITS3 if stage == 3 else UNITS)[name] if stage else None, persist_threshold=0,
                       optimizer=zfunc.adamw(lr=1e-2, weight_decay=0.01))
    state, _ = zfunc_run(rank, name, 2, cfg)
    gathered = bool(state.gathered)
    masters = list(zfunc.iter_full_params(state, dtype=torch.float32, dst=dst))
    compute = list(zfunc.iter_full_params(state, dst=dst))
    order = [n for n, _ in state.module.named_parameters()]
    return {"full": zfunc.full_params(state), "frozen": dict(state.frozen), "masters": masters,
            "compute": compute, "order": order, "gathered": gathered,
            "compute_dtype": state.compute.dtype, "units": len(state.layout.units)}


@pytest.mark.parametrize("world", [1, 2, 3])
def test_the_iterator_equals_full_params_bitwise(world):
    """Stages 0-3, ZooNet (odd size, tied, frozen, a branch one rank skips) and the GPT (tied
    embedding), every rank receiving; the masters equal `full_params` bitwise, the compute copy
    equals them rounded, names in the model's order with frozen ones last."""
    for name in ("zoo", "gpt"):
        for stage in (0, 1, 2, 3):
            for rank, got in enumerate(run_ranks(_iterated, world, name, stage, None, "fp32", None)):
                where = f"{name} stage {stage} world {world} rank {rank}"
                full, frozen = got["full"], got["frozen"]
                names = [n for n, _ in got["masters"]]
                assert sorted(names) == sorted([*full, *frozen]), where
                assert names[len(full):] == [n for n in got["order"] if n in frozen], where
                assert set(names[:len(full)]) == set(full), where
                assert bitwise_equal([t for n, t in got["masters"] if n in full], [full[n] for n in names if n in full]), where
                assert bitwise_equal([t for n, t in got["masters"] if n in frozen], [frozen[n].float() for n in names if n in frozen]), where
                assert bitwise_equal([t for _, t in got["compute"]], [t for _, t in got["masters"]]), where  # fp32: one copy
                if stage in (1, 2) and world > 1:
                    assert not got["gathered"], where  # the iterator gathered the step's slices itself
                if stage == 3:
                    assert got["units"] > 1, where


def test_bf16_yields_the_compute_copy_or_the_masters_as_asked():
    for stage in (0, 2, 3):
        for got in run_ranks(_iterated, 2, "gpt", stage, None, "bf16", None):
            full = got["full"]
            assert got["compute_dtype"] == torch.bfloat16
            assert all(t.dtype == torch.bfloat16 for _, t in got["compute"])
            assert bitwise_equal([t for n, t in got["masters"] if n in full], [full[n] for n, _ in got["masters"] if n in full])
            # the compute copy is the masters rounded to bf16, as the optimizer wrote it
            assert bitwise_equal([t for n, t in got["compute"] if n in full],
                                 [full[n].to(torch.bfloat16) for n, _ in got["compute"] if n in full]), stage


@pytest.mark.parametrize("world,shard_size,dst", [(2, None, 1), (3, None, 2), (2, 1, 0), (2, 1, None)])
def test_one_destination_and_hybrid_sharding(world, shard_size, dst):
    """``dst=r``: rank r receives everything, the others nothing; with hybrid sharding (shard
    groups of one, replicas across) every form still equals `full_params`."""
    for stage in (1, 3):
        for rank, got in enumerate(run_ranks(_iterated, world, "zoo", stage, shard_size, "fp32", dst)):
            where = f"stage {stage} world {world} shard {shard_size} dst {dst} rank {rank}"
            if dst is not None and rank != dst:
                assert got["masters"] == [] and got["compute"] == [], where
                continue
            full = got["full"]
            names = [n for n, _ in got["masters"]]
            assert set(full) <= set(names), where
            assert bitwise_equal([t for n, t in got["masters"] if n in full], [full[n] for n in names if n in full]), where


class _Layers(torch.nn.Module):
    def __init__(self, n: int = 6, d: int = 96):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _memory(rank: int) -> dict[str, int]:
    torch.manual_seed(0)
    state = zfunc.init(_Layers(), zfunc.Config(stage=3, units=[torch.nn.Linear], persist_threshold=0))
    gc.collect()

    def stream() -> None:
        for _, t in zfunc.iter_full_params(state):
            t.sum()  # the receiver reads it and lets it go

    def whole() -> None:
        zfunc.full_params(state)

    unit = max(u.padded for u in state.layout.units) * 4
    # The smallest of three: on a loaded machine the profiler's records (gloo's threads among them)
    # can land out of order and show one unit's free after the next one's allocation (two units,
    # 79,824 bytes here, where the loop holds one; an undisturbed run shows one).
    streamed = min(peak_allocated(stream) for _ in range(3))
    return {"stream": streamed, "whole": peak_allocated(whole), "unit": unit,
            "shard": max(u.shard for u in state.layout.units) * 4, "model": state.layout.full_numel * 4}


def test_a_full_iteration_at_stage_3_holds_about_one_unit():
    for got in run_ranks(_memory, 2):
        assert got["stream"] <= 1.2 * got["unit"] + got["shard"], got
        assert got["whole"] >= got["model"] - got["unit"], got  # full_params holds the whole model


def _early_stop(rank: int, how: str) -> str:
    torch.manual_seed(0)
    state = zfunc.init(_Layers(n=3, d=8), zfunc.Config(stage=3, units=[torch.nn.Linear], persist_threshold=0))
    try:
        if how == "break":  # rank 1 stops after the first tensor: its dropped iterator says so
            for i, _ in enumerate(zfunc.iter_full_params(state)):
                if rank == 1 and i == 0:
                    break
        elif how == "never":  # rank 0 makes the iterator and drops it unused
            it = zfunc.iter_full_params(state)
            if rank == 1:
                list(it)
            else:
                it.close()
        elif how == "all":  # every rank stops at the same place: fine
            for i, _ in enumerate(zfunc.iter_full_params(state)):
                if i == 2:
                    break
            return "ok"
        elif how == "other":  # rank 1 iterates in another dtype
            list(zfunc.iter_full_params(state, dtype=torch.float64 if rank == 1 else None))
        elif how == "dst":  # the ranks disagree on the destination
            list(zfunc.iter_full_params(state, dst=rank))
    except RuntimeError as e:
        return str(e)
    return "ok"


def _failed_load(rank: int) -> list[str]:
    """Rank 0's strict `load_weights` fails mid-stream (its receiver lacks the last layer); then
    both ranks run another collective: the failed load closed its stream at once, so rank 1 has
    raised by then and the collectives line up."""
    torch.manual_seed(0)
    state = zfunc.init(_Layers(n=3, d=8), zfunc.Config(stage=3, units=[torch.nn.Linear], persist_threshold=0))
    said = []
    try:
        if rank == 0:
            zfunc.load_weights(_Layers(n=2, d=8), zfunc.iter_full_params(state, dst=0))
        else:
            list(zfunc.iter_full_params(state, dst=0))
    except (KeyError, RuntimeError) as e:
        said.append(type(e).__name__)
    said.append(str(len(zfunc.full_params(state))))
    list(zfunc.iter_full_params(state, dtype=torch.float32 if rank else None))  # None and the compute dtype agree
    return said


def test_a_consumer_that_fails_closes_the_stream_at_once():
    assert run_ranks(_failed_load, 2, timeout=60) == [["KeyError", "6"], ["RuntimeError", "6"]]


@pytest.mark.parametrize("how", ["break", "never", "other", "dst"])
def test_ranks_that_do_not_iterate_together_all_get_a_clear_error(how):
    said = run_ranks(_early_stop, 2, how, timeout=60)
    for rank, text in enumerate(said):
        if how == "break" and rank == 1:
            # the rank that stopped: its dropped iterator's ``close`` raised the same error, which
            # Python reports on stderr and swallows (an explicit ``close()`` raises it: "never")
            assert text == "ok", text
            continue
        assert "iter_full_params" in text, (rank, text)
        key = "different things" if how in ("other", "dst") else "did not iterate together"
        assert key in text, (rank, text)
    assert run_ranks(_early_stop, 2, "all") == ["ok", "ok"]
    assert run_ranks(_early_stop, 2, "break", timeout=60)  # the world is usable afterwards


def test_bad_arguments_are_refused_before_anything_runs():
    state = zfunc.init(torch.nn.Linear(2, 2), zfunc.Config(stage=3))
    with pytest.raises(ValueError, match="dtype"):
        zfunc.iter_full_params(state, dtype=torch.int64)
    with pytest.raises(ValueError, match="dst"):
        zfunc.iter_full_params(state, dst=1)
    with pytest.raises(ValueError, match="dst"):
        zfunc.iter_full_params(state, dst=True)
    with pytest.raises(ValueError, match="max_shard_size"):
        zfunc.save_pretrained([], "/tmp/nowhere", max_shard_size="lots")
    with pytest.raises(KeyError, match="nope"):
        zfunc.load_weights(torch.nn.Linear(2, 2), [("nope", torch.zeros(1))])
    with pytest.raises(ValueError, match="bias"):
        zfunc.load_weights(torch.nn.Linear(2, 2), [("weight", torch.zeros(2, 2))])
    with pytest.raises(ValueError, match="in the weights"):
        zfunc.load_weights(torch.nn.Linear(2, 2), [("weight", torch.zeros(3, 2))])


def _gpt2(seed: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(seed)
    return GPT2LMHeadModel(cfg)


def _gpt2_batch(step: int, rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return {"x": torch.randint(0, 64, (4, 4), generator=g).repeat(1, 4)}  # motifs: learnable in a few steps


def _gpt2_loss(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(input_ids=batch["x"], labels=batch["x"]).loss


def _generate(model) -> list[int]:
    prompt = torch.tensor([[5, 9, 13, 2]])
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=10, do_sample=False,
                         pad_token_id=0)
    return out[0].tolist()


def _policy(rank: int, out: str) -> dict:
    """A tiny GPT-2 trained at stage 3, its weights streamed into a fresh model on rank 0 and
    written as sharded safetensors."""
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    model = _gpt2(0)
    state = zfunc.init(model, zfunc.Config(stage=3, units=[GPT2Block], clip=1.0, persist_threshold=0,
                                           optimizer=zfunc.adamw(lr=1e-2, weight_decay=0.01)))
    step = zfunc.train_step(_gpt2_loss)
    for i in range(4):
        state = step(state, _gpt2_batch(i, rank))
    receiver = _gpt2(1)  # other values: every parameter must be overwritten
    stream = zfunc.iter_full_params(state, dst=0)
    loaded = zfunc.load_weights(receiver, stream) if rank == 0 else list(stream)
    files = zfunc.save_pretrained(zfunc.iter_full_params(state, dst=0), out, max_shard_size="40KB")
    if rank == 0:
        model.config.save_pretrained(out)
    return {"loaded": loaded, "files": [os.path.basename(f) for f in files],
            "weights": {n: t.clone() for n, t in receiver.state_dict().items()},
            "tokens": _generate(receiver.eval()) if rank == 0 else None}


def test_streamed_weights_generate_as_the_model_trained_without_zfunc(tmp_path):
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    got = run_ranks(_policy, 2, str(tmp_path))
    # the same training in one process: AdamW and clipping over both ranks' batches
    ref = _gpt2(0)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    for i in range(4):
        opt.zero_grad()
        (sum(_gpt2_loss(ref, _gpt2_batch(i, r)) for r in range(2)) / 2).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
    mine, other = got
    assert other["loaded"] == [] and other["files"] == []  # dst=0: rank 1 took part, received nothing
    assert "lm_head.weight" not in mine["loaded"] and "transformer.wte.weight" in mine["loaded"]  # tied: once
    for name, t in ref.state_dict().items():
        assert (mine["weights"][name] - t).abs().max() < 1e-4, (name, (mine["weights"][name] - t).abs().max())
    assert mine["tokens"] == _generate(ref.eval())
    assert mine["tokens"] != _generate(_gpt2(1).eval())  # not what the receiver said before the load

    # the sharded safetensors load with from_pretrained to the same weights and the same tokens
    assert len(mine["files"]) > 2 and "model.safetensors.index.json" in mine["files"]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(mine["loaded"])
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    assert back.lm_head.weight is back.transformer.wte.weight
    for name, t in back.state_dict().items():
        assert torch.equal(t, mine["weights"][name]), name
    assert _generate(back.eval()) == mine["tokens"]


def test_shard_sizes_read_as_transformers_reads_them():
    from zfunc.io.pretrained import _bytes

    assert [_bytes(x) for x in (64, "5GB", "5GiB", "200MB", "5Gb", "1.5KB")] == [
        64, 5 * 10**9, 5 * 2**30, 200 * 10**6, 5 * 10**9 // 8, 1500]


def test_a_save_replaces_an_earlier_one_in_the_same_directory(tmp_path):
    from safetensors.torch import load_file

    old, new = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    zfunc.save_pretrained(old.named_parameters(), tmp_path)  # one file: model.safetensors
    (tmp_path / "config.json").write_text("{}")
    files = zfunc.save_pretrained(new.named_parameters(), tmp_path, max_shard_size=64)
    assert sorted(os.listdir(tmp_path)) == sorted(["config.json", *(os.path.basename(f) for f in files)])
    assert "model.safetensors" not in os.listdir(tmp_path)
    back = {k: v for f in files if f.endswith(".safetensors") for k, v in load_file(f).items()}
    assert torch.equal(back["weight"], new.weight.detach()) and torch.equal(back["bias"], new.bias.detach())
    zfunc.save_pretrained(old.named_parameters(), tmp_path)  # and back to one file
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]


def _exported(rank: int, where: str, stage: int, precision: str) -> dict | None:
    from safetensors.torch import load_file

    cfg = zfunc.Config(stage=stage, precision=precision, units=(UNITS3 if stage == 3 else UNITS)["zoo"],
                       persist_threshold=0, optimizer=zfunc.adamw(lr=1e-2))
    state, _ = zfunc_run(rank, "zoo", 2, cfg)
    full = zfunc.full_params(state)
    file = zfunc.export(state, f"{where}/{stage}-{precision}.safetensors")
    torch.distributed.barrier()
    if rank:
        return None
    got = load_file(file)
    want = {**full, **state.frozen, **state.buffers}
    return {"same_names": sorted(got) == sorted(want),
            "equal": bitwise_equal([got[n] for n in sorted(want)], [want[n] for n in sorted(want)])}


@pytest.mark.parametrize("world", [2, 3])
def test_export_streams_to_rank_0_and_writes_what_full_params_gives(world, tmp_path):
    for stage in (1, 3):
        for precision in ("fp32", "bf16"):
            got = run_ranks(_exported, world, str(tmp_path), stage, precision)[0]
            assert got == {"same_names": True, "equal": True}, (stage, precision)
