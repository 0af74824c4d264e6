"""`toolkit check --model M --gpus SPEC`: does the model fit the training the config files describe?

    fit_findings("accelerate_config.yaml", model="llama-3-8b", gpus="8xA100-80GB") -> [Problem, ...]

The files are read the way the runners read them: a YAML through accelerate's launch validation and the plugin the
Accelerator builds from it (an inline deepspeed_config is ZeRO with the stage, offload and accumulation the plugin
sets; FSDP's sharding, offload and activation checkpointing come from FullyShardedDataParallelPlugin); a DeepSpeed
JSON through DeepSpeed's DeepSpeedZeroConfig. Whatever the files leave to the runner ("auto", or not said at all)
is assumed, and every assumption is reported as a note; --micro-batch / --precision / --checkpointing pin them.
The memory model is toolkit.estimate.memory.estimate_memory, the planner's own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from toolkit.check.findings import EVERY, Problem
from toolkit.check.read import is_plan_json, read_config
from toolkit.engines.readers import _mapping, concrete_int, enabled, quiet_engines, zero_default, zero_settings
from toolkit.errors import UserError
from toolkit.inputs.strategy import Engine, Strategy, parse_strategy


@dataclass(frozen=True)
class FitSettings:
    """What the files say about one GPU's work, and what was assumed for the rest."""
    strategy: Strategy
    micro_batch: int
    precision: str
    checkpointing: bool
    seq_len: int | None = None
    stages: int = 1
    partition: list[int] | None = None
    assumptions: tuple[str, ...] = ()
    job_options: tuple[tuple[str, object], ...] = ()
    """Further Job fields a plan.json states (accumulation, optimizer implementation, Liger, offloading)."""
    shard_group: int | None = None
    """FSDP under parallelism_config: the dp_shard x cp group FSDP shards over (accelerate's `dp_shard_cp` mesh
    dimension), when smaller than the world."""
    sizes: tuple[tuple[str, int], ...] = ()
    """parallelism_config sizes the files state (dp_replicate, dp_shard, tp, cp, sp), or a plan's degrees."""


@dataclass(frozen=True)
class Pins:
    """Values given on the command line for what the files leave open."""
    micro_batch: int | None = None
    precision: str | None = None
    checkpointing: bool | None = None


PRECISION_ASSUMED = "bf16"
"""What an unsaid precision is taken as: bf16 mixed precision, the choice on every GPU that has it (A100, H100)."""


def fit_settings(path: str, pins: Pins = Pins()) -> FitSettings:
    p = Path(path)
    if p.is_dir() or (p.suffix == ".json" and is_plan_json(read_config(p))):
        from toolkit.plan.schema import load_plan
        from toolkit.inputs.strategy import parse_strategy

        plan = load_plan(p)
        return FitSettings(parse_strategy(plan.strategy), pins.micro_batch or plan.micro_batch,
                           pins.precision or plan.precision,
                           plan.checkpointing if pins.checkpointing is None else pins.checkpointing,
                           plan.seq_len, plan.pipeline_stages, plan.partition,
                           job_options=(("grad_accum", plan.grad_accum), ("optimizer", plan.optimizer),
                                        ("optimizer_impl", plan.optimizer_impl), ("liger", plan.liger), ("loss", plan.loss),
                                        ("compile", plan.compile),
                                        ("tiled", plan.tiled), ("attention", plan.attention),
                                        ("activation_offloading", plan.activation_offloading),
                                        ("adapter", plan.adapter_spec), ("allocator_conf", plan.allocator_conf)),
                           sizes=_plan_sizes(plan))
    config = read_config(p)
    if p.suffix == ".json":
        return _from_deepspeed(config, pins, f"{p.name} (a DeepSpeed JSON)")
    return _from_yaml(p, config, pins)


