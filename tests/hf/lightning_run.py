"""One Lightning ``DeepSpeedStrategy`` run, unchanged on DeepSpeed 0.19.8 and on zfunc.

A ``LightningModule`` around the tiny GPT-2 with AdamW and a per-step ``LambdaLR``,
``accumulate_grad_batches``, ``gradient_clip_val``, 4 optimizer steps on 2 gloo ranks; rank 0
writes, per case, the loss and learning rate of each step and the full weights after training
(``<case>.json``).

Lightning's ``DeepSpeedStrategy`` refuses any accelerator but CUDA (``setup_environment``),
checks GPU indices (``setup_distributed``) and passes the device index, ``None`` on a CPU, to
``deepspeed.initialize`` as ``args.device_rank`` (DeepSpeed compares it with 0); on this CPU
machine both runs use a subclass that skips the two checks and passes the local rank
(``CPUDeepSpeedStrategy``), the only change from a GPU script.

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 .venv-ds/bin/torchrun --nproc-per-node 2 \\
        tests/hf/lightning_run.py --reference --out tests/fixtures/hf pl_z2_fp32_gas2 ...
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 -m zfunc.compat.as_deepspeed \\
        tests/hf/lightning_run.py --out /tmp/zf pl_z2_fp32_gas2 ...

A case name is ``pl_z<stage>_fp32_gas<n>``.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import MICRO, dataset, drive, model, saved_tensor  # noqa: E402

STEPS = 4


def parse_case(name: str) -> dict:
    m = re.fullmatch(r"pl_z([123])_fp32_gas(\d)", name)
    if m is None:
        raise SystemExit(f"bad case name {name!r}")
    return {"stage": int(m[1]), "gas": int(m[2])}


def run_case(name: str, work: str) -> dict:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DeepSpeedStrategy
    from lightning.fabric.utilities.seed import reset_seed
    from lightning.pytorch.strategies.ddp import DDPStrategy

    case = parse_case(name)

    class CPUDeepSpeedStrategy(DeepSpeedStrategy):
        def setup_environment(self) -> None:  # Lightning's refuses a non-CUDA accelerator
            DDPStrategy.setup_environment(self)

        def setup_distributed(self) -> None:  # Lightning's checks GPU indices (a CPU has none)
            reset_seed()
            self.set_world_ranks()
            self._init_deepspeed_distributed()

        def _setup_model_and_optimizer(self, model, optimizer, lr_scheduler=None):  # noqa: ANN001, ANN202
            import deepspeed  # Lightning's, with the local rank as device_rank (a CPU device has no index)

            engine, opt, _, _ = deepspeed.initialize(
                args=argparse.Namespace(device_rank=self.local_rank), config=self.config, model=model,
                model_parameters=filter(lambda p: p.requires_grad, model.parameters()), optimizer=optimizer,
                lr_scheduler=lr_scheduler, dist_init_required=False)
            return engine, opt

    class LM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = model()
            self.losses: list[float] = []
            self.lrs: list[float] = []

        def training_step(self, batch, i):  # noqa: ANN001, ANN201
            loss = self.net(**batch).loss
            self.losses.append(float(loss.detach()))
            return loss

        def on_train_batch_end(self, outputs, batch, i):  # noqa: ANN001, ANN201
            self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])

        def configure_optimizers(self):  # noqa: ANN201
            opt = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 2))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    lm = LM()
    strategy = CPUDeepSpeedStrategy(stage=case["stage"], process_group_backend="gloo")
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=STEPS,
                         accumulate_grad_batches=case["gas"], gradient_clip_val=1.0, logger=False,
                         enable_checkpointing=True, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=os.path.join(work, name), use_distributed_sampler=True)
    loader = torch.utils.data.DataLoader(dataset(), batch_size=MICRO, shuffle=False)
    trainer.fit(lm, loader)
    engine = trainer.strategy.model
    # at stage 3 the consolidated state dict (on rank 0), else the module's own
    sd = engine._zero3_consolidated_16bit_state_dict() if case["stage"] == 3 else engine.module.state_dict()
    gas = case["gas"]
    losses = torch.tensor(lm.losses).view(-1, gas).mean(1).tolist()
    result = {"logs": [{"step": i + 1, "loss": loss, "learning_rate": lm.lrs[(i + 1) * gas - 1]}
                       for i, loss in enumerate(losses)]}
    if int(os.environ.get("RANK", 0)) == 0:
        result["weights"] = {k: saved_tensor(v) for k, v in sorted(sd.items())}
        # Lightning's default ModelCheckpoint saved through the strategy (module and optimizer state_dict asked for)
        result["checkpoints"] = sorted(os.listdir(trainer.checkpoint_callback.dirpath))
    return result


if __name__ == "__main__":
    drive(run_case, init_group=False)
