"""The expert-parallel grid a request fixes with --expert-parallel N: FSDP2 x EP (transformers' DistributedConfig
ep_size) or DeepSpeed AutoEP on zero1 / zero2 / zero3 (toolkit.estimate.autoeprows), checked before any work is
done."""

from __future__ import annotations

from toolkit.errors import UserError
from toolkit.estimate.autoeprows import autoep_grids, autoep_strategies, fixes_another_degree
from toolkit.estimate.request import Request
from toolkit.inputs.grid import ParallelGrid
from toolkit.inputs.hardware import Hardware
from toolkit.inputs.modelspec import ModelSpec
from toolkit.inputs.strategy import parse_strategy


def expert_grid(spec: ModelSpec, hw: Hardware, req: Request) -> ParallelGrid:
    """The FSDP2 x EP grid of a request that fixes --expert-parallel, checked against the model as estimate checks
    it (transformers' DistributedConfig rules, the expert count, the ep_plan's dispatch); UserError says why not."""
    if "fsdp2" not in req.strategies:
        raise UserError(f"--expert-parallel {req.expert_parallel} is planned on fsdp2 (DistributedConfig ep_size) or "
                        "zero1 / zero2 / zero3 (DeepSpeed AutoEP), which --strategies leaves out; add one or drop it")
    grid = ParallelGrid.for_strategy(parse_strategy("fsdp2"), nodes=hw.nodes, gpus_per_node=hw.gpus_per_node,
                                     pipeline_stages=req.pipeline_stages, tensor=req.tensor_parallel or 1,
                                     context=req.context_parallel or 1, sequence=req.sequence_parallel or 1,
                                     expert=req.expert_parallel)
    grid.check_model(spec)
    grid.check_sequence(req.seq_len, spec.effective_attention(req.attention), spec)
    return grid


def fixed_expert_grid(spec: ModelSpec, hw: Hardware, req: Request) -> list[ParallelGrid] | str:
    """expert_grid as a row's grids, or why it has none."""
    try:
        return [expert_grid(spec, hw, req)]
    except UserError as exc:
        return str(exc)


def check_fixed_expert(spec: ModelSpec, hw: Hardware, req: Request) -> None:
    """--expert-parallel N in plan, before any work: refused (UserError) when no strategy asked for takes N, by the
    FSDP2 x EP grid's rules (expert_grid) or DeepSpeed AutoEP's on zero1 / zero2 / zero3 (autoep_grids); the first
    reason."""
    autoep = [] if fixes_another_degree(req) else autoep_strategies(req.strategies)
    problems = []
    if "fsdp2" in req.strategies or not autoep:
        fsdp2 = fixed_expert_grid(spec, hw, req)
        if not isinstance(fsdp2, str):
            return
        problems.append(fsdp2)
    for strategy in autoep:
        grids, why = autoep_grids(spec, hw, strategy, [req.expert_parallel], req.seq_len, req.attention)
        if grids:
            return
        problems += [message for _, message in why]
    raise UserError(problems[0])
