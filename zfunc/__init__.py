"""zfunc: ZeRO training as pure functions over an immutable training state.

The training state (sharded parameters, gradients, optimizer moments, loss scaler) is one
optree pytree, `TrainState`; `backward_step`, `accumulate` and `apply_step` transform it.
"""

from __future__ import annotations

from zfunc import comm as comm
from zfunc import schedules as schedules
from zfunc._tree import tree as tree
from zfunc.backward import accumulate as accumulate
from zfunc.backward import backward_step as backward_step
from zfunc.backward import vjp as vjp
from zfunc.checkpoint import CheckpointError as CheckpointError
from zfunc.checkpoint import export as export
from zfunc.checkpoint import load as load
from zfunc.checkpoint import save as save
from zfunc.config import Config as Config
from zfunc.create import full_params as full_params
from zfunc.create import init as init
from zfunc.engine import Engine as Engine
from zfunc.engine import add_config_arguments as add_config_arguments
from zfunc.engine import init_distributed as init_distributed
from zfunc.engine import initialize as initialize
from zfunc.launch import World as World
from zfunc.launch import launch as launch
from zfunc.errors import ConfigError as ConfigError
from zfunc.memory import memory_plan as memory_plan
from zfunc.memory import memory_report as memory_report
from zfunc.optim import AdamConfig as AdamConfig
from zfunc.optim import adam as adam
from zfunc.optim import AdagradConfig as AdagradConfig
from zfunc.optim import LionConfig as LionConfig
from zfunc.optim import ParamGroup as ParamGroup
from zfunc.optim import SGDConfig as SGDConfig
from zfunc.optim import adagrad as adagrad
from zfunc.optim import adamw as adamw
from zfunc.optim import lion as lion
from zfunc.optim import sgd as sgd
from zfunc.regather import settle as settle
from zfunc.scaler import DynamicLossScale as DynamicLossScale
from zfunc.scaler import ScalerState as ScalerState
from zfunc.state import AdagradState as AdagradState
from zfunc.state import AdamState as AdamState
from zfunc.state import LionState as LionState
from zfunc.state import SGDState as SGDState
from zfunc.state import GroupHyper as GroupHyper
from zfunc.state import Metrics as Metrics
from zfunc.state import TrainState as TrainState
from zfunc.train import train_step as train_step
from zfunc.update import apply_step as apply_step
from zfunc.update import learning_rate as learning_rate
from zfunc.update import learning_rates as learning_rates
from zfunc.update import set_hyperparams as set_hyperparams

__version__ = "0.1.0"

__all__ = [
    "AdagradConfig",
    "AdagradState",
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
    "adam",
    "add_config_arguments",
    "adamw",
    "apply_step",
    "backward_step",
    "comm",
    "export",
    "full_params",
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
    "save",
    "schedules",
    "set_hyperparams",
    "settle",
    "sgd",
    "train_step",
    "tree",
    "vjp",
]
