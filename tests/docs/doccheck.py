"""The docs' command blocks, run for real: parse the marked blocks, run each session's commands
in one fresh bash, normalize what legitimately varies, and compare or rewrite the blocks.

A block is generated when an HTML comment right before its fence names a session::

    <!-- sdcreplay-doc: walkthrough -->
    ```
    $ sdcreplay record builtin:tiny-llama --steps 4 --out traces/run.bundle
    Recorded 4 steps ...
    ```

Every ``$ `` line (with its ``\\``-continued lines) is a command; what follows it up to the next
``$ `` line is its output, as the run printed it (stdout and stderr together). The commands of
one session run in document order (README.md first, then docs/*.md by name) in one bash with
``set -euo pipefail``, in an empty temporary directory, so a variable set in one block is there
in the next and a command that works only with a hidden set-up fails here as it would for a
reader. A command that exits other than 0 fails the check unless the block shows it: ``$ echo
$?`` right after it, or ``exit=N`` in the marker. A command already run in its session (the
same text) is not run again: its first output stands for both places.

Marker options (after the session name): ``keep=REGEX`` shows only the output lines that match
(``...`` where lines were left out); ``head=N`` the first N lines then ``...``; ``exit=N``;
``file=NAME`` writes the block (code, shown as written) to NAME for later commands. A ``python``
block with a session marker and no ``file=`` is run as a script at that point of the session.
Every python block, marked or not, has its imports and ``sdcreplay.`` names resolved, and its
``>>>`` lines run as a doctest.

Regenerate with ``make docs`` (``python tests/docs/regenerate.py [SESSION...]``); the runs are
kept in ``.pytest_cache/sdcreplay-docs`` by the digest of the package's sources, the commands and
the shell's settings, so the suite and ``make docs`` run each session once per change.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from normalize import normalized

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
MARKER = re.compile(r"^<!-- sdcreplay-doc: (?P<spec>.*?) -->\s*$")
FENCE = re.compile(r"^```(?P<lang>\S*)\s*$")
ELLIPSIS = "..."
HOST_SHOWN = "h17"  # the documented host name (the docs' examples say h17)
REGENERATE = "make docs"

# Hidden set-up a session needs before its first documented command: only what a reader of the
# page has already (the repository's helper files), never a step the page leaves out. A command
# that the page shows too (the same text) runs once, here, and the page shows its output.
SETUP: dict[str, list[str]] = {
    "bundle": ['mkdir traces && cp -r "$SDCREPLAY_DOC_REPO/traces/tiny.bundle" traces/'],
    "tiny": [
        'mkdir -p tests && cp "$SDCREPLAY_DOC_REPO/tests/misbehaving.py" tests/',
        "sdcreplay record builtin:tiny-llama --steps 3 --out tiny.bundle",
    ],
}


def shown_path(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


@dataclasses.dataclass
class Command:
    text: str  # as shown, the "$ " and continuation lines joined with newlines

    @property
    def shell(self) -> str:
        return "\n".join(line[2:] if line.startswith("$ ") else line for line in self.lines)

    @property
    def lines(self) -> list[str]:
        return self.text.split("\n")


@dataclasses.dataclass
class Block:
    path: Path
    start: int  # index of the opening fence line
    end: int  # index of the closing fence line
    session: str
    options: dict[str, str]
    lang: str
    body: list[str]

    @property
    def where(self) -> str:
        return f"{shown_path(self.path)}:{self.start + 1}"

    @property
    def is_source(self) -> bool:
        """A block of code (not of commands): it is shown as written, and written or run."""
        return self.lang == "python" or "file" in self.options

    def commands(self) -> list[Command]:
        if "file" in self.options:
            return [Command(heredoc(f"cat > {shlex.quote(self.options['file'])}", self.body))]
        if self.is_source:
            return [Command(heredoc("python -", self.body))]
        commands: list[Command] = []
        lines = iter(self.body)
        for line in lines:
            if line.startswith("$ "):
                text = [line]
                while text[-1].endswith("\\"):
                    text.append(next(lines))
                commands.append(Command("\n".join(text)))
            elif not commands:
                raise DocError(f"{self.where}: output before the first '$ ' command: {line!r}")
        if not commands:
            raise DocError(f"{self.where}: a marked block without a '$ ' command")
        return commands


class DocError(Exception):
    """A marked block that cannot be run as it stands."""


def heredoc(command: str, body: list[str]) -> str:
    """A code block handed to a command (``python -``, ``cat > FILE``) in its session's shell."""
    return f"{command} <<'SDCREPLAY_DOC_END'\n" + "\n".join(body) + "\nSDCREPLAY_DOC_END"


