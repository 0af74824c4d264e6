"""Pipeline partition: which decoder layers each stage runs, and which stage counts are refused."""

import pytest

from toolkit.errors import UserError
from toolkit.inputs.partition import balanced_partition, check_partition, check_stage_count, stage_counts


def stage_costs(bounds, costs, first_extra=0.0, last_extra=0.0):
    out = [sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])]
    out[0] += first_extra
    out[-1] += last_extra
    return out


def test_equal_layers_split_evenly():
    assert balanced_partition([1.0] * 8, 2) == [0, 4, 8]
    assert balanced_partition([1.0] * 24, 4) == [0, 6, 12, 18, 24]


def test_embedding_and_head_costs_move_layers_off_the_first_and_last_stages():
    bounds = balanced_partition([1.0] * 8, 2, first_extra=2.0)
    assert bounds == [0, 3, 8]
    bounds = balanced_partition([1.0] * 16, 4, first_extra=1.0, last_extra=3.0)
    layers = [b - a for a, b in zip(bounds, bounds[1:])]
    assert layers[0] < layers[1] and layers[-1] < layers[0]
    assert max(stage_costs(bounds, [1.0] * 16, 1.0, 3.0)) == 5.0


def test_balanced_partition_minimises_the_slowest_stage_exactly():
    import itertools

    costs = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0]
    best = min(max(stage_costs([0, *cut, 8], costs, 2.0, 1.0))
               for cut in itertools.combinations(range(1, 8), 2))
    bounds = balanced_partition(costs, 3, first_extra=2.0, last_extra=1.0)
    assert max(stage_costs(bounds, costs, 2.0, 1.0)) == best


def test_every_stage_gets_at_least_one_layer():
    bounds = balanced_partition([1.0, 100.0, 1.0, 1.0], 4)
    assert bounds == [0, 1, 2, 3, 4]
    bounds = balanced_partition([100.0, 1.0, 1.0, 1.0, 1.0], 3, first_extra=50.0)
    assert all(b > a for a, b in zip(bounds, bounds[1:]))


def test_uneven_layer_counts_are_allowed():
    bounds = balanced_partition([1.0] * 10, 4)
    assert len(bounds) == 5 and bounds[-1] == 10
    assert sorted(b - a for a, b in zip(bounds, bounds[1:])) == [2, 2, 3, 3]


def test_more_stages_than_layers_is_refused_with_the_counts_that_work():
    with pytest.raises(UserError, match=r"model has 4 layers; --pipeline-stages 6 cannot give each stage a "
                                        r"decoder layer \(try 2, 4\)"):
        check_stage_count(4, 6, world=8)
    with pytest.raises(UserError, match="model has 4 layers"):
        balanced_partition([1.0] * 4, 5)


def test_stage_count_must_divide_the_world():
    with pytest.raises(UserError, match=r"--pipeline-stages 6 does not divide 8 processes .*\(try 2, 4, 8\)"):
        check_stage_count(80, 6, world=8)
    assert stage_counts(80, 8) == [1, 2, 4, 8]
    assert stage_counts(3, 8) == [1, 2]
    check_stage_count(80, 8, world=16)


def test_a_plan_partition_must_cover_every_layer_once():
    check_partition([0, 1, 4], 4, 2)
    for bad in ([0, 4], [0, 2, 3], [0, 0, 4], [1, 2, 4], [0, 3, 2, 4]):
        with pytest.raises(UserError, match="does not split 4 layers"):
            check_partition(bad, 4, 2)


@pytest.mark.parametrize("arch, blocked", [("phi3", False), ("gemma3_text", False), ("qwen2_moe", False),
                                           ("bloom", True)])
def test_the_planner_and_the_converter_agree_on_what_can_be_split(arch, blocked):
    """One finder (toolkit.inputs.decoder_parts) answers both: the planner's spec and the converter's Source."""
    from toolkit.inputs.modelspec import build_spec
    from toolkit.train.pipeline.convert import Source
    from toolkit.run.tiny import tiny_config

    config = tiny_config(arch, output_router_logits=True) if arch == "qwen2_moe" else tiny_config(arch)
    spec = build_spec(arch, config)
    assert bool(spec.pipeline_blocker) == blocked
    if blocked:
        with pytest.raises(UserError, match=spec.pipeline_blocker.split(":")[0]):
            Source(config, None)
    else:
        assert Source(config, None).parts.layers
