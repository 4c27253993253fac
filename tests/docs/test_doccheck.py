"""The checker itself, on pages of its own with commands that cost nothing: a number that
changes is a stale block, a failing command fails, variables carry from block to block."""

from __future__ import annotations

from pathlib import Path

import doccheck
import pytest


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


# A diff's counts of divergent entries per step and per layer, as text and as JSON.
DIFF_HERE = [
    "Divergent entries per step",
    "┏━━━━━━┳━━━━━━━━━━━━━━━━━━━┓",
    "┃ step ┃ divergent entries ┃",
    "┡━━━━━━╇━━━━━━━━━━━━━━━━━━━┩",
    "│ 0    │ 0                 │",
    "│ 1    │ 165               │",
    "│ 2    │ 183               │",
    "└──────┴───────────────────┘",
    "Divergent entries per layer, in order of first divergence",
    "│ layers.1.attn.wq      │ 2       │ 4        │ 8         │",
    "│ layers.1.attn         │ 2       │ 6        │ 0         │",
    "(+21 more layers; --json or --plot shows them all)",
    '  "entries": 669,',
    '  "divergent_entries": 348,',
    '  "per_step": {',
    '    "0": 0,',
    '    "2": 183',
    "  },",
    '  "repeats": 1,',
    '      "steps": {"0": 0, "1": 165, "2": 183},',
]
DIFF_ELSEWHERE = [
    line.replace("183", "182").replace("348", "347").replace("│ 8 ", "│ 7 ") for line in DIFF_HERE
]

# Lines of pages generated on one CPU (an AMD EPYC), as another CPU prints them (an Intel Xeon
# that rounds otherwise): digests, the entries a fault reached, values, sizes and the CPU differ.
GENERATED_HERE = [
    "│ cpu:1  │ persistent │ step 1 forward:layers.1.attn.wq │ 1/1      │ 0:ok 1:165 2:183 3:182 │",
    "First divergence: step 1, forward, forward:layers.1.attn.wq "
    "(expected 4e97472796043ca4, got 2117ccfa5b059524)",
    "│ first element │ expected 0.45451363921165466, got 0.32951363921165466 (XOR 00400000) │",
    "first failure at trial 1: output 0, element 69 (position [1, 34]): expected "
    "0.02025335654616356 (0x3ca5ea5e), actual 0.02806585654616356 (0x3ce5ea5e), "
    "XOR mask 0x00400000",
    "│ suspect │ cpu:1: persistent: failed 1000 of 1000 (100.00%, 95% interval 99.62% to "
    "100.00%) │",
    "│ size              │ 670.6 KiB in 8 files  │",
    '  "cpu.model": "AMD EPYC 7B13", "cpu.flags": "sse4_2 avx avx2 fma",',
    "output.weight float32 (256, 48) -3.4440064430236816, loss =float32:40200000, n =int64:0003",
    *DIFF_HERE,
]
READ_ELSEWHERE = [
    "│ cpu:1  │ persistent │ step 1 forward:layers.1.attn.wq │ 1/1      │ 0:ok 1:164 2:182 3:182 │",
    "First divergence: step 1, forward, forward:layers.1.attn.wq "
    "(expected 0c7f3b6e8a5d2c19, got 9a1b2c3d4e5f6071)",
    "│ first element │ expected 0.4545136094093323, got 0.3295136094093323 (XOR 00400000) │",
    "first failure at trial 1: output 0, element 69 (position [1, 34]): expected "
    "0.020253358408808708 (0x3ca5ea5f), actual 0.028065858408808708 (0x3ce5ea5f), "
    "XOR mask 0x00400000",
    "│ suspect │ cpu:1: persistent: failed 1000 of 1000 (100.00%, 95% interval 99.62% to "
    "100.00%) │",
    "│ size              │ 670.7 KiB in 8 files  │",
    '  "cpu.model": "Intel(R) Xeon(R) Platinum 8481C", "cpu.flags": "sse4_2 avx avx2 avx512f",',
    "output.weight float32 (256, 48) -3.444006681442261, loss =float32:40200001, n =int64:0003",
    *DIFF_ELSEWHERE,
]


