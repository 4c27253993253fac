"""README.md and docs/*.md show what a real run prints today: each generated block is compared
with a run of its session (one run per session, shared by its blocks, kept between test runs
while the sources stay the same), every block that shows a ``$`` command is generated, and every
documented Python import and ``sdcreplay.`` name resolves."""

from __future__ import annotations

import functools

import doccheck
import pytest

BLOCKS = doccheck.all_blocks()


@functools.cache
def all_runs() -> dict[str, dict[str, doccheck.Ran]]:
    """Every session, run once for the whole suite (side by side), or read from the cache."""
    return doccheck.run_all()


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
