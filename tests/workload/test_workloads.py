"""The built-in workloads are the reference a replay is compared against, so they
must rebuild bit for bit from a seed and keep their module names stable."""

from __future__ import annotations

import math

import pytest
import torch
from sdcreplay.workloads import tiny_llama, tiny_moe
from torch.utils._python_dispatch import TorchDispatchMode

from sdcreplay.workload.definition import build_workload

FACTORIES = {"tiny-llama": tiny_llama.make_workload, "tiny-moe": tiny_moe.make_workload}


@pytest.fixture(params=sorted(FACTORIES))
def factory(request):
    return FACTORIES[request.param]


@pytest.fixture
def deterministic_algorithms():
    was_enabled = torch.are_deterministic_algorithms_enabled()
    was_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(was_enabled, warn_only=was_warn_only)


def train_step(workload, index: int) -> torch.Tensor:
    loss = workload.loss_fn(workload.model, workload.get_batch(index))
    loss.backward()
    workload.optimizer.step()
    workload.optimizer.zero_grad()
    return loss.detach()


def assert_same_tensors(left: dict, right: dict) -> None:
    assert left.keys() == right.keys()
    for name in left:
        assert torch.equal(left[name], right[name]), name


class RecordOps(TorchDispatchMode):
    """Collects the aten overload packets a piece of code dispatches."""

    def __init__(self):
        super().__init__()
        self.seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.add(func.overloadpacket)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_builtin_reference_builds(name):
    workload = build_workload(f"builtin:{name}", {"seed": 1, "layers": 1})
    assert len(workload.model.layers) == 1


def test_same_seed_rebuilds_bitwise(factory):
    first, second = factory(seed=3), factory(seed=3)
    assert_same_tensors(first.model.state_dict(), second.model.state_dict())
    assert_same_tensors(first.get_batch(7), second.get_batch(7))


def test_different_seeds_differ(factory):
    first, second = factory(seed=0), factory(seed=1)
    first_state, second_state = first.model.state_dict(), second.model.state_dict()
    assert any(not torch.equal(first_state[k], second_state[k]) for k in first_state)
    assert not torch.equal(first.get_batch(0)["tokens"], second.get_batch(0)["tokens"])


def test_get_batch_is_pure_and_leaves_global_rng_alone(factory):
    workload = factory(vocab=50)
    rng_before = torch.get_rng_state()
    batch = workload.get_batch(5)
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert torch.equal(batch["tokens"], workload.get_batch(5)["tokens"])
    assert not torch.equal(batch["tokens"], workload.get_batch(6)["tokens"])
    tokens = batch["tokens"]
    assert tokens.dtype == torch.long and tokens.shape == (4, 33)
    assert 0 <= tokens.min() and tokens.max() < 50


def test_tiny_llama_module_names():
    names = {name for name, _ in tiny_llama.make_workload().model.named_modules()}
    block = (
        "attention_norm attn attn.wq attn.wk attn.wv attn.wo attn_dropout"
        " ffn_norm mlp mlp.w1 mlp.w2 mlp.w3 mlp_dropout"
    ).split()
    expected = {"tok_embeddings", "layers", "norm", "output"}
    expected |= {f"layers.{i}.{part}" for i in range(2) for part in block}
    assert expected <= names


def test_tiny_llama_sizes_by_keyword():
    workload = tiny_llama.make_workload(
        layers=3, dim=32, heads=2, seq_len=8, batch_size=3, vocab=50, hidden=40
    )
    model = workload.model
    assert len(model.layers) == 3
    assert model.layers[2].attn.wq.weight.shape == (32, 32)
    assert model.layers[2].attn.rope_cos.shape == (8, 16)
    assert model.layers[0].mlp.w1.weight.shape == (40, 32)
    assert model.layers[0].mlp.w2.weight.shape == (32, 40)
    assert model.output.weight.shape == (50, 32)
    assert workload.get_batch(0)["tokens"].shape == (3, 9)
    assert "layers.0.attn.rope_cos" not in model.state_dict()
    default_width = tiny_llama.make_workload(dim=96).model.layers[0].mlp.w1.weight.shape[0]
    assert default_width % 8 == 0 and abs(default_width - 8 * 96 / 3) < 8


def test_tiny_moe_sizes_and_names_by_keyword():
    workload = tiny_moe.make_workload(layers=3, dim=32, heads=2, experts=3, top_k=1)
    model = workload.model
    names = {name for name, _ in model.named_parameters()}
    assert "layers.2.moe.router.weight" in names
    assert {f"layers.2.moe.experts.2.{w}.weight" for w in ("w1", "w2", "w3")} <= names
    assert not any(".mlp." in name for name in names)
    assert model.layers[2].moe.router.weight.shape == (3, 32)
    assert len(model.layers[2].moe.experts) == 3
    assert math.isfinite(train_step(workload, 0).item())


def test_training_step_gives_finite_scalar_loss(factory):
    workload = factory()
    before = {k: v.clone() for k, v in workload.model.state_dict().items()}
    loss = train_step(workload, 0)
    assert loss.dim() == 0 and math.isfinite(loss.item())
    after = workload.model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_two_runs_of_two_steps_are_bitwise_identical(factory, deterministic_algorithms):
    def run():
        torch.manual_seed(0)
        workload = factory(seed=2)
        assert workload.model.training
        for index in range(2):
            train_step(workload, index)
        return {k: v.detach().clone() for k, v in workload.model.named_parameters()}

    assert_same_tensors(run(), run())


def test_tiny_moe_dispatches_index_kernels():
    workload = tiny_moe.make_workload(layers=1)
    recorder = RecordOps()
    with recorder:
        workload.loss_fn(workload.model, workload.get_batch(0))
    aten = torch.ops.aten
    assert aten.index_select in recorder.seen
    assert {aten.index_add, aten.index_add_} & recorder.seen


def test_tied_embeddings_share_storage(factory):
    tied = factory(tie_embeddings=True)
    model = tied.model
    assert model.output.weight is model.tok_embeddings.weight
    train_step(tied, 0)
    assert model.output.weight.data_ptr() == model.tok_embeddings.weight.data_ptr()
    untied_count = len(list(factory().model.parameters()))
    assert len(list(model.parameters())) == untied_count - 1


def test_model_follows_to(factory):
    workload = factory(layers=1)
    workload.model.to(torch.float64)
    assert workload.model.layers[0].attn.rope_sin.dtype == torch.float64
    assert math.isfinite(train_step(workload, 0).item())


def test_tiny_llama_holds_no_tensors_outside_the_module():
    # On the meta device any tensor captured at build time would clash; tiny-moe
    # cannot run there because nonzero has no meta kernel.
    workload = tiny_llama.make_workload(layers=1)
    workload.model.to("meta")
    assert workload.loss_fn(workload.model, workload.get_batch(0)).device.type == "meta"
