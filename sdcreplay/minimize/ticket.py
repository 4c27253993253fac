"""The ticket directory: what a vendor needs to act on a silent data corruption.

    TICKET/
      repro.py     standalone reproducer, needs only torch and h5py (templates/repro.py, verbatim)
      inputs.h5    an operator case (operator_case.py): the minimal inputs, the reference's
                   expected output, the suspect's failing output, the call site and prior
                   counts, plus the operator name and the determinism switches as attributes
      ticket.json  ``sdcreplay.ticket/1``: device identity, software, operator, shapes, rate,
                   interval, acceptance numbers, data dependence, first mismatch, bits, commands;
                   for a job's call, the job, the rank, its coordinates in the mesh and the
                   collectives around the call (``job``; inputs.h5 then holds the rank, so a
                   drill's ``rank=`` spec fires in repro.py and screen as it did there)
      ticket.md    the same, for a person

The directory is written beside itself and renamed into place, so a ticket
is either complete or absent.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..devices import torch_device
from ..errors import SdcReplayError
from ..ledger.identity import identify
from ..ledger.nvml import nvml_identity
from ..storage.rundir import make_run_dir, replacing_refused, set_aside

if TYPE_CHECKING:  # torch and h5py are imported where a ticket is written: a corpus reads
    # tickets' names and JSON without them (`fleet.corpus`, `screen`'s own process)
    from ..bisect.operator_case import OperatorCase

SCHEMA = "sdcreplay.ticket/1"
REPRO_FILE = "repro.py"
INPUTS_FILE = "inputs.h5"
JSON_FILE = "ticket.json"
MARKDOWN_FILE = "ticket.md"


def repro_source() -> str:
    return (
        resources.files("sdcreplay.minimize.templates")
        .joinpath(REPRO_FILE)
        .read_text(encoding="utf-8")
    )


def device_identity(label: str) -> dict:
    """Who the device is: NVML's identity and health for a GPU; the CPU model otherwise."""
    from ..capture import determinism

    device = torch_device(label)
    identity = {"label": label, "id": identify(label).id, **determinism.device_description(device)}
    if device.type == "cuda":
        identity["nvml"] = nvml_identity(identity.get("uuid", ""))
    elif hasattr(os, "sched_getaffinity"):
        identity["cpu_affinity"] = sorted(os.sched_getaffinity(0))
    return identity


def ticket_document(result: dict, report: dict) -> dict:
    """ticket.json: the measurement (``result``, sdcreplay.minimize/1) said for a vendor."""
    from ..capture import determinism

    environment = determinism.environment(torch_device(result["device"]))
    reproduced = result["reproduced"]
    injected = result["inject"] or report.get("inject") or []  # here, or when bisect found the call
    recorded = report.get("recorded_faults") or []  # the bundle was recorded with them
    measured = {
        key: result[key]
        for key in ("trials", "failures", "rate", "ci95", "trials_to_first_failure")
    }
    return {
        "schema": SCHEMA,
        "status": "reproduced" if reproduced else "not reproduced",
        "title": _title(result),
        "partial": bool(result.get("interrupted")),
        "interrupted": result.get("interrupted"),  # the signal that ended the shrink early
        "drill": bool(injected or recorded),
        "injected_faults": injected,
        "recorded_faults": recorded,
        "incident": result.get("incident"),
        "device": device_identity(result["device"]),
        "reference": device_identity(result["reference"]),
        "observed_on": (report.get("environment") or {}).get("suspect"),
        "software": {
            key: environment[key]
            for key in ("torch", "cuda", "cudnn", "python", "numpy", "platform", "host")
        },
        "switches": result["switches"],
        "operator": {
            "op": result["op"],
            "kernels": result["kernels"],
            "dtypes": result["dtypes"],
            "site": result["site"],
        },
        "shapes": {
            "original": result["input_shapes_original"],
            "minimal": result["input_shapes_minimal"],
            "shrink": result["shrink"],
        },
        "rate": measured,
        "minimal_rate": result["minimal"],
        "reference_check": {
            "device": result["reference"],
            "trials": result["reference_trials"],
            "failures": result["reference_failures"],
        },
        "acceptance": result["acceptance"],
        "data_dependent": result["data_dependent"],
        "first_mismatch": result["first_mismatch"],
        "coordinates": result.get("coordinates"),
        "bits": result["bits"],
        "pattern": result["pattern"],
        "fault_model": result.get("fault_model"),
        "job": result.get("job"),
        "bisect": {
            key: report.get(key)
            for key in (
                "bundle",
                "step",
                "phase",
                "module",
                "op_index",
                "isolated",
                "pattern",
                "fault_model",
            )
        },
        "commands": result["commands"],
        "reproduce": reproduce_command(result["device"], max(result["trials"], 1000), injected),
        "files": {"reproducer": REPRO_FILE, "inputs": INPUTS_FILE},
    }


