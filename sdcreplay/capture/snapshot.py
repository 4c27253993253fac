"""An in-memory copy of everything a training step changes, put back in place.

Online detectors roll a step back to recompute it, and the ring buffer keeps
the state at the start of its window; both need the same copy: parameter and
buffer values, the optimizer's state and hyper-parameters, the loop's state
objects (schedulers, GradScaler, counters), gradients and every RNG. Restoring
writes into the existing tensors (``copy_``), never replaces a ``Parameter`` or
a buffer, so the optimizer's references, hooks and CUDA-graph addresses stay
valid. A buffer registered as ``None`` that the step fills in (a lazily built
cache) is set back to ``None``, and one the step set to ``None`` gets its copy.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import SdcReplayError
from .determinism import RngState, capture_rng, restore_rng


def _copy_tensor(tensor: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    """A private copy of ``tensor`` (on ``device`` when given): later in-place updates of the
    original never reach it."""
    tensor = tensor.detach()
    if device is None or tensor.device == device:
        return tensor.clone()
    return tensor.to(device, copy=True)


def copy_state(
    value: Any,
    device: torch.device | None = None,
    copy_tensor: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> Any:
    """A deep copy of a state_dict-like nest whose tensors are copied (to ``device``, or by
    ``copy_tensor``)."""
    if isinstance(value, torch.Tensor):
        return _copy_tensor(value, device) if copy_tensor is None else copy_tensor(value)
    if isinstance(value, Mapping):
        copied = type(value)() if isinstance(value, dict) else {}
        copied.update((key, copy_state(item, device, copy_tensor)) for key, item in value.items())
        if hasattr(value, "_metadata"):  # a module state_dict's version information
            copied._metadata = copy.deepcopy(value._metadata)  # type: ignore[attr-defined]
        return copied
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(copy_state(item, device, copy_tensor) for item in value)
    return copy.deepcopy(value)


class _HostCopies:
    """Copies of accelerator tensors to the host that the step does not wait for: into pinned
    host memory (PyTorch's caching host allocator reuses it), on a side stream that first
    waits for the work already queued, ``non_blocking``; ``event`` is done when they are.
    Tensors already on the CPU are copied as they are."""

    _streams: dict[torch.device, Any] = {}  # one side stream per device, made once

    def __init__(self, device: torch.device):
        self.event: Any = None
        self._stream: Any = None
        if device.type == "cuda":
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            self._stream = stream

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach()
        if self._stream is None or not tensor.is_cuda or type(tensor) is not torch.Tensor:
            return tensor.to("cpu", copy=True)  # a CPU tensor, or a DTensor: as it is
        with torch.cuda.stream(self._stream):
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            tensor.record_stream(self._stream)  # its memory outlives the copy
        return host

    def finish(self) -> Any:
        """The event the copies are done at (None: they already are)."""
        if self._stream is not None:
            self.event = self._stream.record_event()
        return self.event


def _nest_nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, Mapping):
        return sum(_nest_nbytes(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_nest_nbytes(item) for item in value)
    return 0


def _buffer_slots(model: torch.nn.Module) -> dict[str, tuple[torch.nn.Module, str]]:
    """Every registered buffer, ``None`` ones included (``named_buffers`` leaves those out):
    its qualified name -> (owning module, name there)."""
    return {
        f"{path}.{key}" if path else key: (module, key)
        for path, module in model.named_modules()
        for key in module._buffers
    }


def _empty_buffers(model: torch.nn.Module) -> tuple[str, ...]:
    return tuple(
        name for name, (module, key) in _buffer_slots(model).items() if module._buffers[key] is None
    )


def _model_device(model: torch.nn.Module) -> torch.device:
    for tensor in model.parameters():
        return tensor.device
    return torch.device("cpu")


@dataclass
class TrainingSnapshot:
    """Parameters, buffers, gradients, optimizer, state objects and RNG at one moment."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None
    state_objects: dict[str, Any]
    params: dict[str, torch.Tensor]  # empty when taken with params=False
    buffers: dict[str, torch.Tensor]
    empty_buffers: tuple[str, ...]  # registered as None when taken
    grads: dict[str, torch.Tensor | None] | None
    optimizer_state: dict | None
    object_states: dict[str, Any]
    rng: RngState | None
    device: torch.device
    restores_params: bool = True
    pending: Any = None  # the copies' CUDA event while a non-blocking copy is in flight

    @classmethod
    def take(
        cls,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        state_objects: Mapping[str, Any] | None = None,
        *,
        grads: bool = True,
        rng: bool = True,
        params: bool = True,
        device: torch.device | str | None = None,
        non_blocking: bool = False,
    ) -> TrainingSnapshot:
        """Copy the training state now; ``device`` (e.g. ``"cpu"``) moves the copy off the
        accelerator, None keeps each tensor on its own device. ``params=False`` leaves the
        parameters out (a forward/backward that never steps the optimizer cannot change them).

        ``non_blocking`` (to the CPU, no gradients: a ring buffer's window) copies from a GPU
        without making the step wait (``_HostCopies``): the buffers, which a forward changes,
        are first copied on the device; ``before_update()`` must run before the optimizer
        changes anything (its step pre-hook: a wait on the device, not on the host), and the
        copy is read only after ``ready()`` (``restore`` calls it).
        """
        store = torch.device(device) if device is not None else None
        step_device = _model_device(model)
        objects = dict(state_objects or {})
        asynchronous = non_blocking and store is not None and store.type == "cpu" and not grads
        buffer_values = dict(model.named_buffers())
        if asynchronous and step_device.type == "cuda":  # queued before the side stream waits
            buffer_values = {n: b.detach().clone() for n, b in buffer_values.items()}
        host = _HostCopies(step_device) if asynchronous else None
        copy_one = host if host is not None else (lambda t: _copy_tensor(t, store))
        snapshot = cls(
            model=model,
            optimizer=optimizer,
            state_objects=objects,
            params={n: copy_one(p) for n, p in model.named_parameters()} if params else {},
            restores_params=params,
            buffers={n: copy_one(b) for n, b in buffer_values.items()},
            empty_buffers=_empty_buffers(model),
            grads=(
                {
                    n: None if p.grad is None else _copy_tensor(p.grad, store)
                    for n, p in model.named_parameters()
                }
                if grads
                else None
            ),
            optimizer_state=(
                copy_state(optimizer.state_dict(), store, copy_one)
                if optimizer is not None
                else None
            ),
            object_states={
                name: copy_state(obj.state_dict(), store) for name, obj in objects.items()
            },
            rng=capture_rng(step_device) if rng else None,
            device=step_device,
        )
        snapshot.pending = None if host is None else host.finish()
        return snapshot

    def before_update(self) -> None:
        """The parameters and optimizer state are about to change: the device waits for a
        non-blocking copy still reading them (the host does not)."""
        if self.pending is not None:
            torch.cuda.current_stream(self.device).wait_event(self.pending)

    def ready(self) -> TrainingSnapshot:
        """Wait until a non-blocking copy is done (then the copy can be read)."""
        if self.pending is not None:
            self.pending.synchronize()
            self.pending = None
        return self

    def restore(self) -> None:
        """Put the copied state back into the same objects, in place.

        The snapshot stays usable: each restore loads fresh copies, so a rolled-back step can
        be rolled back again.
        """
        self.ready()
        params = dict(self.model.named_parameters())
        self._restore_empty_buffers()
        buffers = dict(self.model.named_buffers())
        known = self.params.keys() if self.restores_params else params.keys()
        if params.keys() != known or buffers.keys() != self.buffers.keys():
            raise SdcReplayError(
                "the model's parameters or buffers changed since the snapshot was taken",
                "Take the snapshot after the model is built and wrapped (DDP, FSDP, compile).",
            )
        with torch.no_grad():
            for name, param in params.items() if self.restores_params else ():
                param.copy_(self.params[name])
            for name, buffer in buffers.items():
                buffer.copy_(self.buffers[name])
            if self.grads is not None:
                for name, param in params.items():
                    _restore_grad(param, self.grads[name])
        if self.optimizer is not None and self.optimizer_state is not None:
            self.optimizer.load_state_dict(copy_state(self.optimizer_state, None))
        for name, obj in self.state_objects.items():
            obj.load_state_dict(copy_state(self.object_states[name], None))
            _forget_unscaling(obj)
        if self.rng is not None:
            restore_rng(self.rng, self.device)

    def _restore_empty_buffers(self) -> None:
        """A buffer that was None is None again; one the step emptied gets a fresh copy (on
        the model's device: its own is gone with it)."""
        for name, (module, key) in _buffer_slots(self.model).items():
            if name in self.empty_buffers and module._buffers[key] is not None:
                setattr(module, key, None)
            elif module._buffers[key] is None and name in self.buffers:
                setattr(module, key, _copy_tensor(self.buffers[name], self.device))

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data the snapshot holds (what a ring buffer pays per window)."""
        held = [self.params, self.buffers, self.grads, self.optimizer_state, self.object_states]
        total = sum(_nest_nbytes(part) for part in held if part is not None)
        if self.rng is not None:
            total += _nest_nbytes([self.rng.cpu, self.rng.accelerator])
        return total


def _restore_grad(param: torch.Tensor, saved: torch.Tensor | None) -> None:
    """Gradient back as it was: None stays None; an existing gradient is overwritten in place."""
    if saved is None:
        param.grad = None
    elif param.grad is not None and param.grad.shape == saved.shape:
        param.grad.copy_(saved)
    else:
        param.grad = saved.to(param.device, copy=True)


def _forget_unscaling(obj: Any) -> None:
    """A GradScaler remembers, per optimizer, that this step already unscaled its gradients
    (``unscale_`` then refuses to run again until ``update()``); that bookkeeping is not in its
    ``state_dict``. A snapshot is taken at a step boundary, where there is none, so a step
    stopped or rolled back after ``unscale_`` must not leave it behind."""
    if isinstance(obj, torch.amp.GradScaler):
        obj._per_optimizer_states.clear()  # a defaultdict: each optimizer starts afresh
