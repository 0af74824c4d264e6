"""A plan on a smaller box than it was made for: `toolkit launch DIR --processes N [--cpu]`.

What stays is how a step runs and what it learns from: the strategy (engine, ZeRO stage, offload, FSDP mode),
checkpointing, sequence length, optimizer, adapter, and the global batch (kept by accumulation: micro-batch x
accumulation x data-parallel ranks, toolkit.inputs.grid). What changes is what the box decides: the process count, and on
a CPU the precision and kernels it can run (fp16 and flash attention need a GPU; bf16 runs on CPU; a GRPO plan's vLLM
generation becomes transformers' generate in the training process, as its rehearsal runs it). Every change is
said in one line; a global batch that cannot be kept on N processes is refused with the counts that keep it.
"""

from __future__ import annotations

from toolkit.errors import UserError
from toolkit.inputs.grid import ParallelGrid
from toolkit.plan.schema import Plan

CPU_GPU_NAME = "cpu"
"""plan.gpu of a plan re-made for CPU processes (no GPU catalog rules apply to it)."""


def box_plan(plan: Plan, *, processes: int | None, cpu: bool) -> tuple[Plan, list[str]]:
    """The plan for `processes` processes on one machine (the plan's world size when None), on CPU when `cpu`.
    Returns it and what changed, one sentence each."""
    said: list[str] = []
    world = processes if processes is not None else plan.world_size
    stages = plan.pipeline_stages if plan.strategy_spec.is_pipeline else None
    try:
        # The plan's tensor / context / sequence degrees stay: the ranks of one group share each sample, so they set
        # the data-parallel count the global batch is kept over.
        grid = ParallelGrid.for_strategy(plan.strategy_spec, nodes=1, gpus_per_node=world, pipeline_stages=stages,
                                         tensor=plan.tensor_parallel, context=plan.context_parallel,
                                         sequence=plan.sequence_parallel)
    except UserError as exc:
        raise UserError(f"--processes {world} cannot run {plan.strategy}: {exc}") from None
    if world % plan.expert_parallel:  # transformers' mesh: ep divides the FSDP ranks (DistributedConfig)
        raise UserError(f"--processes {world} cannot run expert parallel {plan.expert_parallel} (it must divide the "
                        f"processes); give --processes {plan.expert_parallel} or a multiple, or re-plan with "
                        "--expert-parallel for this box")
    micro, accum = _keep_global_batch(plan, grid, world)
    if (world, micro, accum) != (plan.world_size, plan.micro_batch, plan.grad_accum):
        said.append(f"{world} processes instead of {plan.world_size}: micro-batch {micro} x accumulation {accum} x "
                    f"{grid.data_parallel} data-parallel keeps the global batch {plan.global_batch} (the plan: "
                    f"{plan.micro_batch} x {plan.grad_accum} x {plan.data_parallel})")
    changes = dict(num_machines=1, gpus_per_node=world, micro_batch=micro, grad_accum=accum, predicted={},
                   predicted_for=None)
    if cpu:
        changes["gpu"] = CPU_GPU_NAME
        if plan.precision == "fp16":
            changes["precision"] = "bf16"
            said.append("fp16 needs a GPU (DeepSpeed refuses it on CPU, accelerate ignores it): running bf16")
        if plan.attention == "flash_attention_2":
            changes["attention"] = "sdpa"
            said.append("flash-attention kernels need a GPU: running sdpa")
        if plan.liger:
            changes["liger"] = False
            said.append("Liger's Triton kernels need a GPU: running without them")
        if plan.grpo:
            grpo, line = plan.grpo_spec.generating_in_process()
            if line:
                changes["grpo"] = grpo.to_dict()
                said.append(line)
    return plan.replace(**changes, notes=[*plan.notes, *said]), said


def _keep_global_batch(plan: Plan, grid: ParallelGrid, world: int) -> tuple[int, int]:
    """(micro-batch, accumulation) meeting the plan's global batch on `grid`: the plan's micro-batch where it
    divides, else the largest smaller one that does (memory per process only goes down)."""
    dp = grid.data_parallel
    for micro in range(plan.micro_batch, 0, -1):
        if plan.micro_batch % micro == 0 and plan.global_batch % (micro * dp) == 0:
            return micro, plan.global_batch // (micro * dp)
    stage_factor = grid.pipeline_stages
    keeps = [n for n in range(stage_factor, max(plan.world_size, world) + 1, stage_factor)
             if plan.global_batch % (n // stage_factor) == 0]
    raise UserError(f"the global batch {plan.global_batch} cannot be kept on {world} processes ({dp} data-parallel "
                    f"ranks do not divide it); use --processes {' or '.join(str(n) for n in keeps[:6])}")
