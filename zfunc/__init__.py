"""zfunc: ZeRO training as pure functions over an immutable training state.

The training state (sharded parameters, gradients, optimizer moments, loss scaler) is one
optree pytree, `TrainState`; `backward_step`, `accumulate` and `apply_step` transform it.

This module is the public face; the package underneath is laid out by concern:

- ``zfunc.core``: the state, `init`, the steps, config, optimizers, loss scaler, schedules;
- ``zfunc.autograd``: how a forward call runs on a state and its gradients reach the state;
- ``zfunc.distributed``: collectives (`zfunc.comm`), the mesh of ranks, the flat layout;
- ``zfunc.io``: checkpoints and their atomic commit;
- ``zfunc.compat``: the DeepSpeed-compatible engine, its optimizer view, config translation;
- ``zfunc.tools``: launching local worlds, metrics, memory reports.
"""

from __future__ import annotations

import sys

from zfunc._tree import tree as tree
from zfunc.autograd.forward_gather import settle as settle
from zfunc.compat import moe as moe
from zfunc.compat import utils as utils
from zfunc.compat import zero as zero
from zfunc.compat.switch import as_deepspeed as as_deepspeed
from zfunc.compat.engine import Engine as Engine
from zfunc.compat.initialize import add_config_arguments as add_config_arguments
from zfunc.compat.initialize import init_distributed as init_distributed
from zfunc.compat.initialize import initialize as initialize
from zfunc.core import schedules as schedules
from zfunc.core.backward import accumulate as accumulate
from zfunc.core.backward import backward_step as backward_step
from zfunc.core.backward import vjp as vjp
from zfunc.core.config import Config as Config
from zfunc.core.create import full_params as full_params
from zfunc.core.create import init as init
from zfunc.core.full_weights import iter_full_params as iter_full_params
from zfunc.core.optim import AdagradConfig as AdagradConfig
from zfunc.core.optim import MuonConfig as MuonConfig
from zfunc.core.optim import AdamConfig as AdamConfig
from zfunc.core.optim import LionConfig as LionConfig
from zfunc.core.optim import ParamGroup as ParamGroup
from zfunc.core.optim import SGDConfig as SGDConfig
from zfunc.core.optim import adagrad as adagrad
from zfunc.core.optim import muon as muon
from zfunc.core.optim import adam as adam
from zfunc.core.optim import adamw as adamw
from zfunc.core.optim import lion as lion
from zfunc.core.optim import sgd as sgd
from zfunc.core.scaler import DynamicLossScale as DynamicLossScale
from zfunc.core.scaler import ScalerState as ScalerState
from zfunc.core.state import AdagradState as AdagradState
from zfunc.core.state import MuonState as MuonState
from zfunc.core.state import AdamState as AdamState
from zfunc.core.state import GroupHyper as GroupHyper
from zfunc.core.state import LionState as LionState
from zfunc.core.state import Metrics as Metrics
from zfunc.core.state import SGDState as SGDState
from zfunc.core.state import TrainState as TrainState
from zfunc.core.train import train_step as train_step
from zfunc.core.update import apply_step as apply_step
from zfunc.core.update import learning_rate as learning_rate
from zfunc.core.update import learning_rates as learning_rates
from zfunc.core.update import set_hyperparams as set_hyperparams
from zfunc.distributed import comm as comm
from zfunc.errors import ConfigError as ConfigError
from zfunc.io.checkpoint import CheckpointError as CheckpointError
from zfunc.io.export import export as export
from zfunc.io.checkpoint import load as load
from zfunc.io.checkpoint import save as save
from zfunc.io.pretrained import load_weights as load_weights
from zfunc.io.pretrained import save_pretrained as save_pretrained
from zfunc.tools.launch import World as World
from zfunc.tools.launch import launch as launch
from zfunc.tools.memory import memory_plan as memory_plan
from zfunc.tools.memory import memory_report as memory_report

# The public submodules keep their short import paths (``from zfunc.comm import all_reduce``).
sys.modules[__name__ + ".comm"] = comm
sys.modules[__name__ + ".schedules"] = schedules
sys.modules[__name__ + ".zero"] = zero
sys.modules[__name__ + ".utils"] = utils
sys.modules[__name__ + ".moe"] = moe
sys.modules[__name__ + ".moe.utils"] = moe.utils

__version__ = "0.1.0"

__all__ = [
    "AdagradConfig",
    "MuonConfig",
    "AdagradState",
    "MuonState",
    "AdamConfig",
    "AdamState",
    "CheckpointError",
    "Config",
    "ConfigError",
    "DynamicLossScale",
    "Engine",
    "GroupHyper",
    "LionConfig",
    "LionState",
    "Metrics",
    "ParamGroup",
    "SGDConfig",
    "SGDState",
    "ScalerState",
    "TrainState",
    "World",
    "accumulate",
    "adagrad",
    "muon",
    "adam",
    "add_config_arguments",
    "adamw",
    "apply_step",
    "as_deepspeed",
    "backward_step",
    "comm",
    "export",
    "full_params",
    "iter_full_params",
    "load_weights",
    "save_pretrained",
    "init",
    "init_distributed",
    "initialize",
    "launch",
    "learning_rate",
    "learning_rates",
    "lion",
    "load",
    "memory_plan",
    "memory_report",
    "moe",
    "save",
    "schedules",
    "set_hyperparams",
    "settle",
    "sgd",
    "train_step",
    "tree",
    "utils",
    "vjp",
    "zero",
]
