"""The accelerate YAML for a plan: what `accelerate launch --config_file` reads.

Choices (each checked against accelerate 1.15's own loader and launch validation in toolkit.emit.validate):
  - DDP: MULTI_GPU over all processes (NO for a single process: accelerate refuses --multi_gpu with one process).
  - ZeRO: DEEPSPEED naming only `deepspeed_config_file` (+ zero3_init_flag, and the multi-node launcher).
    Every training knob lives in the JSON: accelerate refuses a YAML that sets gradient_accumulation_steps,
    gradient_clipping, zero_stage, offload_*, zero3_save_16bit_model or mixed_precision next to a JSON file
    (utils/dataclasses.py DeepSpeedPlugin._deepspeed_config_checks). accelerate opens that file relative to the
    working directory of the launched processes, so the YAML names it by absolute path (presets: by file name,
    and their launch.sh passes --deepspeed_config_file with the script's own directory, which overrides it).
    zero3_init_flag is on for ZeRO-3 so that from_pretrained builds the model already partitioned (no full copy
    per rank in host RAM). Multi-node uses the "standard" (torchrun) launcher: `accelerate launch` runs on every
    node with its machine_rank (slurm.sbatch does that); the hostfile is there for the pdsh route.
  - FSDP2: fsdp_version 2, TRANSFORMER_BASED_WRAP of the plan's decoder-layer class, reshard_after_forward from the
    plan (full -> true, grad_op -> false), FULL_STATE_DICT so that save_model writes a model from_pretrained loads,
    cpu_ram_efficient_loading (rank 0 reads the weights, the others get them by broadcast). Activation checkpointing
    is the Trainer's (gradient_checkpointing=True from plan.checkpointing), not fsdp_activation_checkpointing:
    transformers refuses both at once, and one switch in one place is simpler. Hybrid shard (HSDP) is a
    parallelism_config: replicate across nodes, shard within a node.
  - pipeline / hybrid: a plain multi-process launch (MULTI_GPU, mixed_precision no): accelerate only starts the
    processes; toolkit.train calls deepspeed.initialize on a PipelineModule with ds_config.json.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from toolkit.plan import Plan

MAIN_PROCESS_PORT = 29500
"""torchrun's default rendezvous port (accelerate uses the same when none is set)."""

ACCELERATE_MIXED_PRECISION = {"fp32": "no", "bf16": "bf16", "fp16": "fp16", "bf16-pure": "no"}
"""bf16-pure has no autocast: toolkit.train loads the weights in bf16 and the optimizer runs on them."""


def accelerate_config(plan: Plan, *, ds_config_ref: str | None = None, main_host: str = "node0") -> dict[str, Any]:
    """The YAML as a dict. `ds_config_ref`: how the YAML names ds_config.json (DeepSpeed plans only)."""
    config: dict[str, Any] = {"compute_environment": "LOCAL_MACHINE", "debug": False}
    multi_process = plan.world_size > 1
    if plan.engine == "deepspeed":
        config["distributed_type"] = "DEEPSPEED"
        ds: dict[str, Any] = {"deepspeed_config_file": ds_config_ref or "ds_config.json",
                              "zero3_init_flag": plan.zero_stage == 3}
        if plan.num_machines > 1:
            ds["deepspeed_multinode_launcher"] = "standard"
        config["deepspeed_config"] = ds
    elif plan.engine == "fsdp2":
        config["distributed_type"] = "FSDP"
        config["mixed_precision"] = ACCELERATE_MIXED_PRECISION[plan.precision]
        config["fsdp_config"] = fsdp_config(plan)
        if plan.fsdp_mode == "hybrid" and plan.num_machines > 1:
            config["parallelism_config"] = {
                "parallelism_config_dp_replicate_size": plan.num_machines,
                "parallelism_config_dp_shard_size": plan.gpus_per_node,
            }
    else:  # ddp, pipeline: plain processes
        config["distributed_type"] = "MULTI_GPU" if multi_process else "NO"
        precision = "no" if plan.engine == "pipeline" else ACCELERATE_MIXED_PRECISION[plan.precision]
        config["mixed_precision"] = precision
    config["num_machines"] = plan.num_machines
    config["num_processes"] = plan.world_size
    config["machine_rank"] = 0
    if plan.num_machines > 1:
        # slurm.sbatch overrides both on the command line (the first host of the allocation, each node's rank).
        config["main_process_ip"] = main_host
        config["main_process_port"] = MAIN_PROCESS_PORT
        config["rdzv_backend"] = "static"
        config["same_network"] = True
    config["gpu_ids"] = "all"
    config["use_cpu"] = False
    return config


def fsdp_config(plan: Plan) -> dict[str, Any]:
    return {
        "fsdp_version": 2,
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_transformer_layer_cls_to_wrap": plan.layer_class,
        "fsdp_reshard_after_forward": plan.fsdp_mode != "grad_op",
        "fsdp_state_dict_type": "FULL_STATE_DICT",
        "fsdp_cpu_ram_efficient_loading": True,
        # accelerate's launcher insists on it next to cpu_ram_efficient_loading (utils/launch.py), FSDP2 ignores it.
        "fsdp_sync_module_states": True,
        "fsdp_offload_params": False,
        "fsdp_activation_checkpointing": False,
    }


def accelerate_yaml(plan: Plan, *, ds_config_ref: str | None = None, main_host: str = "node0") -> str:
    config = accelerate_config(plan, ds_config_ref=ds_config_ref, main_host=main_host)
    return yaml.safe_dump(config, sort_keys=False, default_flow_style=False)


def ds_config_reference(out_dir: Path, relative: bool) -> str:
    return "ds_config.json" if relative else str((Path(out_dir) / "ds_config.json").resolve())
