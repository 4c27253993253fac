"""A ring Recorder inside a torch.distributed job: every rank holds its last K steps, and a dump
on every rank writes one job bundle (tests/ring_job_script.py, 2 gloo ranks as torchrun starts
them)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from conftest import TESTS

from sdcreplay.bundle.job_bundle import JobBundle
from tests.conftest import SMALL_ARGS, run_torchrun

FOUR_CPUS = [arg for n in range(4) for arg in ("-d", f"cpu:{n}")]  # two replicas of 2 ranks


def ring_job(tmp_path: Path, mode: str) -> tuple[Path, list[dict]]:
    """Run the script in ``mode``: (the job's path, each rank's report)."""
    script = tmp_path / "train.py"
    shutil.copy(TESTS / "ring_job_script.py", script)
    shutil.copy(TESTS / "midjob_script.py", tmp_path)
    results = tmp_path / "results"
    results.mkdir()
    job = tmp_path / "job.bundle"
    done = run_torchrun(script, 2, str(job), str(results), mode, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return job, [json.loads((results / f"rank{r}.json").read_text()) for r in (0, 1)]


def replayed(cli, job: Path, *args: str, code: int) -> dict:
    result = cli("replay", job, *args, "--timeout", "60", "--json")
    assert result.exit_code == code, result.output
    return json.loads(result.stdout)


def message_names(part) -> list[list[str]]:
    return [[m.profiling_name for m in step] for step in part.messages().values()]


def test_a_manual_dump_on_every_rank_writes_one_job_bundle_of_the_last_steps(cli, tmp_path):
    """3 steps held of 6: nothing is written until the dump; then each rank's part holds steps
    3-5 from the state before step 3, verified together, with the DDP's 2 iterations before
    step 3 noted, and the job replays correct. A second dump gets the next free name."""
    job, reports = ring_job(tmp_path, "manual")
    second = tmp_path / "job-2.bundle"
    for rank, report in enumerate(reports):
        assert report["rank"] == rank and report["written_before_dump"] == []
        assert report["ring_steps"] == [3, 4, 5]
        assert report["dumps"] == report["recorder_dumps"] == [str(job), str(second)]
    for path, reason in ((job, "manual"), (second, "manual, again")):
        bundle = JobBundle.open(path)
        assert bundle.complete and bundle.world_size == 2
        for rank in (0, 1):
            part = bundle.rank(rank)
            assert part.verified and part.step_indices == [3, 4, 5]
            assert part.manifest.distributed.ddp_iterations_before == 2
            trigger = part.manifest.trigger
            assert (trigger.reason, trigger.source, trigger.step, trigger.ring) == (
                reason,
                "user",
                5,
                3,
            )
            assert message_names(part) == [["gloo:all_reduce"]] * 3
    assert replayed(cli, job, code=0)["verdict"] == "correct"


def test_a_fault_on_one_rank_while_the_ring_records_accuses_that_ranks_recording(cli, tmp_path):
    """Rank 1's step 5 computed wrongly while recorded; the window's first step (3) was clean,
    so the dump verifies. Two clean replicas agree with each other against the record: rank 1's
    recording is the suspect, its gradients' all-reduce input the first divergent message."""
    job, reports = ring_job(tmp_path, "fault")
    assert reports[0]["fired"] == [] and reports[1]["fired"] == [[5, "aten.addmm.default"]]
    bundle = JobBundle.open(job)
    assert all(bundle.rank(rank).verified for rank in (0, 1))
    report = replayed(cli, job, *FOUR_CPUS, code=1)
    assert report["verdict"] == "recording_suspect"
    assert report["suspects"] == ["record:rank1 (cpu)"]
    assert report["origin_rank"] == 1 and report["spread_ranks"] == [0]
    first = report["first_divergent_message"]
    assert (first["rank"], first["step"], first["which"]) == (1, 5, "input")
    assert [rank["record"] for rank in report["ranks"]] == [
        {"verdict": "spread", "spread_from": 1},
        {"verdict": "persistent"},
    ]


def test_replay_check_with_a_ring_recorder_dumps_a_job_bundle_on_every_rank(cli, tmp_path):
    """Rank 1's replayed execution of step 3 differs: every rank raises SDCReplayMismatch
    naming rank 1, with the job bundle's path. Its parts hold steps 0-3 (the last one the
    check's clean evidence execution), without the check's own agreement collectives, and
    verify (the DDP had run 1 iteration, the check's reference execution, before step 0)."""
    job, reports = ring_job(tmp_path, "check")
    assert reports[1]["fired"] == [[3, "aten.addmm.default"]] and reports[0]["fired"] == []
    for report in reports:
        assert (report["mismatch_step"], report["mismatch_rank"]) == (3, 1)
        assert report["bundle"] == str(job) and report["recorder_dumps"] == [str(job)]
        assert report["ring_steps"] == [0, 1, 2]  # the dumped evidence step was taken back
    bundle = JobBundle.open(job)
    for rank in (0, 1):
        part = bundle.rank(rank)
        assert part.verified and part.step_indices == [0, 1, 2, 3]
        assert part.manifest.distributed.ddp_iterations_before == 1
        assert (part.manifest.trigger.source, part.manifest.trigger.step) == ("ReplayCheck", 3)
        assert message_names(part)[0] == ["gloo:broadcast"] * 2 + ["gloo:all_reduce"]
    assert replayed(cli, job, code=0)["verdict"] == "correct"


