"""Several nodes, one job: torch's c10d rendezvous, and what the launches tell each other
through its store (``sdcreplay replay JOB --nnodes K --nproc-per-node P --rdzv-endpoint
HOST:PORT --node-rank R``, docs/at-scale.md).

One launch per node. Each makes torch's c10d rendezvous handler (the one ``torchrun
--rdzv-backend c10d`` makes); node 0 hosts its TCP store at ``HOST:PORT``, as the node
torchrun's static rendezvous calls rank 0 does, so which node holds which ranks is fixed
(node R runs ranks R*P .. R*P+P-1) and the one that reports is known before anyone starts.
Through that store, and nothing else (no file is shared between nodes), the launches:
announce their devices (`NodeLink.arrive`: a node that never comes is named), beat while
they live (a node that stops beating for `NODE_SILENCE_SECONDS` is lost, and the others
end their ranks), hand node 0 what their ranks found (`publish`, `gather`: results and the
files they name), and wait for node 0's verdict (`post_verdict`, `await_verdict`).
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ..errors import SdcReplayError

NODE_SILENCE_SECONDS = 15.0
"""A node not heard from for this long is lost (torch's rendezvous keep-alive: 5 s x 3)."""
BEAT_SECONDS = 1.0
ACK_SECONDS = 10.0
"""How long node 0, which hosts the store, waits for the others to read its verdict."""
RDZV_TIMEOUT = 900.0
"""torchrun's default for the nodes to arrive."""
_PREFIX = "sdcreplay/"
_POLL = 0.2


class NodeError(SdcReplayError):
    default_hint = (
        "Start `sdcreplay replay JOB --nnodes K --nproc-per-node P --rdzv-endpoint HOST:PORT "
        "--node-rank R` once on every node, the same K, P and HOST:PORT (node 0's address), "
        "R = 0..K-1, and keep each running until the verdict."
    )


class NotReporting(Exception):
    """Raised in a node other than node 0 once its ranks' findings are handed over: the report
    is node 0's to make (`nodes.replay_on_nodes` waits for its verdict)."""


@dataclass(frozen=True)
class Nodes:
    """Where this launch stands in a job spread over ``nnodes`` nodes (torchrun's flags)."""

    nnodes: int
    nproc_per_node: int
    endpoint: str
    node_rank: int
    rdzv_timeout: float = RDZV_TIMEOUT

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    def ranks_of(self, node: int) -> range:
        return range(node * self.nproc_per_node, (node + 1) * self.nproc_per_node)

    @property
    def local_ranks(self) -> range:
        return self.ranks_of(self.node_rank)

    def describe(self, node: int) -> str:
        ranks = self.ranks_of(node)
        span = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]}"
        return f"node {node} ({span})"

    @property
    def run_id(self) -> str:
        return f"sdcreplay-{self.nnodes}x{self.nproc_per_node}"


@dataclass
class Rendezvous:
    """torch's c10d rendezvous handler for one launch, and its store."""

    handler: Any  # torch.distributed.elastic.rendezvous.RendezvousHandler
    store: Any  # torch.distributed.Store


def open_rendezvous(nodes: Nodes | None, run_id: str) -> Rendezvous:
    """The c10d rendezvous torchrun makes: on ``localhost:0`` for one node, else at the
    endpoint, hosted by node 0."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    configs: dict[str, Any] = {"close_timeout": 5}
    if nodes is not None:
        wait = max(1, round(nodes.rdzv_timeout))
        configs.update(is_host=nodes.node_rank == 0, join_timeout=wait, read_timeout=wait)
    params = RendezvousParameters(
        backend="c10d",
        endpoint=nodes.endpoint if nodes else "localhost:0",
        run_id=nodes.run_id if nodes else run_id,
        min_nodes=nodes.nnodes if nodes else 1,
        max_nodes=nodes.nnodes if nodes else 1,
        **configs,
    )
    try:
        backend, store = create_backend(params)
    except Exception as exc:
        if nodes is None:
            raise
        cause = exc.__cause__ or exc
        if nodes.node_rank == 0:
            raise NodeError(
                f"node 0 cannot host the rendezvous store at {nodes.endpoint}: {cause}",
                "Give --rdzv-endpoint this node's address and a free port.",
            ) from exc
        raise NodeError(
            f"{nodes.describe(nodes.node_rank)} cannot reach the rendezvous store at "
            f"{nodes.endpoint} (node 0 hosts it) within {nodes.rdzv_timeout:g} s: {cause}",
            "Start node 0's launch (--node-rank 0) on the host --rdzv-endpoint names.",
        ) from exc
    return Rendezvous(create_handler(store, backend, params), store)


_ACROSS: list[NodeLink] = []


@contextlib.contextmanager
def across(link: NodeLink) -> Iterator[None]:
    """Within it, `launch.run_ranks` runs this node's ranks of a job spread over nodes."""
    _ACROSS.append(link)
    try:
        yield
    finally:
        _ACROSS.pop()


