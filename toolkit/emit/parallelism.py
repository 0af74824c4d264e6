"""accelerate's ParallelismConfig for a plan: one source for the accelerate YAML's `parallelism_config:` block, the
`parallelism_config` of training_args.json and DeepSpeed's sequence-parallel key; and transformers' DistributedConfig
for tensor- and expert-parallel plans.

Tensor parallelism (and expert parallelism, transformers' DistributedConfig ep_size, the same way) goes through transformers, not accelerate's FSDP plugin: the HF Trainer (5.2x) runs a TP model
only when transformers sharded it at load time (`from_pretrained(..., distributed_config=DistributedConfig(tp_size,
fsdp_size, dp_replicate_size))`, which also applies FSDP2 over the other ranks); it then builds ParallelismConfig from
the model itself (trainer.py `model_tp_size`), while a YAML with an FSDP plugin and tp_size makes it prepare the model
without its optimizer, which accelerate refuses under FSDP2 (measured on CPU by the run side, issue 17). So a TP
plan's YAML is a plain multi-process launch and training_args.json carries `distributed_config`.

accelerate 1.15 reads the YAML block by copying each key onto `accelerate launch`'s arguments as it stands
(commands/launch.py), so the YAML keys are the argparse names, `parallelism_config_<field>`; launch then hands them
to the processes as PARALLELISM_CONFIG_* variables, from which `Accelerator` builds ParallelismConfig() when the
script passes none (the HF Trainer passes TrainingArguments.parallelism_config, None by default). The same sizes as
keyword arguments of `accelerate.parallelism_config.ParallelismConfig` go to training_args.json for scripts run
without the YAML: `ParallelismConfig(**kw)`, with `sp_handler` / `cp_handler` built from their dicts
(`DeepSpeedSequenceParallelConfig`, `TorchContextParallelConfig`).
"""

from __future__ import annotations

from typing import Any

from toolkit.plan.schema import Plan
from toolkit.inputs.strategy import Engine

YAML_PREFIX = "parallelism_config_"
CP_COMM_STRATEGY = "allgather"
"""accelerate's default for cp_comm_strategy (TorchContextParallelConfig); the memory model assumes it
(toolkit.estimate.dimensions.CP_COMM_STRATEGY)."""


def parallelism_kwargs(plan: Plan) -> dict[str, Any]:
    """ParallelismConfig keyword arguments for the plan (empty: the plan needs none). Sizes that are 1 are left
    out, except dp_shard_size, which every plan with a block names."""
    g = plan.grid
    hsdp = plan.engine == Engine.FSDP2 and plan.fsdp_mode == "hybrid" and plan.num_machines > 1
    if (g.model_parallel == 1 and not hsdp) or sharded_at_load(plan):  # TP / EP: transformers' DistributedConfig
        return {}
    kw: dict[str, Any] = {}
    if g.dp_replicate > 1:
        kw["dp_replicate_size"] = g.dp_replicate
    kw["dp_shard_size"] = g.dp_shard
    if g.tensor > 1:
        kw["tp_size"] = g.tensor
    if g.context > 1:
        kw.update(cp_size=g.context, cp_backend="torch", cp_handler={"cp_comm_strategy": CP_COMM_STRATEGY})
    if g.sequence > 1:
        # accelerate sets train_batch_size = micro x accumulation x (dp_replicate x dp_shard) under SP
        # (accelerator.py _prepare_deepspeed): dp_shard_size is world / sp, the ranks with different batches.
        kw.update(sp_size=g.sequence, sp_backend="deepspeed",
                  sp_handler={"sp_seq_length": plan.seq_len, "sp_seq_length_is_variable": True,
                              "sp_attn_implementation": plan.attention})
    return kw


def distributed_config(plan: Plan) -> dict[str, Any]:
    """transformers DistributedConfig keyword arguments for a tensor- or expert-parallel plan (empty otherwise): TP
    over `tp_size` ranks of a node, EP over `ep_size` ranks (the model's own ep_plan; efsdp = fsdp x tp / ep ranks
    shard each expert), FSDP2 over `fsdp_size` (HSDP: `dp_replicate_size` replicas), bf16 compute over fp32 shards
    as the memory model's FSDP2 assumes (transformers distributed/fsdp.py MixedPrecisionPolicy). `ep_implementation`
    stays transformers' "auto", which exchanges the tokens (all_to_all) in training, as every rank has its own batch."""
    g = plan.grid
    if not sharded_at_load(plan):
        return {}
    kw: dict[str, Any] = {"tp_size": g.tensor} if g.tensor > 1 else {}
    kw["fsdp_size"] = g.dp_shard
    if g.expert > 1:
        kw["ep_size"] = g.expert
    if g.dp_replicate > 1:
        kw["dp_replicate_size"] = g.dp_replicate
    if plan.precision in ("bf16", "fp16"):
        kw["fsdp_mixed_precision"] = True
    return kw


def sharded_at_load(plan: Plan) -> bool:
    """transformers shards the model as it loads it (tensor or expert parallelism, FSDP2 included; not DeepSpeed
    AutoEP, which the engine applies in deepspeed.initialize): the accelerate
    YAML is a plain multi-process launch and the Trainer only prepares the model (module docstring)."""
    return plan.grid.tensor > 1 or (plan.grid.expert > 1 and not plan.grid.autoep)


def yaml_block(plan: Plan) -> dict[str, Any]:
    """The accelerate YAML's `parallelism_config:` mapping (handlers flattened into their launch arguments)."""
    out: dict[str, Any] = {}
    for key, value in parallelism_kwargs(plan).items():
        if isinstance(value, dict):
            out.update({YAML_PREFIX + k: v for k, v in value.items()})
        else:
            out[YAML_PREFIX + key] = value
    return out


def build_parallelism_config(kwargs: dict[str, Any]):
    """A ParallelismConfig from training_args.json's `parallelism_config` (what a script does with it)."""
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils.dataclasses import DeepSpeedSequenceParallelConfig, TorchContextParallelConfig

    kw = dict(kwargs)
    if "sp_handler" in kw:
        kw["sp_handler"] = DeepSpeedSequenceParallelConfig(**kw["sp_handler"])
    if "cp_handler" in kw:
        kw["cp_handler"] = TorchContextParallelConfig(**kw["cp_handler"])
    return ParallelismConfig(**kw)
