"""A model built on the ``meta`` device, given values one unit at a time.

`zfunc.init` accepts a model whose parameters are on ``meta`` (built under
``torch.device("meta")`` or `zfunc.zero.Init`). It never holds the whole model: `materialize`
walks the modules, gives a module's parameters host memory only while they are being set, and
hands each unit's values to the caller (which keeps this rank's shard) as soon as the unit is
final; its parameters go back to ``meta`` after. At stage 3 the peak is about the root unit
plus one unit.

The values are those an eager build on the CPU would have, bit for bit, on any number of ranks
(every rank draws the same numbers; rank 0's are broadcast as for an eager model):

- every module's own ``reset_parameters()`` runs in module order, the order an eager build
  constructs (and initialises) them in; a weight shared by two modules keeps the value of the
  first (``b.weight = a.weight`` after construction);
- with ``init_fn``, it then runs on every module in ``module.apply`` order (children first), as
  a model's own ``self.apply(init_fn)`` at the end of ``__init__`` does. The random draws of
  construction are replayed first (their generator states recorded, their values dropped), so
  each module's values are computed when the module is reached, never all at once.
  ``init_fn(module)`` must set the module's *own* parameters only (``recurse=False``), as
  ``reset_parameters`` does.

Random draws come from the CPU generator (the values are made on the host and copied to the
device unit by unit), as in an eager CPU build.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from zfunc.autograd.swap import put_back, swap_in
from zfunc.errors import ConfigError

__all__ = ["on_meta", "materialize"]

Places = list[tuple[dict[str, Any], str]]  # where one tensor is held: (module._parameters or ._buffers, key)
Allocate = Callable[[str, tuple[int, ...], torch.dtype], "torch.Tensor | None"]


def on_meta(model: torch.nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is on the ``meta`` device.

    Examples:
        >>> import torch
        >>> with torch.device("meta"):
        ...     lin = torch.nn.Linear(2, 2)
        >>> on_meta(lin), on_meta(torch.nn.Linear(2, 2))
        (True, False)
    """
    return any(t.is_meta for t in [*model.parameters(), *model.buffers()])


class _Tensors:
    """Every parameter and buffer of a model by name (a tied one under its first name), where
    each is held, and which names each module holds itself."""

    def __init__(self, model: torch.nn.Module):
        self.modules = [m for _, m in model.named_modules()]
        canon = {id(t): n for n, t in [*model.named_parameters(), *model.named_buffers()]}
        self.places: dict[str, Places] = {}
        self.own: dict[int, list[str]] = {}
        for mod in self.modules:
            for kind in ("_parameters", "_buffers"):
                entries = getattr(mod, kind)
                for key, t in entries.items():
                    if t is not None:
                        name = canon[id(t)]
                        self.places.setdefault(name, []).append((entries, key))
                        self.own.setdefault(id(mod), []).append(name)

    def get(self, name: str) -> torch.Tensor:
        entries, key = self.places[name][0]
        return entries[key]

    def put(self, name: str, t: torch.Tensor) -> None:
        swap_in([(entries, key, t) for entries, key in self.places[name]])  # for good

    def make(self, name: str, allocate: Allocate | None = None) -> torch.Tensor:
        """``name`` as a new host tensor (from ``allocate`` if given; NaN when floating, so a
        value never set is caught), put wherever it is held."""
        old = self.get(name)
        new = allocate(name, tuple(old.shape), old.dtype) if allocate is not None else None
        if new is None:
            new = torch.empty(old.shape, dtype=old.dtype)
        if new.is_floating_point():
            new.fill_(float("nan"))
        if isinstance(old, torch.nn.Parameter):
            new = torch.nn.Parameter(new, requires_grad=old.requires_grad)
        self.put(name, new)
        return new