def test_what_another_cpu_computes_is_normalized() -> None:
    assert doccheck.normalized(READ_ELSEWHERE) == doccheck.normalized(GENERATED_HERE)


@pytest.mark.parametrize(
    ("line", "was", "now"),
    [
        (0, "persistent", "intermittent"),  # the verdict
        (0, "1/1", "0/1"),  # how many repeats diverged
        (0, "1:165", "1:ok"),  # which steps diverged
        (0, "cpu:1", "cpu:2"),  # the device
        (1, "step 1", "step 2"),  # where
        (1, "layers.1.attn.wq", "layers.0.attn.wq"),  # the module
        (2, "XOR 00400000", "XOR 00200000"),  # the planted bit
        (3, "element 69", "element 70"),  # the planted element
        (3, "mask 0x00400000", "mask 0x00200000"),
        (4, "failed 1000 of 1000", "failed 999 of 1000"),  # the count of failures
        (4, "99.62%", "99.61%"),  # and its interval
        (5, "8 files", "9 files"),  # structure
        (7, "float32 (256, 48)", "float32 (48, 256)"),  # a shape
        (7, "=int64:0003", "=int64:0004"),  # an integer's value
        (13, "│ 1    │", "│ 3    │"),  # the step of a count
        (12, "│ 0                 │", "│ 1                 │"),  # a step that did not diverge
        (18, "│ 0         │", "│ 1         │"),  # a layer's entries that did not
        (20, "669", "670"),  # how many entries were compared
        (23, '"0": 0', '"0": 1'),
        (26, '"repeats": 1', '"repeats": 2'),  # a number beside the counts
        (27, '"0": 0', '"0": 2'),
    ],
)
def test_what_a_reader_relies_on_stays_exact(line: int, was: str, now: str) -> None:
    changed = list(GENERATED_HERE)
    assert was in changed[line]
    changed[line] = changed[line].replace(was, now)
    assert doccheck.normalized(changed) != doccheck.normalized(GENERATED_HERE)


def test_a_block_fails_on_its_command_exit_code_or_lines_not_on_a_digest(tmp_path: Path) -> None:
    page = _page(
        tmp_path,
        "<!-- sdcreplay-doc: unit -->\n```\n"
        "$ echo digest 4e97472796043ca4 value 0.45451363921165466\n"
        "digest 0c7f3b6e8a5d2c19 value 0.4545136094093323\n```\n\n"
        "<!-- sdcreplay-doc: unit -->\n```\n$ (echo verdict match; exit 1)\nverdict match\n"
        "$ echo $?\n1\n```\n\n"
        "<!-- sdcreplay-doc: unit -->\n```\n$ (echo verdict persistent; exit 1)\n"
        "verdict persistent\n$ echo $?\n0\n```\n\n"
        "<!-- sdcreplay-doc: unit -->\n```\n$ echo one; echo two\none\n```\n",
    )
    blocks, ran = _run(page)
    assert [doccheck.failures(block, ran) for block in blocks] == [[], [], [], []]
    digest, shown, exit_code, structure = (doccheck.stale(block, ran) for block in blocks)
    assert digest == [] and shown == []
    assert "-0" in exit_code and "+1" in exit_code
    assert "+two" in structure
    # a command the page shows otherwise than the run ran is a command not run
    edited = _page(tmp_path, page.read_text().replace("echo one; echo two", "echo one"))
    assert doccheck.failures(doccheck.blocks(edited)[3], ran) == [
        f"{doccheck.blocks(edited)[3].where}: not run (the page changed during the run): $ echo one"
    ]


def test_placeholders_and_unmarked_commands_are_found(tmp_path: Path) -> None:
    page = _page(
        tmp_path,
        "<!-- sdcreplay-doc: unit -->\n```\n$ ls <time>/x\n```\n\n```\n$ echo loose\nloose\n```\n",
    )
    (block,) = doccheck.blocks(page)
    assert doccheck.placeholders(block) == [f"{block.where}: <time>"]
    assert doccheck.unmarked_prompt_blocks(page) == [f"{page}:6"]
