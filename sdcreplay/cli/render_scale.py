"""What ``replay --same-batch`` tells a person: every rank by its coordinates and peers, the
odd rank(s) and where each first left its peers (docs/at-scale.md); and what a node other than
node 0 says of a replay across nodes."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.markup import escape

from .output import Output, styled

if TYPE_CHECKING:
    from ..replay.nodes import NodeReport
    from ..replay.same_batch import SameBatchReport


def render_same_batch(output: Output, report: SameBatchReport) -> None:
    """The per-rank table and the verdict (a fallback is rendered as the job replay it is)."""
    body = report.to_json()
    rows = []
    for rank in body["ranks"]:
        entry = rank["first_divergent_entry"]
        against = (
            "off the record it was fed from"
            if entry and entry["against"] == "record"
            else f"{entry['agreeing']} of {entry['peers']} peers agree"
            if entry
            else ""
        )
        where = (
            "-" if entry is None else f"step {entry['step']} {escape(entry['entry'])} ({against})"
        )
        verdict = styled(rank["verdict"])
        if rank.get("spread_from") is not None:
            verdict += f" (from rank {rank['spread_from']})"
        device = rank["devices"][0]["device"] if rank["devices"] else "-"
        coordinates = ", ".join(f"{k}={v}" for k, v in rank["coordinates"].items())
        rows.append([str(rank["rank"]), coordinates, device, verdict, where])
    output.table(
        f"Same-batch replay of the {report.layout.world_size}-rank job {escape(report.bundle)} "
        f"({escape(report.layout.shape())}, fed rank {report.from_rank}'s batches)",
        ["rank", "coordinates", "device", "verdict", "first entry off its peers"],
        rows,
        fold=[4],
    )
    suspects = report.suspects
    who = f" (suspects: {', '.join(suspects)})" if suspects else ""
    output.say(f"Verdict: {styled(report.verdict)}{who}")
    kept = body["kept_state"]
    start = f" --from-state {escape(kept['path'])}" if kept else ""
    for odd in body["odd_ranks"]:
        output.say(
            f"Odd: {escape(odd['where'])} on {odd['device']}, next: `sdcreplay bisect "
            f"{escape(report.bundle)} --rank {odd['rank']} --alone --suspect D1 --reference D2"
            f"{start}`"
        )
    if kept:
        output.say(f"Kept: the state entering step {kept['step']} in {escape(kept['path'])}")
    if body["same_batch"].get("tie_break"):
        output.say(f"Two peers: {escape(body['same_batch']['tie_break'])}")
    if report.caveat:
        output.warn(f"caveat: {report.caveat}")
    output.say(f"Logs: {report.log_dir}")


def render_node(output: Output, report: NodeReport) -> None:
    """A node that does not report: its ranks, and node 0's verdict."""
    body = report.to_json()
    ranks = body["ranks"]
    output.say(
        f"Node {body['node_rank']} of {body['nnodes']} replayed ranks {ranks[0]}-{ranks[-1]} on "
        f"{', '.join(body['devices'])}; node 0 has the report."
    )
    output.say(f"Verdict (node 0's): {styled(report.verdict)}")