def current() -> NodeLink | None:
    return _ACROSS[-1] if _ACROSS else None


class NodeLink:
    """This launch's side of the conversation between nodes, through the rendezvous store."""

    def __init__(self, nodes: Nodes, rendezvous: Rendezvous):
        self.nodes = nodes
        self.rendezvous = rendezvous
        self.labels: list[str] = []  # every rank's device, once all nodes arrived
        self.identities: dict[int, dict] = {}  # every rank's device identity, as its node saw it
        self.lost: int | None = None  # a node that stopped beating
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._heard: dict[int, tuple[int, float]] = {}  # node -> (beats, when they last moved)
        self._beating = threading.Thread(target=self._beat, name="sdcreplay-node-beat", daemon=True)

    @classmethod
    def open(cls, nodes: Nodes) -> NodeLink:
        link = cls(nodes, open_rendezvous(nodes, nodes.run_id))
        link._beating.start()
        return link

    def close(self) -> None:
        self._done.set()

    # -- the store ----------------------------------------------------------------------

    def _op(self, operation: Callable[..., Any], *args: Any) -> Any:
        try:
            with self._lock:
                return operation(*args)
        except Exception as exc:  # the store's host is gone: only node 0 hosts it
            if self.nodes.node_rank == 0:
                raise NodeError(f"the rendezvous store node 0 hosts failed: {exc}") from exc
            raise NodeError(
                f"{self.nodes.describe(0)} is lost: the rendezvous store it hosts at "
                f"{self.nodes.endpoint} stopped answering ({exc})",
                "Node 0's launch ended before its verdict: its output says why. Start the "
                "replay again on every node.",
            ) from exc

    def _set(self, key: str, value: str | bytes) -> None:
        self._op(self.rendezvous.store.set, _PREFIX + key, value)

    def _get(self, key: str) -> bytes:
        return self._op(self.rendezvous.store.get, _PREFIX + key)

    def _has(self, key: str) -> bool:
        return bool(self._op(self.rendezvous.store.check, [_PREFIX + key]))

    def _add(self, key: str, amount: int) -> int:
        return int(self._op(self.rendezvous.store.add, _PREFIX + key, amount))

    # -- liveness -----------------------------------------------------------------------

    def _beat(self) -> None:
        while not self._done.is_set():
            with contextlib.suppress(Exception):  # a lost store is found by the main thread
                self._add(f"beat/node{self.nodes.node_rank}", 1)
            self._done.wait(BEAT_SECONDS)

    def silent_node(self) -> int | None:
        """A node whose beats stopped for `NODE_SILENCE_SECONDS` (read on this node's clock)."""
        now = time.monotonic()
        for node in range(self.nodes.nnodes):
            if node == self.nodes.node_rank:
                continue
            beats = self._add(f"beat/node{node}", 0)
            seen, since = self._heard.get(node, (-1, now))
            if beats != seen:
                self._heard[node] = (beats, now)
            elif now - since > NODE_SILENCE_SECONDS:
                return node
        return None

    def lost_error(self, node: int, during: str) -> NodeError:
        on = self.labels[self.nodes.ranks_of(node)[0] :][: self.nodes.nproc_per_node]
        devices = f" on {', '.join(on)}" if on else ""
        return NodeError(
            f"{self.nodes.describe(node)}{devices} is lost: not heard from for "
            f"{NODE_SILENCE_SECONDS:g} s {during} (its launch or its host died)",
            f"Node {node}'s output or its rank logs may say why; start the replay again on "
            "every node.",
        )

    @contextlib.contextmanager
    def watching(self, on_lost: Callable[[], None]) -> Iterator[None]:
        """While the ranks run: a node that goes silent is `lost`, and ``on_lost`` ends this
        node's ranks rather than leave them waiting in a collective for its timeout."""
        stop = threading.Event()

        def watch() -> None:
            while not stop.wait(BEAT_SECONDS):
                with contextlib.suppress(Exception):
                    node = self.silent_node()
                    if node is not None:
                        self.lost = node
                        on_lost()
                        return

        thread = threading.Thread(target=watch, name="sdcreplay-node-watch", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()

    # -- the conversation ---------------------------------------------------------------

    def arrive(self, labels: list[str], identities: list[dict]) -> None:
        """Announce this node's devices and wait for every node's (`labels`, `identities`):
        a node that does not come within the rendezvous timeout is named."""
        me = self.nodes.node_rank
        if self._add(f"arrived/node{me}", 1) > 1:
            raise NodeError(
                f"two launches gave --node-rank {me} to the rendezvous at {self.nodes.endpoint}",
                "Give each node its own --node-rank, 0..K-1.",
            )
        self._set(f"devices/node{me}", json.dumps({"labels": labels, "identities": identities}))
        deadline = time.monotonic() + self.nodes.rdzv_timeout
        waiting = set(range(self.nodes.nnodes))
        while True:
            waiting = {node for node in waiting if not self._has(f"devices/node{node}")}
            if not waiting:
                break
            if time.monotonic() > deadline:
                names = ", ".join(self.nodes.describe(node) for node in sorted(waiting))
                raise NodeError(
                    f"{names} never arrived at the rendezvous {self.nodes.endpoint} within "
                    f"{self.nodes.rdzv_timeout:g} s",
                    "Start the launch of every node (the same --nnodes, --nproc-per-node and "
                    "--rdzv-endpoint, each its own --node-rank), or give them longer with "
                    "--rdzv-timeout SECONDS.",
                )
            time.sleep(_POLL)
        for node in range(self.nodes.nnodes):
            shown = json.loads(self._get(f"devices/node{node}"))
            self.labels += shown["labels"]
            for rank, identity in zip(self.nodes.ranks_of(node), shown["identities"]):
                self.identities[rank] = identity

    def publish(self, endings: list[dict], files: dict[str, bytes]) -> None:
        """Hand node 0 this node's ranks' endings and the files their results name."""
        me = self.nodes.node_rank
        for name, content in files.items():
            self._set(f"files/node{me}/{name}", content)
        self._set(f"endings/node{me}", json.dumps({"endings": endings, "files": sorted(files)}))

    def publish_failure(self, error: SdcReplayError) -> None:
        """This node failed before its ranks ended: node 0 says so rather than wait."""
        with contextlib.suppress(Exception):
            body = {"message": error.message, "hint": error.hint}
            self._set(f"failed/node{self.nodes.node_rank}", json.dumps(body))

    def gather(self, write: Callable[[str, bytes], None]) -> list[dict]:
        """Node 0: every other node's rank endings, their files handed to ``write``."""
        endings: list[dict] = []
        waiting = set(range(1, self.nodes.nnodes))
        while waiting:
            for node in sorted(waiting):
                if self._has(f"failed/node{node}"):
                    said = json.loads(self._get(f"failed/node{node}"))
                    raise NodeError(
                        f"{self.nodes.describe(node)} failed: {said['message']}", said["hint"]
                    )
                if not self._has(f"endings/node{node}"):
                    continue
                sent = json.loads(self._get(f"endings/node{node}"))
                for name in sent["files"]:
                    write(name, self._get(f"files/node{node}/{name}"))
                endings += sent["endings"]
                waiting.discard(node)
            self.lost = self.silent_node() if waiting else None
            if self.lost is not None:
                raise self.lost_error(self.lost, "while node 0 waited for its ranks' findings")
            time.sleep(_POLL if waiting else 0)
        return endings

    def post_verdict(
        self, exit_code: int, verdict: str, error: SdcReplayError | None = None
    ) -> None:
        """Node 0: the exit code every node ends with (and the error, if the replay failed);
        it waits a little for the others to read it, since it hosts the store."""
        body: dict[str, Any] = {"exit_code": exit_code, "verdict": verdict, "error": None}
        if error is not None:
            body["error"] = {"message": error.message, "hint": error.hint}
        self._set("verdict", json.dumps(body))
        readers = self.nodes.nnodes - 1 - (self.lost is not None)
        deadline = time.monotonic() + ACK_SECONDS
        while self._add("read", 0) < readers and time.monotonic() < deadline:
            time.sleep(_POLL)

    def await_verdict(self) -> dict:
        """The others: node 0's verdict, once it has one (node 0 lost: a `NodeError`)."""
        while not self._has("verdict"):
            if self.silent_node() == 0:
                raise self.lost_error(0, "while the others waited for its verdict")
            time.sleep(_POLL)
        verdict = json.loads(self._get("verdict"))
        self._add("read", 1)
        return verdict