def parse_marker(spec: str, where: str) -> tuple[str, dict[str, str]]:
    words = shlex.split(spec)
    options = {}
    for word in words[1:]:
        key, sep, value = word.partition("=")
        if not sep or key not in ("keep", "head", "exit", "file"):
            raise DocError(f"{where}: unknown marker option {word!r} (keep=, head=, exit=, file=)")
        options[key] = value
    return words[0], options


def blocks(path: Path) -> list[Block]:
    lines = path.read_text().split("\n")
    found = []
    index = 0
    while index < len(lines):
        fence = FENCE.match(lines[index])
        if not fence:
            index += 1
            continue
        end = index + 1
        while end < len(lines) and not lines[end].startswith("```"):
            end += 1
        marker = MARKER.match(lines[index - 1]) if index else None
        if marker:
            where = f"{shown_path(path)}:{index + 1}"
            session, options = parse_marker(marker["spec"], where)
            found.append(
                Block(path, index, end, session, options, fence["lang"], lines[index + 1 : end])
            )
        index = end + 1
    return found


PLACEHOLDER = re.compile(r"(?<![<\w])<[A-Za-z][\w .-]*>")


def placeholders(block: Block) -> list[str]:
    """``<time>``, ``<same spec>``: what a reader cannot paste (a shell variable can be)."""
    return [
        f"{block.where}: {found}"
        for command in block.commands()
        if not block.is_source
        for found in PLACEHOLDER.findall(command.text)
    ]


def unmarked_prompt_blocks(path: Path) -> list[str]:
    """Fenced blocks that show a '$ ' command but are generated by nothing."""
    lines = path.read_text().split("\n")
    marked = {block.start for block in blocks(path)}
    loose = []
    index = 0
    while index < len(lines):
        if FENCE.match(lines[index]):
            end = index + 1
            while end < len(lines) and not lines[end].startswith("```"):
                end += 1
            body = lines[index + 1 : end]
            if index not in marked and any(line.startswith("$ ") for line in body):
                loose.append(f"{shown_path(path)}:{index + 1}")
            index = end + 1
        else:
            index += 1
    return loose


def all_blocks() -> list[Block]:
    return [block for path in DOCS for block in blocks(path)]


def sessions() -> dict[str, list[Block]]:
    grouped: dict[str, list[Block]] = {}
    for block in all_blocks():
        grouped.setdefault(block.session, []).append(block)
    return grouped


# -- running --------------------------------------------------------------------------------


def _expected_statuses(session_blocks: list[Block]) -> dict[str, set[int]]:
    """The exit statuses each command's block shows it may have, besides 0."""
    allowed: dict[str, set[int]] = {}
    for block in session_blocks:
        commands = block.commands()
        for position, command in enumerate(commands):
            statuses = allowed.setdefault(command.shell, set())
            if "exit" in block.options:
                statuses.add(int(block.options["exit"]))
            following = commands[position + 1] if position + 1 < len(commands) else None
            if following is not None and following.shell.strip() == "echo $?":
                statuses.update(range(1, 256))  # the block shows the status
    return allowed


def is_echo_status(command: Command) -> bool:
    """``$ echo $?`` shows the status of the command before it; it is answered, not run."""
    return command.shell.strip() == "echo $?"


def unique_commands(session: str, session_blocks: list[Block]) -> list[str]:
    ordered = list(SETUP.get(session, []))
    for block in session_blocks:
        for command in block.commands():
            if not is_echo_status(command) and command.shell not in ordered:
                ordered.append(command.shell)
    return ordered


def script(commands: list[str], allowed: dict[str, set[int]], results: Path) -> str:
    """One bash program: each command in the current shell (its variables persist), its output
    in a file of its own; a status no block shows stops the program, as ``set -e`` would."""
    lines = ["set -euo pipefail", "__doc_rc=0", '__doc_status() { return "$1"; }']
    for number, command in enumerate(commands):
        statuses = " ".join(str(s) for s in sorted(allowed.get(command, set())))
        out, rc = (shlex.quote(str(results / f"{number}.{kind}")) for kind in ("out", "rc"))
        lines += [
            f'{{ __doc_status "$__doc_rc"; {command}',
            f"}} > {out} 2>&1 < /dev/null && __doc_rc=0 || __doc_rc=$?",
            f'echo "$__doc_rc" > {rc}',
            f'case " 0 {statuses} " in *" $__doc_rc "*) ;; *) exit "$__doc_rc" ;; esac',
        ]
    return "\n".join(lines) + "\n"


