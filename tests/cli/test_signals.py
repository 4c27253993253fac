"""Clean ends: SIGINT or SIGTERM at a random moment of every command.

Each command runs as the real ``sdcreplay`` console script in a session of its own, with a
marker in its environment that every process it starts inherits (forkserver, resource
tracker, device processes, ranks and their supervisors). A seeded random moment later it
gets SIGINT (to its process group, as a terminal's ^C) or SIGTERM (to its pid, as a
scheduler's); then it must exit 130 / 143 without a traceback, no process carrying the
marker may be alive 10 s later, and every ``.partial`` it left must be named on stderr.

A moment counts from when the process first catches SIGTERM (`handling`), or, for a phase of
a command (`PHASES`: minimize's shrink), from when the line that closes the phase before it
reaches stderr; an interrupted shrink must leave its partial ticket, marked and named.
``SDCREPLAY_SIGNAL_MOMENTS`` moments per command (default 1; the issue's full run is 20),
drawn from ``SDCREPLAY_SIGNAL_SEED`` (default 29).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest

from tests.conftest import SMALL_ARGS, TICKET_CALL, TICKET_FAULTS, process_ended, process_stat

MOMENTS = int(os.environ.get("SDCREPLAY_SIGNAL_MOMENTS", "1"))
SEED = int(os.environ.get("SDCREPLAY_SIGNAL_SEED", "29"))
MARKER = "SDCREPLAY_SIGNAL_TEST"
AT_EXIT = 1.0  # seconds: from a signal to the exit of a command it reached as it exited
GONE_WITHIN = 10.0  # under load a process ends slowly: it frees its memory before its files
FAULT = f"{TICKET_CALL},{TICKET_FAULTS[0]},device=cpu:1"
RANK_FAULT = "kind=bitflip,op=aten.mm,phase=backward,step=1,nth=0,index=3,bit=20,rank=1"

# command -> (its arguments, given the inputs; seconds within which the moment is drawn)
COMMANDS = {
    "record": (lambda i: ["record", "builtin:tiny-llama", "--steps", "3", *SMALL_ARGS], 12),
    "record --nproc": (
        lambda i: ["record", "builtin:tiny-llama", "--nproc", "2", "--steps", "2", *SMALL_ARGS],
        20,
    ),
    "replay": (lambda i: ["replay", i["bundle"], "-d", "cpu:0", "-d", "cpu:1"], 15),
    "replay of a job": (lambda i: ["replay", i["job"]], 20),
    "bisect": (
        lambda i: ["bisect", i["bundle"], "--suspect", "cpu:1", "--step", "1", "--inject", FAULT],
        20,
    ),
    "bisect --rank": (
        lambda i: [
            "bisect",
            i["job"],
            "--rank",
            "1",
            "--suspect",
            "cpu:1",
            "--reference",
            "cpu:0",
            "--step",
            "1",
            "--inject",
            f"{RANK_FAULT},device=cpu:1",
        ],  # fmt: skip
        25,
    ),
    "minimize": (
        lambda i: (
            ["minimize", i["report"], "--trials", "50", "--good-trials", "2", "--inject"] + [FAULT]
        ),
        20,
    ),
    "screen": (
        lambda i: ["screen", i["corpus"], "-d", "cpu:0", "-d", "cpu:1", "--budget", "30"],
        15,
    ),
    # 40000 reference runs per candidate: a shrink of ~50 candidates lasts 20 s or more, so
    # every moment (PHASES: from the shrink's start) lands in it.
    "minimize's shrink": (
        lambda i: (
            ["minimize", i["report"], "--trials", "50", "--good-trials", "40000"]
            + ["--inject", FAULT]
        ),
        3,
    ),
    "doctor": (lambda i: ["doctor", "--device", "cpu"], 12),
    "demo": (lambda i: ["demo", "--out", "demo-out"], 25),
}

# command -> the start of the stderr line that ends the phase before the one it interrupts
PHASES = {"minimize's shrink": "reference: "}


def marked_processes(marker: str) -> list[int]:
    """Every live process whose environment carries ``marker`` (zombies are gone already)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if f"{MARKER}={marker}".encode() in environ.split(b"\0") and not process_ended(
            int(entry.name)
        ):
            found.append(int(entry.name))
    return found


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, _small_bundle_template, tickets, ddp_job) -> dict[str, Path]:
    """What the commands read (never written by them: each run copies nothing, writes its
    outputs into its own directory)."""
    root = tmp_path_factory.mktemp("signal-inputs")
    corpus = root / "corpus"
    added = subprocess.run(
        [_exe(), "corpus", "add", str(corpus), *map(str, tickets)], capture_output=True, text=True
    )
    assert added.returncode == 0, added.stderr
    return {
        "bundle": _small_bundle_template,
        "job": ddp_job[0],
        "report": tickets[0].parent / "run.bundle.bisect",
        "corpus": corpus,
    }