def _from_deepspeed(ds: dict[str, Any], pins: Pins, source: str, *, yaml_precision: str | None = None,
                    assumptions: tuple[str, ...] = ()) -> FitSettings:
    notes = list(assumptions)
    block = _mapping(ds.get("zero_optimization"))
    if block.get("stage") == "auto":
        # accelerate's DeepSpeedPlugin fills it from --zero_stage, default 2 (ACCELERATE_DEEPSPEED_ZERO_STAGE)
        block = {**block, "stage": 2}
        notes.append(f"ZeRO stage taken as 2: \"stage\" is \"auto\" in {source}, filled from `accelerate launch "
                     "--zero_stage` (default 2)")
    zero = zero_settings(block)
    stage = zero.stage if zero else 0
    if stage == 0:
        strategy = Strategy("ddp")
    else:
        strategy = Strategy(f"zero{stage}", offload_optimizer=zero.offload_optimizer if stage >= 1 else "none",
                            offload_params=zero.offload_params if stage == 3 else "none")
    micro = pins.micro_batch or concrete_int(ds.get("train_micro_batch_size_per_gpu"))
    if micro is None:
        micro = 1
        said = "\"auto\"" if ds.get("train_micro_batch_size_per_gpu") == "auto" else "not set"
        notes.append(f"micro-batch taken as 1 (the least it can be): train_micro_batch_size_per_gpu is {said} in "
                     f"{source}, so the runner decides (the HF Trainer's --per_device_train_batch_size, default 8; an "
                     "accelerate script's DataLoader batch size); pin it with --micro-batch")
    precision = pins.precision
    if precision is None:
        bf16 = ds.get("bf16", ds.get("bfloat16"))
        flags = [b.get("enabled") for b in (bf16, ds.get("fp16")) if isinstance(b, dict)]
        if enabled(bf16):
            precision = "bf16"
        elif enabled(ds.get("fp16")):
            precision = "fp16"
        elif "auto" in flags and yaml_precision is None:
            precision = PRECISION_ASSUMED
            notes.append(f"precision taken as {PRECISION_ASSUMED}: bf16/fp16 \"enabled\" is \"auto\" in {source}, "
                         "filled by the runner (HF Trainer --bf16/--fp16, accelerate --mixed_precision); pin it "
                         "with --precision")
        else:
            precision = yaml_precision or "fp32"
            if not any(k in ds for k in ("bf16", "bfloat16", "fp16")) and yaml_precision is None:
                notes.append(f"precision taken as fp32: {source} has no bf16 or fp16 block (the HF Trainer's --bf16 / "
                             "--fp16 or accelerate's --mixed_precision add one); pin it with --precision")
    checkpointing = _checkpointing(pins, None, source, notes)
    # ZeRO-2/3's bucket as DeepSpeed will size it: the config's own number, DeepSpeed's default where the config
    # leaves the key out (accelerate's inline deepspeed_config does), the HF "auto" fill (0) where it says "auto".
    bucket = block.get("reduce_bucket_size", zero_default("reduce_bucket_size"))
    size = int(bucket) if isinstance(bucket, (int, float)) and not isinstance(bucket, bool) else 0
    options = (("zero_reduce_bucket", size),) if stage >= 2 and size else ()
    if stage in (1, 2) and zero.overlap_comm:  # stage_1_and_2.py setup_buckets: a second IPG buffer
        options += (("zero_overlap_comm", True),)
    return FitSettings(strategy, micro, precision, checkpointing, assumptions=tuple(notes), job_options=options,
                       sizes=_autoep_sizes(ds))


def _autoep_sizes(ds: dict[str, Any]) -> tuple[tuple[str, int], ...]:
    """(("expert", autoep_size),) when the JSON turns DeepSpeed AutoEP on at a size above 1, as DeepSpeed reads the
    section (toolkit.check.deepspeed); the fit is then the AutoEP grid's (experts / autoep_size a rank)."""
    from deepspeed.runtime.config import get_expert_parallel_config

    from toolkit.check.deepspeed import _autoep_enabled

    if not _autoep_enabled(ds):
        return ()
    size = get_expert_parallel_config(ds).autoep_size
    return (("expert", size),) if isinstance(size, int) and size > 1 else ()


def _checkpointing(pins: Pins, said: bool | None, source: str, notes: list[str]) -> bool:
    if pins.checkpointing is not None:
        value = pins.checkpointing
    elif said is not None:
        value = said
    else:
        value = False
        notes.append(f"activation checkpointing taken as off: {source} does not say (the HF Trainer's "
                     "--gradient_checkpointing or the script decides); pin it with --checkpointing on")
    return value


