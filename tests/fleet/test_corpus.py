"""corpus add: tickets enter once per defect class (operator, shapes, dtypes, failing bits);
a ticket that tests nothing is refused before anything is added. The tickets are conftest's
``tickets``, from real minimize runs."""

from __future__ import annotations

import json
import shutil

from sdcreplay.fleet.corpus import CORPUS_FILE, defect_key, read_corpus


def test_each_defect_class_enters_once(tickets, tmp_path, cli):
    copy = tmp_path / "same-defect-elsewhere"
    shutil.copytree(tickets[1], copy)  # another directory, the same defect class
    corpus = tmp_path / "corpus"
    done = cli("corpus", "add", corpus, tickets[0], tickets[1], copy, "--json")
    assert done.exit_code == 0, done.stderr
    added = json.loads(done.stdout)
    doc = json.loads((tickets[0] / "ticket.json").read_text())
    first = added["added"][0]
    assert first["key"] == defect_key(
        "aten.mm.default", doc["shapes"]["minimal"], doc["operator"]["dtypes"], [22]
    )
    assert (first["op"], first["bits"], first["dtypes"]) == (
        "aten.mm.default",
        [22],
        ["float32", "float32"],
    )
    assert first["reference"]["kind"] == "cpu" and first["drill"] is True
    assert [d["ticket"] for d in added["duplicates"]] == [str(copy.resolve())]
    assert [entry.key for entry in read_corpus(corpus)] == [a["key"] for a in added["added"]]
    for entry in read_corpus(corpus):
        assert (corpus / entry.directory / "inputs.h5").is_file()

    again = cli("corpus", "add", corpus, tickets[2], tickets[0], "--json")
    assert json.loads(again.stdout)["tickets"] == 3  # only the third defect class was new


def test_a_ticket_that_did_not_reproduce_is_refused_and_nothing_is_added(tickets, tmp_path, cli):
    quiet = tmp_path / "not-reproduced"
    shutil.copytree(tickets[0], quiet)
    doc = json.loads((quiet / "ticket.json").read_text())
    (quiet / "ticket.json").write_text(json.dumps({**doc, "status": "not reproduced"}))
    corpus = tmp_path / "corpus"
    done = cli("corpus", "add", corpus, tickets[1], quiet)
    assert done.exit_code == 3
    assert f"Error: {quiet} is a ticket that did not reproduce: it tests nothing" in done.stderr
    assert not (corpus / CORPUS_FILE).exists()
    bad = cli("corpus", "add", corpus, tmp_path)
    assert bad.exit_code == 3 and "is not a ticket directory" in bad.stderr
