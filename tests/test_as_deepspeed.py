"""``zfunc.as_deepspeed``: the switch, and the DeepSpeed entry points the clients call.

The switch changes ``sys.path`` for the whole process, so each check of it runs in a fresh
interpreter. The clients themselves (Trainer, Accelerate, Lightning) are run in
``test_huggingface.py``.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import zfunc
from tests.helpers import run_ranks
from zfunc.compat.switch import PATH
from zfunc.errors import ConfigError


def _python(*argv: str) -> subprocess.CompletedProcess:
    """``python argv...`` in a fresh interpreter."""
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=120)


def _code(code: str) -> subprocess.CompletedProcess:
    return _python("-c", textwrap.dedent(code))


def test_the_switch_serves_deepspeed_from_zfunc():
    done = _code("""
        import importlib.metadata, sys, zfunc
        zfunc.as_deepspeed()
        sys.path.insert(0, "/nonexistent")
        zfunc.as_deepspeed()  # again: nothing more, whatever came first on sys.path since
        import deepspeed, deepspeed.comm, deepspeed.zero, deepspeed.runtime.engine, deepspeed.moe.utils
        import deepspeed.checkpointing, deepspeed.utils.logging, deepspeed.runtime.zero.partition_parameters
        from deepspeed.accelerator import get_accelerator
        from deepspeed.checkpoint.utils import clone_tensors_for_torch_save
        from deepspeed.runtime.lr_schedules import VALID_LR_SCHEDULES
        assert deepspeed.initialize is zfunc.initialize
        assert deepspeed.DeepSpeedEngine is deepspeed.runtime.engine.DeepSpeedEngine is zfunc.Engine
        assert deepspeed.zero.GatheredParameters is zfunc.zero.GatheredParameters
        assert deepspeed.utils.safe_get_full_grad is zfunc.utils.safe_get_full_grad
        assert deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer is \
            zfunc.moe.utils.split_params_into_different_moe_groups_for_optimizer
        assert "WarmupDecayLR" in VALID_LR_SCHEDULES
        print(importlib.metadata.version("deepspeed"), deepspeed.__version__, get_accelerator().device_name())
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0.19.8", "0.19.8", "cuda" if torch.cuda.is_available() else "cpu"]


def test_the_switch_after_a_client_was_imported_says_what_to_do():
    done = _code("""
        import accelerate, zfunc
        zfunc.as_deepspeed()
    """)
    assert done.returncode != 0
    assert "accelerate was imported before it" in done.stderr and "-m zfunc.compat.as_deepspeed" in done.stderr


def test_the_runner_runs_an_unchanged_script(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import sys, deepspeed\nprint(deepspeed.__file__.startswith(sys.argv[1]), sys.argv[2:])\n")
    done = _python("-m", "zfunc.compat.as_deepspeed", str(script), PATH, "--deepspeed", "ds.json")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True ['--deepspeed', 'ds.json']"


def test_accelerate_gets_gloo_for_a_deepspeed_run_without_cuda():
    """Accelerate, with DeepSpeed on and no GPU, finds no backend (one process); the switch
    gives such a launched run gloo, and leaves every other run as Accelerate decides."""
    pytest.importorskip("accelerate")
    done = _code("""
        import os, zfunc
        zfunc.as_deepspeed()
        from accelerate.state import PartialState
        prepare = PartialState._prepare_backend
        os.environ.pop("LOCAL_RANK", None)
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        unlaunched = prepare(None, cpu=False)
        os.environ["LOCAL_RANK"] = "0"
        launched = prepare(None, cpu=False)
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "false"
        plain = prepare(None, cpu=False)
        print(unlaunched[0], launched[0], plain[0])
    """)
    assert done.returncode == 0, done.stderr
    expected = "None nccl nccl" if torch.cuda.is_available() else "None gloo None"
    assert done.stdout.split() == expected.split()


def test_engine_config_is_deepspeeds_dict_and_cfg_zfuncs():
    ds = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}}
    engine, *_ = zfunc.initialize(model=torch.nn.Linear(3, 2), config=ds)
    assert engine.config == ds and engine.config.get("zero_optimization", {}).get("stage") == 2
    assert isinstance(engine.cfg, zfunc.Config) and engine.cfg.stage == 2
    assert not engine.zero_gather_16bit_weights_on_model_save()
    with pytest.raises(ValueError, match="requires ZeRO-3"):
        engine._zero3_consolidated_16bit_state_dict()
    cfg = zfunc.Config(stage=1)
    engine, *_ = zfunc.initialize(model=torch.nn.Linear(3, 2), config=cfg)
    assert engine.config is cfg is engine.cfg


