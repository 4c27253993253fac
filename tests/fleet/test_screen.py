"""screen: tickets from real minimize runs form a corpus, and screening three virtual replicas,
one with a planted fault, names that one and the ticket it failed, within the budget; the
ledger then holds it as suspect and export drains its node.

The tickets are conftest's ``tickets``: one real bisect, three real minimize runs.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

from sdcreplay.fleet.corpus import CORPUS_FILE, add_tickets
from sdcreplay.fleet.screen import STOP_BEFORE, screen

PLANTED = "kind=bitflip,op=aten.mm,bit=22,device=cpu:1"  # every matmul on cpu:1, element 0


def test_screen_names_the_faulty_replica_and_its_ticket_and_the_ledger_drains_it(
    tickets, run_exe, tmp_path
):
    env = {"SDCREPLAY_LEDGER": str(tmp_path / "ledger.sqlite")}
    corpus = tmp_path / "corpus"
    added = run_exe("corpus", "add", corpus, *tickets, tickets[0], "--json", env=env)
    assert added.returncode == 0, added.stderr
    addition = json.loads(added.stdout)
    keys = [ticket["key"] for ticket in addition["added"]]
    assert len(set(keys)) == 3 and addition["tickets"] == 3
    assert [t["bits"] for t in addition["added"]] == [[22], [3], [30]]
    assert [t["drill"] for t in addition["added"]] == [True] * 3
    said = run_exe("corpus", "add", tmp_path / "other", tickets[1], env=env)
    assert "[drill: kind=bitflip," in said.stderr and "it tests the tooling, not a device" in (
        said.stderr
    )
    assert addition["duplicates"] == [
        {"ticket": str(tickets[0].resolve()), "key": keys[0], "of": str(tickets[0].resolve())}
    ]

    done = run_exe(
        "screen",
        corpus,
        "-d",
        "cpu:0",
        "-d",
        "cpu:1",
        "-d",
        "cpu:2",
        "--budget",
        "60",
        "--json",
        env={**env, "SDCREPLAY_INJECT": PLANTED},
    )
    assert done.returncode == 1, done.stderr
    report = json.loads(done.stdout)
    devices = {row["device"]: row for row in report["devices"]}
    assert {label: row["status"] for label, row in devices.items()} == {
        "cpu:0": "passed",
        "cpu:1": "failed",
        "cpu:2": "passed",
    }
    assert report["failed"] == ["cpu:1"] and report["drill"] is True
    assert devices["cpu:0"]["tickets_passed"] == devices["cpu:2"]["tickets_passed"] == 3
    failure = devices["cpu:1"]["failure"]
    assert failure["ticket"]["key"] == keys[0]  # the first ticket, at its first trial
    assert failure["ticket"]["op"] == "aten.mm.default"
    assert (failure["trial"], failure["element"], failure["bits"], failure["xor"]) == (
        1,
        0,
        "22",
        "00400000",
    )
    assert [t["status"] for t in devices["cpu:1"]["tickets"]] == ["failed"]  # it stopped there
    assert report["within_budget"] and report["seconds"] <= 60
    host = socket.gethostname()
    assert devices["cpu:1"]["device_id"] == f"cpu:1@{host}"
    assert f"cpu:1 (cpu:1@{host}): FAILED ticket {keys[0]} aten.mm.default at trial 1" in (
        done.stderr
    )

    assert f"every ticket of {corpus} is a drill (made with injected faults)" in done.stderr

    listing = run_exe("devices", "list", "--json", env=env)
    assert listing.returncode == 0, listing.stderr
    states = {row["label"]: row["state"] for row in json.loads(listing.stdout)["devices"]}
    assert states == {"cpu:0": "healthy", "cpu:1": "drill", "cpu:2": "healthy"}  # never evidence

    drain = run_exe("devices", "export", "--format", "slurm", env=env)
    assert drain.returncode == 0 and drain.stdout == "", drain.stderr  # a drill drains nothing
    shown = run_exe("devices", "export", "--format", "slurm", "--state", "drill", env=env)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout == (
        "# drill (injected faults, not evidence): "
        f"scontrol update NodeName={host.split('.')[0]} State=DRAIN "
        f"Reason='sdcreplay: cpu:1 cpu:1@{host} drill: screen aten.mm element 0 bit 22'\n"
    )


def _foreign(corpus: Path, tickets: list[Path]) -> Path:
    """The corpus, with its first ticket's expected output said to come from another CPU."""
    add_tickets(corpus, tickets[:2])
    index = json.loads((corpus / CORPUS_FILE).read_text())
    index["tickets"][0]["reference"]["model"] = "Another CPU 9000"
    (corpus / CORPUS_FILE).write_text(json.dumps(index))
    return corpus


def test_a_ticket_from_another_model_is_skipped_with_the_reason(tickets, tmp_path):
    corpus = _foreign(tmp_path / "corpus", tickets)
    index = json.loads((corpus / CORPUS_FILE).read_text())
    index["tickets"] = index["tickets"][:1]
    (corpus / CORPUS_FILE).write_text(json.dumps(index))
    report = screen(corpus, ["cpu:0"], budget=60, ledger=False)
    (device,) = report.to_json()["devices"]
    assert device["status"] == "skipped" and report.exit_code == 3
    (ticket,) = device["tickets"]
    assert ticket["status"] == "skipped"
    assert ticket["reason"].startswith("its expected output was computed on Another CPU 9000")


def test_a_budget_spent_before_any_process_could_start_runs_nothing_and_says_so(tickets, tmp_path):
    corpus = tmp_path / "corpus"
    add_tickets(corpus, tickets)
    report = screen(corpus, ["cpu:0", "cpu:1"], budget=STOP_BEFORE / 2, ledger=False)
    data = report.to_json()
    assert report.exit_code == 3 and data["within_budget"]
    for device in data["devices"]:
        assert device["status"] == "incomplete"
        assert [t["status"] for t in device["tickets"]] == ["unrun"] * 3


def test_a_read_only_corpus_screens_with_its_logs_in_the_temp_dir_and_says_so(
    tickets, run_exe, tmp_path, read_only
):
    corpus = tmp_path / "corpus"
    add_tickets(corpus, tickets[:1])
    read_only(corpus)  # a read-only mount, as a Kubernetes Job's corpus volume
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {"SDCREPLAY_LEDGER": str(tmp_path / "ledger.sqlite"), "TMPDIR": str(temp)}
    args = ["-d", "cpu:0", "--budget", "120", "--json"]
    done = run_exe("screen", corpus, *args, env=env, timeout=600)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    logs = Path(report["log_dir"])
    assert logs.parent == temp / "sdcreplay-screen"
    assert report["logs_elsewhere"] == f"{corpus} cannot be written"
    assert (logs / "screen-cpu-0.result.json").is_file()
    assert not (corpus / ".screen").exists()
    said = " ".join(done.stderr.split())
    assert f"Logs: {logs} (not in the corpus: {corpus} cannot be written)" in said

    mine = tmp_path / "my-logs"  # --logs: this run's own directory inside the one named
    done = run_exe("screen", corpus, *args, "--logs", mine, env=env, timeout=600)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert Path(report["log_dir"]).parent == mine and report["logs_elsewhere"] is None
    assert f"Logs: {report['log_dir']}" in " ".join(done.stderr.split())
