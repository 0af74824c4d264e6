"""Building a Plan: the one place where a model, a strategy on a process grid and a job become plan.json's fields.
The planner's choice (toolkit.estimate.search.to_plan), the CPU rehearsal's plans (toolkit.run.rehearsal) and the
presets (toolkit.emit.presets) all come through here, so the grid's shape, its degrees and the batch arithmetic are
read from the grid, never recomputed beside it."""

from __future__ import annotations

from typing import Any, Sequence

from toolkit.inputs.grid import ParallelGrid
from toolkit.inputs.job import Job
from toolkit.inputs.strategy import Engine, Strategy
from toolkit.plan.schema import Plan


def build_plan(*, model: str, model_config: dict[str, Any], model_type: str, layer_class: str, num_layers: int,
               params: int, strategy: Strategy, grid: ParallelGrid, job: Job, gpu: str,
               partition: Sequence[int] | None = None, notes: Sequence[str] = (), moe_block: str | None = None,
               **fields: Any) -> Plan:
    """The Plan of `job` with `strategy` on `grid` for the model described by the first six fields. `moe_block`: the
    model's MoE block class (ModelSpec.moe_block), a ZeRO-3 plan's leaf module. `fields`: the plan's other fields
    (attention as the model runs it, hardware numbers, trainable_params), validated by Plan; the job's own fields
    come from toolkit.plan.job.job_to_plan_fields."""
    from toolkit.plan.job import job_to_plan_fields

    notes = list(notes)
    # Not under AutoEP: the engine swaps the MoE blocks for its own layers before it applies leaf modules
    # (runtime/engine.py: _configure_expert_parallel, then _configure_distributed_model).
    if moe_block and strategy.engine == Engine.DEEPSPEED and strategy.zero_stage == 3 and not grid.autoep:
        fields["leaf_modules"] = [moe_block]
        notes.append(f"ZeRO-3 leaf module: {moe_block} (the MoE block) is fetched whole, never hooked expert by "
                     "expert (zero_optimization.leaf_module.classes in the DeepSpeed JSON; DeepSpeed's engine calls "
                     "set_z3_leaf_modules with it)")
    return Plan(
        model=model, model_config=model_config, model_type=model_type, layer_class=layer_class,
        num_layers=num_layers, params=params, strategy=strategy.name, num_machines=grid.nodes,
        gpus_per_node=grid.gpus_per_node, pipeline_stages=grid.pipeline_stages,
        tensor_parallel=grid.tensor, context_parallel=grid.context, sequence_parallel=grid.sequence,
        expert_parallel=grid.expert,
        partition=list(partition) if partition else None,
        global_batch=grid.global_batch(job.micro_batch, job.grad_accum), gpu=gpu, notes=notes,
        **{**job_to_plan_fields(job), **fields})