@pytest.mark.parametrize("key", ["stage3_gather_16bit_weights_on_model_save",
                                 "stage3_gather_fp16_weights_on_model_save"])
def test_the_16bit_save_flag_under_both_names(key):
    engine, *_ = zfunc.initialize(model=torch.nn.Linear(3, 2), config={
        "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, key: True}})
    assert engine.zero_gather_16bit_weights_on_model_save()
    with pytest.raises(ConfigError, match="true or false"):
        zfunc.initialize(model=torch.nn.Linear(3, 2), config={
            "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, key: "yes"}})


class _Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(5, 3)
        self.norm = torch.nn.BatchNorm1d(3)
        self.frozen = torch.nn.Linear(3, 3)
        self.frozen.requires_grad_(False)
        self.head = torch.nn.Linear(3, 5, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scratch", torch.zeros(2), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.frozen(self.norm(self.emb(idx))))


def _consolidated(rank: int, exclude_frozen: bool) -> dict | None:
    torch.manual_seed(0)
    model = _Tied()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    engine, *_ = zfunc.initialize(model=model, config={"train_micro_batch_size_per_gpu": 2, "zero_optimization": {
        "stage": 3, "stage3_param_persistence_threshold": 0}})
    sd = engine._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=exclude_frozen)
    if sd is None:
        return None
    same = {k: torch.equal(sd[k], expected[k]) for k in sd}
    return {"keys": sorted(sd), "same": all(same.values()), "tied": sd["head.weight"] is sd["emb.weight"]}


@pytest.mark.parametrize("world", [1, 2, 3])
def test_the_consolidated_16bit_state_dict_is_deepspeeds(world):
    """On rank 0 only; a tied weight one tensor under both names (Transformers' save then keeps
    one, as with DeepSpeed); persistent buffers, not the others; frozen ones left out on request."""
    for exclude in (False, True):
        outs = run_ranks(_consolidated, world, exclude)
        assert all(o is None for o in outs[1:])
        keys = ["emb.weight", "head.weight", "norm.bias", "norm.num_batches_tracked", "norm.running_mean",
                "norm.running_var", "norm.weight"] + ([] if exclude else ["frozen.bias", "frozen.weight"])
        assert outs[0] == {"keys": sorted(keys), "same": True, "tied": True}


def _whole_init(rank: int) -> list:
    from zfunc.compat.zero import WholeInit

    torch.manual_seed(rank)  # each rank draws other values; modifier_rank=0's win
    with WholeInit(config_dict_or_path={}):
        model = torch.nn.Linear(2, 2)
    with zfunc.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
        if rank == 0:
            with torch.no_grad():
                model.bias.fill_(3.0)
    with zfunc.zero.GatheredParameters(model.weight):  # no modifier: nothing moves
        pass
    return [model.weight.tolist(), model.bias.tolist()]


def test_gathered_parameters_on_a_model_no_engine_holds_broadcast_the_modifiers_values():
    outs = run_ranks(_whole_init, 3)
    assert outs[0] == outs[1] == outs[2] and outs[0][1] == [3.0, 3.0]


def test_gathered_parameters_on_a_meta_parameter_says_why():
    with zfunc.zero.Init():
        model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="meta device"):
        with zfunc.zero.GatheredParameters(model.weight, modifier_rank=0):
            pass


def test_initialize_takes_deepspeeds_keywords_and_refuses_what_it_cannot_serve(tmp_path):
    import argparse
    import json

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 3}))
    engine, *_ = zfunc.initialize(args=argparse.Namespace(deepspeed_config=str(path)), model=torch.nn.Linear(2, 1),
                                  dist_init_required=None, distributed_port=29500, training_data=None)
    assert engine.train_micro_batch_size_per_gpu() == 3
    with pytest.raises(ConfigError, match="both"):
        zfunc.initialize(args=argparse.Namespace(deepspeed_config=str(path)), model=torch.nn.Linear(2, 1),
                         config={"train_micro_batch_size_per_gpu": 1})
    with pytest.raises(ConfigError, match="training_data is not supported"):
        zfunc.initialize(model=torch.nn.Linear(2, 1), training_data=[1, 2])
    with pytest.raises(ConfigError, match="no process group"):
        zfunc.initialize(model=torch.nn.Linear(2, 1), dist_init_required=False)


