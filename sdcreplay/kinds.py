"""The closed sets of words results carry: phases and verdicts, as types.

A verdict is read by people, scripts (``--json``) and the renderer's colours;
naming each set once lets a type checker see a misspelt one. Imports nothing,
so the command line can use them without loading the pipeline. Fault kinds are
``faults.FaultKind``, beside the table that implements them.
"""

from __future__ import annotations

from enum import Enum
from typing import Literal

PhaseName = Literal["forward", "backward", "optimizer"]

# What a recorded step's signature log holds: every layer's entries (the forensic level), or
# only the step's boundary (the production level: docs/recording.md, "Signature levels").
SignatureLevel = Literal["layer", "boundary"]
SIGNATURE_LEVELS: tuple[SignatureLevel, ...] = ("layer", "boundary")

# How a signature log names modules and parameters: by their plain paths (wrappers' segments
# left out: capture/module_names.py), or as ``named_modules()`` says (bundles recorded before).
ModuleNaming = Literal["plain", "wrapped"]
MODULE_NAMINGS: tuple[ModuleNaming, ...] = ("plain", "wrapped")


class Phase(str, Enum):
    """A phase of a training step, as an option value (``--phase``)."""

    forward = "forward"
    backward = "backward"
    optimizer = "optimizer"


# One voter's runs against the majority; a device whose process failed is ``error``.
DeviceVerdictName = Literal["match", "persistent", "intermittent", "undecided", "incomparable"]
# In a job, "spread": a rank's run diverged only after a collective brought it another rank's
# corruption (that rank is the origin); it is not a suspect.
DeviceRunVerdict = Literal[DeviceVerdictName, "spread", "error"]
# The vote over every device (replay's answer).
ConsensusVerdict = Literal[
    "correct", "transient", "persistent", "recording_suspect", "undecided", "incomparable"
]
BisectVerdict = Literal["divergence", "no_divergence"]
# Where bisect's first wrong call got its wrong output: the operator alone (kernel), the
# inputs it was handed (upstream), or neither reproducible alone (intermittent).
Isolation = Literal["kernel", "intermittent", "upstream"]
ShrinkStatus = Literal[
    "shrunk", "already minimal", "not applicable", "not reproduced", "interrupted"
]
