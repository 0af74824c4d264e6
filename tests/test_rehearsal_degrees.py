"""The rehearsal's tiny model keeps every divisibility its grid needs (toolkit.run.tiny.sizes_for_degrees), and the
one fact of which grids can resume (ParallelGrid.resumable)."""

from __future__ import annotations

import pytest

from toolkit.inputs.grid import ParallelGrid
from toolkit.inputs.strategy import parse_strategy


@pytest.mark.parametrize("strategy, degrees, resumable", [
    ("fsdp2", {"tensor": 2}, False),
    ("fsdp2-hybrid", {"tensor": 2}, False),
    ("fsdp2", {}, True),
    ("fsdp2", {"context": 2}, True),
    ("zero3", {"sequence": 2}, True),
    ("zero2", {}, True),
    ("ddp", {}, True),
    ("hybrid", {}, True),
])
def test_only_tensor_parallel_grids_cannot_resume(strategy, degrees, resumable):
    """transformers shards a TP model at load time and its Trainer checkpoints no optimizer for it."""
    grid = ParallelGrid.for_strategy(parse_strategy(strategy), nodes=2, gpus_per_node=4, **degrees)
    assert grid.resumable is resumable
    assert (grid.resume_problem() is None) is resumable
    if not resumable:
        assert "cannot resume" in grid.resume_problem()
