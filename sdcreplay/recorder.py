"""The Recorder: the hook a training loop uses to write a trace bundle.

```python
rec = sdcreplay.Recorder("run.bundle", workload="mytrain:make_workload", model=model, optimizer=opt)
for batch in loader:
    with rec.step(batch):
        loss = loss_fn(model, batch); loss.backward()
    opt.step(); opt.zero_grad()
rec.close()
```
Each step is written as soon as the optimizer has stepped, so a run that dies
later keeps every step that completed.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import determinism
from .bundle import Bundle, BundleWriter, checkpoint_reference, load_checkpoint
from .capture import OperatorMode, SignatureCapture
from .devices import torch_device
from .digest import algorithm_for
from .errors import CheckpointError, WorkloadError
from .faults import Injector, parse_specs
from .tensorio import map_tensors
from .workload import accepts_seed, build_workload, canonical_ref


@contextlib.contextmanager
def _loss_capture(capture: SignatureCapture) -> Iterator[None]:
    """Record the tensor handed to backward as the loss, without touching the user's code."""
    original = torch.autograd.backward

    def backward(tensors, *args, **kwargs):
        if isinstance(tensors, torch.Tensor) and tensors.numel() == 1:
            capture.record_loss(tensors)
        return original(tensors, *args, **kwargs)

    torch.autograd.backward = backward
    try:
        yield
    finally:
        torch.autograd.backward = original


class Recorder:
    """Writes the steps of a training loop into a bundle at ``path``.

    ``workload`` names the factory replay will call (with ``workload_kwargs``) to
    rebuild the model and optimizer; the state they start from is embedded in
    the bundle, or referenced by SHA-256 when ``checkpoint`` is the file the
    model and optimizer were just loaded from.
    """

    def __init__(
        self,
        path: str | Path,
        workload: str,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        workload_kwargs: dict | None = None,
        checkpoint: str | Path | None = None,
        device_label: str | None = None,
        start_step: int = 0,
        max_depth: int | None = None,
        deterministic: bool = True,
        overwrite: bool = False,
    ):
        first_param = next(model.parameters())
        self.device = first_param.device
        self.model, self.optimizer = model, optimizer
        switches = determinism.enable() if deterministic else determinism.current_switches()
        header = {
            "workload": {"ref": canonical_ref(workload), "kwargs": dict(workload_kwargs or {})},
            "device": device_label or str(self.device),
            "device_type": self.device.type,
            "digest": algorithm_for(self.device.type),
            "environment": determinism.environment(self.device),
            "determinism": switches,
            "capture": {"max_depth": max_depth},
        }
        self._writer = BundleWriter(Path(path), header, overwrite=overwrite)
        if checkpoint is not None:
            reference = checkpoint_reference(Path(checkpoint))
            _check_model_matches_checkpoint(model, reference)
            self._writer.reference_checkpoint(reference)
        else:
            self._writer.embed_state(model.state_dict(), optimizer.state_dict())
        self._capture = SignatureCapture(model, optimizer, max_depth=max_depth)
        self._hook = optimizer.register_step_post_hook(lambda *_: self._finish_pending())
        self._next_index = start_step
        self._pending: tuple[int, Any, determinism.RngState, float] | None = None
        self.steps_written = 0
        self.entries_written = 0
        self.path: Path = self._writer.path

    @contextlib.contextmanager
    def step(self, batch: Any) -> Iterator[None]:
        """Record one forward/backward; the optimizer step that follows completes it."""
        self._finish_pending()
        started = time.perf_counter()
        rng = determinism.capture_rng(self.device)
        stored_batch = map_tensors(batch, lambda t: t.detach().to("cpu", copy=True))
        self._capture.begin_step(rng)
        with _loss_capture(self._capture):
            yield
        self._capture.record_gradients()
        self._pending = (self._next_index, stored_batch, rng, started)
        self._next_index += 1

    def _finish_pending(self) -> None:
        if self._pending is None:
            return
        index, batch, rng, started = self._pending
        self._pending = None
        stepped = self._capture.optimizer_stepped
        entries = self._capture.end_step()
        seconds = time.perf_counter() - started  # replay derives its hang timeout from it
        self._writer.add_step(index, batch, rng, entries, optimizer_step=stepped, seconds=seconds)
        self.steps_written += 1
        self.entries_written += len(entries)

    def close(self) -> Path:
        """Write the last step, mark the bundle complete and give it its final name."""
        self._finish_pending()
        self._release()
        self.path = self._writer.close()
        return self.path

    def abandon(self) -> Path:
        """Stop after a failure: keep the steps written so far as an incomplete ``.partial`` bundle."""
        if self._capture.step_open and self._pending is None:
            self._capture.end_step()  # a step that raised mid-way is not evidence
        self._finish_pending()
        self._release()
        return self.path

    def _release(self) -> None:
        self._hook.remove()
        self._capture.close()

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abandon()