def test_register_external_parameter_is_refused_with_what_to_do():
    m = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="stage 2"):
        zfunc.zero.register_external_parameter(m, m.weight)


def _second_engine(rank: int, stage: int) -> dict:
    torch.manual_seed(0)
    model = _Tied()
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "AdamW", "params": {"lr": 0.05}}}
    first, *_ = zfunc.initialize(model=model, config=config)
    for step in range(2):
        idx = torch.randint(0, 5, (2,), generator=torch.Generator().manual_seed(10 * step + rank))
        first.backward(first(idx).square().mean())
        first.step()
    trained = {k: v.clone() for k, v in first.module_state_dict().items()}
    second, *_ = zfunc.initialize(model=model, config=config)  # takes the module, weights and all
    taken = second.module_state_dict()
    try:
        first(torch.zeros(2, dtype=torch.long))
        old_refused = False
    except Exception:  # noqa: BLE001  (destroyed: it holds no state)
        old_refused = True
    second.backward(second(torch.zeros(2, dtype=torch.long)).square().mean())
    second.step()
    return {"same": all(torch.equal(taken[k], v) for k, v in trained.items()),
            "keys": sorted(taken) == sorted(trained), "old_refused": old_refused, "trains": second.global_steps == 1}


@pytest.mark.parametrize("stage", [1, 3])
def test_a_second_initialize_of_a_module_takes_its_engines_weights(stage):
    """As DeepSpeed's engines share their module: a second ``initialize`` of ``engine.module``
    starts from the first engine's current weights (and buffers), and the first is destroyed."""
    for out in run_ranks(_second_engine, 2, stage):
        assert out == {"same": True, "keys": True, "old_refused": True, "trains": True}


def _destroy_and_again(rank: int) -> dict:
    torch.manual_seed(0)
    model = _Tied()
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
              "optimizer": {"type": "AdamW", "params": {"lr": 0.05}}}
    engine, optimizer, *_ = zfunc.initialize(model=model, config=config)
    engine.backward(engine(torch.tensor([rank, 4])).square().mean())
    engine.step()
    trained = {k: v.clone() for k, v in engine.module_state_dict().items()}
    engine.destroy()  # Accelerate's free_memory(): the weights go back into the module
    engine.destroy()  # a second call does nothing
    back = {k: torch.equal(v, trained[k]) for k, v in model.state_dict().items()}
    errors = []
    for call in (lambda: engine(torch.zeros(2, dtype=torch.long)), engine.step, engine.zero_grad,
                 optimizer.zero_grad, lambda: engine.save_checkpoint("/nonexistent")):
        try:
            call()
        except RuntimeError as e:
            errors.append("destroy() was called" in str(e))
    again, *_ = zfunc.initialize(model=model, config=config)
    taken = again.module_state_dict()
    return {"back": all(back.values()) and len(back) == len(trained) - 1,  # not the non-persistent buffer
            "errors": errors, "again": all(torch.equal(taken[k], v) for k, v in trained.items())}


