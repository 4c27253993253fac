"""How each rank of a job ended, wherever it ran: what judging the job needs (`launch.run_ranks`),
and, across nodes, its way to node 0 through the rendezvous store, with the files its
result names (no file system is shared between nodes)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .rendezvous import NodeError, NodeLink, NotReporting
from .worker import DeviceResult


@dataclass
class Ending:
    """How a rank ended, as the node that ran it saw it: what judging the job needs, wherever
    the rank ran (node 0 gathers the other nodes' through the rendezvous store)."""

    rank: int
    label: str
    result: DeviceResult  # its own (`_own_result`)
    finished: bool  # it wrote its result
    silent: bool  # it ended by itself without a result
    hung: bool  # its node's watchdog killed it
    reported_at: int  # its result file's mtime, in ns
    where: str
    status: int | None
    log: str
    tail: str

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "result": self.result.to_json()}

    @classmethod
    def from_json(cls, data: dict) -> Ending:
        return cls(**{**data, "result": DeviceResult.from_json(data["result"])})


def first_failure(endings: list[Ending]) -> int | None:
    """The rank whose failure ended the job: the hung one, else one that died without a word
    (its peers' errors follow from its death), else the first to report an error."""
    hung = [ending.rank for ending in endings if ending.hung]
    silent = [ending.rank for ending in endings if ending.silent]
    if hung or silent:
        return min(hung or silent)
    reported = [e for e in endings if e.result.error is not None and e.finished]
    if not reported:
        return None
    return min(reported, key=lambda ending: ending.reported_at).rank


_SHIPPED = "sdcreplay-node-file:"
"""What a path a rank's result names becomes on its way to node 0 (a name in its log dir)."""


def _paths_in(value: Any, convert: Callable[[str], str]) -> Any:
    if isinstance(value, str):
        return convert(value)
    if isinstance(value, dict):
        return {key: _paths_in(item, convert) for key, item in value.items()}
    if isinstance(value, list):
        return [_paths_in(item, convert) for item in value]
    return value


def exchange(link: NodeLink, endings: list[Ending], work_dir: Path) -> list[Ending]:
    """Node 0: every rank's ending, the other nodes' files written into ``work_dir`` and the
    paths in their results naming them there; each result with its device's identity as its
    own node saw it. The others: theirs handed to node 0, then `NotReporting`."""
    if link.lost is not None:
        raise link.lost_error(link.lost, "during the replay")
    me = link.nodes.node_rank
    if me != 0:
        files: dict[str, bytes] = {}
        root = work_dir.resolve()

        def ship(text: str) -> str:
            path = Path(text)
            try:
                if not path.is_absolute() or not path.is_file() or root not in path.parents:
                    return text
            except (OSError, ValueError):  # a string that is no path
                return text
            name = str(path.relative_to(root))
            files[name] = path.read_bytes()
            return _SHIPPED + name

        sent = []
        for ending in endings:
            body = ending.to_json()
            body["result"] = _paths_in(body["result"], ship)
            body["log"] = f"{ending.log} on node {me}"
            if ending.result.error is not None:
                body["result"]["error"]["log"] = body["log"]
            sent.append(body)
        link.publish(sent, files)
        raise NotReporting()

    def write(name: str, content: bytes) -> None:
        target = work_dir / name
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise NodeError(f"a node sent a file named {name!r}, outside its log dir")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content)

    def receive(text: str) -> str:
        shipped = text.startswith(_SHIPPED)
        return str(work_dir.resolve() / text[len(_SHIPPED) :]) if shipped else text

    gathered = [Ending.from_json(_paths_in(body, receive)) for body in link.gather(write)]
    everyone = sorted([*endings, *gathered], key=lambda ending: ending.rank)
    for ending in everyone:
        if ending.result.value is not None:
            ending.result.value["identity"] = link.identities[ending.rank]
    return everyone