def _exe() -> str:
    from tests.conftest import _console_script

    return _console_script()


def _moments(command: str) -> list[tuple[float, signal.Signals]]:
    horizon = COMMANDS[command][1]
    rng = random.Random(f"{SEED}:{command}")
    return [
        (rng.uniform(0.0, horizon), rng.choice([signal.SIGINT, signal.SIGTERM]))
        for _ in range(MOMENTS)
    ]


def handling(pid: int) -> None:
    """Wait until process ``pid`` catches SIGTERM: its first line of sdcreplay has run. Before
    that the interpreter starts (``site``, ~0.1-0.3 s) and no Python code can answer a signal:
    a SIGINT there is Python's own KeyboardInterrupt, a SIGTERM ends it before it started
    anything."""
    caught = 1 << (signal.SIGTERM - 1)
    for _ in range(600):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            return  # it has ended
        if int(status.split("SigCgt:")[1].split()[0], 16) & caught:
            return
        time.sleep(0.01)


def interrupt(
    args: list[str], at: float, signum: signal.Signals, cwd: Path, after: str | None = None
) -> dict:
    """Run the command, send ``signum`` ``at`` seconds after its start (or after a stderr line
    that starts with ``after``: the phase it ends), and judge its end."""
    marker = uuid.uuid4().hex
    env = {**os.environ, MARKER: marker, "SDCREPLAY_LEDGER": "off"}
    env.pop("SDCREPLAY_DEBUG", None)
    process = subprocess.Popen(
        [_exe(), *map(str, args)],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    begun = threading.Event()

    def read_stderr() -> None:
        assert process.stderr is not None
        for line in process.stderr:
            lines.append(line)
            if after is not None and line.startswith(after):
                begun.set()
        begun.set()  # it ended: nothing more to wait for

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    out: list[str] = []  # read aside: its end waits for every holder of the pipe, not the exit
    pipe = process.stdout
    assert pipe is not None
    stdout_reader = threading.Thread(target=lambda: out.append(pipe.read()), daemon=True)
    stdout_reader.start()
    handling(process.pid)
    if after is not None:
        begun.wait(timeout=120)
    time.sleep(at)
    sent = process.poll() is None
    sent_at = time.monotonic()
    if sent:
        if signum == signal.SIGINT:
            os.killpg(process.pid, signum)  # a terminal's ^C reaches the whole group
        else:
            os.kill(process.pid, signum)  # a scheduler's SIGTERM, to the command
    process.wait(timeout=120)
    exited_after = time.monotonic() - sent_at
    stdout_reader.join(timeout=30)
    stdout = "".join(out)
    reader.join(timeout=10)
    stderr = "".join(lines)
    ended = time.monotonic()
    alive = marked_processes(marker)
    while alive and time.monotonic() - ended < GONE_WITHIN:
        time.sleep(0.1)
        alive = marked_processes(marker)
    survivors = [_described(pid) for pid in alive]
    for pid in alive:  # not to leave them to the next test
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return {
        "sent": sent,
        "exited_after": round(exited_after, 2),
        "code": process.returncode,
        "stdout": stdout,
        "stderr": stderr,
        "alive": survivors,
        "gone_after": round(time.monotonic() - ended, 2),
    }


def _at_its_exit(ended: dict, signum: signal.Signals) -> bool:
    """The signal landed as the command exited, its work done and answered: -signum, Python
    shutting down with its handlers reset (a shell reports that as 128 + signum too, and nothing
    is lost); or its own exit status (0, 1) within a moment of the signal, which reached it past
    its last line of Python, where no handler runs any more. A command that ignored a signal
    mid-work would run on for seconds, and fail here."""
    if ended["code"] == -signum:
        return True
    return (
        ended["code"] in (0, 1)
        and ended["exited_after"] < AT_EXIT
        and ("Interrupted" not in ended["stderr"])
    )


def _described(pid: int) -> str:
    """A survivor as a person debugging it wants it: pid, parent, state and command line."""
    stat = process_stat(pid)
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        stat = None
    if stat is None:
        return f"{pid} (gone)"
    return f"{pid} (parent {stat[1]}, state {stat[0]}): {command[:200]}"


def named_leftovers(stderr: str) -> list[Path]:
    return [
        Path(line.split("Left behind: ", 1)[1].split(": ", 1)[0])
        for line in stderr.splitlines()
        if line.startswith("Left behind: ")
    ]


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_signal_at_any_moment_ends_the_command_cleanly(command, inputs, tmp_path):
    for number, (at, signum) in enumerate(_moments(command)):
        cwd = tmp_path / f"moment{number}"
        cwd.mkdir()
        args = COMMANDS[command][0](inputs)
        if command.startswith(("record", "bisect", "minimize")):
            args += ["--out", cwd / "out"]
        if command.startswith(("replay", "bisect", "minimize", "screen")):
            args += ["--no-ledger"]
        if command.startswith(("replay", "screen")):
            args += ["--logs", cwd / "logs"]
        ended = interrupt(args, at, signum, cwd, PHASES.get(command))
        said = f"{command} at {at:.2f} s ({signum.name}): {ended['code']}\n"
        said += ended["stderr"][-3000:]
        assert "Traceback" not in ended["stderr"], said
        assert not ended["alive"], said
        if ended["sent"] and not _at_its_exit(ended, signum):
            assert ended["code"] == 128 + signum, said
            assert f"Interrupted ({signum.name})" in ended["stderr"], said
        partial = [path for path in cwd.rglob("*.partial")]
        named = [cwd / path for path in named_leftovers(ended["stderr"])]  # as the command saw
        assert all(path.exists() for path in named), said
        for path in partial:
            assert any(path == left or left in path.parents for left in named), f"{path}\n{said}"
        if command in PHASES:
            assert ended["sent"] and "random data: " not in ended["stderr"], said  # in the shrink
            assert named == [cwd / "out"], said
            ticket = json.loads((cwd / "out" / "ticket.json").read_text())
            assert (ticket["partial"], ticket["interrupted"]) == (True, signum.name), said
            assert ticket["status"] == "reproduced" and ticket["shapes"]["shrink"]["status"] == (
                "interrupted"
            )
            assert (
                "> **Partial:** the shrink was interrupted"
                in (cwd / "out" / "ticket.md").read_text()
            )
        print(f"{said.splitlines()[0]} (moment {number + 1} of {MOMENTS}): passed", flush=True)


def test_an_interruption_with_json_is_an_error_object(inputs, tmp_path):
    """A script asking for --json reads why there is no result, and what was left."""
    ended = interrupt(
        ["replay", inputs["bundle"], "-d", "cpu:0", "--no-ledger", "--json"]
        + ["--repeats", "500", "--logs", tmp_path / "L"],  # still running at 8 s
        8.0,
        signal.SIGTERM,
        tmp_path,
    )
    assert ended["sent"] and ended["code"] == 143, ended["stderr"]
    error = json.loads(ended["stdout"])
    assert error["schema"] == "sdcreplay.error/1" and error["exit_code"] == 143
    assert error["kind"] == "interrupted" and error["message"] == "interrupted by SIGTERM"
