"""DeepSpeed's accessors (zfunc.utils, zfunc.zero.GatheredParameters) against plain torch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zfunc
from tests.helpers import run_ranks


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def _batch(rank: int, micro: int) -> torch.Tensor:
    return torch.randn(4, 5, generator=torch.Generator().manual_seed(10 * rank + micro))


def _reference(world: int, ga: int) -> tuple[dict, dict, dict]:
    """Mean gradient over every rank's micro-batches, then one torch AdamW step."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.0)
    for r in range(world):
        for m in range(ga):
            (model(_batch(r, m)).square().mean() / (world * ga)).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.step()
    moments = {n: (opt.state[p]["exp_avg"].clone(), opt.state[p]["exp_avg_sq"].clone())
               for n, p in model.named_parameters()}
    return grads, {n: p.detach().clone() for n, p in model.named_parameters()}, moments


def _accessors(rank: int, stage: int, ga: int) -> dict:
    engine, *_ = zfunc.initialize(model=_model(), config={
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": ga, "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.1, "weight_decay": 0.0}}})
    params = dict(engine.module.named_parameters())
    out: dict = {"before": {n: zfunc.utils.safe_get_full_fp32_param(p) for n, p in params.items()}}
    for m in range(ga):
        engine.backward(engine(_batch(rank, m)).square().mean())
        if m == ga - 1:
            out["grad"] = {n: zfunc.utils.safe_get_full_grad(p) for n, p in params.items()}
            out["local grad"] = {n: zfunc.utils.safe_get_local_grad(p) for n, p in params.items()}
        engine.step()
    out["after"] = {n: zfunc.utils.safe_get_full_fp32_param(p) for n, p in params.items()}
    out["local"] = {n: zfunc.utils.safe_get_local_fp32_param(p) for n, p in params.items()}
    out["moments"] = {n: (zfunc.utils.safe_get_full_optimizer_state(p, "exp_avg"),
                          zfunc.utils.safe_get_full_optimizer_state(p, "exp_avg_sq")) for n, p in params.items()}
    out["grad after step"] = zfunc.utils.safe_get_full_grad(params["0.weight"])
    zfunc.utils.safe_set_full_fp32_param(params["2.bias"], torch.tensor([1.0, 2.0, 3.0]))
    out["set"] = zfunc.full_params(engine.state)["2.bias"]
    with torch.no_grad():  # the forward sees the new bias: tanh(b0) @ W2.T + (1, 2, 3)
        full = zfunc.full_params(engine.state)
        expected = torch.tanh(full["0.bias"]) @ full["2.weight"].T + torch.tensor([1.0, 2.0, 3.0])
        out["forward after set"] = bool(torch.allclose(engine(torch.zeros(1, 5))[0], expected, atol=1e-6))
    with zfunc.zero.GatheredParameters(list(params.values()), modifier_rank=world_size() - 1):
        out["gathered shapes"] = [tuple(p.shape) for p in params.values()]
        if rank == world_size() - 1:
            with torch.no_grad():
                params["0.bias"].fill_(0.25)
    out["modified"] = zfunc.full_params(engine.state)["0.bias"]
    out["empty outside"] = all(p.numel() == 0 for p in params.values()) if stage == 3 else True
    w, w2 = params["0.weight"], params["2.weight"]  # each rank doubles its part of the master, adds 1 to exp_avg
    out["pre"] = (zfunc.utils.safe_get_full_fp32_param(w), zfunc.utils.safe_get_full_optimizer_state(w2, "exp_avg"))
    zfunc.utils.safe_set_local_fp32_param(w, zfunc.utils.safe_get_local_fp32_param(w) * 2)
    zfunc.utils.safe_set_local_optimizer_state(w2, zfunc.utils.safe_get_local_optimizer_state(w2, "exp_avg") + 1,
                                               "exp_avg")
    out["post"] = (zfunc.utils.safe_get_full_fp32_param(w), zfunc.utils.safe_get_full_optimizer_state(w2, "exp_avg"))
    return out


def world_size() -> int:
    return zfunc.comm.world().size


@pytest.mark.parametrize("world", [1, 2, 3])
def test_the_accessors_read_and_write_what_torch_computes(world):
    for stage in (0, 1, 2, 3):
        for ga in (1, 2):
            grads, after, moments = _reference(world, ga)
            before = dict(_model().named_parameters())
            outs = run_ranks(_accessors, world, stage, ga)
            for rank, out in enumerate(outs):
                where = f"world {world} stage {stage} ga {ga} rank {rank}"
                assert all(torch.equal(out["before"][n], before[n].detach()) for n in before), where
                assert all((out["grad"][n] - grads[n]).abs().max() <= 1e-6 for n in grads), where
                assert all((out["after"][n] - after[n]).abs().max() <= 1e-6 for n in after), where
                for n, (mu, nu) in moments.items():
                    assert (out["moments"][n][0] - mu).abs().max() <= 1e-6, where
                    assert (out["moments"][n][1] - nu).abs().max() <= 1e-9, where
                assert out["grad after step"] is None, where  # released with the step, as set_to_none
                assert out["set"].tolist() == [1.0, 2.0, 3.0] and out["forward after set"], where
                assert torch.equal(out["modified"], torch.full((7,), 0.25)), where
                assert out["gathered shapes"] == [(7, 5), (7,), (3, 7), (3,)] and out["empty outside"], where
                assert torch.equal(out["post"][0], out["pre"][0] * 2), where
                assert torch.equal(out["post"][1], out["pre"][1] + 1), where
            for n in after:  # every rank's local part, in rank order, is the whole parameter
                local = torch.cat([o["local"][n] for o in outs]) if stage else outs[0]["local"][n]
                assert torch.equal(local, outs[0]["after"][n].reshape(-1)), (world, stage, n)
                g = torch.cat([o["local grad"][n] for o in outs]) if stage else outs[0]["local grad"][n]
                assert torch.equal(g, outs[0]["grad"][n].reshape(-1)), (world, stage, n)