def test_record_nproc_with_a_ring_dumps_a_job_bundle_per_alarm_and_at_the_end(cli, tmp_path):
    """`record --nproc 2 --ring 4 --dump-on update --dump-on end` with a NaN planted in rank
    1's step 5: the ranks' UpdateDetectors alarm together (rank 0 through the all-reduced
    gradients), dump the alarmed execution as one job bundle, recompute (transient) and go on;
    the end of the run dumps the last steps as the next job bundle. The alarm's job accuses
    rank 1's recording."""
    job, last = tmp_path / "ring.bundle", tmp_path / "ring-2.bundle"
    spec = "kind=nan,op=aten.mm,module=layers.0.mlp.w1,phase=forward,step=5,nth=0,index=5,rank=1"
    result = cli(
        "record", "builtin:tiny-llama", "--nproc", "2", "--steps", "8", "--ring", "4",
        "--dump-on", "update", "--dump-on", "end", "--inject", spec, *SMALL_ARGS,
        "--out", job, "--json",
    )  # fmt: skip
    assert result.exit_code == 1, result.output  # an alarm is a finding
    recorded = json.loads(result.stdout)
    assert recorded["bundle"] == str(job) and recorded["world_size"] == 2
    assert [rank["steps"] for rank in recorded["ranks"]] == [8, 8]
    alarm, end = recorded["ring"]["dumps"]
    assert (alarm["bundle"], end["bundle"]) == (str(job), str(last))
    assert (alarm["trigger"]["source"], alarm["trigger"]["step"]) == ("UpdateDetector", 5)
    assert alarm["trigger"]["reason"].endswith("(transient)")
    assert end["trigger"] == {"reason": "the run ended", "source": "record", "step": 7, "ring": 4}
    assert recorded["verification"]["status"] == "passed"
    for path, steps in ((job, [0, 1, 2, 3, 4, 5]), (last, [4, 5, 6, 7])):
        bundle = JobBundle.open(path)
        for rank in (0, 1):
            part = bundle.rank(rank)
            assert part.verified and part.step_indices == steps
            assert part.manifest.distributed.ddp_iterations_before == min(steps[0], 2)
    report = replayed(cli, job, *FOUR_CPUS, code=1)
    assert report["verdict"] == "recording_suspect"
    assert report["suspects"] == ["record:rank1 (cpu)"] and report["origin_rank"] == 1
    first = report["first_divergent_message"]
    assert (first["rank"], first["step"], first["which"]) == (1, 5, "input")


def test_ranks_dumping_at_different_steps_are_aligned_or_refused_and_alone_is_said(cli, tmp_path):
    """Ranks training alone (no DDP) with a per-rank check of the user's own. Rank 1 dumps
    after step 5, rank 0 after step 6: both parts hold steps 3-5, the window every rank holds,
    said in a warning and in the trigger. Rank 1 then dumps after step 8, rank 0 after step
    12: no step in common, so nothing is written, the refusal naming each rank's steps is
    warned about on every rank and training goes on. The job's ranks logged no message: the
    recording warns (rank 0 writes the job) and `info` says so by name."""
    job, reports = ring_job(tmp_path, "apart")
    note = (
        "the ranks dumped at different steps (rank 0 holding steps 3-6, rank 1 holding steps "
        "3-5): every part holds steps 3-5, the steps all ranks hold"
    )
    aligned = f"sdcreplay: {note}; left out: rank 0's step 6"
    alone = (
        f"sdcreplay: the job bundle {job}: its 2 ranks exchanged no message in any recorded "
        "step (no DDP, FSDP or other collective): each rank trained alone"
    )
    for rank, report in enumerate(reports):
        assert report["dumps"] == [str(job), None]
        assert report["ring_steps"] == [9, 10, 11, 12]  # training went on to the end
        said = report["warnings"]
        assert said[0] == aligned
        assert [w.startswith(alone) for w in said[1:]] == ([True, False] if rank == 0 else [False])
        assert said[-1].startswith(
            f"sdcreplay: the ring's dump (rank {rank}'s loss check) wrote nothing: the ranks "
            "dumped at different steps and hold no steps in common (rank 0 holding steps 9-12, "
            "rank 1 holding steps 6-8): a job bundle's parts must hold the same steps (Hint: "
            "Dump on every rank at the same step"
        )
    assert sorted(p.name for p in tmp_path.glob("job*")) == ["job.bundle"]
    bundle = JobBundle.open(job)
    for rank in (0, 1):
        part = bundle.rank(rank)
        assert part.verified and part.step_indices == [3, 4, 5]
        assert (part.manifest.trigger.step, part.manifest.trigger.note) == (5, note)
        assert message_names(part) == [[], [], []]
    shown = cli("info", job)
    assert shown.exit_code == 0, shown.output
    assert "exchanged no message in any" in " ".join(shown.output.split())


def test_an_inline_loops_detector_alarms_on_every_rank_at_once_and_dumps_one_job(tmp_path):
    """`with detector.step(batch):` around a DDP step written inline: a NaN in rank 1's step
    5 reaches rank 0 through the all-reduce; the ranks agree as the step ends, both alarm at
    step 5 and dump one job bundle holding steps 3-5, which verifies."""
    job, reports = ring_job(tmp_path, "inline")
    assert reports[1]["fired"] == [[5, "aten.addmm.default"]] and reports[0]["fired"] == []
    assert [report["alarms"] for report in reports] == [
        [[5, "nonfinite:grad:0.weight", str(job)]],
        [[5, "nonfinite:loss", str(job)]],
    ]
    bundle = JobBundle.open(job)
    for rank in (0, 1):
        part = bundle.rank(rank)
        assert part.verified and part.step_indices == [3, 4, 5]
        assert (part.manifest.trigger.source, part.manifest.trigger.step) == ("UpdateDetector", 5)