def reproduce_command(device: str, trials: int, injected: list[str]) -> str:
    """The command that runs the reproducer, whole: a drill's faults are injected only with
    ``SDCREPLAY_INJECT`` set to them (and sdcreplay importable), so the command sets it."""
    command = f"python {REPRO_FILE} --device {device} --trials {trials}"
    if not injected:
        return command
    return f"SDCREPLAY_INJECT={shlex.quote(';'.join(injected))} {command}"


def _percent(rate: float) -> str:
    return f"{100 * rate:.3g}%"


def _title(result: dict) -> str:
    where = f"{result['op']} on {result['device']}"
    if not result["reproduced"]:
        return (
            f"{where}: not reproduced in {result['trials']} trials "
            f"(rate below {_percent(result['ci95'][1])}, 95% upper bound)"
        )
    low, high = result["ci95"]
    return (
        f"{where} computes wrong: failed {result['failures']} of {result['trials']} trials "
        f"({_percent(result['rate'])}, 95% interval {_percent(low)} to {_percent(high)})"
    )


def render_markdown(doc: dict) -> str:
    """ticket.md: the ticket as a person reads it, most important first."""
    device, operator, shapes = doc["device"], doc["operator"], doc["shapes"]
    nvml = device.get("nvml") or {}
    lines = [f"# {doc['title']}", ""]
    if doc.get("partial"):
        shrink = doc["shapes"]["shrink"]
        lines += [
            f"> **Partial:** the shrink was interrupted ({doc['interrupted']}) after "
            f"{shrink['tests']} tests: the inputs are the smallest accepted so far, not "
            "1-minimal, and the rate was measured on the original inputs only. It reproduces "
            "as it is; `sdcreplay minimize` again with `--overwrite` finishes the shrink.",
            "",
        ]
    if doc["drill"]:
        faults = list(doc["injected_faults"]) + [
            f"recorded with {spec}" for spec in doc.get("recorded_faults") or []
        ]
        lines += [
            "> **Drill:** the corruption was injected by sdcreplay ("
            + "; ".join(faults)
            + "). This ticket tests the tooling; it says nothing about the hardware.",
            "",
        ]
    lines += [
        "## Reproduce",
        "",
        "```",
        doc["reproduce"],
        "```",
        "",
        f"`{REPRO_FILE}` needs only torch and h5py and reads `{INPUTS_FILE}`. "
        "It prints `failed F of N` and the first mismatching element. Exit status: "
        "0 no trial failed, 1 a trial's output differed (reproduced), 2 a usage error, "
        "3 it could not run here (no such device, unreadable inputs, the operator raised).",
        "",
        *_drill_lines(doc),
        "## Device",
        "",
        "| | |",
        "| --- | --- |",
        f"| label | {device['label']} |",
        f"| name | {device.get('name')} |",
    ]
    lines += [
        f"| {key.replace('_', ' ')} | {value} |"
        for key, value in {**nvml.get("identity", {}), "driver": nvml.get("driver")}.items()
        if key != "name" and value is not None
    ]
    if "cpu_affinity" in device:
        lines.append(
            f"| cores | {device.get('cores')} (this process may run on {device['cpu_affinity']}) |"
        )
    if nvml and not nvml.get("available"):
        lines.append(f"| NVML | {nvml.get('note')} |")
    software = doc["software"]
    lines += [
        f"| software | torch {software['torch']}, CUDA {software['cuda']}, "
        f"cuDNN {software['cudnn']}, "
        f"Python {software['python']} on {software['platform']} |",
        "",
        "## Operator",
        "",
        "| | |",
        "| --- | --- |",
        f"| operator | `{operator['op']}` |",
        "| kernels | "
        f"{', '.join(f'`{k}`' for k in operator['kernels']) or '- (none recorded: CPU)'} |",
        f"| dtypes | {', '.join(operator['dtypes'])} |",
        f"| in training | step {operator['site']['step']}, {operator['site']['phase']}, "
        f"module `{operator['site']['module']}`, call {operator['site']['index']} |",
        f"| original input shapes | {shapes['original']} |",
        f"| minimal input shapes | {shapes['minimal']} (shrink: {shapes['shrink']['status']}"
        + (f", {shapes['shrink']['reason']}" if shapes["shrink"].get("reason") else "")
        + ") |",
        "",
        "## Measurement",
        "",
        "| | |",
        "| --- | --- |",
    ]
    rate = doc["rate"]
    lines.append(
        f"| original inputs | failed {rate['failures']} of {rate['trials']} "
        f"({_percent(rate['rate'])}, 95% Wilson interval {_percent(rate['ci95'][0])} "
        f"to {_percent(rate['ci95'][1])})"
        + (
            f", first at trial {rate['trials_to_first_failure']}"
            if rate["trials_to_first_failure"]
            else ""
        )
        + " |"
    )
    if doc["minimal_rate"]:
        minimal = doc["minimal_rate"]
        lines.append(
            f"| minimal inputs | failed {minimal['failures']} of {minimal['trials']} "
            f"({_percent(minimal['rate'])}, 95% interval {_percent(minimal['ci95'][0])} "
            f"to {_percent(minimal['ci95'][1])}) |"
        )
    check = doc["reference_check"]
    acceptance = doc["acceptance"]
    lines += [
        f"| reference {check['device']} | failed {check['failures']} of {check['trials']} |",
        f"| acceptance rule | reference passes all {acceptance['good_trials']} good trials, "
        f"suspect fails within {acceptance['bad_trials']} bad trials |",
        f"| depends on the data | {_dependence(doc['data_dependent'])} |",
    ]
    first = doc["first_mismatch"]
    if first and "index" in first:
        lines += [
            f"| first mismatch | output {first['output']}, element {first['index']} "
            f"at {first['position']} of {first['count']} wrong in {first['total']}: "
            f"expected {first['expected']}, actual {first['actual']}, "
            f"XOR mask 0x{first['xor']}"
            + (" (in the minimal inputs)" if doc.get("coordinates") else "")
            + " |",
            *_coordinate_lines(doc.get("coordinates")),
            f"| pattern | {doc['pattern']} |",
            *_fault_model_lines(doc.get("fault_model")),
            "| flipped bits | "
            + ", ".join(
                f"bit {b}: {n}" for b, n in (doc["bits"] or {}).get("histogram", {}).items()
            )
            + " |",
        ]
    lines += _health_lines(nvml.get("health"))
    lines += job_lines(doc.get("job"))
    lines += ["", "## How we got here", "", "```", *doc["commands"], "```", ""]
    lines += _return_process_lines(device)
    return "\n".join(lines)