# What every session's shell has, whoever runs it: a fixed terminal, and the kernels every
# machine has, so that the digests and values shown are the same anywhere.
SETTINGS = {
    "COLUMNS": "130",
    "NO_COLOR": "1",
    "TERM": "dumb",
    "PYTHONUNBUFFERED": "1",  # stdout and stderr interleaved as a terminal shows them
    "OMP_NUM_THREADS": "1",
    "ATEN_CPU_CAPABILITY": "default",
    "MKL_CBWR": "COMPATIBLE",
}


# The environment as this process began: the runs go on in a thread beside tests that change
# os.environ for a while (tests/docs/conftest.py).
STARTING_ENVIRONMENT = dict(os.environ)


def environment(home: Path, overrides: dict[str, str] | None = None) -> dict[str, str]:
    env = {
        key: value
        for key, value in STARTING_ENVIRONMENT.items()
        if not key.startswith(("SDCREPLAY_", "SLURM_", "PYTEST_", "LINES"))
    }
    env.update(
        SETTINGS,
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
        SDCREPLAY_HOME=str(home),  # its signing secret and default ledger: never the person's
        SDCREPLAY_DOC_REPO=str(REPO),
    )
    env.update(overrides or {})
    return env


def present(text: str, workdir: Path, home: Path) -> str:
    """What a reader would see in their own directory, on the documented host."""
    for root, shown in ((workdir, ""), (home, "$SDCREPLAY_HOME/")):
        for form in sorted({str(root), os.path.realpath(root)}, key=len, reverse=True):
            text = text.replace(form + "/", shown).replace(form, shown.rstrip("/") or ".")
    host = socket.gethostname()
    for name in sorted({host, host.split(".")[0]} - {""}, key=len, reverse=True):
        text = re.sub(rf"(?<![\w.-]){re.escape(name)}(?![\w-])", host_shown(name), text)
    return text


def host_shown(name: str) -> str:
    """The documented host, h17, cut or padded to the real name's length so that the columns
    of a table stay aligned (h1 for a host named vm, h1700 for node1)."""
    return (HOST_SHOWN + "0" * len(name))[: len(name)]


# -- the runs, once per source ---------------------------------------------------------------

CACHE = REPO / ".pytest_cache" / "sdcreplay-docs"


def sources_digest() -> str:
    """What the runs' output depends on: the package, the helper files a session uses, torch
    and Python (not these checks: the raw output is kept, and presented when read)."""
    digest = hashlib.sha256()
    files = sorted((REPO / "sdcreplay").rglob("*.py")) + sorted((REPO / "sdcreplay").rglob("*.md"))
    files += [REPO / "tests" / "misbehaving.py", REPO / "pyproject.toml"]
    for path in files:
        digest.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes())
    try:
        from importlib.metadata import version

        digest.update(version("torch").encode())
    except Exception:  # torch absent: the runs will say so
        pass
    digest.update(sys.version.encode())
    return digest.hexdigest()


@dataclasses.dataclass
class Ran:
    output: list[str]  # presented: the work directory, the home and the host replaced
    status: int | None  # None: not reached, an earlier command failed


