"""Layer-level capture of the signature log.

Forward hooks digest every module's output and hang a tensor hook on it, so
the gradient flowing back into that module is digested when it arrives (much
cheaper than ``register_full_backward_hook``). Gradients, the loss, the
parameters after the optimizer step and the RNG states complete a step.
"""

from __future__ import annotations

from collections import Counter
from functools import partial

import torch

from .determinism import RngState
from .digest import Digester

ROOT = "<root>"


def flatten_tensors(value) -> list[torch.Tensor]:
    """Tensors of a module output (tensor, tuple/list, dict), in a stable order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in flatten_tensors(item)]
    if isinstance(value, dict):
        return [t for key in value for t in flatten_tensors(value[key])]
    return []


class SignatureCapture:
    """Hooks a model and optimizer once; they record only inside an open step.

    A step goes ``begin_step`` -> forward/backward (hooks) -> ``record_loss``
    -> ``record_gradients`` -> optimizer step (hook) -> ``end_step``. The order
    of entries is the execution order, so two runs of the same program produce
    the same names in the same order.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None):
        self.model = model
        self._digester: Digester | None = None
        self._in_forward_window = False
        self._calls: Counter[str] = Counter()
        self.optimizer_stepped = False
        self._handles = [
            module.register_forward_hook(partial(self._on_forward, path or ROOT))
            for path, module in model.named_modules()
        ]
        if optimizer is not None:
            self._handles.append(optimizer.register_step_post_hook(self._on_optimizer_step))

    @property
    def step_open(self) -> bool:
        return self._digester is not None

    def begin_step(self, rng: RngState) -> None:
        self._digester = Digester()
        self._calls.clear()
        self.optimizer_stepped = False
        self._in_forward_window = True
        for name, value in rng.signature_items():
            self._digester.add(name, value)

    def _numbered(self, name: str) -> str:
        count = self._calls[name]
        self._calls[name] += 1
        return name if count == 0 else f"{name}#{count}"

    def _on_forward(self, path: str, module, inputs, output) -> None:
        if not self._in_forward_window:
            return
        base = self._numbered(path)
        tensors = flatten_tensors(output)
        for position, tensor in enumerate(tensors):
            suffix = f"[{position}]" if len(tensors) > 1 else ""
            self._digester.add(f"forward:{base}{suffix}", tensor)
            if tensor.requires_grad:
                tensor.register_hook(partial(self._on_output_grad, f"backward:{base}{suffix}"))

    def _on_output_grad(self, name: str, grad: torch.Tensor) -> None:
        if self._digester is not None:
            self._digester.add(name, grad)

    def record_loss(self, loss: torch.Tensor) -> None:
        if self._digester is not None:
            self._digester.add(self._numbered("loss"), loss)

    def record_gradients(self) -> None:
        """Close the forward/backward window with every parameter's gradient."""
        self._in_forward_window = False
        for name, param in self.model.named_parameters():
            self._digester.add(f"grad:{name}", param.grad)

    def _on_optimizer_step(self, optimizer, args, kwargs) -> None:
        if self._digester is None or self._in_forward_window:
            return
        for name, param in self.model.named_parameters():
            self._digester.add(f"param:{name}", param)
        for name, buffer in self.model.named_buffers():
            self._digester.add(f"buffer:{name}", buffer)
        self.optimizer_stepped = True

    def end_step(self) -> list[tuple[str, str]]:
        """Fetch the step's digests (one device sync) and close the step."""
        entries = self._digester.entries()
        self._digester = None
        self._in_forward_window = False
        return entries

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