def job_lines(job: dict | None) -> list[str]:
    """Where in the job the call ran: the job, the rank and its coordinates, the collectives
    around the call (the call itself needs no peers: repro.py runs it alone)."""
    if not job:
        return []
    size = f"{job['world_size']} ranks" if job.get("world_size") else "a job"
    mesh = f", mesh {job['mesh']}" if job.get("mesh") else ""
    backend = f", {job['backend']}" if job.get("backend") else ""
    how = "alone (without its data-parallel peers)" if job["alone"] else "among its peers"
    lines = [
        "",
        "## In the job",
        "",
        "| | |",
        "| --- | --- |",
        f"| job | `{job['bundle']}` ({size}{backend}{mesh}) |",
        f"| rank | {job['where']} |",
        f"| bisected | {how} |",
    ]
    around = job.get("collectives")
    if around:
        for side in ("before", "after"):
            message, edge = around[side], "first" if side == "before" else "last"
            shown = (
                f"{message['message']} (the step's message {message['record_id'] + 1} of "
                f"{around['in_step']})"
                if message
                else f"none: the call comes {side} the step's {edge} collective"
            )
            lines.append(f"| collective {side} the call | {shown} |")
    return lines


def _drill_lines(doc: dict) -> list[str]:
    if not doc["injected_faults"]:
        return []
    return [
        "A drill: the command sets `SDCREPLAY_INJECT` to the injected faults, which "
        f"`{REPRO_FILE}` applies only where sdcreplay is importable (without it, or without "
        "the variable, a healthy device fails 0 trials).",
        "",
    ]