def _check_model_matches_checkpoint(model: torch.nn.Module, reference: dict) -> None:
    model_state, _ = load_checkpoint(reference)
    for name, tensor in model.state_dict().items():
        saved = model_state.get(name)
        if saved is None or not torch.equal(saved, tensor.detach().cpu()):
            raise CheckpointError(
                f"the model's {name} differs from checkpoint {reference['path']}",
                "Load the checkpoint into the model (and optimizer) before creating the Recorder.",
            )


def _check_loss(workload: str, index: int, loss: Any) -> None:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = list(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise WorkloadError(f"the loss_fn of {workload} returned {shape} in step {index}, "
                            "not a scalar tensor",
                            "Return the loss as one number (e.g. reduce it with .mean()).")


@dataclass
class RecordSummary:
    bundle: Path
    workload: str
    kwargs: dict
    device: str
    steps: int
    entries: int
    size_bytes: int
    final_loss: float | None


def record(
    workload: str,
    out: str | Path,
    *,
    steps: int = 4,
    device: str = "cpu",
    seed: int = 0,
    kwargs: dict | None = None,
    checkpoint: str | Path | None = None,
    overwrite: bool = False,
    inject: Sequence[str] = (),
    max_depth: int | None = None,
    on_step: Callable[[int, float], None] | None = None,
) -> RecordSummary:
    """Drive a workload for ``steps`` steps under a Recorder (what `sdcreplay record` does).

    ``inject`` corrupts the recording device as a defective GPU would; the
    bundle does not say so, exactly like one recorded on a defective GPU.
    """
    kwargs = dict(kwargs or {})
    if accepts_seed(workload):
        kwargs.setdefault("seed", seed)
    target = torch_device(device)
    determinism.enable()
    built = build_workload(workload, kwargs)
    built.model.to(target)
    if checkpoint is not None:
        model_state, optimizer_state = load_checkpoint(checkpoint_reference(Path(checkpoint)))
        built.model.load_state_dict(model_state)
        if optimizer_state is not None:
            built.optimizer.load_state_dict(optimizer_state)
    determinism.seed_everything(seed)
    injector = Injector(parse_specs(inject), device)
    loss_value = None
    recorder = Recorder(
        out, workload, built.model, built.optimizer, workload_kwargs=kwargs,
        checkpoint=checkpoint, device_label=device, overwrite=overwrite, max_depth=max_depth,
    )
    with recorder:
        for index in range(steps):
            batch = map_tensors(built.get_batch(index), lambda t: t.to(target))
            injector.before_step(index, built.model)
            chain = [injector] if injector.has_operator_faults else []
            mode = OperatorMode(built.model, built.optimizer, chain, index) if chain else contextlib.nullcontext()
            with mode:
                with recorder.step(batch):
                    loss = built.loss_fn(built.model, batch)
                    _check_loss(workload, index, loss)
                    loss.backward()
                built.optimizer.step()
                built.optimizer.zero_grad()
            loss_value = float(loss.detach())
            if on_step is not None:
                on_step(index, loss_value)
    bundle_path = recorder.path
    size = Bundle.open(bundle_path, verify=False).size_bytes()
    return RecordSummary(
        bundle=bundle_path, workload=workload, kwargs=kwargs, device=device,
        steps=recorder.steps_written, entries=recorder.entries_written,
        size_bytes=size, final_loss=loss_value,
    )
