"""The accelerate YAML for a plan: what `accelerate launch --config_file` reads.

Choices (each checked against accelerate 1.15's own loader and launch validation in toolkit.engines.validate):
  - DDP: MULTI_GPU over all processes (NO for a single process: accelerate refuses --multi_gpu with one process).
  - ZeRO: DEEPSPEED with `deepspeed_config_file` (+ zero3_init_flag, and the multi-node launcher).
    Every training knob lives in the JSON: accelerate refuses a YAML that sets gradient_accumulation_steps,
    gradient_clipping, zero_stage, offload_*, zero3_save_16bit_model or mixed_precision next to a JSON file
    (utils/dataclasses.py DeepSpeedPlugin._deepspeed_config_checks). accelerate hands the value to the processes
    as ACCELERATE_DEEPSPEED_CONFIG_FILE, and its HfDeepSpeedConfig (utils/deepspeed.py) opens it as a path
    relative to the processes' working directory, else parses it as JSON text. A path breaks a plan folder that
    is copied elsewhere or launched from another directory (a relative path is resolved against the launch
    directory, an absolute one names the machine it was emitted on), so the YAML carries ds_config.json's content
    itself, as one line of JSON (one line: DeepSpeed's pdsh launcher forwards environment variables line by line).
    `accelerate launch --config_file PLAN/accelerate_config.yaml script.py` then works from any directory.
    zero3_init_flag is on for ZeRO-3 so that from_pretrained builds the model already partitioned (no full copy
    per rank in host RAM). Multi-node uses the "standard" (torchrun) launcher: `accelerate launch` runs on every
    node with its machine_rank (slurm.sbatch does that); the hostfile is there for the pdsh route.
  - FSDP2: fsdp_version 2, TRANSFORMER_BASED_WRAP of the plan's decoder-layer class, reshard_after_forward from the
    plan (full -> true, grad_op -> false), FULL_STATE_DICT so that save_model writes a model from_pretrained loads,
    cpu_ram_efficient_loading (rank 0 reads the weights, the others get them by broadcast). Activation checkpointing
    is fsdp_activation_checkpointing (= plan.checkpointing): accelerate applies it for every script it launches
    (Trainer, TRL, a custom loop), where a TrainingArguments flag would reach Trainer scripts only; the emitted
    TrainingArguments leave gradient_checkpointing off for FSDP2 (transformers refuses both at once, trainer.py). Hybrid shard (HSDP) is a
    parallelism_config: replicate across nodes, shard within a node; context parallelism adds cp to it, Ulysses
    sequence parallelism (under DEEPSPEED) its sp settings. Tensor parallelism is a plain multi-process launch:
    transformers shards the model at load (DistributedConfig) and runs FSDP2 itself (toolkit.emit.parallelism).
  - pipeline / hybrid: a plain multi-process launch (MULTI_GPU, mixed_precision no): accelerate only starts the
    processes; toolkit.train calls deepspeed.initialize on a PipelineModule with ds_config.json.
"""

from __future__ import annotations

import json
from typing import Any

import yaml

from toolkit.emit.parallelism import sharded_at_load, yaml_block
from toolkit.plan.schema import Plan
from toolkit.inputs.strategy import Engine

MAIN_PROCESS_PORT = 29500
"""torchrun's default rendezvous port (accelerate uses the same when none is set)."""

ACCELERATE_MIXED_PRECISION = {"fp32": "no", "bf16": "bf16", "fp16": "fp16", "bf16-pure": "no"}
"""bf16-pure has no autocast: toolkit.train loads the weights in bf16 and the optimizer runs on them."""


def accelerate_config(plan: Plan, *, ds_config: dict[str, Any] | None = None,
                      main_host: str = "node0") -> dict[str, Any]:
    """The YAML as a dict. `ds_config`: ds_config.json's content, carried inline (DeepSpeed plans only)."""
    config: dict[str, Any] = {"compute_environment": "LOCAL_MACHINE", "debug": False}
    multi_process = plan.world_size > 1
    if plan.engine == Engine.DEEPSPEED:
        config["distributed_type"] = "DEEPSPEED"
        if ds_config is None:
            raise ValueError("a DeepSpeed plan's YAML carries its ds_config.json: pass ds_config")
        ds: dict[str, Any] = {"deepspeed_config_file": inline_json(ds_config),
                              "zero3_init_flag": plan.zero_stage == 3}
        if plan.num_machines > 1:
            ds["deepspeed_multinode_launcher"] = "standard"
        config["deepspeed_config"] = ds
        if yaml_block(plan):  # Ulysses sequence parallelism (sp_backend deepspeed)
            config["parallelism_config"] = yaml_block(plan)
    elif plan.engine == Engine.FSDP2 and not sharded_at_load(plan):
        config["distributed_type"] = "FSDP"
        config["mixed_precision"] = ACCELERATE_MIXED_PRECISION[plan.precision]
        config["fsdp_config"] = fsdp_config(plan)
        if yaml_block(plan):  # HSDP, tensor and context parallelism (toolkit.emit.parallelism)
            config["parallelism_config"] = yaml_block(plan)
    else:  # ddp, pipeline, and tensor / expert parallelism transformers applies at load (toolkit.emit.parallelism)
        config["distributed_type"] = "MULTI_GPU" if multi_process else "NO"
        precision = "no" if plan.engine == Engine.PIPELINE else ACCELERATE_MIXED_PRECISION[plan.precision]
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
    if plan.compile:
        # accelerate's dynamo plugin: torch.compile in prepare(), DeepSpeed's engine.compile() under DeepSpeed
        # (accelerator.py); the keys `accelerate config` writes (commands/config/cluster.py).
        config["dynamo_config"] = {"dynamo_backend": "INDUCTOR"}
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
        # true: accelerate builds torch's CPUOffloadPolicy() for FSDP2 (utils/dataclasses.py set_cpu_offload).
        "fsdp_offload_params": plan.offload_params != "none",
        "fsdp_activation_checkpointing": plan.checkpointing,
    }


def inline_json(config: dict[str, Any]) -> str:
    """A DeepSpeed config as the one-line JSON text that accelerate's HfDeepSpeedConfig parses (module docstring)."""
    return json.dumps(config, separators=(", ", ": "))


def inline_ds_config(value: str) -> dict[str, Any] | None:
    """A YAML deepspeed_config_file value as the config it holds when it is JSON text (emitted YAMLs), else None
    (a path). accelerate tries the path first, then JSON (utils/deepspeed.py HfDeepSpeedConfig)."""
    if not isinstance(value, str) or not value.lstrip().startswith("{"):
        return None
    try:
        config = json.loads(value)
    except json.JSONDecodeError:
        return None
    return config if isinstance(config, dict) else None


YAML_HEADER = ("# accelerate launch --config_file THIS_FILE your_script.py [ARGS]   (works from any directory)\n"
               "# deepspeed_config_file holds ds_config.json's content as JSON text, not a path: accelerate parses\n"
               "# it (accelerate utils/deepspeed.py HfDeepSpeedConfig), so the folder can be copied or moved.\n"
               "# Settings for your own script: training_args.json and PLAN.md beside this file.\n")


def accelerate_yaml(plan: Plan, *, ds_config: dict[str, Any] | None = None, main_host: str = "node0") -> str:
    config = accelerate_config(plan, ds_config=ds_config, main_host=main_host)
    body = yaml.safe_dump(config, sort_keys=False, default_flow_style=False, width=float("inf"))
    return YAML_HEADER + body