def _fault_model_lines(models: dict | None) -> list[str]:
    """The damage as the fault model a vendor recognizes, on the original and minimal inputs."""
    if not models or not models.get("original"):
        return []
    lines = [f"| fault model | {models['original']} (original inputs) |"]
    if models.get("minimal") not in (None, models["original"]):
        lines.append(f"| fault model, minimal inputs | {models['minimal']} |")
    return lines


def _coordinate_lines(coordinates: dict | None) -> list[str]:
    """The failing element in the original inputs' coordinates, and why it is another one."""
    if not coordinates:
        return []
    original = coordinates["original"]
    first = coordinates["original_first_mismatch"]
    where = f"element {original['position']}" if original else "no place"
    lines = [f"| in the original output | {where}: {coordinates['why']} |"]
    if first:
        lines.append(
            f"| original inputs' first mismatch | output {first['output']}, "
            f"element {first['index']} at {first['position']} |"
        )
    return lines


def _health_lines(health: dict | None) -> list[str]:
    """The GPU's health when the ticket was written: what a vendor checks first."""
    if not health:
        return []
    lines = ["", "## Device health when this ticket was written", "", "| | |", "| --- | --- |"]
    for group in ("ecc", "retired_pages", "remapped_rows", "clocks_mhz"):
        values = health[group]
        shown = (
            ", ".join(f"{key.replace('_', ' ')} {value}" for key, value in values.items())
            if isinstance(values, dict)
            else values
        )
        lines.append(f"| {group.replace('_', ' ')} | {shown} |")
    lines += [
        f"| {key.replace('_', ' ')} | {health[key]} |"
        for key in ("temperature_c", "power_w", "power_limit_w")
    ]
    return lines


def _return_process_lines(device: dict) -> list[str]:
    """What a vendor's return (RMA) process asks for besides this directory."""
    if device.get("type") != "cuda":
        return [
            "## For the vendor",
            "",
            "Attach this directory, the CPU's model, stepping and microcode (`lscpu`, "
            "`grep microcode /proc/cpuinfo`) and the machine's serial (`dmidecode -t system`), "
            "and the output of the vendor's own CPU diagnostic.",
            "",
        ]
    identity = (device.get("nvml") or {}).get("identity") or {}
    board = ", ".join(
        f"{key.replace('_', ' ')} {identity[key]}"
        for key in ("serial", "board_part_number")
        if key in identity
    )
    return [
        "## For the vendor's return process",
        "",
        "A GPU return (RMA) asks for the board's identity "
        f"({board or 'serial and part number from NVML'}) and evidence besides this directory:",
        "",
        "- the output of `sudo nvidia-bug-report.sh` run on this host "
        "(`nvidia-bug-report.log.gz`);",
        "- the log of NVIDIA's field diagnostic (`fieldiag`, from the vendor's enterprise "
        "support) for this serial, or where it is not at hand `dcgmi diag -r 3`;",
        "- `nvidia-smi -q -d ECC,PAGE_RETIREMENT,ROW_REMAPPER,CLOCK,TEMPERATURE,POWER` "
        "(the health above, as the vendor's tools print it);",
        "- this directory: `repro.py` and `inputs.h5` reproduce the failure on the board alone.",
        "",
    ]