def _from_yaml(path: Path, config: dict[str, Any], pins: Pins) -> FitSettings:
    from toolkit.check.accelerate import resolve_ds_file
    from toolkit.engines.validate import ConfigRejected, accelerate_launch_plugins

    kind = str(config.get("distributed_type", "NO"))
    source = f"{path.name} ({kind})"
    notes: list[str] = []
    extra: list[str] = []
    ds_path = None
    ds_file = _mapping(config.get("deepspeed_config")).get("deepspeed_config_file") if kind == "DEEPSPEED" else None
    from toolkit.emit.accelerate import inline_ds_config

    inline = inline_ds_config(ds_file) if ds_file else None  # emitted YAMLs carry the JSON text; accelerate parses it
    if ds_file and inline is None:
        ds_path = resolve_ds_file(str(ds_file), path, [], quiet=True)
        if ds_path is None:
            raise UserError(f"{path}: deepspeed_config_file {ds_file} does not exist; the fit check needs it")
        extra = ["--deepspeed_config_file", str(ds_path)]
    if "num_processes" not in config:
        extra += ["--num_processes", "1"]
    try:
        with quiet_engines():
            _, plugin, env = accelerate_launch_plugins(path, extra)
    except ConfigRejected as exc:
        raise UserError(f"{path}: accelerate refuses the file ({exc}), so the fit check cannot read it; fix the "
                        "findings above first") from None
    except (RuntimeError, ImportError) as exc:
        raise UserError(f"{path}: accelerate's launch check stops on this machine ({exc}); the fit check needs it")
    mixed = env.get("ACCELERATE_MIXED_PRECISION", str(config.get("mixed_precision", "no")))
    yaml_precision = {"bf16": "bf16", "fp16": "fp16", "fp8": "bf16"}.get(mixed)
    if mixed == "fp8":
        notes.append("fp8 is estimated as bf16 mixed precision (fp8 matmuls keep bf16 weights and activations)")
    if kind == "DEEPSPEED" and plugin is not None:
        # The plugin's config: the JSON after accelerate filled it, or the one it builds from the YAML's fields.
        ds = json.loads(json.dumps(plugin.deepspeed_config, default=str))
        if "mixed_precision" not in config:
            # accelerate filled the flags from its default "no"; the HF Trainer fills them from --bf16 / --fp16
            # instead, so what the files leave open stays open.
            raw = read_config(ds_path) if ds_path else (inline or {})
            for key in ("bf16", "fp16"):
                ds[key] = raw.get(key, {"enabled": "auto"})
            yaml_precision = None
        settings = _from_deepspeed(ds, pins, source, yaml_precision=yaml_precision, assumptions=tuple(notes))
        return replace(settings, sizes=_env_sizes(env) + settings.sizes)
    precision = pins.precision or yaml_precision or "fp32"
    micro = pins.micro_batch or 1
    if pins.micro_batch is None:
        notes.append(f"micro-batch taken as 1: {source} does not set it (the HF Trainer's "
                     "--per_device_train_batch_size or the script's DataLoader does); pin it with --micro-batch")
    shard_group = None
    if kind == "FSDP" and plugin is not None:
        strategy, said_ckpt = _fsdp_strategy(plugin, notes)
        prefix = "PARALLELISM_CONFIG_"
        sizes = {k.removeprefix(prefix): v for k, v in env.items() if k.startswith(prefix)}
        if sizes.get("DP_SHARD_SIZE", "").isdigit() and sizes.get("CP_SIZE", "1").isdigit():
            shard_group = int(sizes["DP_SHARD_SIZE"]) * int(sizes.get("CP_SIZE", "1"))
    else:
        strategy, said_ckpt = Strategy("ddp"), None
    checkpointing = _checkpointing(pins, said_ckpt, source, notes)
    return FitSettings(strategy, micro, precision, checkpointing, assumptions=tuple(notes), shard_group=shard_group,
                       sizes=_env_sizes(env))


def _env_sizes(env: dict[str, str]) -> tuple[tuple[str, int], ...]:
    """The sizes accelerate's launcher hands the processes (PARALLELISM_CONFIG_*), when the YAML has the block."""
    if env.get("ACCELERATE_USE_PARALLELISM_CONFIG", "").lower() != "true":
        return ()
    out = []
    for name in ("dp_replicate", "dp_shard", "tp", "cp", "sp"):
        value = env.get(f"PARALLELISM_CONFIG_{name.upper()}_SIZE", "1")
        out.append((name, int(value) if value.isdigit() else 1))
    return tuple(out)


def _plan_sizes(plan) -> tuple[tuple[str, int], ...]:
    g = plan.grid
    if g.model_parallel == 1:
        return (("expert", g.expert),) if g.expert > 1 and not g.expert_shared_batch else ()
    return (("dp_replicate", g.dp_replicate), ("dp_shard", g.dp_shard), ("tp", g.tensor), ("cp", g.context),
            ("sp", g.sequence))