def test_a_local_setter_checks_the_parts_size():
    engine, *_ = zfunc.initialize(model=_model(), config={"train_batch_size": 4})
    with pytest.raises(ValueError, match="this rank holds 35 elements of '0.weight', got 3"):
        zfunc.utils.safe_set_local_fp32_param(engine.module[0].weight, torch.zeros(3))


def test_an_accessor_given_another_tensor_says_what_to_pass():
    with pytest.raises(ValueError, match="not a parameter of a live zfunc engine's module"):
        zfunc.utils.safe_get_full_fp32_param(torch.zeros(2))
    engine, *_ = zfunc.initialize(model=_model(), config={"train_batch_size": 1})
    with pytest.raises(ValueError, match="'momentum' is not a moment of adam, which steps"):
        zfunc.utils.safe_get_full_optimizer_state(engine.module[0].weight, "momentum")


def test_deepspeeds_moe_group_splitter_passes_dense_groups_through():
    from zfunc.moe.utils import split_params_into_different_moe_groups_for_optimizer as split

    model = _model()
    groups = split([{"params": list(model[0].parameters()), "lr": 0.05}, {"params": model[2].parameters()}])
    assert [len(g["params"]) for g in groups] == [2, 2] and groups[0]["lr"] == 0.05
    engine, *_ = zfunc.initialize(model=model, model_parameters=groups, config={
        "train_batch_size": 1, "optimizer": {"type": "AdamW", "params": {"lr": 0.1}}})
    assert [g["lr"] for g in engine.optimizer.param_groups] == [0.05, 0.1]
    model[2].weight.allreduce = False  # DeepSpeed's mark of an expert parameter
    with pytest.raises(zfunc.ConfigError, match=r"param_groups\[0\]: parameters \[0\] are experts'"):
        split({"params": model[2].parameters()})


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_value_of_the_wrong_shape_is_named_with_both_shapes(stage):
    engine, *_ = zfunc.initialize(model=torch.nn.Linear(3, 3), config={
        "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage}})
    w = engine.module.weight
    before = engine.state.params.clone()
    with pytest.raises(ValueError, match=r"safe_set_full_fp32_param for parameter 'weight': shape \[36\], but the "
                                         r"parameter's full shape is \[3, 3\]"):
        zfunc.utils.safe_set_full_fp32_param(w, torch.zeros(36))
    with pytest.raises(ValueError, match=r"safe_set_full_optimizer_state\('exp_avg'\) for parameter 'weight': "
                                         r"shape \[9\]"):
        zfunc.utils.safe_set_full_optimizer_state(w, torch.zeros(9), "exp_avg")
    assert torch.equal(engine.state.params, before)


def _edit_one_bf16(rank: int, stage: int) -> tuple[int, float, float]:
    """Three bf16 steps (fp32 masters), then ``GatheredParameters(modifier_rank=0)`` writing one
    element of a weight: how many other elements' masters changed, the edited master, the value."""
    torch.manual_seed(0)
    engine, *_ = zfunc.initialize(model=_model(), config={
        "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0, "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": stage}})
    for micro in range(3):
        engine.backward(engine(_batch(rank, micro).bfloat16()).float().square().mean())
        engine.step()
    w = engine.module[0].weight
    before = zfunc.utils.safe_get_full_fp32_param(w).clone()
    with zfunc.zero.GatheredParameters(w, modifier_rank=0):
        with torch.no_grad():
            w[0, 0] = 0.123 if rank == 0 else 9.0  # the modifier's write is the one kept
            held = torch.tensor(0.123, dtype=w.dtype).item()  # as the parameter holds it (bf16 at stages 0-2)
    after = zfunc.utils.safe_get_full_fp32_param(w)
    others = torch.ones_like(before, dtype=torch.bool)
    others[0, 0] = False
    return int((after != before)[others].sum()), after[0, 0].item(), held


def test_a_bf16_edit_in_gathered_parameters_keeps_the_other_masters():
    """With bf16 compute copies and fp32 masters, what the modifier rank writes becomes the master;
    the elements it did not write keep their fp32 masters bitwise (none is rounded through the
    bf16 copy), at every stage."""
    for stage in (0, 1, 2, 3):
        for changed, edited, written in run_ranks(_edit_one_bf16, 2, stage):
            assert changed == 0 and edited == written, (stage, changed, edited, written)
