"""``replay --same-batch`` and ``replay --rank R --alone``: the two phases of judging a large
job (docs/at-scale.md), dispatched from the replay command."""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path

from ..errors import SdcReplayError
from .output import Output


def at_scale_replay(
    output: Output,
    bundle: Path,
    device: list[str] | None,
    inject: list[str] | None,
    logs: Path | None,
    timeout: float | None,
    trust: AbstractContextManager,
    ledger: bool,
    *,
    same_batch: bool,
    from_rank: int | None,
    rank: int | None,
    alone: bool,
    keep_state: Path | None = None,
    from_state: Path | None = None,
):
    """Phase 1 (``--same-batch``) or phase 2 (``--rank R --alone``) on a job bundle."""
    from ..bundle.job_bundle import is_job_bundle

    if not is_job_bundle(bundle):
        raise SdcReplayError(
            f"--same-batch, --from-rank, --rank and --alone are for a job bundle; {bundle} is a "
            "single process's bundle",
            "Leave them out: a single process is replayed on each --device as it is.",
        )
    if same_batch == (alone or rank is not None) or (alone != (rank is not None)):
        raise SdcReplayError(
            "give either --same-batch [--from-rank R] (phase 1) or --rank R --alone (phase 2)",
            "Phase 1 judges every rank in one replay; phase 2 replays one rank's group alone "
            "(docs/at-scale.md).",
        )
    if (from_rank is not None or keep_state is not None) and not same_batch:
        raise SdcReplayError(
            "--from-rank and --keep-state are for --same-batch", "Add --same-batch."
        )
    if from_state is not None and not alone:
        raise SdcReplayError("--from-state is for --rank R --alone", "Add --rank R --alone.")
    with trust, output.stages() as progress:
        if same_batch:
            from ..replay.same_batch import replay_same_batch

            stage, note = "replaying the job on one batch", "every rank at once"
            progress.update(stage, 0, 1, note)
            report: object = replay_same_batch(
                bundle, device, from_rank=from_rank, inject=inject or [], log_dir=logs,
                timeout=timeout, ledger=ledger, keep_state=keep_state,
            )  # fmt: skip
        else:
            from ..replay.alone import replay_alone

            assert rank is not None
            stage, note = "replaying one rank alone", ", ".join(device or [])
            progress.update(stage, 0, 1, note)
            report = replay_alone(
                bundle, rank, device or [], inject=inject or [], log_dir=logs, timeout=timeout,
                ledger=ledger, from_state=from_state,
            )  # fmt: skip
        progress.update(stage, 1, 1, note)  # the line a log keeps says the stage is done
        return report
