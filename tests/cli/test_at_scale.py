"""`replay JOB --rank R --alone` as a person reads it in a log: the stage's last line says it is
done (1/1), and the table's steps column says, per replica, how each step compared (the record,
which judges a rank alone without being judged, reads ``-``). On the DDP job of
tests/job_script.py, rank 1 alone on cpu:0 and cpu:1, cpu:1 with a bit flipped in step 0 in a
gradient its all_reduce sends: the record names cpu:1 the odd one."""

from __future__ import annotations

import json

FAULT = (
    "kind=bitflip,op=aten.mm.default,module=layers.0.attn.wq,phase=backward,step=0,nth=0,"
    "index=3,bit=20,device=cpu:1"
)


def test_a_rank_alone_prints_its_steps_and_a_finished_stage(cli, ddp_job, tmp_path):
    job, _ = ddp_job
    result = cli(
        "replay", job, "--trust-workload", "--rank", "1", "--alone", "-d", "cpu:0", "-d", "cpu:1",
        "--inject", FAULT, "--logs", tmp_path / "logs", "--no-ledger", "--json",
    )  # fmt: skip
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    steps = {run["device"]: run["steps"] for run in report["devices"]}
    assert report["consensus"]["suspects"] == ["cpu:1"] and steps["cpu:0"] == {"0": 0, "1": 0}
    assert steps["cpu:1"]["0"] > 0 and steps["cpu:1"]["1"] > 0
    stage = next(line for line in result.stderr.splitlines() if line.startswith("replaying one"))
    assert stage.startswith("replaying one rank alone: 1/1, cpu:0, cpu:1 (")
    rows = {line.split("│")[1].strip(): line for line in result.stderr.splitlines() if "│" in line}
    assert "0:ok 1:ok" in rows["cpu:0"]
    assert f"0:{steps['cpu:1']['0']} 1:{steps['cpu:1']['1']}" in rows["cpu:1"]
    assert rows["record"].split("│")[5].strip() == "-"
