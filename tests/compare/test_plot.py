"""The pictures: `sdcreplay diff --plot` and bisect's element heatmap are valid PNGs."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO

from sdcreplay import replay_on_device
from sdcreplay.capture.signature import write_signature_log
from sdcreplay.compare.logs import compare_logs, load_log

pytest.importorskip("matplotlib")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
RING = (
    np.array([0x1F, 0x5F, 0xBF]) / 255
)  # the colour plot.py marks the first divergence / flipped cells with


def read_png(path: Path) -> np.ndarray:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.image

    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 1000
    return matplotlib.image.imread(str(path))


def ring_pixels(image: np.ndarray) -> int:
    return int((np.abs(image[..., :3] - RING).max(axis=-1) < 0.08).sum())


@pytest.fixture(scope="module")
def faulty_log(_small_bundle_template, tmp_path_factory) -> Path:
    from conftest import preserved_global_state

    path = tmp_path_factory.mktemp("plot") / "faulty.sig.zst"
    with preserved_global_state():
        log = replay_on_device(
            _small_bundle_template,
            "cpu:1",
            inject=["kind=bitflip,op=aten.mm,module=layers.0.mlp.w1,phase=forward,step=1,index=40"],
        )
    write_signature_log(path, log)
    return path


def test_diff_plot_is_a_png(cli, small_bundle, faulty_log, tmp_path):
    target = tmp_path / "out" / "map.png"
    result = cli("diff", small_bundle, faulty_log, "--plot", target, "--json")
    assert result.exit_code == 1, result.stderr
    assert json.loads(result.stdout)["plot"] == str(target)
    assert f"Plot: {target}" in result.stderr
    image = read_png(target)
    assert image.ndim == 3 and image.shape[0] > 300 and image.shape[1] > 500
    assert ring_pixels(image) > 20  # the first divergence is outlined (and its row label coloured)


def test_identical_plot(small_bundle, tmp_path):
    from sdcreplay.compare.plot import plot_divergence_map

    reference = load_log(small_bundle)
    path = plot_divergence_map(reference, compare_logs(reference, reference), tmp_path / "same.png")
    assert path == tmp_path / "same.png"
    assert ring_pixels(read_png(path)) == 0  # nothing outlined


def test_heatmap_marks_a_single_flipped_element(tmp_path):
    from sdcreplay.compare.plot import plot_element_heatmap

    expected = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
    actual = expected.clone()
    actual.view(torch.int32)[100, 37] ^= 1 << 22
    path = plot_element_heatmap(
        expected, actual, tmp_path / "heat.png", "aten.mm.default under layers.1.attn.wq"
    )
    assert path == tmp_path / "heat.png"
    image = read_png(path)
    assert ring_pixels(image) > 30  # the ring and guide lines around the one element

    clean = plot_element_heatmap(
        expected, expected.clone(), tmp_path / "clean.png", "no difference"
    )
    assert ring_pixels(read_png(clean)) == 0


@pytest.mark.parametrize(
    "shape, dtype",
    [
        ((1000,), torch.bfloat16),
        ((2, 3, 5, 8), torch.float16),
        ((7,), torch.int64),
        ((4, 4), torch.bool),
        ((), torch.float32),
    ],
)
def test_heatmap_other_shapes_and_dtypes(tmp_path, shape, dtype):
    from sdcreplay.capture.faults import FaultSpec, corrupt
    from sdcreplay.compare.plot import plot_element_heatmap

    expected = (
        torch.zeros(shape, dtype=dtype)
        if dtype == torch.bool
        else torch.arange(max(1, int(np.prod(shape)))).reshape(shape).to(dtype)
    )
    actual = expected.clone()
    corrupt(FaultSpec.parse("kind=bitflip,op=x,index=0,bit=0"), actual)
    read_png(plot_element_heatmap(expected, actual, tmp_path / "h.png", f"{dtype} {shape}"))


def test_heatmap_refuses_tensors_that_do_not_match(tmp_path):
    from sdcreplay.compare.plot import plot_element_heatmap

    with pytest.raises(ValueError, match="cannot compare"):
        plot_element_heatmap(torch.zeros(3), torch.zeros(4), tmp_path / "x.png", "t")


def test_matplotlib_is_imported_only_inside_the_functions():
    source = REPO / "sdcreplay" / "compare" / "plot.py"
    top_level = [
        node
        for node in ast.parse(source.read_text()).body
        if isinstance(node, (ast.Import, ast.ImportFrom))
    ]
    names = [alias.name for node in top_level for alias in node.names] + [
        node.module or "" for node in top_level if isinstance(node, ast.ImportFrom)
    ]
    assert not any(name.startswith(("matplotlib", "rich", "typer")) for name in names)
