"""Module names as the person reads the model: a wrapper's own name left out.

DistributedDataParallel keeps the model as ``module``, ``torch.compile``'s
``OptimizedModule`` as ``_orig_mod``, an activation-checkpoint wrapper as
``_checkpoint_wrapped_module`` and FSDP (1) as ``_fsdp_wrapped_module``: under them
``model.named_modules()`` says ``module.transformer.h.0.mlp`` where the person's model
says ``transformer.h.0.mlp``. Operator call sites, kernel sites and fault specs name a
module (and a parameter) by its *plain* path, the one the unwrapped model gives it; a
wrapper and the module it wraps share one. A name a person types may still be the wrapped
one (`aliases`). The string rules import no torch (fault specs are checked before it
loads).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from ..kinds import ModuleNaming

if TYPE_CHECKING:
    import torch

ROOT = "<root>"

WRAPPED_ATTRIBUTES = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")
"""What torch.compile, checkpoint_wrapper and FSDP call the module they wrap: never a
module a person wrote (the names are private to those wrappers)."""

DATA_PARALLEL_ATTRIBUTE = "module"
"""What (Distributed)DataParallel calls the module it wraps: a wrapper's name only under
one of them, as a person's own model may have a child called ``module``."""


def _joined(prefix: str, segment: str) -> str:
    return f"{prefix}.{segment}" if prefix else segment


def _wraps_as_module(parent: torch.nn.Module) -> bool:
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    return isinstance(parent, (DistributedDataParallel, DataParallel))


def plain_paths(model: torch.nn.Module) -> dict[str, str]:
    """Every path of ``model.named_modules()`` -> its plain path (``""`` for the root)."""
    modules = dict(model.named_modules())
    plain = {"": ""}
    for path in modules:  # parents come before their children
        if not path:
            continue
        parent, _, segment = path.rpartition(".")
        wrapper = segment in WRAPPED_ATTRIBUTES or (
            segment == DATA_PARALLEL_ATTRIBUTE and _wraps_as_module(modules[parent])
        )
        plain[path] = plain[parent] if wrapper else _joined(plain[parent], segment)
    return plain


def named_modules(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """``(plain path or ROOT, module)`` for every module, in ``named_modules`` order; a
    wrapper and what it wraps both come, under one name."""
    plain = plain_paths(model)
    for path, module in model.named_modules():
        yield plain[path] or ROOT, module


def outermost_modules(
    model: torch.nn.Module, names: ModuleNaming = "plain"
) -> Iterator[tuple[str, str, torch.nn.Module]]:
    """``(name or ROOT, path in named_modules(), module)``: one module per name, the outermost
    (a wrapper, whose output is what it wraps' output; an activation-checkpoint wrapper's is
    not run again when the backward recomputes), named as ``names`` says."""
    plain = plain_paths(model) if names == "plain" else None
    seen: set[str] = set()
    for path, module in model.named_modules():
        name = (plain[path] if plain is not None else path) or ROOT
        if name not in seen:
            seen.add(name)
            yield name, path, module


def _plain_leaves(plain: dict[str, str], named: Iterator[tuple[str, object]]):
    for name, value in named:
        owner, _, leaf = name.rpartition(".")
        yield _joined(plain.get(owner, owner), leaf), value


def named_parameters(
    model: torch.nn.Module, names: ModuleNaming = "plain"
) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """``(plain name, parameter)``, in ``named_parameters`` order (``names="wrapped"``:
    as ``named_parameters`` names them, for a bundle recorded so)."""
    if names == "wrapped":
        yield from model.named_parameters()
    else:
        yield from _plain_leaves(plain_paths(model), model.named_parameters())


def named_buffers(
    model: torch.nn.Module, names: ModuleNaming = "plain"
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(plain name, buffer)``, in ``named_buffers`` order (``names`` as `named_parameters`)."""
    if names == "wrapped":
        yield from model.named_buffers()
    else:
        yield from _plain_leaves(plain_paths(model), model.named_buffers())


def aliases(name: str) -> tuple[str, ...]:
    """The names a typed module or parameter name may mean: as typed, and (a wrapped name
    copied from ``named_modules()``) without the wrappers' segments, a leading
    (Distributed)DataParallel ``module`` included."""
    segments = [s for s in name.split(".") if s not in WRAPPED_ATTRIBUTES]
    found = [name, ".".join(segments)]
    if segments[:1] == [DATA_PARALLEL_ATTRIBUTE]:
        found.append(".".join(segments[1:]))
    return tuple(dict.fromkeys(found))
