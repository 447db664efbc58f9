"""The records every kernel backend takes, and the protocol the backends implement.

One optimizer pass reads three kinds of input: the vectors it updates (`AdamVectors`), the
per-step device scalars (`StepScalars`) and the run's host hyperparameters (`AdamHyper`).
``zfunc_kernels.fused_adam`` checks them once and hands the records to a `Backend`: the CPU
kernels (``_cpu``), the CUDA kernels and their simulator (``_cuda``) or the plain-torch
reference (``_reference``).
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

__all__ = ["AdamHyper", "SGDHyper", "LionHyper", "AdagradHyper", "StepScalars", "AdamVectors", "SlotVectors",
           "Backend"]


class AdamHyper(NamedTuple):
    """Adam/AdamW hyperparameters fixed for a run (host numbers).

    ``decoupled=True`` is AdamW (``p *= 1 - lr * wd``); ``False`` is Adam (``g += wd * p``).

    Examples:
        >>> AdamHyper(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01).decoupled
        True
    """

    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled: bool = True


class SGDHyper(NamedTuple):
    """``torch.optim.SGD``'s hyperparameters (host numbers).

    Examples:
        >>> SGDHyper(momentum=0.9).nesterov
        False
    """

    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False


class LionHyper(NamedTuple):
    """Lion's hyperparameters (Chen et al., 2023; host numbers).

    Examples:
        >>> LionHyper().beta2
        0.99
    """

    beta1: float = 0.9
    beta2: float = 0.99
    weight_decay: float = 0.0


class AdagradHyper(NamedTuple):
    """``torch.optim.Adagrad``'s hyperparameters (host numbers).

    Examples:
        >>> AdagradHyper().eps
        1e-10
    """

    lr_decay: float = 0.0
    weight_decay: float = 0.0
    eps: float = 1e-10


class MuonMomentumHyper(NamedTuple):
    """Muon's momentum pass (`zfunc_kernels.fused_muon_momentum`; host numbers).

    Examples:
        >>> MuonMomentumHyper().momentum
        0.95
    """

    momentum: float = 0.95
    nesterov: bool = True


class MuonApplyHyper(NamedTuple):
    """Muon's update pass (`zfunc_kernels.fused_muon_apply`; host numbers).

    Examples:
        >>> MuonApplyHyper().weight_decay
        0.1
    """

    weight_decay: float = 0.1


class StepScalars(NamedTuple):
    """The device scalars of one optimizer step; the kernels never read them on the host.

    Attributes:
        step: 0-dim int64, updates applied so far; incremented unless ``found_inf``.
        lr: 0-dim float32 learning rate.
        inv_scale: 0-dim float32, ``1 / loss_scale``.
        clip_coef: 0-dim float32 gradient-clipping factor (1 for none).
        found_inf: 0-dim float32; nonzero skips the whole step.

    Examples:
        >>> s = StepScalars(torch.tensor(0), torch.tensor(0.1), torch.tensor(1.0), torch.tensor(1.0),
        ...                 torch.tensor(0.0))
        >>> s.step.item(), round(s.lr.item(), 3)
        (0, 0.1)
    """

    step: torch.Tensor
    lr: torch.Tensor
    inv_scale: torch.Tensor
    clip_coef: torch.Tensor
    found_inf: torch.Tensor


class AdamVectors(NamedTuple):
    """The 1-D vectors of one pass: ``master``, ``mu``, ``nu`` (and ``compute``) are updated.

    Examples:
        >>> v = AdamVectors(torch.zeros(2), torch.ones(2), torch.zeros(2), torch.zeros(2))
        >>> v.compute is None
        True
    """

    master: torch.Tensor
    grad: torch.Tensor
    mu: torch.Tensor
    nu: torch.Tensor
    compute: torch.Tensor | None = None


class SlotVectors(NamedTuple):
    """The vectors of one pass of a one-slot optimizer (SGD, Lion, Adagrad): ``master``,
    ``slot`` (and ``compute``) are updated.

    Examples:
        >>> SlotVectors(torch.zeros(2), torch.ones(2), torch.zeros(2)).compute is None
        True
    """

    master: torch.Tensor
    grad: torch.Tensor
    slot: torch.Tensor
    compute: torch.Tensor | None = None


class Backend(Protocol):
    """What each kernel backend module provides (arguments already checked)."""

    def fused_adam(self, vectors: AdamVectors, scalars: StepScalars, hyper: AdamHyper) -> None:
        """One fused unscale + clip + Adam/AdamW pass, in place."""

    def fused_slot_update(self, kind: str, vectors: SlotVectors, scalars: StepScalars, hyper: tuple) -> None:
        """One fused pass of the one-slot optimizer ``kind`` ("sgd", "lion", "adagrad"), in place."""

    def overflow_sumsq(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """``out[:] = [found_inf, sum(x**2)]``."""