def test_destroy_gives_the_weights_back_to_the_module():
    """As DeepSpeed's ``destroy()`` (Accelerate's ``free_memory()``) leaves the weights on the
    module: at stage 3 they go back into the module's parameters and buffers, a new
    ``initialize`` continues from them, and the destroyed engine's methods say what happened."""
    for out in run_ranks(_destroy_and_again, 2):
        assert out == {"back": True, "errors": [True] * 5, "again": True}


def test_gathered_parameters_changes_nothing_when_it_refuses():
    engine, *_ = zfunc.initialize(model=torch.nn.Linear(3, 2), config={"train_micro_batch_size_per_gpu": 1,
                                                                       "zero_optimization": {"stage": 3}})
    with zfunc.zero.Init():
        other = torch.nn.Linear(2, 2)
    w = engine.module.weight
    with pytest.raises(ConfigError, match="meta device"):
        with zfunc.zero.GatheredParameters([w, other.weight], modifier_rank=0):
            pass
    assert w.numel() == 0  # still the empty stage-3 placeholder
    with zfunc.zero.GatheredParameters(w):
        assert w.shape == (2, 3)


class _SharedBuffer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
        pos = torch.arange(2.0)
        self.a.register_buffer("pos", pos)
        self.b.register_buffer("pos", pos)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x) + self.a.pos)


def test_a_buffer_under_two_names_is_saved_under_both():
    model = _SharedBuffer()
    expected = sorted(model.state_dict())
    engine, *_ = zfunc.initialize(model=model, config={"train_micro_batch_size_per_gpu": 1,
                                                       "zero_optimization": {"stage": 3}})
    assert sorted(engine._zero3_consolidated_16bit_state_dict()) == expected


def test_config_wins_over_config_params_as_in_deepspeed():
    ds = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2}}
    engine, *_ = zfunc.initialize(model=torch.nn.Linear(2, 1), config=ds, config_params=None)
    assert engine.cfg.stage == 2 and engine.train_micro_batch_size_per_gpu() == 4
    engine, *_ = zfunc.initialize(model=torch.nn.Linear(2, 1), config=ds,
                                  config_params={"train_micro_batch_size_per_gpu": 1})
    assert engine.train_micro_batch_size_per_gpu() == 4
    engine, *_ = zfunc.initialize(model=torch.nn.Linear(2, 1), config_params=ds)
    assert engine.train_micro_batch_size_per_gpu() == 4


def test_accelerates_cpu_adam_for_an_offloaded_optimizer_trains_as_torchs():
    """With ``offload_optimizer`` and no ``optimizer`` section, Accelerate turns the client's
    optimizer into ``deepspeed.ops.adam.DeepSpeedCPUAdam`` (AdamW when it was one, else Adam's
    L2 decay): the switch serves it, and one step equals torch's AdamW / Adam."""
    pytest.importorskip("accelerate")
    done = _code("""
        import copy, zfunc
        zfunc.as_deepspeed()
        import torch, deepspeed
        from accelerate.utils.deepspeed import map_pytorch_optim_to_deepspeed
        for cls in (torch.optim.AdamW, torch.optim.Adam):
            torch.manual_seed(0)
            model = torch.nn.Linear(3, 2)
            ref = copy.deepcopy(model)
            opt = map_pytorch_optim_to_deepspeed(cls(model.parameters(), lr=0.1, weight_decay=0.1))
            engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config={
                "train_batch_size": 1, "gradient_clipping": 0.0,
                "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}})
            x = torch.randn(1, 3)
            engine.backward(engine(x).square().sum())
            engine.step()
            torch_opt = cls(ref.parameters(), lr=0.1, weight_decay=0.1)
            ref(x).square().sum().backward()
            torch_opt.step()
            full = zfunc.full_params(engine.state)
            print(type(opt).__name__, max((full[n] - p).abs().max().item() for n, p in ref.named_parameters()))
    """)
    assert done.returncode == 0, done.stderr
    lines = [line.split() for line in done.stdout.strip().splitlines()]
    assert [name for name, _ in lines] == ["DeepSpeedCPUAdam", "DeepSpeedCPUAdam"], done.stdout
    assert all(float(diff) < 1e-6 for _, diff in lines), done.stdout
