"""What a person reads: tables that keep names whole on an 80-column terminal, progress with
real totals on a terminal and one line per stage in a log.

The renderers take the library's real result types (a real bundle's ``describe``, a real
``Comparison``) and draw on a rich Console of a fixed width writing to a string.
"""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
from rich.console import Console

from sdcreplay.bundle.info import describe
from sdcreplay.cli.output import Output
from sdcreplay.cli.render_record import render_info
from sdcreplay.cli.render_replay import render_diff
from sdcreplay.compare.logs import Comparison, Divergence

# Entry names as long as a deep model's: each must read whole on some line of the table.
LONG_NAMES = [
    "forward:encoder.layers.11.attention.out_proj",
    "backward:encoder.layers.11.mlp.gate_proj",
    "optim:decoder.embed_tokens.weight.exp_avg",
]


def console(width: int = 80, terminal: bool = False) -> tuple[Console, io.StringIO]:
    buffer = io.StringIO()
    return Console(
        file=buffer,
        width=width,
        force_terminal=terminal,
        color_system=None,
        highlight=False,
        soft_wrap=True,
    ), buffer


def assert_whole_on_a_line(text: str, names: list[str]) -> None:
    for name in names:
        assert any(name in line for line in text.splitlines()), f"{name!r} broken in:\n{text}"


def table_width(text: str) -> int:
    """The widest table line (sentences around the tables are soft-wrapped by the terminal)."""
    return max(len(line) for line in text.splitlines() if line[:1] in "┏┃┡│└")


def test_diff_table_keeps_layer_names_whole_at_80_columns():
    divergences = [Divergence(step, name, "aa", "bb") for step in (0, 1) for name in LONG_NAMES]
    comparison = Comparison(steps=[0, 1], entries=40, divergences=divergences)
    screen, buffer = console()
    render_diff(Output(console=screen), comparison)
    text = buffer.getvalue()
    layers = list(comparison.per_layer())
    assert len(layers) == 3 and max(len(layer) for layer in layers) > 33
    assert_whole_on_a_line(text, layers)
    assert table_width(text) <= 80


def test_info_keeps_every_name_whole_at_80_columns(small_bundle: Path):
    """Property names and CPU flags stay whole; only a value wider than the room left (a
    40-digit commit hash beside two other columns) may fold."""
    about = describe(small_bundle)
    screen, buffer = console()
    render_info(Output(console=screen), about)
    text = buffer.getvalue()
    fingerprint = about.fingerprint or {}
    flags = str(fingerprint.get("cpu.flags", "")).split()
    assert len(fingerprint) > 5 and flags
    assert_whole_on_a_line(text, list(fingerprint) + flags + [about.workload["ref"]])
    assert table_width(text) <= 80


def test_a_log_gets_one_line_per_stage_with_its_count_total_and_time():
    screen, buffer = console(terminal=False)
    with Output(console=screen).stages() as progress:
        for done in range(1, 11):
            progress.update("suspect", done, 10, f"{done // 5} failed")
        for tested in range(1, 8):
            progress.update("shrink", tested, None, "2 kept")
        progress.begin("oplog", "operator-level replay of step 1 on cpu:0")
        progress.begin("oplog", "operator-level replay of step 1 on cpu:1")
    lines = buffer.getvalue().splitlines()
    assert len(lines) == 4, lines
    assert re.fullmatch(r"suspect: 10/10, 2 failed \(\d+\.\d s\)", lines[0])
    assert re.fullmatch(r"shrink: 7, 2 kept \(\d+\.\d s\)", lines[1])  # no total: no "/?"
    for line, device in zip(lines[2:], ("cpu:0", "cpu:1")):  # one line per phase, same name or not
        assert re.fullmatch(
            rf"oplog: operator-level replay of step 1 on {device} \(\d+\.\d s\)", line
        )


@pytest.mark.parametrize(
    "order", [("cpu:0", "cpu:1", "cpu:2"), ("cpu:2", "cpu:0", "cpu:1"), ("cpu:1", "cpu:2", "cpu:0")]
)
@pytest.mark.parametrize("failing", [(), ("cpu:1",), ("cpu:0", "cpu:2")])
def test_a_log_says_the_same_of_device_processes_whichever_ends_last(order, failing):
    """The line a replay or a screen leaves sums its devices up: the failed ones in the order
    they ended, else "all finished"; never whichever process the scheduler ended last."""
    screen, buffer = console(terminal=False)
    with Output(console=screen).stages() as progress:
        for label in order:
            progress.device_done("replaying", label, label in failing, len(order))
    (line,) = buffer.getvalue().splitlines()
    ended = [label for label in order if label in failing]
    note = f"{', '.join(ended)} failed" if ended else "all finished"
    assert re.fullmatch(rf"replaying: 3/3, {re.escape(note)} \(\d+\.\d s\)", line), line


def test_a_terminal_sees_each_stage_against_its_real_total():
    screen, buffer = console(terminal=True)
    with Output(console=screen).stages() as progress:
        for done in range(1, 1001, 111):
            progress.update("suspect", done, 1000, "0 failed")
            screen.file.flush()
        progress.update("shrink", 774, None, "3 kept")
        progress.progress.refresh()
    shown = buffer.getvalue()
    assert "/1000" in shown and "774" in shown
    assert "/?" not in shown


def test_ops_table_never_breaks_an_operator_or_module_name():
    """The op and module columns are what people copy into a spec: whole on their line at 80
    columns (the outputs' shapes fold instead), and printed whole even where they alone are
    wider than the console."""
    from sdcreplay.bisect.ops import Call, OpsListing
    from sdcreplay.cli.render_bisect import render_ops

    shapes = [{"shape": [128, 64, 3, 3], "dtype": "float32"}, {"shape": [64], "dtype": "float32"}]
    calls = [
        Call(7, "forward", "conv1", "aten.convolution.default", 0, shapes),
        Call(9, "optimizer", "conv1.weight", "aten.addcdiv_.default", 0, shapes[:1]),
    ]
    listing = OpsListing("b", 1, "cpu", {"phase": None, "module": None, "op": None}, 40, calls)
    screen, buffer = console()
    render_ops(Output(console=screen), listing)
    text = buffer.getvalue()
    assert_whole_on_a_line(text, [c.op for c in calls] + [c.module for c in calls])
    assert table_width(text) <= 80
    deep = Call(10, "backward", "encoder.layers.11.self_attention.core_attention.flash", (
        "aten._scaled_dot_product_flash_attention_for_cpu_backward.default"
    ), 0, shapes)  # fmt: skip
    screen, buffer = console()
    render_ops(Output(console=screen), OpsListing("b", 1, "cpu", listing.filters, 40, [deep]))
    text = buffer.getvalue()
    assert_whole_on_a_line(text, [deep.op, deep.module])
    assert table_width(text) > 80  # wider than the console, never cut
