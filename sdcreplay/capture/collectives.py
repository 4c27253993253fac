"""The message-order log of a rank: every collective and point-to-point call, in issue order.

Under ``torch.distributed`` one rank's step is only evidence together with what it sent and
received: the gradient all-reduce spreads one rank's wrong value to every rank. ``MessageLog``
sees every call of the dispatcher's ``c10d`` operators (DDP's gradient buckets issued by the
C++ reducer, FSDP2's all-gathers and reduce-scatters, ``dist.all_reduce``, ``send``/``recv``)
and logs it with the flight recorder's field names, the digest of the rank's input before the
call and of its output once the call completed.

PyTorch's functional collectives (``_c10d_functional::*``: DTensor's redistribution under
tensor parallelism, compiled code) call the ProcessGroup from C++ (all_gather_into_tensor
through ``c10d::_allgather_base_``, passed through: one message per functional call), so
they get kernels of their own at the ``ADInplaceOrView`` key, the first key below
autograd (``torch.distributed._functional_collectives`` registers their autograd at the
``Autograd`` key when imported, and a kernel there would replace it). They return at once, the
output valid once ``_c10d_functional::wait_tensor`` waited for it: that kernel digests the
output when the last output tensor of a logged call is waited for (found by its storage, as
PyTorch's work registry finds it); ``end_step`` waits for and digests what nobody waited for.
Calls on fake tensors (torch.compile tracing) move nothing and are not logged; neither are
``batch_p2p_ops``, ``isend`` and ``irecv``.

Why not a ``TorchDispatchMode``: a mode sees every aten call of the step, and a pass-through
mode alone doubled tiny-llama's step time (measured 2.1x); a Python kernel registered at the
``Autograd`` key of the ``c10d`` operators runs for those calls only. It is installed once per
process and passes calls through untouched while no log is open.

With ``expected`` (the record's messages of the step) a replay checks each call BEFORE it is
issued: another collective, process group, peer, size or dtype, or a call too many, raises
``MessageOrderError`` naming the record_id, and a call missing at the end of the step does too.
Sequence numbers restart at every step, so a step replays alone.

This module imports torch only where calls are logged.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from ..errors import MessageOrderError
from ..heartbeat import HEARTBEAT
from .message import Message

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class _Layout:
    """Where a c10d operator's input and output tensors are among its arguments."""

    name: str  # the flight recorder's collective name
    inputs: int | None
    outputs: int | None
    peer: int | None = None
    p2p: bool = False

    @property
    def group(self) -> int:
        """The process group's argument: after the tensors (a list, or outputs then inputs)."""
        separate = None not in (self.inputs, self.outputs) and self.inputs != self.outputs
        return 2 if separate else 1

    def inputs_of(self, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        return [] if self.inputs is None else _tensors(args[self.inputs])

    def outputs_of(self, args: tuple, kwargs: dict) -> list[tuple[list[int], str]]:
        outputs = [] if self.outputs is None else _tensors(args[self.outputs])
        return [(list(t.shape), _dtype_name(t)) for t in outputs]

    def finish(self, log: MessageLog, result: Any, position: int, args: tuple) -> Any:
        if self.outputs is None:
            return result
        return log._digest_on_completion(result, position, _tensors(args[self.outputs]))


LAYOUTS: dict[str, _Layout] = {
    "allreduce_": _Layout("all_reduce", 0, 0),
    "allreduce_coalesced_": _Layout("allreduce_coalesced", 0, 0),
    "broadcast_": _Layout("broadcast", 0, 0),
    "reduce_": _Layout("reduce", 0, 0),
    "allgather_": _Layout("all_gather", 1, 0),
    "_allgather_base_": _Layout("_allgather_base", 1, 0),
    "allgather_coalesced_": _Layout("allgather_coalesced", 1, 0),
    "allgather_into_tensor_coalesced_": _Layout("allgather_into_tensor_coalesced", 1, 0),
    "reduce_scatter_": _Layout("reduce_scatter", 1, 0),
    "_reduce_scatter_base_": _Layout("_reduce_scatter_base", 1, 0),
    "reduce_scatter_tensor_coalesced_": _Layout("reduce_scatter_tensor_coalesced", 1, 0),
    "gather_": _Layout("gather", 1, 0),
    "scatter_": _Layout("scatter", 1, 0),
    "alltoall_": _Layout("all_to_all", 1, 0),
    "alltoall_base_": _Layout("all_to_all_base", 1, 0),
    "barrier": _Layout("barrier", None, None),
    "monitored_barrier_": _Layout("monitored_barrier", None, None),
    "send": _Layout("send", 0, None, peer=2, p2p=True),
    "recv_": _Layout("recv", None, 0, peer=2, p2p=True),
    "recv_any_source_": _Layout("recv_any_source", None, 0, p2p=True),
}
"""Every c10d operator that moves data between ranks (torch 2.13 lists these and
``check_for_nan``, which does not)."""


@dataclass(frozen=True)
class _Functional:
    """A functional collective: its group_name's argument, the shape of what it returns."""

    name: str  # as the c10d operator of the same collective is logged
    group: int
    rows: str = "same"  # the output's first dimension: same, gather, scatter, splits, out
    size_arg: int = 1  # gather, scatter: group_size's argument; splits: output_split_sizes'

    p2p = False
    peer = None

    def inputs_of(self, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        return _tensors(args[0])

    def outputs_of(self, args: tuple, kwargs: dict) -> list[tuple[list[int], str]]:
        """Known before the call, so that a replay refuses another collective before issuing."""
        if self.rows == "out":
            return [(list(kwargs["out"].shape), _dtype_name(kwargs["out"]))]
        outputs = []
        for tensor in _tensors(args[0]):
            shape = list(tensor.shape)
            size = args[self.size_arg]
            if self.rows == "gather":
                shape[0] *= size
            elif self.rows == "scatter":
                shape[0] //= size
            elif self.rows == "splits" and size:
                shape[0] = sum(int(rows) for rows in size)
            outputs.append((shape, _dtype_name(tensor)))
        return outputs

    def finish(self, log: MessageLog, result: Any, position: int, args: tuple) -> Any:
        log._digest_when_waited(_tensors(result), position)
        return result


FUNCTIONAL: dict[str, _Functional] = {
    "all_reduce": _Functional("all_reduce", 2),
    "all_reduce_": _Functional("all_reduce", 2),
    "all_reduce_coalesced": _Functional("allreduce_coalesced", 2),
    "all_reduce_coalesced_": _Functional("allreduce_coalesced", 2),
    "all_gather_into_tensor": _Functional("_allgather_base", 2, "gather"),
    "all_gather_into_tensor_out": _Functional("_allgather_base", 2, "out"),
    "all_gather_into_tensor_coalesced": _Functional("allgather_into_tensor_coalesced", 2, "gather"),
    "reduce_scatter_tensor": _Functional("_reduce_scatter_base", 3, "scatter", 2),
    "reduce_scatter_tensor_out": _Functional("_reduce_scatter_base", 3, "out"),
    "reduce_scatter_tensor_coalesced": _Functional(
        "reduce_scatter_tensor_coalesced", 3, "scatter", 2
    ),
    "all_to_all_single": _Functional("all_to_all_base", 3, "splits"),
    "broadcast": _Functional("broadcast", 2),
    "broadcast_": _Functional("broadcast", 2),
}
"""The functional collectives of torch 2.13 (with ``wait_tensor``, ``isend``, ``irecv``,
``batch_p2p_ops`` and ``_wrap_tensor_autograd``), profiling names as their c10d operators'."""

_installed: list[Any] = []  # the torch.library.Library holding the kernels, once installed
_BELOW_VIEW: list[Any] = []  # the dispatch keys after ADInplaceOrView, once installed
# Some functional collectives (all_gather_into_tensor) issue a c10d operator: their message
# is the functional call's, and the c10d kernel passes it through on this thread.
_issuing = threading.local()
_active: MessageLog | None = None


def _tensors(value: Any) -> list[torch.Tensor]:
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


def _digest(tensors: list[torch.Tensor]) -> str | None:
    """One tensor's digest, or a SHA-256 over several tensors' digests.

    The log's own work, never the step's operators: it runs inside an operator capture (a
    call's input, a functional output when ``wait_tensor`` waits for it, the output of a call
    that had completed when its digest was attached, which then runs at once on the step's
    thread), so it is marked as the capture's own wherever it runs."""
    from .digest import tensor_digest
    from .operators import _own_work

    if not tensors:
        return None
    with _own_work():
        digests = [tensor_digest(t) for t in tensors]
    if len(digests) == 1:
        return digests[0]
    return "sha256:" + hashlib.sha256("\n".join(digests).encode()).hexdigest()[:32]


@dataclass
class _Unwaited:
    """A logged functional call whose outputs are not all waited for yet."""

    position: int  # in the step's messages
    outputs: list[torch.Tensor]  # until digested (then [], so that their memory can go)
    storages: set[int]  # of the outputs not waited for


def _dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _work_of(result: Any) -> Any:
    """The call's Work (the result, or the last item of a result tuple), unboxed; or None."""
    import torch

    work = result[-1] if isinstance(result, tuple) and result else result
    if not isinstance(work, torch.ScriptObject):
        return None
    return torch._C._distributed_c10d.Work.unbox(work)


def _with_work(result: Any, future: Any) -> Any:
    """``result`` with its Work replaced by one that completes with ``future``."""
    import torch

    create = torch._C._distributed_c10d._create_work_from_future  # type: ignore[attr-defined]
    work = create(future).boxed()
    return (*result[:-1], work) if isinstance(result, tuple) else work


def _done(value: Any) -> Any:
    import torch

    future: torch.futures.Future = torch.futures.Future()
    future.set_result(value)
    return future


def _group(group: Any, known: dict[str, tuple[int, str, str]]) -> tuple[int, str, str]:
    """(pg_id, name, backend) of a boxed process group or a group's name (a functional
    collective's ``group_name``); ``known``: those looked up before."""
    import torch.distributed as dist

    by_name = isinstance(group, str)
    if not by_name and not isinstance(group, dist.ProcessGroup):
        group = dist.ProcessGroup.unbox(group)
    name: str = group if by_name else group.group_name
    found = known.get(name)
    if found is None:
        if by_name:
            group = dist.distributed_c10d._resolve_process_group(group)
        pg_id, canonical = _canonical_groups().get(name, (-1, name))
        found = known[name] = (pg_id, canonical, dist.get_backend(group))
    return found


def _canonical_groups() -> dict[str, tuple[int, str]]:
    """Each process group's name -> (pg_id, name) of the first group created over the same
    ranks: the position in creation order of the groups with distinct members.

    A group is its members: a workload rebuilt in the same process (the Recorder's first-step
    verification, a script replaying its own part) makes a new ``DeviceMesh`` whose groups
    are new objects with new names, yet they are the same groups of ranks as the recorded
    ones, and are logged under the same id and name."""
    import torch.distributed as dist

    first: dict[tuple[int, ...], tuple[int, str]] = {}
    canonical = {}
    for group, name in dist.distributed_c10d._world.pg_names.items():
        members = tuple(dist.get_process_group_ranks(group))
        canonical[str(name)] = first.setdefault(members, (len(first), str(name)))
    return canonical


def _below_autograd(op: Any, args: tuple, kwargs: dict) -> Any:
    import torch

    with torch._C._AutoDispatchBelowAutograd():
        return op(*args, **kwargs)


def _kernel(layout: _Layout, op: Any, *args: Any, **kwargs: Any) -> Any:
    log = _active
    if log is None or getattr(_issuing, "functional", False):
        return _below_autograd(op, args, kwargs)
    return log.call(layout, lambda: _below_autograd(op, args, kwargs), args, kwargs)


def _functional_kernel(layout: _Functional, op: Any, keys: Any, *args: Any, **kwargs: Any) -> Any:
    """At ``ADInplaceOrView``: the call goes on to the next key (the collective's kernel)."""
    below = keys & _BELOW_VIEW[0]
    log = _active
    if log is None or _traced(args):
        return op.redispatch(below, *args, **kwargs)

    def issue() -> Any:
        _issuing.functional = True
        try:
            return op.redispatch(below, *args, **kwargs)
        finally:
            _issuing.functional = False

    return log.call(layout, issue, args, kwargs)


def _traced(args: tuple) -> bool:
    """A call on tensors without data (torch.compile tracing the step): nothing moves."""
    from torch._subclasses.fake_tensor import is_fake

    return any(tensor.is_meta or is_fake(tensor) for tensor in _tensors(args[0]))


def _wait_kernel(op: Any, keys: Any, tensor: torch.Tensor) -> torch.Tensor:
    result = op.redispatch(keys & _BELOW_VIEW[0], tensor)
    log = _active
    if log is not None:
        log._waited(tensor)
    return result


def install() -> None:
    """Register the logging kernels for every c10d operator and functional collective (once
    per process)."""
    if _installed:
        return
    import functools

    import torch
    import torch.distributed  # noqa: F401 (registers the c10d operators)

    library = torch.library.Library("c10d", "IMPL")
    for name, layout in LAYOUTS.items():
        packet = getattr(torch.ops.c10d, name, None)
        if packet is not None:
            library.impl(name, functools.partial(_kernel, layout, packet.default), "Autograd")
    _BELOW_VIEW.append(torch._C._after_ADInplaceOrView_keyset)
    functional = torch.library.Library("_c10d_functional", "IMPL")
    ops = torch.ops._c10d_functional
    for name, described in FUNCTIONAL.items():
        if hasattr(ops, name):
            kernel = functools.partial(_functional_kernel, described, getattr(ops, name).default)
            functional.impl(name, kernel, "ADInplaceOrView", with_keyset=True)
    kernel = functools.partial(_wait_kernel, ops.wait_tensor.default)
    functional.impl("wait_tensor", kernel, "ADInplaceOrView", with_keyset=True)
    _installed.extend([library, functional])


def log_open() -> bool:
    """Is a message log open in this process (a recording's or a replay's step)?"""
    return _active is not None


def issued_in_step() -> int | None:
    """How many messages the open log holds in its step so far: where an operator call lies
    among the step's collectives (None: no log is open)."""
    log = _active
    return None if log is None else len(log.messages)


@contextlib.contextmanager
def unlogged() -> Iterator[None]:
    """Collectives issued inside a logged step that are not the step's (a detector's ranks
    agreeing at its optimizer step): a replay of the step would not issue them. Only between
    the step's own collectives (none in flight on another thread)."""
    global _active
    log, _active = _active, None
    try:
        yield
    finally:
        _active = log


class MessageLog:
    """A rank's messages, step by step: ``begin_step(i)``, the step, ``end_step()``.

    One log is open at a time in a process (the c10d kernels are process-wide; DDP issues its
    buckets from autograd's threads). ``expected``: the record's messages of the step to
    enforce (replay); the log records the replay's own messages either way.
    """

    def __init__(self, digest_algorithm: str, expected: Sequence[Message] | None = None):
        self.digest_algorithm = digest_algorithm  # the bundle's; tensor_digest picks it by device
        self.expected = None if expected is None else list(expected)
        self.messages: list[Message] = []
        self.violation: MessageOrderError | None = None
        self.step: int | None = None
        self._counters: Counter[tuple[int, str]] = Counter()
        self._groups: dict[str, tuple[int, str, str]] = {}  # by name, looked up in this step
        self._pending: list[Any] = []  # futures that complete once an output is digested
        self._unwaited: list[_Unwaited] = []  # functional calls of the step
        self._by_storage: dict[int, _Unwaited] = {}  # their outputs not waited for
        self._lock = threading.Lock()

    def begin_step(self, step: int, expected: Sequence[Message] | None = None) -> None:
        """Open ``step`` (``expected``: this step's recorded messages, replacing the log's)."""
        global _active
        install()
        if _active is not None and _active is not self:
            raise MessageOrderError(
                "another message log is open in this process",
                "End the other recording's or replay's step first (one at a time per process).",
            )
        if expected is not None:
            self.expected = list(expected)
        self.step, self.messages, self.violation = step, [], None
        self._counters.clear()
        self._groups.clear()
        self._pending = []
        self._unwaited, self._by_storage = [], {}
        _active = self

    def end_step(self) -> list[Message]:
        """Close the step: its messages, every output digested (a call nobody waited for is
        waited for here, a functional one by ``wait_tensor``); a recorded call the replay did
        not issue is raised."""
        self.abandon()
        for future in self._pending:
            future.wait()
        self._wait_functional()
        if self.violation is not None:
            raise self.violation
        expected = self.expected
        if expected is not None and len(self.messages) < len(expected):
            missing = expected[len(self.messages)]
            raise self._violation(
                missing.record_id,
                f"the record has {missing.brief()}, the replay's step ended without it",
            )
        return self.messages

    def abandon(self) -> None:
        """Stop logging (a step that raised); what was logged stays in ``messages``."""
        global _active
        if _active is self:
            _active = None

    def call(
        self, layout: _Layout | _Functional, issue: Callable[[], Any], args: tuple, kwargs: dict
    ) -> Any:
        """Log one call: its input digest, the check against the record, the call (``issue``);
        its output is digested when the call completes (``_digest_on_completion``) or, for a
        functional collective, when it is waited for (``_digest_when_waited``)."""
        with self._lock:
            message = self._message(layout, args, kwargs)
            self._check(message)
            # Progress a stuck job's watchdog sees: ranks waiting here issued more collectives
            # than a rank stuck before its call (launch.py kills the one that issued fewest).
            HEARTBEAT.issuing(f"step {message.step}, {message.profiling_name} {message.record_id}")
            result = issue()
            position = len(self.messages)
            self.messages.append(message)
        return layout.finish(self, result, position, args)

    def _digest_when_waited(self, outputs: list[torch.Tensor], position: int) -> None:
        """The functional call's output is read once ``wait_tensor`` waited for each tensor."""
        from .memory import storage_key

        storages = {key for key in map(storage_key, outputs) if key is not None}
        call = _Unwaited(position, outputs, storages)
        with self._lock:
            self._unwaited.append(call)
            self._by_storage.update((storage, call) for storage in call.storages)

    def _waited(self, tensor: torch.Tensor) -> None:
        """``wait_tensor`` waited for ``tensor``: digest the call it is the last output of."""
        if not self._by_storage:
            return
        from .memory import storage_key

        storage = storage_key(tensor)
        if storage is None:
            return
        with self._lock:
            call = self._by_storage.pop(storage, None)
            if call is None:
                return
            call.storages.discard(storage)
            if call.storages:
                return
            outputs, call.outputs = call.outputs, []
        self._set_output(call.position, _digest(outputs))

    def _wait_functional(self) -> None:
        """Wait for and digest the functional calls of the step nobody waited for."""
        import torch

        from .operators import _own_work

        for call in self._unwaited:
            if call.outputs:
                with torch.no_grad(), _own_work():  # the log's wait, not the step's
                    for tensor in call.outputs:
                        torch.ops._c10d_functional.wait_tensor(tensor)
                self._set_output(call.position, _digest(call.outputs))
        self._unwaited, self._by_storage = [], {}

    def _digest_on_completion(self, result: Any, position: int, outputs: list) -> Any:
        """Hand back a Work that completes once the output is digested, so whoever waits for
        the call (DDP's reducer through its future, ``dist.all_reduce`` through ``wait``)
        reads it only after; the step does not wait for it (DDP overlaps its buckets with the
        backward). A Work without a future (gloo's recv) is waited for here instead.

        The digest runs on the thread that completes the call (gloo's), or at once on this one
        when the call has already completed (a small broadcast, such as DDP's when it rebuilds
        its buckets, often has): which one depends on the machine's load, so ``_digest`` is
        never seen by an operator capture on either."""
        work = _work_of(result)
        try:
            future = work.get_future() if work is not None else _done(outputs)
        except RuntimeError:  # no future for this Work (gloo's send/recv)
            future = None
        if future is None:
            # Waited outside the handler: the call's own error (gloo refusing PREMUL_SUM inside
            # FSDP) is then the one a person sees, not chained to the missing future. A second
            # wait on gloo's recv would block: a done Work goes back.
            work.wait()
            future = _done(outputs)

        def digest(done: Any) -> Any:
            value = done.value()  # the call's error, if it failed, reaches the waiter
            self._set_output(position, _digest(outputs))
            return value

        chained = future.then(digest)
        self._pending.append(chained)
        return _with_work(result, chained)

    def _set_output(self, position: int, output_digest: str | None) -> None:
        with self._lock:
            self.messages[position] = replace(self.messages[position], output_digest=output_digest)

    def _message(self, layout: _Layout | _Functional, args: tuple, kwargs: dict) -> Message:
        pg_id, name, backend = _group(args[layout.group], self._groups)
        inputs = layout.inputs_of(args, kwargs)
        outputs = layout.outputs_of(args, kwargs)
        kind = "p2p" if layout.p2p else "collective"
        sequence = self._counters[(pg_id, kind)]
        self._counters[(pg_id, kind)] += 1
        op_id = self._counters[(pg_id, "op")]
        self._counters[(pg_id, "op")] += 1
        return Message(
            step=self.step if self.step is not None else -1,
            record_id=len(self.messages),
            pg_id=pg_id,
            process_group=name,
            collective_seq_id=None if layout.p2p else sequence,
            p2p_seq_id=sequence if layout.p2p else None,
            op_id=op_id,
            profiling_name=f"{backend}:{layout.name}",
            input_sizes=[list(t.shape) for t in inputs],
            input_dtypes=[_dtype_name(t) for t in inputs],
            output_sizes=[shape for shape, _ in outputs],
            output_dtypes=[dtype for _, dtype in outputs],
            input_digest=_digest(inputs),
            output_digest=None,
            peer=None if layout.peer is None else int(args[layout.peer]),
        )

    def _check(self, message: Message) -> None:
        """Refuse, before it is issued, a call the record does not have at this place."""
        if self.expected is None:
            return
        position = message.record_id
        if position >= len(self.expected):
            raise self._violation(
                position,
                f"the record's step has {len(self.expected)} messages, the replay issues "
                f"{message.brief()} as one more",
            )
        wanted = self.expected[position]
        if wanted.structure() != message.structure():
            raise self._violation(
                position, f"the record has {wanted.brief()}, the replay issues {message.brief()}"
            )

    def _violation(self, record_id: int, what: str) -> MessageOrderError:
        self.violation = MessageOrderError(
            f"step {self.step}, message record_id {record_id}: {what} (another collective order: "
            "a different program, not a device's arithmetic)"
        )
        return self.violation


def log_python_group_call(operator: str, args: tuple, issue: Callable[[], Any]) -> Any:
    """A collective of a process group written in Python (replay/alone.py): torch calls its
    methods directly, not through the c10d operators this module hooks, so it logs itself as
    the operator ``operator`` (``allreduce_``, ...) would be with that operator's arguments
    ``args``. The Work to wait on once its output is digested, or None when no log is open."""
    log = _active
    if log is None:
        issue()
        return None
    return _work_of(log.call(LAYOUTS[operator], issue, args, {}))
