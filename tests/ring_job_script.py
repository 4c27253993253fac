"""A user's DDP training script that records all the time with a ring buffer and dumps a job
bundle on demand (tests copy it into tmp_path and start it as torchrun does).

``python -m torch.distributed.run --standalone --nproc_per_node 2 ring_job_script.py OUT
RESULTS MODE``: a ring ``Recorder`` of 3 steps on every rank. ``manual``: 6 steps, then
``dump("manual")`` on every rank, twice. ``fault``: the same with rank 1's step 5 corrupted
while it is recorded (one dump). ``check``: a ``ReplayCheck`` drives 4 steps and rank 1's
replayed execution of step 3 is corrupted: the check dumps the ring. ``inline``: the loop's
step written inline under ``with detector.step(batch):`` (an ``UpdateDetector`` given no
train_step), a NaN in rank 1's step 5. ``apart``: no DDP (each
rank trains alone) and a per-rank check of the user's own: rank 1 dumps after its steps 5 and
8, rank 0 after its steps 6 and 12 (13 steps), with the warnings each rank saw. Each rank writes
``RESULTS/rank<r>.json``. The model, optimizer and loop are tests/midjob_script.py's.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
from midjob_script import make_workload  # copied beside this script: the same user's model

import sdcreplay
from sdcreplay.capture.faults import Injector, parse_specs
from sdcreplay.capture.operators import OperatorMode
from sdcreplay.online.replay_check import ReplayCheck
from sdcreplay.online.stopping import SDCReplayMismatch
from sdcreplay.online.update_detector import UpdateDetector

FAULTS = {  # rank 1's, per mode: the first addmm of a forward (the first Linear)
    "fault": "kind=bitflip,op=aten.addmm,phase=forward,step=5,nth=0,index=3,bit=22",
    "check": "kind=bitflip,op=aten.addmm,phase=forward,step=3,nth=1,index=3,bit=22",
    "inline": "kind=nan,op=aten.addmm,phase=forward,step=5,nth=0,index=3",
}


DUMPS_APART = {0: (6, 12), 1: (5, 8)}  # mode apart: the steps after which each rank dumps


def main(out: str, results: str, mode: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    kwargs = {"alone": True} if mode == "apart" else {}
    workload = make_workload(**kwargs)
    recorder = sdcreplay.Recorder(
        out, f"{Path(__file__).with_name('midjob_script.py')}:make_workload", workload.model,
        workload.optimizer, state=workload.state, ring=3, workload_kwargs=kwargs,
    )  # fmt: skip
    if mode == "apart":
        report = apart(recorder, workload, rank)
        Path(results, f"rank{rank}.json").write_text(json.dumps(report))
        return
    specs = [FAULTS[mode]] if rank == 1 and mode in FAULTS else []
    injector = Injector(parse_specs(specs, include_env=False), "cpu")
    report: dict = {"rank": rank}
    check = ReplayCheck(workload, recorder=recorder, num_steps=-1) if mode == "check" else None
    detector = (
        UpdateDetector(model=workload.model, optimizer=workload.optimizer, recorder=recorder)
        if mode == "inline"
        else None
    )
    for index in range(4 if check else 6):
        batch = workload.get_batch(index)
        with OperatorMode(workload.model, workload.optimizer, [injector], index):
            if detector is not None:
                with detector.step(batch):  # the loop's own step, written inline
                    workload.train_step(batch)
                continue
            if check is None:
                with recorder.step(batch):
                    workload.train_step(batch)
                continue
            try:
                check.run_step(batch)
            except SDCReplayMismatch as mismatch:
                report.update(mismatch_step=mismatch.step, mismatch_rank=mismatch.rank)
                report["bundle"] = mismatch.bundle
    report["fired"] = [(fault.step, fault.op) for fault in injector.fired]
    report["written_before_dump"] = sorted(p.name for p in Path(out).parent.glob("job*"))
    report["ring_steps"] = recorder.ring_steps
    if detector is not None:
        report["alarms"] = [
            [alarm.step, alarm.reasons[0], alarm.bundle] for alarm in detector.alarms
        ]
        detector.close()
    elif check is None:
        report["dumps"] = [str(recorder.dump("manual"))]
        if mode == "manual":
            report["dumps"].append(str(recorder.dump("manual, again")))
    else:
        check.close()
    recorder.close()
    report["recorder_dumps"] = [str(path) for path in recorder.dumps]
    Path(results, f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


def apart(recorder, workload, rank: int) -> dict:
    """Ranks training alone, each dumping when its own check says so."""
    dumps: list[str | None] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for index in range(13):
            batch = workload.get_batch(index)
            with recorder.step(batch):
                workload.train_step(batch)
            if index in DUMPS_APART[rank]:
                path = recorder.dump(f"rank {rank}'s loss check")
                dumps.append(None if path is None else str(path))
        recorder.close()
    said = [str(w.message) for w in caught if str(w.message).startswith("sdcreplay")]
    return {"rank": rank, "dumps": dumps, "warnings": said, "ring_steps": recorder.ring_steps}


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
    # Everything is written: leave before torch's teardown, which after gloo sometimes aborts
    # ("terminate called without an active exception"; see tests/replay_check_ranks.py).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
