"""The planner's DeepSpeed AutoEP rows (toolkit.inputs.autoep): the ZeRO-1 / 2 / 3 grids whose expert degree is
AutoEP's autoep_size, every degree the engine admits for the model (toolkit.estimate.search costs each, as it costs
the FSDP2 x EP degrees)."""

from __future__ import annotations

from toolkit.errors import UserError
from toolkit.inputs.autoep import AUTOEP_STAGES, autoep_optimizer_problem
from toolkit.inputs.grid import ParallelGrid
from toolkit.inputs.hardware import Hardware
from toolkit.inputs.modelspec import ModelSpec
from toolkit.inputs.strategy import Strategy, parse_strategy

AUTOEP_STRATEGIES = tuple(f"zero{stage}" for stage in AUTOEP_STAGES)
"""The strategies an AutoEP row runs on."""


def autoep_strategies(names) -> list[Strategy]:
    """The AutoEP strategies among the request's strategy names."""
    return [parse_strategy(n) for n in AUTOEP_STRATEGIES if n in names]


def fixes_another_degree(req) -> bool:
    """Whether the request fixes a pipeline / tensor / context / sequence degree: an AutoEP row has none (its ranks
    are plain ZeRO data-parallel ranks), so such a request plans no AutoEP row."""
    return any(v not in (None, 1) for v in (req.pipeline_stages, req.tensor_parallel, req.context_parallel,
                                            req.sequence_parallel))


def autoep_grids(spec: ModelSpec, hw: Hardware, strategy: Strategy, degrees, seq_len: int | None,
                 attention: str | None) -> tuple[list[ParallelGrid], list[tuple[int, str]]]:
    """(the AutoEP grids of `strategy` at `degrees` that the engine admits for `spec`, (degree, why not) for the
    others). attention: the request's. seq_len None: no sequence rule (a search over lengths)."""
    grids, problems = [], []
    attention = spec.effective_attention(attention)
    for degree in degrees:
        try:
            grid = ParallelGrid.for_strategy(strategy, nodes=hw.nodes, gpus_per_node=hw.gpus_per_node, expert=degree)
            grid.check_model(spec)
            grid.check_sequence(seq_len if seq_len is not None else grid.sequence_multiple(), attention, spec)
        except UserError as exc:
            problems.append((degree, str(exc)))
            continue
        grids.append(grid)
    return grids, problems


def autoep_options(spec: ModelSpec, hw: Hardware, req, degrees, sequence_rule: bool, job_problem, summarise):
    """toolkit.estimate.search.options_for's AutoEP rows: (row key, strategy, grids or why none) for zero1 / zero2 /
    zero3 at `degrees` (None: every divisor of the world above 1). `job_problem(strategy, hw, req, fix)`: why the job
    cannot run expert parallelism; `summarise(problems)`: one reason for the degrees refused (the search's own)."""
    if fixes_another_degree(req):
        return
    degrees = degrees or [d for d in range(2, hw.world_size + 1) if hw.world_size % d == 0]
    for strategy in autoep_strategies(req.strategies):
        problem = job_problem(strategy, hw, req, "so this plan ranks no AutoEP row") \
            or autoep_optimizer_problem(req.optimizer)
        grids, why = autoep_grids(spec, hw, strategy, degrees, req.seq_len if sequence_rule else None, req.attention)
        yield f"{strategy.name} x ep", strategy, problem or grids or summarise(why)
