"""The whole story on builtin:tiny-llama, as library calls: what `sdcreplay demo` runs.

A healthy recording, then three virtual replicas of which one (cpu:1) has a
planted defect: a single bit of one matmul output flipped in the forward pass
of step 1. Each stage is what a person would type; the demo only chains them.

A drill must never reach the person's own files: unless ``SDCREPLAY_LEDGER`` and
``SDCREPLAY_HOME`` say otherwise, the demo's ledger (``OUT/ledger.sqlite``) and its signing
secret (``OUT/home``) live in its own directory, so ``~/.config/sdcreplay`` is left as it was
and no device of this machine is drained by a planted fault.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from ..bisect.localize import bisect
from ..bisect.report import BisectResult
from ..compare.logs import Comparison, compare_logs, load_log
from ..errors import SdcReplayError
from ..home import HOME_ENV
from ..ledger.store import LEDGER_ENV, ledger_location, shown
from ..minimize.driver import MinimizeResult, minimize
from ..minimize.kernel_case import KernelMinimizeResult
from ..recording.drive import RecordSummary, record
from ..replay.replicas import ReplayReport, replay_devices

# Element 69 is row 1 of the query projection: token 1 attends to two tokens, so the wrong query
# reaches the loss (token 0 attends only to itself, and a wrong query there changes nothing).
DEFECT_ELEMENT = 69
DEFECT = (
    "kind=bitflip,op=aten.mm,module=layers.1.attn.wq,phase=forward,step=1,"
    f"index={DEFECT_ELEMENT},bit=22,device=cpu:1"
)
REPLICAS = ["cpu:0", "cpu:1", "cpu:2"]

StageResult = TypeVar(
    "StageResult", bound=RecordSummary | ReplayReport | Comparison | BisectResult | MinimizeResult
)


@dataclass
class DemoStage:
    name: str
    command: str
    result: RecordSummary | ReplayReport | Comparison | BisectResult | MinimizeResult


@dataclass
class Demo:
    out: Path
    stages: list[DemoStage] = field(default_factory=list)
    ledger: str = ""  # where its (drill) verdicts went

    def result(self, name: str):
        return next(stage.result for stage in self.stages if stage.name == name)

    @property
    def exit_code(self) -> int:
        """1 when a finding differs from the planted defect: the story does not hold."""
        return 1 if self.mismatches() else 0

    def to_json(self) -> dict:
        return {
            "schema": "sdcreplay.demo/1",
            "out": str(self.out),
            "ledger": self.ledger,
            "defect": DEFECT,
            "stages": [
                {"name": stage.name, "command": stage.command, "result": stage.result.to_json()}
                for stage in self.stages
            ],
            "mismatches": self.mismatches(),
        }

    def mismatches(self) -> list[str]:
        """Where the findings differ from the planted defect (empty: the story holds)."""
        problems = []
        consensus = self.result("replay").consensus
        if consensus.verdict != "persistent" or consensus.suspects != ["cpu:1"]:
            problems.append(
                f"replay said {consensus.verdict} with suspects {consensus.suspects}, "
                "expected persistent [cpu:1]"
            )
        first = self.result("diff").first
        if first is None or (first.step, first.name) != (1, "forward:layers.1.attn.wq"):
            problems.append(
                f"diff's first divergence is {first}, expected step 1 forward:layers.1.attn.wq"
            )
        found = self.result("bisect").to_json()
        named = (
            found.get("op"),
            found.get("module"),
            found.get("isolated"),
            (found.get("elements") or {}).get("indices"),
        )
        if named != ("aten.mm.default", "layers.1.attn.wq", "kernel", [DEFECT_ELEMENT]):
            problems.append(
                f"bisect named {named}, expected aten.mm.default under layers.1.attn.wq, "
                f"kernel, element [{DEFECT_ELEMENT}]"
            )
        ticket = self.result("minimize").to_json()
        if not ticket.get("reproduced"):
            problems.append("minimize did not reproduce the failure")
        return problems


DEMO_MARKER = ".sdcreplay-demo"
DEMO_LEDGER = "ledger.sqlite"
DEMO_HOME = "home"


@contextlib.contextmanager
def own_files(out: Path) -> Iterator[str]:
    """While inside: the ledger and the secret are the demo's (in ``out``) unless the person
    chose them; yields the ledger's location."""
    chosen = {
        name: str((out / part).resolve())
        for name, part in ((LEDGER_ENV, DEMO_LEDGER), (HOME_ENV, DEMO_HOME))
        if not os.environ.get(name)
    }
    saved = {name: os.environ.get(name) for name in chosen}
    os.environ.update(chosen)
    try:
        yield shown(ledger_location())
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def run_demo(
    out: str | Path, on_stage: Callable[[DemoStage], None] = lambda stage: None, steps: int = 3
) -> Demo:
    """Record, replay on three replicas, diff, bisect, minimize; call ``on_stage`` after each.
    Its verdicts (drills) go to its own ledger, ``out/ledger.sqlite``, unless
    ``SDCREPLAY_LEDGER`` names one."""
    out = Path(out)
    ours = (out / DEMO_MARKER).is_file() or (out.is_dir() and not any(out.iterdir()))
    if out.exists() and not ours:
        raise SdcReplayError(
            f"{out} exists and was not written by `sdcreplay demo`; it is not replaced",
            "Give --out a new directory (or an earlier demo's).",
        )
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    (out / DEMO_MARKER).write_text("written by sdcreplay demo; replaced by the next one\n")
    with own_files(out) as ledger:
        return _run_stages(Demo(out, ledger=ledger), on_stage, steps)


def _run_stages(demo: Demo, on_stage: Callable[[DemoStage], None], steps: int) -> Demo:
    out = demo.out
    bundle = out / "tiny.bundle"

    def stage(name: str, command: str, result: StageResult) -> StageResult:
        demo.stages.append(DemoStage(name, command, result))
        on_stage(demo.stages[-1])
        return result

    stage(
        "record",
        f"sdcreplay record builtin:tiny-llama --steps {steps} --out {bundle}",
        record("builtin:tiny-llama", bundle, steps=steps),
    )
    logs = out / "replay"
    report = stage(
        "replay",
        f"sdcreplay replay {bundle} "
        + " ".join(f"--device {d}" for d in REPLICAS)
        + f" --inject {DEFECT} --logs {logs}",
        replay_devices(bundle, REPLICAS, inject=[DEFECT], log_dir=logs),
    )
    suspect_log = next(run.log_paths[0] for run in report.devices if run.device == "cpu:1")
    stage(
        "diff",
        f"sdcreplay diff {bundle} {suspect_log}",
        compare_logs(load_log(bundle), load_log(suspect_log)),
    )
    bisect_dir = out / "bisect"
    stage(
        "bisect",
        f"sdcreplay bisect {bundle} --suspect cpu:1 --reference cpu:0 --inject {DEFECT} "
        f"--out {bisect_dir}",
        bisect(bundle, suspect="cpu:1", reference="cpu:0", inject=[DEFECT], out=bisect_dir),
    )
    ticket = out / "ticket"
    stage(
        "minimize",
        f"sdcreplay minimize {bisect_dir} --inject {DEFECT} --out {ticket}",
        _operator_ticket(minimize(bisect_dir, inject=[DEFECT], out=ticket, trials=200)),
    )
    return demo


def _operator_ticket(result: MinimizeResult | KernelMinimizeResult) -> MinimizeResult:
    """The demo's defect is in an eager operator: its minimize measures an operator call."""
    assert isinstance(result, MinimizeResult)
    return result
