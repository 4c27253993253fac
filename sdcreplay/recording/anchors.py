"""Where a ring's window starts when the job saved a checkpoint: the checkpoint itself.

A ring must hand replay the state its window starts from. Without checkpoints it copies the
state every K steps (a ``TrainingSnapshot``); a loop that tells the Recorder it just saved
one (``checkpoint_saved(path)``) anchors the window there instead: the ring copies nothing
but the state objects' small state dicts, and a dump references the checkpoint by SHA-256.
The SHA-256 is taken in a thread of its own (``hashlib`` releases the GIL), so the step does
not wait for it; a dump waits for it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..bundle.checkpoints import HF_OPTIMIZER, checkpoint_format, checkpoint_reference
from ..bundle.manifest import CheckpointState
from ..capture.layers import state_digests
from ..capture.snapshot import copy_state
from ..errors import CheckpointError, SdcReplayError


@dataclass
class CheckpointAnchor:
    """A checkpoint the loop saved as step ``before_step`` was about to begin: its path, the
    state objects' state dicts and the digests of the parameters and buffers then (what the
    checkpoint must hold: a dump's verification compares them with what it loads)."""

    path: Path
    before_step: int
    object_states: dict[str, Any]
    digests: dict[str, str]
    _reference: CheckpointState | None = None
    _error: CheckpointError | None = None
    _hashing: threading.Thread | None = field(default=None, repr=False)

    @classmethod
    def saved(
        cls, path: str | Path, model: torch.nn.Module, objects: dict[str, Any], before_step: int
    ) -> CheckpointAnchor:
        """Anchor at the checkpoint just saved at ``path`` (refused at once when there is none,
        or it is of no known kind); its SHA-256 is taken in the background."""
        resolved = Path(path).resolve()
        if checkpoint_format(resolved) == "hf" and not (resolved / HF_OPTIMIZER).is_file():
            raise CheckpointError(
                f"Trainer checkpoint {resolved} holds no {HF_OPTIMIZER}: a replay from it would "
                "start with a fresh optimizer",
                "Save the optimizer with the model (TrainingArguments(save_only_model=False)).",
            )
        anchor = cls(
            path=resolved,
            before_step=before_step,
            object_states={name: copy_state(obj.state_dict()) for name, obj in objects.items()},
            digests=state_digests(model),
        )
        anchor._hashing = threading.Thread(
            target=anchor._hash, name="sdcreplay-checkpoint-sha256", daemon=True
        )
        anchor._hashing.start()
        return anchor

    def _hash(self) -> None:
        try:
            self._reference = checkpoint_reference(self.path)
        except CheckpointError as exc:
            self._error = exc

    def reference(self) -> CheckpointState:
        """The checkpoint pinned as it was saved (waits for its SHA-256)."""
        if self._hashing is not None:
            self._hashing.join()
        if self._error is not None:
            raise self._error
        if self._reference is None:
            raise SdcReplayError(f"the SHA-256 of checkpoint {self.path} was never taken")
        return self._reference

    @property
    def nbytes(self) -> int:
        """What the ring pays for it: the state objects' tensors (no model, no optimizer)."""
        tensors: list[torch.Tensor] = []

        def gather(value: Any) -> None:
            if isinstance(value, torch.Tensor):
                tensors.append(value)
            elif isinstance(value, dict):
                for item in value.values():
                    gather(item)
            elif isinstance(value, (list, tuple)):
                for item in value:
                    gather(item)

        gather(self.object_states)
        return sum(t.numel() * t.element_size() for t in tensors)
