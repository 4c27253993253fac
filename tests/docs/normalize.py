"""What a docs block is compared by (docs/architecture.md, "Docs that cannot drift"): a page pins
what a reader relies on and shows only the form of what varies between two runs (times, stamps,
pids, the host) or between two machines (sizes, digests, values their kernels compute, how far
their rounding carried a fault, their CPU)."""

from __future__ import annotations

import re
from collections.abc import Callable

SIGNIFICANT = 6  # digits from which a printed number is a computed value, not a chosen one


def _computed_number(match: re.Match[str]) -> str:
    """A number printed to full precision (``0.45451363921165466``) is what a kernel computed;
    one with fewer digits (``0.125``, ``99.62``) is a count, a rate or a setting."""
    mantissa = match[0].lstrip("-").split("e")[0].replace(".", "").lstrip("0")
    return "<float>" if len(mantissa) >= SIGNIFICANT else match[0]


# What legitimately differs between two runs of the same command, or between two machines that
# run it, and nothing else (docs/architecture.md, "Docs that cannot drift"). What a reader
# relies on stays exact: commands, verdicts, names, steps, elements, planted bits and masks,
# counts of trials and failures, structure, exit codes.
Rules = list[tuple[re.Pattern[str], str | Callable[[re.Match[str]], str]]]

RUN_VARYING: Rules = [  # when, where and how long, and the machine's name and make
    (re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?([+-]\d\d:\d\d|Z)?"), "<iso-time>"),
    (re.compile(r"\b\d{8}-\d{6}(-[0-9A-Za-z]+)*"), "<run-dir>"),  # run and log directory stamps
    (re.compile(r"\b\d+(\.\d+)? ?(s|ms|seconds)\b"), "<seconds>"),
    (re.compile(r"\b\d+(\.\d+)? (B|KiB|MiB|GiB)\b"), "<size>"),  # the manifest holds the host
    (re.compile(r"\bpid \d+"), "pid <pid>"),
    (re.compile(r"\b[0-9a-f]{64}\b"), "<sha256>"),  # a manifest's (an incident's) holds times
    # the machine a page was generated on (its CPU model and flags) is not the one it is read on
    (re.compile(r'("cpu\.(model|flags)": )"[^"]*"'), r'\1"<cpu>"'),
    (re.compile(r"(?<![\w.-])h(1(70*)?)?(?![\w-])"), "<host>"),  # host_shown() of any length
]
# What the machine's kernels compute: another CPU rounds the last bits otherwise, even with the
# kernels pinned (whether two machines compute alike is the kernel probe's to say, not a page's).
COMPUTED_VARYING: Rules = [
    # a signature entry's digest (16 hex digits), or the bits of a small floating-point value
    # inlined in its place (=float32:3f800000); a planted mask (0x..., XOR ...) and an integer's
    # value (=int64:...) stay exact
    (re.compile(r"(?<![\w.:])(?<!0x)(?<!XOR )[0-9a-f]{16}\b"), "<digest>"),
    (re.compile(r"=((b?float|half)\d*):[0-9a-f]+\b"), r"=\1:<bits>"),
    # an element's value to full precision, and its bits beside it; the XOR mask stays exact
    (re.compile(r"(?<![\w.])-?\d+\.\d+(e[+-]?\d+)?(?![\w.])"), _computed_number),
    (re.compile(r"<float> \(0x[0-9a-f]+\)"), "<float> (<bits>)"),
    # how many signature entries of a diverged step differ: how far the rounding carried the
    # fault (which steps diverged, N:ok or N:count, stays exact)
    (re.compile(r"(?<![\w:.])(\d+):\d+(?![\w:.])"), r"\1:<entries>"),
]
LAYOUT: Rules = [
    (re.compile(r"[ \t]+"), " "),  # table columns widen and narrow with the values above
    (re.compile(r"([─━═┄-])\1+"), r"\1"),
]

ENTRY_TABLE = re.compile(r"^Divergent entries per ")  # diff's tables: per step, per layer
ENTRY_OBJECT = re.compile(r'^\s*"(steps|per_step|per_layer)": \{')  # the same in JSON
DIVERGENT_TOTAL = re.compile(r'("divergent_entries": )[1-9]\d*\b')
NONZERO_VALUE = re.compile(r'(": )[1-9]\d*\b')
BOX = ("┏", "┃", "┡", "│", "└")


def _divergent_entry_counts(lines: list[str]) -> list[str]:
    """The counts of a diff's (a replay's) divergent entries per step and per layer: how far
    the kernels' rounding carried a fault, like ``2:183``; 0 (not diverged) stays exact."""
    result, in_table, depth = [], False, 0
    for line in lines:
        if ENTRY_TABLE.match(line):
            in_table = True
        elif in_table and line.startswith("│"):
            cells = line.split("│")
            line = "│".join(
                cells[:2] + [re.sub(r"\b[1-9]\d*\b", "<entries>", c) for c in cells[2:]]
            )
        elif in_table and not line.startswith(BOX):
            in_table = False
        opened = ENTRY_OBJECT.match(line)
        if opened or depth:
            start = opened.end() if opened else 0
            line = line[:start] + NONZERO_VALUE.sub(r"\1<entries>", line[start:])
            depth = (1 if opened else depth) + line.count("{", start) - line.count("}", start)
        result.append(DIVERGENT_TOTAL.sub(r"\1<entries>", line))
    return result


def normalized(lines: list[str], machine: bool = True) -> list[str]:
    """Lines as compared: what varies between runs normalized, and (``machine``) what varies
    between machines that run them."""
    rules = RUN_VARYING + (COMPUTED_VARYING if machine else []) + LAYOUT
    if machine:
        lines = _divergent_entry_counts(lines)
    result = []
    for line in lines:
        for pattern, replacement in rules:
            line = pattern.sub(replacement, line)
        result.append(line.rstrip())
    return result
