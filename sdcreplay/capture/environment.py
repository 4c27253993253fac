"""The environment a recording depends on, and what a device process takes from the shell.

A replay's verdict must depend only on the bundle and the command typed, never on who types
it. So a script-mode bundle keeps the variables that can change what its loop computes
(`RECORDED`, and the patterns its Recorder was given with ``env=``), and every device
process (replay, bisect, ops, minimize, a same-batch or alone replay, a job's ranks, the
first-step check) starts from `inherited`: the few variables of the shell that select this
machine's devices, find its programs and libraries, and set sdcreplay's own behaviour
(`INHERITED`); the rest comes from the bundle. A variable of the shell that no device process
takes and that could change the result is named to the person (`ignored`), never used.
A secret is never recorded (`is_secret`). Torch-free: the device processes' parent reads it.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Mapping, Sequence

from ..errors import SdcReplayError

SWITCH_ENV_VARS = (
    "CUBLAS_WORKSPACE_CONFIG",
    "NCCL_ALGO",
    "NCCL_PROTO",
    "NCCL_MIN_NCHANNELS",
    "NCCL_MAX_NCHANNELS",
    "NCCL_NVLS_ENABLE",
    "NCCL_CROSS_NIC",
    "NVIDIA_TF32_OVERRIDE",
)
"""Variables that change which kernels run: determinism.py records them as switches, applies
them in a replay and refuses one the shell sets to another value."""
PINNED_ENV = {"cpu.capability": "ATEN_CPU_CAPABILITY", "cpu.blas_branch": "MKL_CBWR"}
"""The CPU kernels' choice (fingerprint property -> variable): determinism.py pins the recorded
value in a device process unless the person set one, which the fingerprint then judges."""

RECORDED = (
    # which code runs
    "PYTHONPATH",
    "PYTHONHASHSEED",
    "TORCH_*",
    "TORCHINDUCTOR_*",
    "TORCHDYNAMO_*",
    "PYTORCH_*",
    "TRITON_*",
    # launchers' and trainers' switches (mixed precision, CPU or not, the distributed type...)
    "ACCELERATE_*",
    "TRANSFORMERS_*",
    "HF_*",
    "TOKENIZERS_PARALLELISM",
    "DEEPSPEED_*",
    "DS_ACCELERATOR",
    "PL_*",
    "LIGHTNING_*",
    "NVTE_*",
    # threads and math libraries
    "OMP_*",
    "MKL_*",
    "KMP_*",
    "OPENBLAS_*",
    "NVPL_*",
    "DNNL_*",
    "ONEDNN_*",
)
"""What a script-mode bundle keeps of the recording's environment (besides the variables a
Recorder names with ``env=``), less `INHERITED` and secrets."""

INHERITED = (
    # programs, files, libraries, the locale and time zone
    "PATH",
    "HOME",
    "USER",
    "LOGNAME",
    "SHELL",
    "TERM",
    "LANG",
    "LANGUAGE",
    "LC_*",
    "TZ",
    "TMPDIR",
    "TEMP",
    "TMP",
    "LD_LIBRARY_PATH",
    "VIRTUAL_ENV",
    "CONDA_PREFIX",
    "XDG_CACHE_HOME",
    "TORCHINDUCTOR_CACHE_DIR",  # caches are this machine's
    "TRITON_CACHE_DIR",
    "PYTHONUNBUFFERED",
    "PYTHONDONTWRITEBYTECODE",
    "PYTHONFAULTHANDLER",
    # which devices this machine lends the command, and where their toolkit is
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_ORDER",
    "HIP_VISIBLE_DEVICES",
    "ROCR_VISIBLE_DEVICES",
    "NVIDIA_VISIBLE_DEVICES",
    "CUDA_HOME",
    "CUDA_PATH",
    # how ranks reach each other here (NCCL's result-affecting settings are switches)
    "NCCL_*",
    "GLOO_SOCKET_IFNAME",
    # sdcreplay's own settings
    "SDCREPLAY_*",
    # determinism.py's: recorded, applied or pinned, and checked there
    *SWITCH_ENV_VARS,
    *PINNED_ENV.values(),
)
"""What a device process takes from the shell of the command that starts it."""

SECRET_WORDS = ("TOKEN", "KEY", "SECRET", "PASSWORD", "CREDENTIAL")
"""A variable whose name holds one of these is never recorded, whatever pattern names it."""

_SESSION = (
    "PWD",
    "OLDPWD",
    "SHLVL",
    "_",
    "HOSTNAME",
    "HOSTTYPE",
    "OSTYPE",
    "MACHTYPE",
    "DISPLAY",
    "COLUMNS",
    "LINES",
    "COLORTERM",
    "TERM_*",
    "SSH_*",
    "MAIL",
    "PS1",
    "EDITOR",
    "PAGER",
    "LESS*",
    "LS_COLORS",
    "DBUS_*",
    "XDG_*",
)
"""A shell session's own variables: never named as what a recording may depend on."""