def _dependence(data_dependent: bool | None) -> str:
    if data_dependent is None:
        return "unknown (not reproduced)"
    if data_dependent:
        return "yes: random data of the same shape, dtype and range does not fail"
    return "no: random data of the same shape, dtype and range fails too"


def claim_ticket(target: Path, overwrite: bool) -> None:
    """Refuse ``target`` unless it is free, an empty directory, or a ticket ``overwrite`` may
    replace (before any trial runs: a refusal costs a second, not the measurement)."""
    if not target.exists() and not target.is_symlink():
        return
    is_ticket = target.is_dir() and not target.is_symlink() and (target / JSON_FILE).is_file()
    empty = target.is_dir() and not target.is_symlink() and not any(target.iterdir())
    if not is_ticket and not empty:
        raise SdcReplayError(
            f"{target} exists and is not a ticket directory",
            "Name a new --out directory, or remove that one.",
            python_hint="Name a new out= directory, or remove that one.",
        )
    if is_ticket and not overwrite:
        raise replacing_refused(target, "a minimize ticket")


def write_ticket(
    target: Path, result: dict, report: dict, case: OperatorCase, overwrite: bool = False
) -> Path | None:
    """Write the ticket directory for ``result``; a ticket already there (``overwrite``) is
    moved aside, and where it went is returned."""
    with staged_ticket(Path(target), case, result, overwrite) as (staging, moved):
        doc = ticket_document(result, report)
        (staging / JSON_FILE).write_text(json.dumps(doc, indent=2, default=str), encoding="utf-8")
        (staging / MARKDOWN_FILE).write_text(render_markdown(doc), encoding="utf-8")
    return moved[0] if moved else None


@contextlib.contextmanager
def staged_ticket(
    target: Path, case: Any, result: dict, overwrite: bool = False
) -> Iterator[tuple[Path, list[Path]]]:
    """A ticket directory written whole or not at all: ``inputs.h5`` (the case, the call it runs
    and ``result``'s switches) and ``repro.py`` staged in a run directory of its own; the caller
    adds its documents; then it takes ``target``'s place, a ticket there (``overwrite``) moved
    aside (where to: the list yielded, filled once the block ends). A block that fails leaves no
    staging behind."""
    import h5py

    claim_ticket(target, overwrite)
    staging = make_run_dir(target.parent, target.name + ".", ".partial")
    moved: list[Path] = []
    try:
        case.write(staging / INPUTS_FILE)
        with h5py.File(staging / INPUTS_FILE, "a") as handle:
            handle.attrs["op"] = case.op
            handle.attrs["switches"] = json.dumps(result["switches"])
            if result.get("job"):
                handle.attrs["rank"] = result["job"]["rank"]
        (staging / REPRO_FILE).write_text(repro_source(), encoding="utf-8")
        yield staging, moved
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    claim_ticket(target, overwrite)  # another run may have written one meanwhile
    if target.is_dir() and not any(target.iterdir()):
        target.rmdir()
    elif target.exists():
        moved.append(set_aside(target))
    try:
        staging.rename(target)
    except OSError as exc:
        raise SdcReplayError(
            f"{target} was written by another run while this one ran; this run's ticket is in "
            f"{staging}",
            "Give each minimize its own --out.",
            python_hint="Give each minimize its own out=.",
        ) from exc