def materialize(model: torch.nn.Module, units: list[list[str]],
                init_fn: Callable[[torch.nn.Module], None] | None,
                on_unit: Callable[[int, dict[str, torch.Tensor]], None],
                allocate: Allocate | None = None) -> dict[str, torch.Tensor]:
    """Initialise the meta-built ``model`` (see the module docstring): ``on_unit(i, values)``
    once per unit ``units[i]`` (parameter names) as soon as its values are final, in the same
    order on every rank; those parameters go back to ``meta`` after. Returns every other
    parameter and buffer (frozen ones and buffers, which every rank keeps) by name; the module
    holds them too. ``allocate(name, shape, dtype)`` may give a unit parameter its memory (a
    view of one buffer per unit, say, so a unit is one allocation, freed as one); None: its own.

    Raises:
        ConfigError: a module holding tensors on meta has no ``reset_parameters`` and no
            ``init_fn`` was given, or a tensor is left unset (a buffer the module computed in
            ``__init__``, which meta construction loses).

    Examples:
        >>> import torch
        >>> def build():
        ...     return torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
        >>> torch.manual_seed(0) and None
        >>> eager = build()
        >>> with torch.device("meta"):
        ...     lazy = build()
        >>> torch.manual_seed(0) and None
        >>> got = {}
        >>> rest = materialize(lazy, [["0.weight", "0.bias"], ["1.weight", "1.bias"]], None,
        ...                    lambda i, values: got.update({n: v.clone() for n, v in values.items()}))
        >>> all(torch.equal(got[n], p) for n, p in eager.named_parameters()), lazy[0].weight.is_meta, rest
        (True, True, {})
    """
    tensors = _Tensors(model)
    unresettable = [name or type(model).__name__ for name, mod in model.named_modules()
                    if tensors.own.get(id(mod)) and not hasattr(mod, "reset_parameters")
                    and any(tensors.get(n).is_meta for n in tensors.own[id(mod)])]
    if unresettable and init_fn is None:
        raise ConfigError(f"model: built on the meta device, and {unresettable[:5]} hold parameters or buffers but "
                          "have no reset_parameters(); pass init_fn=<a function that sets one module's own "
                          "parameters> to zfunc.init")
    first_owner = {}
    for mod in tensors.modules:
        for name in tensors.own.get(id(mod), []):
            first_owner.setdefault(name, id(mod))
    states = _construction_states(tensors, first_owner) if init_fn is not None else None
    order = tensors.modules if init_fn is None else list(_post_order(model))
    last_owner = {name: id(mod) for mod in order for name in tensors.own.get(id(mod), [])}
    unit_of = {n: i for i, names in enumerate(units) for n in names}
    left = {i: set(names) for i, names in enumerate(units)}
    made: dict[str, int] = {}  # name -> its version when made (any in-place write moves it)

    def checked(name: str) -> torch.Tensor:
        t = tensors.get(name)
        unset = name in made and t._version == made[name]
        if unset or (t.is_floating_point() and bool(torch.isnan(t).any())):
            raise ConfigError(f"model: {name!r} was not set by its module's reset_parameters() nor by init_fn; it "
                              "was built on the meta device, where values computed in __init__ are lost. Set it in "
                              "init_fn=<fn> or compute it in forward")
        return t.detach()

    for mod in order:
        names = tensors.own.get(id(mod), [])
        if not names:
            continue
        for name in names:
            if name not in made and tensors.get(name).is_meta:
                made[name] = tensors.make(name, allocate if name in unit_of else None)._version
        if hasattr(mod, "reset_parameters"):
            if states is None:
                _reset(mod, tensors, first_owner)
            else:  # the draws construction made for this module, then on from where init_fn left off
                resume = torch.get_rng_state()
                torch.set_rng_state(states[id(mod)])
                _reset(mod, tensors, first_owner)
                torch.set_rng_state(resume)
        if init_fn is not None:
            init_fn(mod)
        for name in names:
            if last_owner[name] == id(mod) and name in unit_of:
                left[unit_of[name]].discard(name)
        for i in sorted(i for i, rest in left.items() if not rest):
            del left[i]
            values = {n: checked(n) for n in units[i]}
            on_unit(i, values)
            for n in units[i]:
                old = tensors.get(n)
                tensors.put(n, torch.nn.Parameter(torch.empty(old.shape, dtype=old.dtype, device="meta"),
                                                  requires_grad=old.requires_grad))
    out = {}
    for name in tensors.places:
        if name in unit_of:
            continue
        t = tensors.get(name)
        if t.is_meta:
            raise ConfigError(f"model: {name!r} is still on the meta device after initialisation; give its module a "
                              "reset_parameters() or pass init_fn=<fn> to zfunc.init that sets it")
        out[name] = checked(name)
    return out


def _reset(mod: torch.nn.Module, tensors: _Tensors, first_owner: dict[str, int]) -> None:
    """``mod.reset_parameters()``, where a tensor ``mod`` shares with a module before it gets a
    scratch copy: the draws happen, the shared value stays the first module's."""
    shared = [(entries, key, entries[key]) for entries, key, name in _own_places(mod, tensors)
              if first_owner[name] != id(mod)]
    taken = swap_in([(entries, key, _like(t, torch.empty_like(t))) for entries, key, t in shared])
    try:
        with torch.no_grad():
            mod.reset_parameters()
    finally:
        put_back(taken)


def _own_places(mod: torch.nn.Module, tensors: _Tensors) -> list[tuple[dict[str, Any], str, str]]:
    out = []
    for name in tensors.own.get(id(mod), []):
        for entries, key in tensors.places[name]:
            if entries is mod._parameters or entries is mod._buffers:
                out.append((entries, key, name))
    return out


def _construction_states(tensors: _Tensors, first_owner: dict[str, int]) -> dict[int, torch.Tensor]:
    """Replay construction's draws (every ``reset_parameters`` in module order, on views of one
    scratch buffer); return the CPU generator's state before each module's draws. The generator
    is left where construction left it."""
    states = {}
    sizes = [sum(_nbytes(entries[key]) for entries, key, _ in _own_places(mod, tensors)) for mod in tensors.modules]
    pool = torch.empty(max(sizes, default=0) + 64 * len(max(tensors.own.values(), key=len, default=[])),
                       dtype=torch.uint8)
    for mod in tensors.modules:
        names = tensors.own.get(id(mod), [])
        if not names or not hasattr(mod, "reset_parameters"):
            continue
        states[id(mod)] = torch.get_rng_state()
        places, at = [], 0
        for entries, key, _ in _own_places(mod, tensors):
            t = entries[key]
            n = _nbytes(t)
            places.append((entries, key, _like(t, pool.narrow(0, at, n).view(t.dtype).view(t.shape))))
            at += -(-n // 64) * 64  # each view 64-byte aligned
        taken = swap_in(places)
        try:
            with torch.no_grad():
                mod.reset_parameters()
        finally:
            put_back(taken)
    return states


def _like(t: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` as what ``t`` is: a parameter (with ``t``'s ``requires_grad``) or a plain tensor."""
    if isinstance(t, torch.nn.Parameter):
        return torch.nn.Parameter(value, requires_grad=t.requires_grad)
    return value


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _post_order(module: torch.nn.Module) -> list[torch.nn.Module]:
    """Modules in the order ``module.apply`` visits them (children first), each once."""
    out: list[torch.nn.Module] = []
    seen: set[int] = set()

    def walk(m: torch.nn.Module) -> None:
        for child in m.children():
            walk(child)
        if id(m) not in seen:
            seen.add(id(m))
            out.append(m)

    walk(module)
    return out

