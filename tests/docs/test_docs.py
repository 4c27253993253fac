"""README.md and docs/*.md show what a real run prints today: each generated block is compared
with a run of its session (one run per session, shared by its blocks, kept between test runs
while the sources stay the same), every block that shows a ``$`` command is generated, and every
documented Python import and ``sdcreplay.`` name resolves."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor

import doccheck
import pytest

BLOCKS = doccheck.all_blocks()


OTHER_CPU = "walkthrough, through its bisect, under the native capability"


@functools.cache
def _native_capability() -> str:
    """The ATen CPU capability this machine's CPU gives when nothing pins it (avx2, avx512)."""
    env = {key: value for key, value in os.environ.items() if key != "ATEN_CPU_CAPABILITY"}
    done = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.strip().lower()


def _through_first(command: str, session_blocks: list[doccheck.Block]) -> list[doccheck.Block]:
    """A session's blocks up to the first that runs ``command``: a prefix runs on its own."""
    for count, block in enumerate(session_blocks, 1):
        if any(found.shell.startswith(command) for found in block.commands()):
            return session_blocks[:count]
    raise AssertionError(f"no block runs {command!r}")


_RUNS: Future[dict[str, dict[str, doccheck.Ran]]] | None = None


def run_needed(item: pytest.Item) -> str | None:
    """The run (a session's name, or OTHER_CPU) a chosen test of this module needs, if any."""
    name = getattr(item, "originalname", None)
    if name == "test_block_is_what_a_real_run_prints":
        return item.callspec.params["block"].session  # type: ignore[attr-defined]
    if name == "test_pages_pass_on_a_cpu_that_computes_otherwise":
        return OTHER_CPU
    return None


def start_runs(wanted: set[str]) -> None:
    """The sessions named, and (OTHER_CPU) the walkthrough's proof on another capability, run
    once for the whole suite side by side (in one pool: each run is mostly one process at a
    time, so the proof overlaps the longer ``tiny`` session), or read from the cache; in a
    thread of their own, so that they start with the suite (conftest.py) and run on the core
    its other tests leave idle."""
    global _RUNS
    if _RUNS is not None:
        return
    extra: dict[str, doccheck.Run] = {}
    if OTHER_CPU in wanted and _native_capability() != doccheck.SETTINGS["ATEN_CPU_CAPABILITY"]:
        proof = _through_first("sdcreplay bisect", doccheck.sessions()["walkthrough"])
        extra[OTHER_CPU] = ("walkthrough", proof, {"ATEN_CPU_CAPABILITY": _native_capability()})
    names = sorted(wanted & set(doccheck.sessions()))
    _RUNS = ThreadPoolExecutor(1, "sdcreplay-docs").submit(doccheck.run_all, names, extra)


def all_runs() -> dict[str, dict[str, doccheck.Ran]]:
    start_runs({*doccheck.sessions(), OTHER_CPU})  # run without conftest.py's choice: all
    assert _RUNS is not None
    return _RUNS.result()


def session_run(name: str) -> dict[str, doccheck.Ran]:
    return all_runs()[name]


@pytest.mark.parametrize("block", BLOCKS, ids=[block.where for block in BLOCKS])
def test_block_is_what_a_real_run_prints(block: doccheck.Block) -> None:
    ran = session_run(block.session)
    problems = doccheck.failures(block, ran)
    assert not problems, "\n".join(problems)
    diff = doccheck.stale(block, ran)
    assert not diff, (
        "\n".join(diff) + f"\n{block.where} no longer shows what the command prints: "
        f"`{doccheck.REGENERATE}` rewrites it from a real run (then read the diff)"
    )


def test_pages_pass_on_a_cpu_that_computes_otherwise() -> None:
    """The pages, generated under ATEN_CPU_CAPABILITY=default, pass unregenerated where the
    kernels round otherwise: the native capability's vector kernels stand for another CPU. The
    README's walkthrough through its bisect shows every kind of value a machine computes (a
    bundle's size, a replay's per-step entry counts, a diff's digests, a bisect's element
    values) for one record, one replay and one bisect; the other sessions' blocks show the same
    kinds (tests/docs/test_doccheck.py pins the rule on each)."""
    if OTHER_CPU not in all_runs():
        pytest.skip(f"this CPU has no capability beyond {_native_capability()!r}")
    session_blocks = _through_first("sdcreplay bisect", doccheck.sessions()["walkthrough"])
    ran = all_runs()[OTHER_CPU]
    problems = [
        problem
        for block in session_blocks
        for problem in doccheck.failures(block, ran) + doccheck.stale(block, ran)
    ]
    assert not problems, "\n".join(problems)
    # the native kernels did compute otherwise, or this test would prove nothing
    computed_otherwise = [
        block.where
        for block in session_blocks
        if doccheck.normalized(doccheck.generated(block, ran), machine=False)
        != doccheck.normalized(block.body, machine=False)
    ]
    assert computed_otherwise, "the native kernels printed every value the pages show, bit for bit"


def test_every_block_with_a_command_is_generated() -> None:
    loose = [where for path in doccheck.DOCS for where in doccheck.unmarked_prompt_blocks(path)]
    assert not loose, (
        "these blocks show `$ ` commands that no test runs; put "
        "`<!-- sdcreplay-doc: SESSION -->` before each (tests/docs/doccheck.py): "
        + ", ".join(loose)
    )


def test_commands_paste_into_a_shell() -> None:
    found = [where for block in BLOCKS for where in doccheck.placeholders(block)]
    assert not found, "placeholders a shell cannot run (use a variable set earlier): " + ", ".join(
        found
    )


def test_every_documented_python_name_resolves() -> None:
    assert doccheck.unresolved_names() == []


def test_python_prompts_print_what_the_page_says() -> None:
    import doctest

    failed = []
    for path in doccheck.DOCS:
        text = path.read_text()
        if ">>> " not in text:
            continue
        parser = doctest.DocTestParser()
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
        for where, source in _prompt_blocks(path):
            test = parser.get_doctest(source, {}, where, str(path), 0)
            result = runner.run(test, out=lambda line, w=where: failed.append(f"{w}: {line}"))
            assert result.attempted
    assert not failed, "\n".join(failed)


def _prompt_blocks(path):
    lines = path.read_text().split("\n")
    for block_start, line in enumerate(lines):
        if line.startswith("```python"):
            end = lines.index("```", block_start + 1)
            body = lines[block_start + 1 : end]
            if any(entry.startswith(">>> ") for entry in body):
                where = f"{path.relative_to(doccheck.REPO)}:{block_start + 1}"
                yield where, "\n".join(body) + "\n"
