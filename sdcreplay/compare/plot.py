"""Pictures where people would rather look than read (headless matplotlib).

``plot_divergence_map``: for ``sdcreplay diff --plot``, which layers diverge at
which step, forward, backward and optimizer side by side.
``plot_element_heatmap``: for ``bisect --plot``, where in one operator's output
the bits differ.

matplotlib is imported inside the functions (with the Agg backend), so the
package imports and runs without it; it is the ``plot`` extra.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..capture.signature import SignatureLog, layer_of, phase_of
from ..errors import SdcReplayError

if TYPE_CHECKING:
    from matplotlib.axes import Axes

PANELS = ("forward", "backward", "optimizer")
_EMPTY = "#f3f3f3"
_FIRST = "#1f5fbf"
_INT_OF = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _pyplot():
    try:
        import matplotlib
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise SdcReplayError(
            "drawing a plot needs matplotlib, which is not installed",
            "pip install 'sdcreplay[plot]' (or matplotlib), or leave out --plot.",
            python_hint="pip install 'sdcreplay[plot]' (or matplotlib), or pass plot=None.",
        ) from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _layer_rows(reference: SignatureLog, steps: list[int]) -> list[str]:
    """Layers in the order the reference step runs them (forward first, then the rest)."""
    rows: dict[str, None] = {}
    entries = reference.steps[steps[0]] if steps else []
    for wanted in ("forward", "backward", "optimizer"):
        for name, _ in entries:
            if phase_of(name) == wanted:
                rows.setdefault(layer_of(name), None)
    return list(rows)


def _discrete_colormap(plt, top: int):
    """One colour per count 1..top (light orange to dark red); missing cells see through."""
    from matplotlib.colors import BoundaryNorm, ListedColormap

    base = plt.get_cmap("YlOrRd")
    levels = max(top, 1)
    colors = [base(0.42 + 0.58 * i / max(levels - 1, 1)) for i in range(levels)]
    cmap = ListedColormap(colors).with_extremes(bad=(0, 0, 0, 0))
    norm = BoundaryNorm(np.arange(0.5, levels + 1.5), cmap.N)
    return cmap, norm


def plot_divergence_map(reference: SignatureLog, comparison, path: str | Path) -> Path:
    """Draw, per step, which layers diverge (forward, backward, optimizer) into a PNG.

    Rows are the layers in the reference log's execution order, columns the
    steps; a cell's colour is the number of that layer's entries that diverge
    at that step in that phase. The first divergent entry is outlined and
    named in the title; divergent entries of no layer (RNG states...) are
    listed under the panels.
    """
    plt = _pyplot()
    from matplotlib.patches import Rectangle
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    path = Path(path)
    steps = list(comparison.steps)
    rows = _layer_rows(reference, steps)
    counts: Counter[tuple[str, str, int]] = Counter()
    elsewhere: Counter[str] = Counter()
    for divergence in comparison.divergences:
        if divergence.phase in PANELS:
            if divergence.layer not in rows:
                rows.append(divergence.layer)
            counts[(divergence.phase, divergence.layer, divergence.step)] += 1
        else:
            elsewhere[divergence.name] += 1
    row_of = {layer: i for i, layer in enumerate(rows)}
    col_of = {step: j for j, step in enumerate(steps)}
    top = max(counts.values(), default=1)
    cmap, norm = _discrete_colormap(plt, top)
    first = comparison.first

    # Layout in inches, so labels and cells keep their size whatever the counts.
    n_rows, n_cols = max(len(rows), 1), max(len(steps), 1)
    row_h = 0.2 if n_rows <= 60 else max(0.08, 12.0 / n_rows)
    cell_w = min(0.42, max(0.05, 5.0 / n_cols))
    panel_w = max(1.5, cell_w * n_cols)
    fontsize = 8 if n_rows <= 60 else max(4.0, 8 * row_h / 0.2)
    label_w = 0.25 + 0.0075 * fontsize * max((len(r) for r in rows), default=8)
    gap, right, top_m = 0.18, 1.15, 0.95
    bottom = 0.62 + (0.22 if elsewhere else 0)
    width = label_w + len(PANELS) * panel_w + (len(PANELS) - 1) * gap + right
    height = top_m + n_rows * row_h + bottom
    fig = plt.figure(figsize=(width, height))
    axes: list[Axes] = []
    for index, phase in enumerate(PANELS):
        left = label_w + index * (panel_w + gap)
        ax = fig.add_axes(
            [left / width, bottom / height, panel_w / width, n_rows * row_h / height],
            sharey=axes[0] if axes else None,
        )
        axes.append(ax)
        grid = np.full((n_rows, n_cols), np.nan)
        for (where, layer, step), count in counts.items():
            if where == phase:
                grid[row_of[layer], col_of[step]] = count
        ax.set_facecolor(_EMPTY)
        image = ax.pcolormesh(
            np.arange(n_cols + 1) - 0.5,
            np.arange(n_rows + 1) - 0.5,
            np.ma.masked_invalid(grid),
            cmap=cmap,
            norm=norm,
            edgecolors="white",
            linewidth=0 if n_cols > 100 or n_rows > 200 else 0.6 if n_rows <= 60 else 0.3,
        )
        ax.set_xlim(-0.5, n_cols - 0.5)
        ax.set_ylim(n_rows - 0.5, -0.5)
        ax.set_title(phase, fontsize=10, fontweight="bold", pad=4)
        ax.set_xlabel("step", fontsize=9, labelpad=2)
        ax.xaxis.set_major_locator(MaxNLocator(nbins=min(n_cols, 8), integer=True))
        ax.xaxis.set_major_formatter(
            FuncFormatter(
                lambda value, _, steps=steps: (
                    str(steps[int(value)])
                    if value == int(value) and 0 <= int(value) < len(steps)
                    else ""
                )
            )
        )
        ax.tick_params(axis="x", labelsize=8, length=2)
        ax.tick_params(axis="y", length=0)
        if index:
            ax.tick_params(axis="y", labelleft=False)
        for spine in ax.spines.values():
            spine.set_color("#bbbbbb")
        if first is not None and first.phase == phase and first.layer in row_of:
            ax.add_patch(
                Rectangle(
                    (col_of[first.step] - 0.5, row_of[first.layer] - 0.5),
                    1,
                    1,
                    fill=False,
                    edgecolor=_FIRST,
                    linewidth=2.2,
                    zorder=5,
                    clip_on=False,
                )
            )
    axes[0].set_yticks(range(len(rows)))
    axes[0].set_yticklabels(rows, fontsize=fontsize, family="monospace")
    if first is not None and first.layer in row_of:
        label = axes[0].get_yticklabels()[row_of[first.layer]]
        label.set_color(_FIRST)
        label.set_fontweight("bold")

    total = comparison.entries
    if first is None:
        headline, colour = (
            f"identical: all {total} entries of steps {_span(steps)} match bit for bit",
            "#1a7f37",
        )
        detail = "no layer diverges"
    else:
        headline, colour = (
            f"first divergence: step {first.step}, {first.phase}, {first.name}",
            "#8a1f11",
        )
        per_step = ", ".join(f"{step}: {n}" for step, n in comparison.per_step().items() if n)
        detail = f"{len(comparison.divergences)} of {total} entries diverge (per step: {per_step})"
        if len(detail) > 150:
            detail = detail[:147] + "...)"
    fig.text(
        0.12 / width,
        1 - 0.12 / height,
        headline,
        fontsize=11,
        fontweight="bold",
        color=colour,
        ha="left",
        va="top",
    )
    fig.text(
        0.12 / width, 1 - 0.42 / height, detail, fontsize=9, color="#444444", ha="left", va="top"
    )
    if elsewhere:
        names = ", ".join(f"{name} ({n} steps)" for name, n in list(elsewhere.items())[:4])
        more = f" and {len(elsewhere) - 4} more" if len(elsewhere) > 4 else ""
        fig.text(
            0.12 / width,
            0.1 / height,
            f"also diverged, not drawn: {names}{more}",
            fontsize=8,
            color="#8a1f11",
            ha="left",
            va="bottom",
        )
    if counts:
        bar_h = min(1.8, max(0.6, 0.35 * top), n_rows * row_h)
        bar = fig.add_axes(
            [
                (width - right + 0.2) / width,
                (bottom + n_rows * row_h - bar_h) / height,
                0.16 / width,
                bar_h / height,
            ]
        )
        colorbar = fig.colorbar(image, cax=bar, ticks=_integer_ticks(top))
        colorbar.set_label("divergent\nentries", fontsize=8)
        colorbar.ax.tick_params(labelsize=7, length=2)
        colorbar.outline.set_edgecolor("#bbbbbb")
    if first is not None and first.phase in PANELS:
        fig.text(
            (width - right + 0.2) / width,
            (bottom - 0.05) / height,
            "outline:\nfirst\ndivergence",
            fontsize=7,
            color=_FIRST,
            ha="left",
            va="top",
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def _integer_ticks(top: int) -> list[int]:
    return sorted({int(round(v)) for v in np.linspace(1, max(top, 1), min(max(top, 1), 8))})


def _span(steps: list[int]) -> str:
    if not steps:
        return "(none)"
    return f"{steps[0]}..{steps[-1]}" if len(steps) > 1 else str(steps[0])


# ---------------------------------------------------------------------------
# One tensor: where the bits differ


def _as_grid(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
    """Flat values and the 2-D grid they are drawn on (rows, cols)."""
    shape = tuple(tensor.shape)
    if len(shape) == 2:
        return tensor, shape
    if len(shape) > 2:
        return tensor, (math.prod(shape[:-1]), shape[-1])
    n = max(tensor.numel(), 1)
    cols = math.ceil(math.sqrt(n))
    return tensor, (math.ceil(n / cols), cols)


def _words(tensor: torch.Tensor) -> np.ndarray:
    tensor = tensor.detach().to("cpu").contiguous()
    if tensor.dtype == torch.bool:
        tensor = tensor.view(torch.uint8)
    return tensor.view(_INT_OF[tensor.element_size()]).reshape(-1).numpy()


def _popcount(values: np.ndarray) -> np.ndarray:
    as_bytes = np.ascontiguousarray(values).view(np.uint8).reshape(len(values), -1)
    return np.unpackbits(as_bytes, axis=1).sum(axis=1)


def _position(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(int(i) for i in np.unravel_index(flat, shape)) if shape else ()


def plot_element_heatmap(
    expected: torch.Tensor, actual: torch.Tensor, path: str | Path, title: str
) -> Path:
    """Draw where in a tensor the bits of ``actual`` differ from ``expected`` into a PNG.

    A 2-D tensor is drawn as is, a 1-D one folded into a near-square, one with
    more dimensions as ``[prod(leading), last]``. Cells are coloured by the
    number of flipped bits of their storage word, and every differing element
    is also ringed, so a single flip in a 4096x4096 output still shows.
    """
    if tuple(expected.shape) != tuple(actual.shape) or expected.dtype != actual.dtype:
        raise ValueError(
            f"cannot compare a {expected.dtype} {tuple(expected.shape)} tensor "
            f"with a {actual.dtype} {tuple(actual.shape)} one"
        )
    plt = _pyplot()
    path = Path(path)
    shape = tuple(expected.shape)
    _, (rows, cols) = _as_grid(expected)
    left, right = _words(expected), _words(actual)
    xor = np.bitwise_xor(left, right)
    differing = np.flatnonzero(xor)
    bits = np.zeros(xor.shape, dtype=np.int64)
    if len(differing):
        bits[differing] = _popcount(xor[differing])
    width = 8 * expected.element_size()
    grid: np.ndarray = np.full(rows * cols, np.nan)
    grid[: len(bits)] = np.where(bits > 0, bits, np.nan)
    grid = grid.reshape(rows, cols)
    outside = np.zeros(rows * cols, dtype=bool)
    outside[len(bits) :] = True

    top = int(bits.max()) if len(differing) else 1
    cmap, norm = _discrete_colormap(plt, top)
    from matplotlib.colors import ListedColormap

    aspect = rows / cols
    square = 0.5 < aspect < 2
    fig_w = 7.6
    fig_h = min(11.0, max(4.2, 5.0 * min(aspect, 1.6) + 2.2))
    fig, ax = plt.subplots(figsize=(fig_w, fig_h))
    # inside the tensor: light grey; padding of a folded 1-D tensor: darker
    background = outside.reshape(rows, cols).astype(float)
    ax.imshow(
        background,
        cmap=ListedColormap([_EMPTY, "#bdbdbd"]),
        vmin=0,
        vmax=1,
        interpolation="nearest",
        aspect="equal" if square else "auto",
    )
    image = ax.imshow(
        np.ma.masked_invalid(grid),
        cmap=cmap,
        norm=norm,
        interpolation="nearest",
        aspect="equal" if square else "auto",
    )
    shown = differing[:2000]
    if len(shown):
        ys, xs = np.divmod(shown, cols)
        if len(shown) <= 3:  # guide the eye to a lone cell in a large tensor
            for y, x in zip(ys, xs):
                ax.axhline(
                    y, color=_FIRST, linewidth=0.6, linestyle=(0, (3, 3)), alpha=0.6, zorder=3
                )
                ax.axvline(
                    x, color=_FIRST, linewidth=0.6, linestyle=(0, (3, 3)), alpha=0.6, zorder=3
                )
        ring = max(40.0, min(160.0, 9000.0 / max(rows, cols)))
        ax.scatter(xs, ys, s=ring, facecolors="none", edgecolors=_FIRST, linewidths=1.4, zorder=4)
    ax.set_xlim(-0.5, cols - 0.5)
    ax.set_ylim(rows - 0.5, -0.5)
    if len(shape) == 2:
        xlabel, ylabel = f"column (of {cols})", f"row (of {rows})"
    elif len(shape) > 2:
        xlabel, ylabel = f"last dimension (of {cols})", f"flat index over {list(shape[:-1])}"
    else:
        xlabel, ylabel = f"element % {cols}", f"element // {cols}"
    ax.set_xlabel(xlabel, fontsize=9)
    ax.set_ylabel(ylabel, fontsize=9)
    ax.tick_params(labelsize=8)

    total = int(np.prod(shape)) if shape else 1
    summary = (
        f"{len(differing)} of {total} elements differ "
        f"({str(expected.dtype).removeprefix('torch.')}, shape {list(shape)})"
    )
    fig.suptitle(title, fontsize=11, fontweight="bold", x=0.02, ha="left")
    ax.set_title(summary, fontsize=9, color="#444444", loc="left")
    lines = []
    flat_expected = expected.detach().to("cpu").reshape(-1)
    flat_actual = actual.detach().to("cpu").reshape(-1)
    for flat in differing[:6]:
        mask = int(xor[flat]) & ((1 << width) - 1)
        lines.append(
            f"{list(_position(int(flat), shape))}: "
            f"{flat_expected[flat].item():.6g} -> {flat_actual[flat].item():.6g}"
            f"  xor 0x{mask:0{width // 4}x}"
        )
    if len(differing) > 6:
        lines.append(f"... and {len(differing) - 6} more")
    if lines:
        fig.text(
            0.02, 0.01, "\n".join(lines), fontsize=7.5, family="monospace", ha="left", va="bottom"
        )
    fig.subplots_adjust(
        left=0.12, right=0.86, bottom=(0.65 + 0.13 * len(lines)) / fig_h, top=1 - 0.75 / fig_h
    )
    box = ax.get_position()
    bar_h = min(box.height, max(0.6, 0.3 * top) / fig_h)
    bar = fig.add_axes([0.885, box.y1 - bar_h, 0.022, bar_h])
    colorbar = fig.colorbar(image, cax=bar, ticks=_integer_ticks(top))
    colorbar.set_label(f"flipped bits\n(of {width})", fontsize=8)
    colorbar.ax.tick_params(labelsize=7, length=2)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path