def _fsdp_strategy(plugin: Any, notes: list[str]) -> tuple[Strategy, bool | None]:
    """FullyShardedDataParallelPlugin: FSDP2 says reshard_after_forward, FSDP1 a ShardingStrategy."""
    if int(getattr(plugin, "fsdp_version", 1) or 1) == 2:
        mode = "full" if plugin.reshard_after_forward else "grad_op"
    else:
        name = getattr(plugin.sharding_strategy, "name", str(plugin.sharding_strategy))
        mode = {"SHARD_GRAD_OP": "grad_op", "HYBRID_SHARD": "hybrid", "_HYBRID_SHARD_ZERO2": "hybrid"}.get(name, "full")
        if name == "NO_SHARD":
            return Strategy("ddp"), bool(plugin.activation_checkpointing)
    offload = getattr(plugin, "cpu_offload", None)
    if offload is not None and getattr(offload, "offload_params", offload is True):
        notes.append("FSDP CPU offload is not modelled: the estimate keeps parameters on the GPU, an upper bound")
    if int(getattr(plugin, "fsdp_version", 1) or 1) == 2 and type(offload).__name__ == "CPUOffloadPolicy":
        if mode == "full":
            return parse_strategy("fsdp2-offload"), bool(plugin.activation_checkpointing)
        notes.append("FSDP2 CPU offload is modelled with reshard_after_forward only: the estimate keeps parameters "
                     "on the GPU, an upper bound")
    return Strategy("fsdp2", fsdp_mode=mode), bool(plugin.activation_checkpointing)


