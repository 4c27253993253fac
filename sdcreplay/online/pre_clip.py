"""The gradients' norms before clipping or unscaling changes them.

Clipping (``clip_grad_norm_(..., 1.0)``, in nearly every LLM recipe) divides every gradient by
the total norm: a corrupted element makes that norm huge, so the gradients the optimizer is
given are all small and unremarkable, the faulty one near ``max_norm`` and the rest
collapsed. The update detector therefore measures each parameter's gradient norm at the first
moment of the step that changes the gradients after backward: torch's in-place clipping
(``clip_grad_norm_``, ``clip_grads_with_norm_``, ``clip_grad_value_``, which the Hugging Face
and Lightning trainers call too) or a ``GradScaler``'s ``unscale_`` (the norms then divided by
its scale), else the optimizer's step. Gradient accumulation adds every micro-batch's
gradients before either, so the norms are those of the step's whole gradient.

Those functions are looked up by name when they are called, so while any detector is open they
are wrapped (once, process-wide) by a function that first tells the open ``PreClipNorms`` whose
model owns the parameters being clipped, then clips.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.utils
import torch.nn.utils.clip_grad as clip_grad

from ..capture.module_names import named_parameters
from .alarms import gradient_norms

_lock = threading.Lock()
_open: weakref.WeakSet[PreClipNorms] = weakref.WeakSet()
_wrapped: list[tuple[Any, str, Any]] = []  # (namespace, name, original), while any is open


def _clipping(original: Callable) -> Callable:
    """``original`` (a clip taking the parameters first), after the open watchers measured."""

    @functools.wraps(original)
    def clip(parameters, *args, **kwargs):
        if not isinstance(parameters, torch.Tensor):
            parameters = list(parameters)  # a generator is read here and still clipped
        for watcher in list(_open):
            watcher.before_change(parameters)
        return original(parameters, *args, **kwargs)

    clip.__sdcreplay_original__ = original  # type: ignore[attr-defined]
    return clip


def _unscaling(original: Callable) -> Callable:
    @functools.wraps(original)
    def unscale_(scaler, optimizer):
        for watcher in list(_open):
            watcher.before_unscale(scaler, optimizer)
        return original(scaler, optimizer)

    unscale_.__sdcreplay_original__ = original  # type: ignore[attr-defined]
    return unscale_


def _targets() -> list[tuple[Any, str, Callable[[Callable], Callable]]]:
    return [
        (clip_grad, "_clip_grads_with_norm_", _clipping),  # what clip_grad_norm_ calls
        (torch.nn.utils, "clip_grads_with_norm_", _clipping),
        (clip_grad, "clip_grad_value_", _clipping),
        (torch.nn.utils, "clip_grad_value_", _clipping),
        (torch.amp.GradScaler, "unscale_", _unscaling),
    ]


def _wrap() -> None:
    for namespace, name, wrapper in _targets():
        original = getattr(namespace, name, None)
        if original is not None and not hasattr(original, "__sdcreplay_original__"):
            setattr(namespace, name, wrapper(original))
            _wrapped.append((namespace, name, original))


def _unwrap() -> None:
    while _wrapped:
        namespace, name, original = _wrapped.pop()
        setattr(namespace, name, original)


class PreClipNorms:
    """Each parameter's gradient norm in a step, taken before the step's first clip or unscale.

    ``begin()`` at each execution's start; ``take()`` where the step is judged (the optimizer's
    step, or its end): the norms measured before the first change, else measured now.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        named: list[tuple[str, torch.nn.Parameter]] | None = None,
    ):
        self.model, self.optimizer = model, optimizer
        self.named = list(named_parameters(model)) if named is None else named
        self._ids = {id(p) for _, p in self.named}
        self._norms: dict[str, float] | None = None
        self._watching = False
        with _lock:
            if not _open:
                _wrap()
            _open.add(self)
        weakref.finalize(self, _forget)

    def begin(self) -> None:
        """An execution of the step starts: nothing measured yet."""
        self._norms, self._watching = None, True

    def take(self) -> dict[str, float]:
        """The norms before the step's first clip or unscale (measured now if none came)."""
        norms = self._norms if self._norms is not None else gradient_norms(self.model, self.named)
        self._norms, self._watching = None, False
        return norms

    def before_change(self, parameters: Any, scale: float = 1.0) -> None:
        """A clip is about to change ``parameters``' gradients: measure ours, once a step."""
        if not self._watching or self._norms is not None:
            return
        tensors = [parameters] if isinstance(parameters, torch.Tensor) else parameters
        if any(id(p) in self._ids for p in tensors):
            norms = gradient_norms(self.model, self.named)
            self._norms = {name: norm / scale for name, norm in norms.items()}

    def before_unscale(self, scaler: torch.amp.GradScaler, optimizer: Any) -> None:
        if optimizer is self.optimizer and scaler.is_enabled():
            self.before_change([p for _, p in self.named], float(scaler.get_scale()))

    def close(self) -> None:
        self._watching = False
        with _lock:
            _open.discard(self)
            if not list(_open):
                _unwrap()


def _forget() -> None:
    """A watcher was collected without ``close()``: unwrap once none is open."""
    with _lock:
        if not list(_open):  # iterating skips the collected ones
            _unwrap()