def _raw_runs(
    session: str,
    commands: list[str],
    allowed: dict[str, set[int]],
    overrides: dict[str, str] | None = None,
) -> dict:
    """Each command's raw output and status, from one bash (or the cache of the same inputs)."""
    settings = {
        k: v
        for k, v in environment(Path("HOME"), overrides).items()
        if k not in STARTING_ENVIRONMENT or k in (overrides or {})
    }
    key = hashlib.sha256(
        json.dumps(
            [
                sources_digest(),
                settings,
                commands,
                sorted((c, sorted(s)) for c, s in allowed.items()),
            ]
        ).encode()
    ).hexdigest()[:20]
    cached = CACHE / f"{session}-{key}.json"
    CACHE.mkdir(parents=True, exist_ok=True)
    # One run per key for the whole suite: each pytest-xdist worker starts the runs its chosen
    # tests need, the first to take a key's lock runs it, and the others read what it cached.
    with open(CACHE / f"{session}-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if cached.exists():
            return json.loads(cached.read_text())
        return _run_and_cache(session, commands, allowed, overrides, cached)


def _run_and_cache(
    session: str,
    commands: list[str],
    allowed: dict[str, set[int]],
    overrides: dict[str, str] | None,
    cached: Path,
) -> dict:
    """One bash runs the commands; cached only when every command was reached."""
    with tempfile.TemporaryDirectory(prefix=f"sdcreplay-doc-{session}-") as scratch:
        root = Path(scratch)
        workdir, home, results = root / "work", root / "home", root / "results"
        for folder in (workdir, home, results):
            folder.mkdir()
        (root / "session.sh").write_text(script(commands, allowed, results))
        with subprocess.Popen(
            ["bash", "--noprofile", "--norc", str(root / "session.sh")],
            cwd=workdir,
            env=environment(home, overrides),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # stop_runs() ends it with all it started
        ) as shell:
            with _SHELLS_LOCK:
                _SHELLS.add(shell)
            try:
                shell.wait()
            finally:
                with _SHELLS_LOCK:
                    _SHELLS.discard(shell)
        runs: dict = {"workdir": str(workdir), "home": str(home), "commands": {}}
        for number, command in enumerate(commands):
            out, rc = results / f"{number}.out", results / f"{number}.rc"
            runs["commands"][command] = [
                out.read_text(errors="replace") if out.exists() else "",
                int(rc.read_text()) if rc.exists() else None,
            ]
    if all(status is not None for _, status in runs["commands"].values()):
        cached.write_text(json.dumps(runs))
    return runs


_SHELLS: set[subprocess.Popen] = set()  # the sessions' shells running now
_SHELLS_LOCK = threading.Lock()


def stop_runs() -> None:
    """End every session's shell still running, and what it started (a suite that stops before
    its docs tests leaves no replay behind); those runs are not cached."""
    with _SHELLS_LOCK:
        for shell in _SHELLS:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(shell.pid, signal.SIGKILL)


def run_session(
    session: str, session_blocks: list[Block], overrides: dict[str, str] | None = None
) -> dict[str, Ran]:
    """A session's commands run for real, once per set of sources; their output presented.
    ``overrides`` replace settings of its shell (another CPU capability: a machine that
    computes otherwise than the one the pages were generated on)."""
    commands = unique_commands(session, session_blocks)
    runs = _raw_runs(session, commands, _expected_statuses(session_blocks), overrides)
    workdir, home = Path(runs["workdir"]), Path(runs["home"])
    ran = {}
    for command, (text, status) in runs["commands"].items():
        text = present(text, workdir, home)
        lines = [line.rstrip() for line in text.rstrip("\n").split("\n")]
        ran[command] = Ran(lines if text.strip() else [], status)
    return ran


# -- blocks from runs ------------------------------------------------------------------------


def shown(block: Block, output: list[str]) -> list[str]:
    """The output lines a block shows: all, or those its keep=/head= option chooses."""
    if "head" in block.options:
        count = int(block.options["head"])
        return output[:count] + ([ELLIPSIS] if len(output) > count else [])
    if "keep" in block.options:
        pattern = re.compile(block.options["keep"])
        kept: list[str] = []
        for line in output:
            if pattern.search(line):
                kept.append(line)
            elif not kept or kept[-1] != ELLIPSIS:
                kept.append(ELLIPSIS)
        return kept
    return output


def failures(block: Block, ran: dict[str, Ran]) -> list[str]:
    """Why a block's commands did not run as the block shows (empty: they did)."""
    problems = []
    for command in block.commands():
        if is_echo_status(command):
            continue
        result = ran.get(command.shell)
        if result is None:
            problems.append(
                f"{block.where}: not run (the page changed during the run): {command.text}"
            )
        elif result.status is None:
            problems.append(f"{block.where}: not reached (an earlier one failed): {command.text}")
        elif result.status not in {0, *_expected_statuses([block]).get(command.shell, set())}:
            tail = "\n    ".join(result.output[-15:])
            problems.append(f"{block.where}: `{command.text}` exited {result.status}:\n    {tail}")
    return problems


def generated(block: Block, ran: dict[str, Ran]) -> list[str]:
    """The block's body as a real run prints it today."""
    if block.is_source:
        return block.body
    body: list[str] = []
    status = 0
    for command in block.commands():
        body += command.lines
        if is_echo_status(command):
            body.append(str(status))
            continue
        result = ran[command.shell]
        status = result.status if result.status is not None else 0
        body += shown(block, result.output)
    return body


def stale(block: Block, ran: dict[str, Ran]) -> list[str]:
    """A unified diff of the block against today's run, normalized (empty: it is current)."""
    import difflib

    expected = generated(block, ran)
    if normalized(block.body) == normalized(expected):
        return []
    return list(difflib.unified_diff(block.body, expected, block.where, "a real run", lineterm=""))


def rewrite(path: Path, ran_by_session: dict[str, dict[str, Ran]], force: bool = False) -> bool:
    """Write a page's generated blocks from the runs (only those that differ by more than what
    varies between runs, unless forced); True when it changed."""
    lines = path.read_text().split("\n")
    changed = False
    for block in reversed(blocks(path)):
        ran = ran_by_session.get(block.session)
        if ran is None or block.is_source or failures(block, ran):
            continue
        body = generated(block, ran)
        if body != block.body if force else normalized(body) != normalized(block.body):
            lines[block.start + 1 : block.end] = body
            changed = True
    if changed:
        path.write_text("\n".join(lines))
    return changed


Run = tuple[str, list[Block], dict[str, str] | None]  # a session, its blocks, the overrides


def run_all(
    names: list[str] | None = None, extra: dict[str, Run] | None = None
) -> dict[str, dict[str, Ran]]:
    """Every session (or the named ones), and the ``extra`` runs by their keys, at once: each is
    mostly one process at a time, so on two cores the runs side by side take about as long as
    the longest (``tiny``) alone."""
    from concurrent.futures import ThreadPoolExecutor

    runs: dict[str, Run] = {
        n: (n, b, None) for n, b in sessions().items() if names is None or n in names
    }
    runs.update(extra or {})
    with ThreadPoolExecutor(max_workers=len(runs) or 1) as pool:
        futures = {key: pool.submit(run_session, *run) for key, run in runs.items()}
        return {key: future.result() for key, future in futures.items()}


# -- python snippets -------------------------------------------------------------------------

PROMPT = re.compile(r"^(>>> |\.\.\. )")
DOTTED = re.compile(r"\bsdcreplay(?:\.[A-Za-z_]\w*)+")


def python_blocks() -> list[tuple[str, list[str]]]:
    """Every python block of the docs, as (where, its source lines without prompts)."""
    found = []
    for path in DOCS:
        lines = path.read_text().split("\n")
        index = 0
        while index < len(lines):
            fence = FENCE.match(lines[index])
            if not fence:
                index += 1
                continue
            end = index + 1
            while end < len(lines) and not lines[end].startswith("```"):
                end += 1
            if fence["lang"] == "python":
                body = lines[index + 1 : end]
                if any(PROMPT.match(line) for line in body):
                    body = [PROMPT.sub("", line) for line in body if PROMPT.match(line)]
                found.append((f"{shown_path(path)}:{index + 1}", body))
            index = end + 1
    return found


def documented_names(source: list[str]) -> list[tuple[str, str | None]]:
    """(module, name) pairs a snippet imports or names: ``from M import n``, ``import M`` and
    every dotted ``sdcreplay.a.b`` it mentions (module None: resolve the dotted path)."""
    import ast

    names: list[tuple[str, str | None]] = []
    statements = []
    try:
        statements = list(ast.walk(ast.parse("\n".join(source))))
    except SyntaxError:  # a fragment: read its import lines one by one
        for line in source:
            try:
                statements += list(ast.walk(ast.parse(line.strip())))
            except SyntaxError:
                continue
    for node in statements:
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names += [(node.module, alias.name) for alias in node.names if alias.name != "*"]
        elif isinstance(node, ast.Import):
            names += [(alias.name, None) for alias in node.names]
    text = "\n".join(source)
    names += [(dotted, None) for dotted in sorted(set(DOTTED.findall(text)))]
    return names


RESOLVE = """
import importlib, json, sys
problems = []
for where, module, name in json.load(sys.stdin):
    try:
        if name is not None:
            getattr(importlib.import_module(module), name)
            continue
        parts = module.split(".")
        for cut in range(len(parts), 0, -1):
            try:
                target = importlib.import_module(".".join(parts[:cut]))
                break
            except ModuleNotFoundError as error:
                if error.name is None or not ".".join(parts[:cut]).startswith(error.name):
                    raise
        for attribute in parts[cut:]:
            target = getattr(target, attribute)
    except Exception as error:
        shown = f"from {module} import {name}" if name else module
        problems.append(f"{where}: {shown}: {type(error).__name__}: {error}")
print(json.dumps(problems))
"""


def unresolved_names() -> list[str]:
    """Every documented import and ``sdcreplay.`` name that does not resolve, one process."""
    wanted = [
        [where, module, name]
        for where, source in python_blocks()
        for module, name in documented_names(source)
    ]
    with tempfile.TemporaryDirectory(prefix="sdcreplay-doc-home-") as home:
        done = subprocess.run(
            [sys.executable, "-c", RESOLVE],
            input=json.dumps(wanted),
            capture_output=True,
            text=True,
            env={**os.environ, "SDCREPLAY_HOME": home},
            check=False,
        )
    if done.returncode:
        return [f"resolving the documented names failed: {done.stderr[-2000:]}"]
    return list(json.loads(done.stdout))
