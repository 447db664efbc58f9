"""The loss scaler against a small Python model of DeepSpeed's ZeRO rule (loss_scaler.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import zfunc
from zfunc.core.scaler import scaler_init, scaler_update


@dataclasses.dataclass
class DeepSpeedRule:
    """DeepSpeed's dynamic loss scaler, written from its documented rule (growth factor 2).

    One knowing difference, pinned here: at the minimum scale DeepSpeed raises; zfunc stays.
    """

    scale: float
    window: int
    hysteresis: int
    min_scale: float
    consecutive: bool
    t: int = 0
    last: int = -1
    h: int = 0
    skipped: int = 0

    def __post_init__(self):
        self.h = self.hysteresis

    def update(self, overflow: bool) -> None:
        if overflow:
            if self.hysteresis == 1 or self.h == 1:
                self.scale = max(self.scale / 2, self.min_scale)
            else:
                self.h -= 1
            self.last = self.t
            self.skipped += 1
        else:
            if self.consecutive:
                self.h = self.hysteresis
            k = self.t - self.last - 1
            if k > 0 and k % self.window == 0:
                if not self.consecutive:
                    self.h = self.hysteresis
                self.scale *= 2
        self.t += 1


def _cfg(init, window, hysteresis, min_scale, consecutive):
    return zfunc.Config(precision="fp16", loss_scale=zfunc.DynamicLossScale(
        init=init, window=window, hysteresis=hysteresis, min_scale=min_scale, consecutive_hysteresis=consecutive))


def _scales(cfg, overflows):
    s = scaler_init(cfg)
    out = []
    for t, o in enumerate(overflows):
        s = scaler_update(s, torch.tensor(float(o)), cfg, torch.tensor(t))
        out.append(s.scale.item())
    return out, s


@settings(max_examples=150, deadline=None)
@given(init_pow=st.integers(0, 20), window=st.integers(1, 5), hysteresis=st.integers(1, 4),
       min_pow=st.integers(0, 4), consecutive=st.booleans(),
       overflows=st.lists(st.booleans(), min_size=1, max_size=40))
def test_matches_deepspeed_rule(init_pow, window, hysteresis, min_pow, consecutive, overflows):
    init, min_scale = 2.0 ** max(init_pow, min_pow), 2.0 ** min_pow
    ref = DeepSpeedRule(init, window, hysteresis, min_scale, consecutive)
    cfg = _cfg(init, window, hysteresis, min_scale, consecutive)
    s = scaler_init(cfg)
    for t, o in enumerate(overflows):
        ref.update(o)
        s = scaler_update(s, torch.tensor(float(o)), cfg, torch.tensor(t))
        assert (s.scale.item(), s.last_overflow.item(), s.hysteresis.item(),
                s.skipped.item()) == (ref.scale, ref.last, ref.h, ref.skipped)


def test_doubles_every_window_without_overflow():
    scales, _ = _scales(_cfg(2.0**8, 2, 2, 1.0, False), [0] * 10)
    assert scales == [256, 256, 512, 512, 1024, 1024, 2048, 2048, 4096, 4096]


def test_eight_overflows_halve_to_the_floor_and_stay():
    scales, s = _scales(_cfg(2.0**4, 1000, 1, 1.0, False), [1] * 8)
    assert scales == [8, 4, 2, 1, 1, 1, 1, 1]  # DeepSpeed raises at the floor; zfunc stays there
    assert s.skipped.item() == 8


def test_hysteresis_three():
    scales, _ = _scales(_cfg(256.0, 1000, 3, 1.0, False), [1, 1, 1, 1])
    assert scales == [256, 256, 128, 64]


def test_consecutive_hysteresis_refills_on_a_clean_step():
    plain, _ = _scales(_cfg(256.0, 1000, 2, 1.0, False), [1, 0, 1])
    refill, _ = _scales(_cfg(256.0, 1000, 2, 1.0, True), [1, 0, 1])
    assert plain == [256, 256, 128]   # hysteresis is not refilled by a clean step
    assert refill == [256, 256, 256]  # consecutive_hysteresis refills it


def test_mixed_sequence_like_deepspeed_test():
    # 2 overflows (/4), 3 clean steps with window 2 (x2 once), 1 overflow (/2): hysteresis 1.
    scales, _ = _scales(_cfg(2.0**8, 2, 1, 1.0, False), [1, 1, 0, 0, 0, 1])
    assert scales == [128, 64, 64, 64, 128, 64]


def test_static_scale_never_moves_but_counts_skips():
    cfg = zfunc.Config(precision="fp16", loss_scale=128.0)
    scales, s = _scales(cfg, [1, 0, 1, 0])
    assert scales == [128.0] * 4 and s.skipped.item() == 2


@settings(max_examples=100, deadline=None)
@given(init_pow=st.integers(0, 20), window=st.integers(1, 5), overflows=st.lists(st.booleans(), min_size=1, max_size=40))
def test_grad_scaler_rule_matches_torch_amp_update_scale(init_pow, window, overflows):
    """``rule="grad_scaler"`` against torch's own update (``torch._amp_update_scale_``, what
    ``torch.amp.GradScaler.update`` runs): halve at every overflow, double at every window-th
    clean step in a row."""
    cfg = zfunc.Config(precision="fp16", loss_scale=zfunc.DynamicLossScale.grad_scaler(2.0**init_pow, window))
    scale, tracker = torch.tensor(2.0**init_pow), torch.tensor(0, dtype=torch.int32)
    s = scaler_init(cfg)
    for t, o in enumerate(overflows):
        torch._amp_update_scale_(scale, tracker, torch.tensor(float(o)), 2.0, 0.5, window)
        s = scaler_update(s, torch.tensor(float(o)), cfg, torch.tensor(t))
        assert s.scale.item() == scale.item(), (t, overflows[:t + 1])


def test_grad_scaler_rule_takes_no_hysteresis():
    with pytest.raises(zfunc.ConfigError, match="hysteresis=1"):
        zfunc.DynamicLossScale(rule="grad_scaler")  # hysteresis 2 by default
    with pytest.raises(zfunc.ConfigError, match="loss_scale.rule"):
        zfunc.DynamicLossScale(rule="torch")
