"""The base of the tool's dispatch modes: each observes ATen calls, and a higher-order
operator that compiled code calls under it (activation checkpointing's
``run_and_save_rng_state`` in an Inductor graph) runs through untouched instead of failing
the step with torch's "no rule registered" error. Its inner calls are the compiled code's own;
the bundle's code digests (compiled.py) stand for them."""

from __future__ import annotations

from typing import Any

from torch._ops import HigherOrderOperator
from torch.utils._python_dispatch import TorchDispatchMode


class AtenMode(TorchDispatchMode):
    """Subclasses implement ``on_aten``; a higher-order operator is called as it is."""

    supports_higher_order_operators = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if isinstance(func, HigherOrderOperator):  # the mode is off while torch calls this
            return func(*args, **(kwargs or {}))
        return self.on_aten(func, types, args, kwargs or {})

    def on_aten(self, func, types, args: Any, kwargs: dict) -> Any:
        raise NotImplementedError