_PATTERN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\*?|\*")


def matches(name: str, patterns: Iterable[str]) -> bool:
    """Does ``name`` match one of ``patterns`` (exact names, or ``PREFIX*``)?"""
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


def is_secret(name: str) -> bool:
    upper = name.upper()
    return any(word in upper for word in SECRET_WORDS)


def check_patterns(patterns: Sequence[str] | str | None) -> tuple[str, ...]:
    """A Recorder's ``env=``: names or ``PREFIX*`` patterns of the loop's own variables;
    refused: anything else, and a name that is a secret."""
    if patterns is None:
        return ()
    if isinstance(patterns, str):
        patterns = [patterns]
    checked = []
    for pattern in patterns:
        if not isinstance(pattern, str) or not _PATTERN.fullmatch(pattern):
            raise SdcReplayError(
                f"env= takes variable names or NAME* patterns, not {pattern!r}",
                'Name the loop\'s own variables: Recorder(..., env=["MYAPP_*", "SEED"]).',
            )
        if "*" not in pattern and is_secret(pattern):
            raise SdcReplayError(
                f"env= names {pattern}, a secret: a bundle never keeps one",
                f"Leave it out (names holding {', '.join(SECRET_WORDS)} are never recorded); "
                "a replay must not need it.",
            )
        checked.append(pattern)
    return tuple(checked)


def recorded(environ: Mapping[str, str], extra: Sequence[str] = ()) -> dict[str, str]:
    """What a bundle keeps of ``environ``: `RECORDED` and ``extra``, less what a device
    process inherits and secrets."""
    return {
        name: value
        for name, value in sorted(environ.items())
        if matches(name, (*RECORDED, *extra))
        and not matches(name, INHERITED)
        and not is_secret(name)
    }


def inherited(environ: Mapping[str, str]) -> dict[str, str]:
    """What a device process takes from ``environ``, the shell's."""
    return {name: value for name, value in environ.items() if matches(name, INHERITED)}


def ignored(
    environ: Mapping[str, str], kept: Mapping[str, str], extra: Sequence[str] = ()
) -> list[str]:
    """The shell's variables a replay does not use although they could change its result:
    those the bundle keeps with another value, and those it would have kept."""
    notes = []
    for name, value in sorted(environ.items()):
        if matches(name, INHERITED) or is_secret(name):
            continue
        if name in kept:
            if kept[name] != value:
                notes.append(f"{name}={value!r} here, {kept[name]!r} in the bundle")
        elif matches(name, (*RECORDED, *extra)):
            notes.append(f"{name}={value!r} here, unset in the recording")
    return notes


def unkept(environ: Mapping[str, str], kept: Mapping[str, str], limit: int = 40) -> str:
    """The variables set while recording that a replay does not get (neither kept nor
    inherited), as a hint's candidates: their names, never their values."""
    names = sorted(
        name
        for name in environ
        if name not in kept
        and not matches(name, INHERITED)
        and not matches(name, _SESSION)
        and not is_secret(name)
    )
    if not names:
        return ""
    shown = ", ".join(names[:limit]) + (
        f" and {len(names) - limit} more" if len(names) > limit else ""
    )
    return f"variables set while recording that the bundle does not keep: {shown}"
