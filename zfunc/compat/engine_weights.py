"""The engine's weights out of the state: the module's full state dict, DeepSpeed's 16-bit save
entry points (which Hugging Face and Accelerate call), and the weights written back into the
module when the engine lets it go (`Engine` inherits them)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from zfunc.autograd.swap import set_data
from zfunc.core.deepspeed_config import gather_16bit_on_save
from zfunc.core.config import Config
from zfunc.core.create import full_params
from zfunc.distributed import comm

if TYPE_CHECKING:
    from zfunc.autograd.binding import ModuleBinding
    from zfunc.core.state import TrainState

__all__ = ["WeightsOut"]


class WeightsOut:
    """The engine's full weights, by the module's names."""

    module: torch.nn.Module
    cfg: Config
    config: Any
    _state: TrainState
    _router: ModuleBinding
    _live: Any  # the engine's: its state, or the error that says it was destroyed

    def module_state_dict(self) -> dict[str, torch.Tensor]:
        """The trained model's full state dict (parameters in the compute dtype, buffers), under
        the module's own keys, at every stage; gathers at stages 1-3 (call it on every rank). A
        tied weight is one tensor under each of its names, as the module's own state dict has it;
        non-persistent buffers are included (`save_16bit_model` leaves them out)."""
        st = self._live()
        full = {n: t.to(st.cfg.compute_dtype) for n, t in full_params(st).items()}
        by_id = {id(p): n for n, p in self.module.named_parameters()}
        values = {**full, **st.frozen, **st.buffers}
        by_id.update({id(b): n for n, b in self.module.named_buffers()})
        out, copies = {}, {}
        for name, t in [*self.module.named_parameters(remove_duplicate=False),
                        *self.module.named_buffers(remove_duplicate=False)]:
            source = by_id.get(id(t), name)
            if source not in copies:
                copies[source] = values[source].detach().clone()
            out[name] = copies[source]
        return out

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """DeepSpeed's: whether the config asks stage 3 to gather 16-bit weights when the model is
        saved (``zero_optimization.stage3_gather_16bit_weights_on_model_save``)."""
        return not isinstance(self.config, Config) and gather_16bit_on_save(self.config)

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False
                                             ) -> dict[str, torch.Tensor] | None:
        """DeepSpeed's, which Hugging Face and Accelerate call to save a stage-3 model: the full
        weights in the compute dtype on rank 0 (``None`` on the others), a tied weight one tensor
        under each of its names, persistent buffers, trainable parameters only when
        ``exclude_frozen_parameters``. A collective: call it on every rank."""
        if self.cfg.stage != 3:
            raise ValueError("this function requires ZeRO-3 mode")
        sd = self._saved_state_dict(exclude_frozen_parameters)
        return sd if self._state.group.rank == 0 else None

    def _saved_state_dict(self, exclude_frozen_parameters: bool) -> dict[str, torch.Tensor]:
        """`module_state_dict` as a saved model holds it: persistent buffers only, frozen
        parameters left out on request."""
        sd = self.module_state_dict()
        keep = {n for n, _ in self.module.named_parameters(remove_duplicate=False)}
        keep |= {n for n, _ in _persistent_buffers(self.module)}
        if exclude_frozen_parameters:
            keep -= {n for n, p in self.module.named_parameters(remove_duplicate=False) if not p.requires_grad}
        return {n: t for n, t in sd.items() if n in keep}

    def save_16bit_model(self, save_dir: str | os.PathLike, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """DeepSpeed's ``save_16bit_model``: the module's state dict (parameters in the compute
        dtype: 16-bit under fp16/bf16; persistent buffers) written by rank 0 with ``torch.save``,
        loadable with ``module.load_state_dict(..., strict=True)`` (less the frozen parameters
        with ``exclude_frozen_parameters``). Call on every rank. At stage 3 it saves whether or not
        ``stage3_gather_16bit_weights_on_model_save`` is set (DeepSpeed writes nothing then)."""
        sd = self._saved_state_dict(exclude_frozen_parameters)
        if self._state.group.rank == 0:
            os.makedirs(os.fspath(save_dir), exist_ok=True)
            torch.save(sd, os.path.join(os.fspath(save_dir), save_filename))
        comm.all_gather_object(None, self._state.group)  # barrier: the file is there
        return True

    def _return_weights(self) -> None:
        """Write the current weights into the module: trained parameters (the compute-dtype
        values, each stored in the parameter's own dtype; a donated module gets its storage back),
        frozen parameters and buffers. A collective at stages 1-3 (it gathers)."""
        sd = self.module_state_dict()
        named = dict(self.module.named_parameters())
        with torch.no_grad():
            for name, buf in self.module.named_buffers():
                if name in sd:
                    buf.copy_(sd[name])
            for name, p in named.items():
                if name in self._state.frozen:
                    p.copy_(sd[name])
        if self._router.donated:
            self._router.give_back(sd)
        else:
            # stages 0-2: the module viewed this engine's buffers
            set_data([(p, sd[name].to(p.dtype).clone()) for name, p in named.items()
                      if name not in self._state.frozen])


def _persistent_buffers(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, buffer)`` for the buffers a module's state dict holds (not the non-persistent ones)."""
    for prefix, m in module.named_modules(remove_duplicate=False):
        for name, buf in m.named_buffers(recurse=False):
            if buf is not None and name not in m._non_persistent_buffers_set:
                yield (f"{prefix}.{name}" if prefix else name), buf
