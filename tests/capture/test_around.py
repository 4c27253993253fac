"""What a loop sets around its step, set back on replay: each param group's hyperparameters,
and the torch RNG at each restore point (a fed input, an entry of the model's forward)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sdcreplay.capture.around import RestorePoints, hyperparameters, set_hyperparameters
from sdcreplay.errors import WorkloadMismatchError


def test_hyperparameters_are_taken_and_set_back_per_group():
    first, second = nn.Linear(2, 2), nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(
        [{"params": first.parameters()}, {"params": second.parameters(), "lr": 0.5}],
        lr=0.1,
        betas=(0.9, 0.95),
    )
    taken = hyperparameters(optimizer)
    assert [group["lr"] for group in taken] == [0.1, 0.5]
    assert taken[0]["betas"] == (0.9, 0.95) and "amsgrad" not in taken[0]  # flags: no schedule's
    for group in optimizer.param_groups:
        group.update(lr=7.0, betas=(0.1, 0.2), weight_decay=3.0)
    set_hyperparameters(optimizer, taken)
    assert [(g["lr"], g["betas"], g["weight_decay"]) for g in optimizer.param_groups] == [
        (0.1, (0.9, 0.95), 0.01),
        (0.5, (0.9, 0.95), 0.01),
    ]
    with pytest.raises(WorkloadMismatchError, match="2 param groups, the recording 1"):
        set_hyperparameters(optimizer, taken[:1])


class Dropped(nn.Module):
    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(x)


def test_draws_between_restore_points_change_nothing_on_replay():
    """Recorded: a feed, a forward, a prefetch's draw, a feed, a forward. Replayed from another
    generator state with other draws between the points: the same dropout masks."""
    model, x = Dropped(), torch.ones(64)
    points = RestorePoints(torch.device("cpu"), model)
    torch.manual_seed(0)
    points.begin_recording()
    recorded = []
    for _ in range(2):
        points.at_point("a rec.feed")
        recorded.append(model(x))
        torch.randint(10, (3,))  # the prefetch
    noted = points.end()
    assert len(noted) == 4  # two feeds, two forward entries

    torch.manual_seed(1)
    points.begin_replay(noted)
    replayed = []
    for draws in (5, 50):
        points.at_point("a rec.feed")
        torch.rand(draws)  # something else the replayed loop draws before its forward
        replayed.append(model(x))
    points.end()
    assert all(torch.equal(a, b) for a, b in zip(recorded, replayed))

    points.begin_replay(noted[:1])
    points.at_point("a rec.feed")
    with pytest.raises(WorkloadMismatchError, match="reaches a forward entry the recorded"):
        model(x)
    points.end()
    points.close()
    model(x)  # no point outside a step, nor once closed
