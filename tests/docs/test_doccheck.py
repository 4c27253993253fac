"""The checker itself, on pages of its own with commands that cost nothing: a number that
changes is a stale block, a failing command fails, variables carry from block to block."""

from __future__ import annotations

from pathlib import Path

import doccheck


def _page(tmp_path: Path, text: str) -> Path:
    page = tmp_path / "page.md"
    page.write_text(text)
    return page


def _run(page: Path) -> tuple[list[doccheck.Block], dict[str, doccheck.Ran]]:
    blocks = doccheck.blocks(page)
    return blocks, doccheck.run_session("unit", blocks)


PAGE = """Some prose.

<!-- sdcreplay-doc: unit -->
```
$ ANSWER=42; echo "the answer is $ANSWER"
the answer is 41
```

<!-- sdcreplay-doc: unit keep="^kept" -->
```console
$ printf '%s\\n' "kept $ANSWER" dropped 'kept 2'; (exit 3)
$ echo $?
7
```
"""


def test_a_changed_number_is_stale_and_rewritten(tmp_path: Path) -> None:
    page = _page(tmp_path, PAGE)
    blocks, ran = _run(page)
    assert [doccheck.failures(block, ran) for block in blocks] == [[], []]
    assert "-the answer is 41" in doccheck.stale(blocks[0], ran)
    assert "+the answer is 42" in doccheck.stale(blocks[0], ran)
    assert doccheck.rewrite(page, {"unit": ran})
    rewritten = doccheck.blocks(page)
    assert rewritten[0].body == ['$ ANSWER=42; echo "the answer is $ANSWER"', "the answer is 42"]
    # the variable set in the first block is there in the second; keep= leaves "..." between
    assert rewritten[1].body[1:] == ["kept 42", "...", "kept 2", "$ echo $?", "3"]
    assert [doccheck.stale(block, ran) for block in rewritten] == [[], []]


def test_a_failing_command_fails_and_stops_the_session(tmp_path: Path) -> None:
    page = _page(
        tmp_path,
        "<!-- sdcreplay-doc: unit -->\n```\n$ ls no-such-file\n```\n\n"
        "<!-- sdcreplay-doc: unit -->\n```\n$ echo after\nafter\n```\n",
    )
    blocks, ran = _run(page)
    first, second = (doccheck.failures(block, ran) for block in blocks)
    assert len(first) == 1 and "`$ ls no-such-file` exited 2" in first[0]
    assert second == [f"{blocks[1].where}: not reached (an earlier one failed): $ echo after"]
    assert not doccheck.rewrite(page, {"unit": ran})


def test_what_varies_between_runs_is_all_that_is_normalized() -> None:
    assert doccheck.normalized(
        ["done (1.3 s) at 2026-12-01T21:24:32+00:00 in 20261201-213819"]
    ) == (doccheck.normalized(["done (12.9 s) at 2026-12-02T01:00:00+00:00 in 20261202-010000"]))
    assert doccheck.normalized(["failed 3 of 1000"]) != doccheck.normalized(["failed 4 of 1000"])
    assert doccheck.normalized(["bit 22"]) != doccheck.normalized(["bit 21"])
    assert doccheck.normalized(['"cpu.flags": "sse4_2 avx avx2 fma",']) == doccheck.normalized(
        ['"cpu.flags": "sse4_2 avx avx2 fma avx512f",']
    )
    assert doccheck.normalized(["replaying: 3/3, cpu:1 failed"]) != doccheck.normalized(
        ["replaying: 3/3, all finished"]
    )


def test_placeholders_and_unmarked_commands_are_found(tmp_path: Path) -> None:
    page = _page(
        tmp_path,
        "<!-- sdcreplay-doc: unit -->\n```\n$ ls <time>/x\n```\n\n```\n$ echo loose\nloose\n```\n",
    )
    (block,) = doccheck.blocks(page)
    assert doccheck.placeholders(block) == [f"{block.where}: <time>"]
    assert doccheck.unmarked_prompt_blocks(page) == [f"{page}:6"]
