"""The layers ``Guard`` raised, and their return: each raised layer goes back to its own format after a quiet
window (no raise of it), a window doubled each time it is raised again after a return (``layers.raise_layer``,
``layers.lower_layer``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ampkit.guard import layers


class Raises:
    """The raised layers of ``model`` (``raised``: name -> ``"float32"`` or ``"16 bits"``, in the order raised).

    Args:
        model: the guarded model.
        watch: the guard's layer watch, which follows each layer's module through a raise and a return.
        quiet_window: the steps a raised layer runs quiet before it returns (None: never).
        master_of: a 16-bit parameter's float32 master (O2's optimizer's ``master_of``), or None.
        sixteen: the run's 16-bit dtype, asked at a raise (``Replay.sixteen``), or None.
    """

    def __init__(self, model: nn.Module, watch: layers.LayerWatch, quiet_window: int | None,
                 master_of: layers.MasterOf | None = None,
                 sixteen: Callable[[], torch.dtype | None] | None = None) -> None:
        self.model, self.watch, self.quiet_window, self.master_of = model, watch, quiet_window, master_of
        self.sixteen = sixteen or (lambda: None)
        self.raised: dict[str, str] = {}
        self._originals: dict[str, nn.Module] = {}  # each raised layer's module before its first raise
        self._raised_at: dict[str, int] = {}  # each raised layer's step of its last raise
        self._windows: dict[str, int] = {}  # each layer's quiet window

    def raise_(self, layer: str, step: int) -> str:
        """Raise ``layer`` one step at ``step``; what was done, in words."""
        if self.raised.get(layer) == "float32":
            return f"not raised ({layer} runs in float32 already)"
        module = self.model.get_submodule(layer)
        to = layers.raised_to(module)
        # an FP8 linear whose input is within a doubling of float16's largest (it comes in float32, from a layer raised
        # before it) computes in float32: in float16 it overflows at once, and would be raised again the next step
        past = layers.input_past(module, self.sixteen()) if to == "16 bits" else None
        if layer not in self._originals:  # its own format, which it returns to once quiet
            self._originals[layer] = module
            if layer in self._windows:  # it failed again after a return: a window twice as long
                self._windows[layer] *= 2
        self._windows.setdefault(layer, self.quiet_window or 0)
        for _ in range(2 if past is not None else 1):
            self.watch.watch(layer, layers.raise_layer(self.model, layer, self.master_of))
        self.raised[layer], self._raised_at[layer] = "float32" if past is not None else to, step
        return f"raised to float32 ({past})" if past is not None else f"raised to {to}"

    def return_quiet(self, step: int) -> list[tuple[str, str, str]]:
        """Lower each raised layer quiet for its window at ``step``: (layer, why in words, what was done) each."""
        returned = []
        for layer in [name for name in self.raised if step - self._raised_at[name] >= self._windows[name] > 0]:
            original = self._return(layer)
            window = self._windows[layer]
            returned.append((layer, f"{layer}: {window} quiet steps since its raise at step {self._raised_at[layer]} "
                             f"(should it fail again: {2 * window})", f"returned to {layers.format_of(original)}"))
        return returned

    def _return(self, layer: str) -> nn.Module:
        """``layer`` back in its own format (``layers.lower_layer``), watched there; its module before the raise."""
        original = self._originals.pop(layer)
        self.watch.watch(layer, layers.lower_layer(self.model, layer))
        del self.raised[layer]
        return original

    def state_dict(self) -> dict[str, Any]:
        return {"raised": dict(self.raised), "raised_at": dict(self._raised_at), "windows": dict(self._windows)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Raise the layers ``state`` names as it says (and return those it does not name), at its steps and
        windows. A name ``model`` lacks is refused before any change."""
        missing = [name for name in state["raised"] if name not in dict(self.model.named_modules())]
        if missing:
            raise ValueError(f"The guard's state raises {missing}, which this model does not have: load it into the "
                             "model it was saved with.")
        for layer in list(self.raised):  # back to their formats first, then raised as the state says
            self._return(layer)
        for layer, to in state["raised"].items():
            self.raise_(layer, state["raised_at"][layer])
            if to != self.raised[layer]:  # an FP8 or block-scaled layer raised to 16 bits, then to float32
                self.raise_(layer, state["raised_at"][layer])
        self._raised_at, self._windows = dict(state["raised_at"]), dict(state["windows"])