def fit_findings(path: str, *, model: str, gpus: str | None, seq_len: int | None = None,
                 pins: Pins = Pins()) -> list[Problem]:
    """The assumptions (notes), then an error per GPU (or host) limit the described training would overflow."""
    from toolkit.inputs.choices import GIB
    from toolkit.inputs.hardware import parse_hardware
    from toolkit.inputs.grid import ParallelGrid
    from toolkit.inputs.job import Job, adapter_problem, check_job, default_seq_len
    from toolkit.estimate.memory import estimate_memory
    from toolkit.inputs.modelspec import resolve_model
    from toolkit.estimate.search import CPU_RAM_RESERVE

    if not gpus:
        raise UserError("--model needs --gpus with a GPU type, e.g. --gpus 8xH100-80GB")
    hw = parse_hardware(gpus)
    spec = resolve_model(model)
    moe = _lone_json_leaf_problem(path, spec)
    try:
        s = fit_settings(path, pins)
    except UserError as exc:  # the check's own findings say what is wrong with the file
        return moe + [Problem(path, "note", f"fit check skipped: {exc}", EVERY)]
    notes = list(s.assumptions)
    seq, adapted = default_seq_len(spec, seq_len or s.seq_len)
    if seq_len is None and s.seq_len is None:
        notes.append(f"sequence length taken as {seq}" + (f" ({adapted})" if adapted else " (toolkit's default)")
                     + "; pin it with --seq")
    job = Job(seq_len=seq, micro_batch=s.micro_batch, precision=s.precision, checkpointing=s.checkpointing,
              **dict(s.job_options))
    strategy = s.strategy
    sizes = dict(s.sizes)
    grid = None
    if any(sizes.get(k, 1) > 1 for k in ("tp", "cp", "sp")):
        # Tensor / context / sequence parallelism: the grid the files describe, with its rules (toolkit.inputs.grid).
        try:
            grid = ParallelGrid(hw.nodes, hw.gpus_per_node, dp_replicate=sizes["dp_replicate"],
                                dp_shard=hw.world_size // (sizes["dp_replicate"] * sizes["tp"] * sizes["cp"]
                                                           * sizes["sp"]) if strategy.engine == Engine.DEEPSPEED
                                else sizes["dp_shard"], tensor=sizes["tp"], context=sizes["cp"],
                                sequence=sizes["sp"])
            grid.check_model(spec)
            grid.check_sequence(seq, spec.effective_attention(job.attention), spec)
        except UserError as exc:
            return [Problem(path, "note", f"fit check assumption: {n}", EVERY) for n in notes] + [
                Problem(path, "error", f"{spec.name}: {exc}", EVERY)]
        notes.append(f"parallelism_config: {grid.describe()} (tensor / context / sequence parallelism modelled "
                     "per rank: toolkit.estimate.dimensions)")
    elif sizes.get("expert", 1) > 1:
        # Expert parallelism (DeepSpeed AutoEP's autoep_size, or a plan's FSDP2 x EP): experts / degree a rank.
        try:
            grid = ParallelGrid.for_strategy(strategy, nodes=hw.nodes, gpus_per_node=hw.gpus_per_node,
                                             expert=sizes["expert"])
            grid.check_model(spec)
        except UserError as exc:  # the AutoEP findings above say it for a JSON; the fit has no grid to cost
            said = any(p.severity == "error" for p in moe)
            return moe + [Problem(path, "note", f"fit check assumption: {n}", EVERY) for n in notes] + [
                Problem(path, "note" if said else "error", f"{'fit check skipped: ' if said else ''}{spec.name}: "
                        f"{exc}", EVERY)]
        notes.append(f"expert parallelism: {grid.describe()} ({spec.moe_experts // sizes['expert']} of "
                     f"{spec.moe_experts} experts a rank)")
    elif s.shard_group and s.shard_group < hw.world_size and hw.world_size % s.shard_group == 0:
        # The estimator's hybrid FSDP shards within a "node"; a node of dp_shard x cp GPUs is that group.
        strategy = replace(strategy, fsdp_mode="hybrid")
        hw = replace(hw, gpus_per_node=s.shard_group, nodes=hw.world_size // s.shard_group)
        notes.append(f"FSDP shards over dp_shard x cp = {s.shard_group} of {hw.world_size} GPUs (parallelism_config)")
    if adapter_problem(job.adapter, strategy):
        # A plan's method the runner refuses under its strategy: the folder check's error on plan.json
        # (toolkit.check.folder.plan_adapter_problems) says it, and there is no such run to fit.
        return [Problem(path, "note", f"fit check skipped: {job.adapter.method} cannot train under {strategy.name} "
                        "(the error on plan.json says why)", EVERY)]
    try:
        check_job(spec, job, hw, strategy, pipeline_stages=s.stages)
    except UserError as exc:
        return [Problem(path, "note", f"fit check assumption: {n}", EVERY) for n in notes] + [
            Problem(path, "error", f"{spec.name}: {exc}", EVERY)]
    partition = s.partition
    if strategy.is_pipeline and partition is None:
        partition = ParallelGrid.for_strategy(strategy, nodes=hw.nodes, gpus_per_node=hw.gpus_per_node,
                                              pipeline_stages=s.stages).partition(spec)
    memory = estimate_memory(spec, strategy, job, hw, pipeline_stages=s.stages, partition=partition, grid=grid)
    out = moe + [Problem(path, "note", f"fit check assumption: {n}", EVERY) for n in notes]
    what = (f"{spec.name} with {strategy.name}, {s.precision}, micro-batch {s.micro_batch}, seq {seq}"
            f"{', checkpointing' if s.checkpointing else ''}")
    if not memory.fits:
        out.append(Problem(path, "error", f"{what}: needs {memory.required_bytes / GIB:.1f} GiB of "
                           f"{memory.capacity_bytes / GIB:.1f} per GPU (run `toolkit plan {model} --gpus {gpus} "
                           f"--seq {seq} ...` for one that fits)", EVERY))
    else:
        out.append(Problem(path, "note", f"{what}: fits, {memory.required_bytes / GIB:.1f} GiB of "
                           f"{memory.capacity_bytes / GIB:.1f} per GPU", EVERY))
    if memory.cpu_bytes_per_node > hw.cpu_ram_bytes_per_node * (1 - CPU_RAM_RESERVE):
        out.append(Problem(path, "error", f"offload needs {memory.cpu_bytes_per_node / GIB:.0f} GiB host RAM per node "
                           f"of {hw.cpu_ram_bytes_per_node / GIB:.0f}", EVERY))
    return out


def _lone_json_leaf_problem(path: str, spec) -> list[Problem]:
    """The model findings for a DeepSpeed JSON (leaf modules, AutoEP, a quantized checkpoint) or accelerate YAML
    (leaf modules, a quantized checkpoint) given with --model (a plan folder gets them from the folder check, with
    the plan's model)."""
    from toolkit.check.moe import autoep_problems, leaf_module_problem, yaml_leaf_module_problem
    from toolkit.check.quantized import quantized_checkpoint_problem

    p = Path(path)
    if p.is_dir():
        return []
    config = read_config(p)
    if p.suffix == ".json" and is_plan_json(config):
        return []
    is_json = p.suffix == ".json"
    zero = (config.get("zero_optimization") if is_json else None) or {}
    quantized = quantized_checkpoint_problem(spec.config_dict(), path, model=spec.name, params=spec.params,
                                             method=None, zero3=isinstance(zero, dict) and zero.get("stage") == 3)
    if not is_json:
        found = yaml_leaf_module_problem(config, p, model=spec.name, moe_block=spec.leaf_module_needed)
        return [f for f in (found, quantized) if f]
    found = leaf_module_problem(config, path, model=spec.name, moe_block=spec.leaf_module_needed)
    return [f for f in (found, quantized) if f] + autoep_problems(config, path, model=spec.name,
                                                                  model_type=spec.model_type,
                                                                  experts=spec.moe_experts)
