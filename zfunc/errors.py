"""`ConfigError` and the small value checks every configuration record shares.

This module imports nothing from zfunc, so any module may raise `ConfigError` without an
import circle.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["ConfigError", "DeepSpeedAssertion", "CheckpointError", "refuse_create_graph", "check", "is_number",
           "is_finite_number", "is_positive_int"]


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and the accepted form.

    Examples:
        >>> import zfunc
        >>> try:
        ...     zfunc.Config(stage=5)
        ... except zfunc.ConfigError as e:
        ...     print(e)
        stage: expected one of 0, 1, 2, 3, got 5
    """


class DeepSpeedAssertion(ConfigError, AssertionError):
    """A refusal in the DeepSpeed shim where DeepSpeed itself fails an ``assert``: a `ConfigError`
    that is also an ``AssertionError``, so code written against DeepSpeed (``except
    AssertionError``) sees the type it expects.

    Examples:
        >>> issubclass(DeepSpeedAssertion, ConfigError) and issubclass(DeepSpeedAssertion, AssertionError)
        True
    """


def refuse_create_graph(grad_enabled: bool) -> None:
    """Refuse a backward with ``create_graph=True`` through zfunc's parameters (in a custom
    autograd Function's backward, grad mode is on exactly then).

    zfunc adds parameter gradients into the state's buffers in place, outside autograd, so a
    graph of them cannot be built; an error beats a gradient that goes missing.

    Examples:
        >>> try:
        ...     refuse_create_graph(True)
        ... except RuntimeError as e:
        ...     print(str(e)[:60])
        backward(create_graph=True) through a zfunc model's paramete
    """
    if grad_enabled:
        raise RuntimeError(
            "backward(create_graph=True) through a zfunc model's parameters is not supported: zfunc adds "
            "parameter gradients into the state's buffers in place, outside autograd. Gradients of gradients "
            "with respect to the inputs work (a gradient penalty: torch.autograd.grad(loss, inputs, "
            "create_graph=True), then a plain backward of the penalised loss); call backward without "
            "create_graph")


class CheckpointError(Exception):
    """A checkpoint cannot be written, is missing or damaged, or does not fit the state it is
    loaded into. The message names the path or the piece; nothing was changed.

    Examples:
        >>> import tempfile, torch, zfunc
        >>> state = zfunc.init(torch.nn.Linear(2, 1), zfunc.Config())
        >>> try:
        ...     zfunc.load(tempfile.mkdtemp(), like=state)
        ... except zfunc.CheckpointError as e:
        ...     print(str(e).split(": ", 1)[1])
        not a complete zfunc checkpoint (no COMPLETE marker): it is an empty directory; load an earlier one
    """


def check(ok: bool, name: str, expected: str, got: Any) -> None:
    """Raise `ConfigError` ``"<name>: expected <expected>, got <got>"`` unless ``ok``.

    Examples:
        >>> check(True, "lr", "a number", 1.0)
    """
    if not ok:
        hint = ""
        if type(got).__module__ == "numpy" and getattr(got, "ndim", None) == 0:  # np.float32(1e-3), np.int64(2)
            hint = " (a numpy scalar: pass a Python number, float(x) or int(x))"
        elif type(got).__module__.startswith("torch") and getattr(got, "ndim", None) == 0:
            hint = " (a tensor: pass a Python number, x.item())"
        raise ConfigError(f"{name}: expected {expected}, got {got!r}{hint}")


def is_number(x: Any) -> bool:
    """An int or float that is not a bool.

    Examples:
        >>> is_number(1), is_number(True), is_number("1")
        (True, False, False)
    """
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def is_finite_number(x: Any) -> bool:
    """A number that is neither infinite nor NaN.

    Examples:
        >>> is_finite_number(1e3), is_finite_number(float("inf"))
        (True, False)
    """
    return is_number(x) and math.isfinite(x)


def is_positive_int(x: Any) -> bool:
    """An int (not a bool) greater than 0.

    Examples:
        >>> is_positive_int(2), is_positive_int(0), is_positive_int(2.0)
        (True, False, False)
    """
    return isinstance(x, int) and not isinstance(x, bool) and x > 0
