"""The planner: every strategy the engines support x micro-batch x accumulation x checkpointing x pipeline
stages, each costed by the memory and step-time models, ranked by predicted tokens/s (ties: more headroom).

A candidate that cannot run says why: it does not fit ("needs 93.1 GiB of 79.1"), the batch does not divide, the
layers do not split into the stages, the GPU lacks the precision, the node lacks host RAM for offload.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from toolkit.errors import UserError
from toolkit.hardware import GIB, Hardware
from toolkit.job import Job
from toolkit.memory import Breakdown, estimate_memory, states_floor_bytes
from toolkit.modelspec import ModelSpec
from toolkit.plan import Plan
from toolkit.strategy import ALL_STRATEGY_NAMES, Strategy, parse_strategy
from toolkit.timing import Timing, step_time

MAX_MICRO_BATCH = 64
CPU_RAM_RESERVE = 0.10
"""Share of host RAM left to the OS, dataloaders and the Python processes when offloading."""


@dataclass(frozen=True, eq=False)
class Candidate:
    strategy: Strategy
    job: Job
    pipeline_stages: int
    data_parallel: int
    global_batch: int
    partition: list[int] | None = None
    memory: Breakdown | None = None
    timing: Timing | None = None
    reason: str | None = None
    """Why it cannot run (None: feasible)."""

    @property
    def feasible(self) -> bool:
        return self.reason is None

    @property
    def name(self) -> str:
        if self.strategy.is_pipeline:
            return f"{self.strategy.name} (pp={self.pipeline_stages} x dp={self.data_parallel})"
        return self.strategy.name

    def row(self) -> dict[str, Any]:
        """The plain-dict view the emitters' PLAN.md chart and --json output use."""
        return {
            "name": self.name, "strategy": self.strategy.name, "feasible": self.feasible, "reason": self.reason,
            "micro_batch": self.job.micro_batch, "grad_accum": self.job.grad_accum,
            "checkpointing": self.job.checkpointing, "pipeline_stages": self.pipeline_stages,
            "data_parallel": self.data_parallel, "global_batch": self.global_batch,
            "peak_bytes": self.memory.required_bytes if self.memory else None,
            "capacity_bytes": self.memory.capacity_bytes if self.memory else None,
            "cpu_bytes_per_node": self.memory.cpu_bytes_per_node if self.memory else None,
            "step_time_s": self.timing.step_time_s if self.timing else None,
            "tokens_per_s": self.timing.tokens_per_s if self.timing else None,
        }


@dataclass(frozen=True)
class Request:
    """What the user asked for, before any strategy is chosen."""

    seq_len: int
    global_batch: int | None = None
    micro_batch: int | None = None
    grad_accum: int | None = None
    precision: str = "bf16"
    optimizer: str = "adamw"
    attention: str = "sdpa"
    device_kind: str = "cuda"
    checkpointing: bool | None = None
    """None: let the planner choose; True/False: force it."""
    pipeline_stages: int | None = None
    strategies: tuple[str, ...] = ALL_STRATEGY_NAMES

    def __post_init__(self) -> None:
        if self.global_batch is None and self.micro_batch is None:
            raise UserError("give --global-batch G, or --micro-batch B (with optional --accumulation A)")
        for flag, value in (("--global-batch", self.global_batch), ("--micro-batch", self.micro_batch),
                            ("--accumulation", self.grad_accum), ("--pipeline-stages", self.pipeline_stages)):
            if value is not None and value <= 0:
                raise UserError(f"{flag} must be a positive integer, got {value}")
        Job(seq_len=self.seq_len, precision=self.precision, optimizer=self.optimizer,  # validates choices
            attention=self.attention, device_kind=self.device_kind)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _grids(strategy: Strategy, spec: ModelSpec, hw: Hardware, req: Request) -> list[tuple[int, int]] | str:
    """(pipeline stages, data parallel) pairs to try, or the reason there are none."""
    world = hw.world_size
    if not strategy.is_pipeline:
        if strategy.kind == "fsdp2" and strategy.fsdp_mode == "hybrid" and hw.nodes < 2:
            return "shards inside a node and replicates across nodes; needs 2+ nodes"
        if strategy.kind == "ddp" and req.pipeline_stages not in (None, 1):
            return "no pipeline stages in DDP"
        return [(1, world)]
    if world < 2:
        return "needs 2+ GPUs"
    from toolkit.pipeline.partition import PIPELINE_MODEL_TYPES

    if spec.model_type not in PIPELINE_MODEL_TYPES:
        return (f"pipeline conversion supports {', '.join(PIPELINE_MODEL_TYPES)}, not {spec.model_type}; "
                "ZeRO and FSDP2 run it")
    if req.pipeline_stages is not None:
        stage_options = [req.pipeline_stages]
    elif strategy.kind == "pipeline":
        stage_options = [world]
    else:
        stage_options = [p for p in _divisors(world) if 1 < p < world]
    grids = []
    problems = []
    for p in stage_options:
        dp = world // p
        if world % p:
            problems.append(f"{p} stages do not divide {world} GPUs")
            continue
        if strategy.kind == "pipeline" and dp != 1:
            problems.append(f"pipeline uses every GPU as a stage ({world}); use hybrid for {p} stages x {dp}")
            continue
        if strategy.kind == "hybrid" and dp < 2:
            problems.append("hybrid needs data parallel 2+")
            continue
        if p > spec.num_layers:
            problems.append(f"{spec.num_layers} layers do not split into {p} stages")
            continue
        grids.append((p, dp))
    if not grids:
        from toolkit.pipeline.partition import stage_counts

        ok = [s for s in stage_counts(spec.num_layers, world) if s > 1]
        hint = f" (stage counts that work on {world} GPUs: {', '.join(map(str, ok))})" if ok else ""
        return f"{'; '.join(problems) or 'no stage count fits'}{hint}"
    return grids


def _batch_options(req: Request, dp: int) -> list[tuple[int, int]] | str:
    """(micro_batch, grad_accum) pairs meeting the batch exactly."""
    if req.global_batch is None:
        return [(req.micro_batch, req.grad_accum or 1)]
    if req.global_batch % dp:
        return f"global batch {req.global_batch} does not divide over {dp} data-parallel ranks"
    per_replica = req.global_batch // dp
    if req.micro_batch is not None:
        if per_replica % req.micro_batch:
            return (f"global batch {req.global_batch} / {dp} ranks = {per_replica} per rank is not a multiple of "
                    f"micro-batch {req.micro_batch}")
        if req.grad_accum is not None and req.micro_batch * req.grad_accum != per_replica:
            return (f"micro-batch {req.micro_batch} x accumulation {req.grad_accum} x {dp} ranks != global batch "
                    f"{req.global_batch}")
        return [(req.micro_batch, per_replica // req.micro_batch)]
    if req.grad_accum is not None:
        if per_replica % req.grad_accum:
            return f"{per_replica} samples per rank do not split into {req.grad_accum} accumulation steps"
        return [(per_replica // req.grad_accum, req.grad_accum)]
    return [(b, per_replica // b) for b in _divisors(per_replica) if b <= MAX_MICRO_BATCH]


def _partition(spec: ModelSpec, stages: int) -> list[int]:
    """Balance stages by parameter bytes, with the embedding and head (and the tied copy) as extras."""
    from toolkit.pipeline.partition import balanced_partition

    head_extra = spec.post_layer_params + (spec.embedding_params if spec.tied else 0)
    return balanced_partition([float(p) for p in spec.layer_params], stages,
                              first_extra=float(spec.pre_layer_params), last_extra=float(head_extra))


def _check_hardware(strategy: Strategy, req: Request, hw: Hardware) -> str | None:
    if req.precision in ("bf16", "bf16-pure") and not hw.gpu.bf16_supported:
        return f"{hw.gpu.name} has no bf16; use --precision fp16 or fp32"
    if strategy.is_pipeline and req.precision == "bf16-pure":
        return "pipeline engine runs bf16 with fp32 gradient accumulation; use --precision bf16"
    return None


def evaluate(spec: ModelSpec, hw: Hardware, strategy: Strategy, job: Job, *, stages: int, dp: int,
             partition: list[int] | None) -> Candidate:
    floor = states_floor_bytes(spec, strategy, job, hw, pipeline_stages=stages, partition=partition)
    if floor > hw.gpu.memory_bytes:
        return Candidate(strategy=strategy, job=job, pipeline_stages=stages, data_parallel=dp,
                         global_batch=job.micro_batch * job.grad_accum * dp, partition=partition,
                         reason=f"needs over {floor / GIB:.1f} GiB of {hw.gpu.memory_bytes / GIB:.1f} per GPU for "
                                "model states alone")
    memory = estimate_memory(spec, strategy, job, hw, pipeline_stages=stages, partition=partition)
    stage_params = None
    if partition is not None:
        stage_params = [sum(spec.layer_params[a:b]) for a, b in zip(partition, partition[1:])]
    timing = step_time(spec, strategy, job, hw, pipeline_stages=stages, stage_params=stage_params)
    reason = None
    if not memory.fits:
        reason = (f"needs {memory.required_bytes / GIB:.1f} GiB of {memory.capacity_bytes / GIB:.1f} per GPU"
                  + (" (largest stage)" if strategy.is_pipeline else ""))
    elif memory.cpu_bytes_per_node > hw.cpu_ram_bytes_per_node * (1 - CPU_RAM_RESERVE):
        reason = (f"offload needs {memory.cpu_bytes_per_node / GIB:.0f} GiB host RAM per node of "
                  f"{hw.cpu_ram_bytes_per_node / GIB:.0f} (keep {CPU_RAM_RESERVE:.0%} free)")
    return Candidate(strategy=strategy, job=job, pipeline_stages=stages, data_parallel=dp,
                     global_batch=job.micro_batch * job.grad_accum * dp, partition=partition, memory=memory,
                     timing=timing, reason=reason)


def _better(a: Candidate, b: Candidate | None) -> bool:
    if b is None:
        return True
    if a.feasible != b.feasible:
        return a.feasible
    if a.feasible:
        ka = (round(a.timing.tokens_per_s, 6), a.memory.headroom_bytes)
        kb = (round(b.timing.tokens_per_s, 6), b.memory.headroom_bytes)
        return ka > kb
    return _need(a) < _need(b)  # the least-infeasible explains best


def _need(c: Candidate) -> float:
    if c.memory is not None:
        return c.memory.required_bytes
    return float("inf") if c.reason is None else 1e30


def plan_candidates(spec: ModelSpec, hw: Hardware, req: Request) -> list[Candidate]:
    """One best candidate per strategy (and per stage count for pipeline plans), feasible first by tokens/s."""
    strategies = [parse_strategy(s) for s in req.strategies]
    if hw.world_size == 1:
        strategies = [s for s in strategies if s.kind == "ddp" or s.offloads] or strategies
    best: dict[str, Candidate] = {}
    refused: dict[str, Candidate] = {}
    ckpt_options = [False, True] if req.checkpointing is None else [req.checkpointing]
    for strategy in strategies:
        key = strategy.name
        problem = _check_hardware(strategy, req, hw)
        grids = _grids(strategy, spec, hw, req) if problem is None else problem
        if isinstance(grids, str):
            refused[key] = _refusal(strategy, req, hw, grids)
            continue
        for stages, dp in grids:
            batches = _batch_options(req, dp)
            if isinstance(batches, str):
                refused.setdefault(key, _refusal(strategy, req, hw, batches))
                continue
            partition = _partition(spec, stages) if strategy.is_pipeline else None
            for micro, accum in sorted(batches, reverse=True):
                for ckpt in ckpt_options:
                    job = Job(seq_len=req.seq_len, micro_batch=micro, grad_accum=accum, precision=req.precision,
                              optimizer=req.optimizer, checkpointing=ckpt, attention=req.attention,
                              device_kind=req.device_kind)
                    cand = evaluate(spec, hw, strategy, job, stages=stages, dp=dp, partition=partition)
                    if _better(cand, best.get(key)):
                        best[key] = cand
    ranked = sorted(best.values(), key=_rank_key)
    return ranked + [c for k, c in refused.items() if k not in best]


def _rank_key(c: Candidate):
    if not c.feasible:
        return (1, _need(c))
    return (0, -c.timing.tokens_per_s, -c.memory.headroom_bytes)


def _refusal(strategy: Strategy, req: Request, hw: Hardware, reason: str) -> Candidate:
    job = Job(seq_len=req.seq_len, micro_batch=req.micro_batch or 1, grad_accum=req.grad_accum or 1,
              precision=req.precision, optimizer=req.optimizer, attention=req.attention, device_kind=req.device_kind)
    return Candidate(strategy=strategy, job=job, pipeline_stages=1, data_parallel=hw.world_size,
                     global_batch=req.global_batch or 0, reason=reason)


def to_plan(c: Candidate, spec: ModelSpec, hw: Hardware, model_name: str) -> Plan:
    """The chosen candidate as the Plan that emit, launch and train read."""
    predicted: dict[str, Any] = {}
    if c.memory:
        predicted.update(c.memory.to_dict())
    if c.timing:
        predicted.update(c.timing.to_dict())
    notes = list(c.memory.notes) if c.memory else []
    if c.timing:
        notes += list(c.timing.assumptions)
    config = spec.config_dict()
    return Plan(
        model=model_name, model_config=_jsonable(config), model_type=spec.model_type, layer_class=spec.layer_class,
        num_layers=spec.num_layers, params=spec.params, strategy=c.strategy.name, engine=c.strategy.engine,
        zero_stage=c.strategy.zero_stage, offload_optimizer=c.strategy.offload_optimizer,
        offload_params=c.strategy.offload_params, fsdp_mode=c.strategy.fsdp_mode, num_machines=hw.nodes,
        gpus_per_node=hw.gpus_per_node, pipeline_stages=c.pipeline_stages, data_parallel=c.data_parallel,
        partition=list(c.partition) if c.partition else None, seq_len=c.job.seq_len, micro_batch=c.job.micro_batch,
        grad_accum=c.job.grad_accum, global_batch=c.global_batch, precision=c.job.precision,
        optimizer=c.job.optimizer, checkpointing=c.job.checkpointing,
        attention=spec.effective_attention(c.job.attention), gpu=hw.gpu.name,
        predicted=predicted, notes=notes)


def _jsonable(obj: Any) -> Any:
    import json

    return json.loads(json.dumps(obj, default=str))


# ----------------------------------------------------------------------------------------------------------------
# `toolkit check --model M --gpus SPEC`: does the model fit the configuration a file describes?


def _strategy_from_ds(ds: dict[str, Any]) -> Strategy:
    zero = ds.get("zero_optimization") or {}
    stage = int(zero.get("stage", 0) or 0)
    opt_dev = (zero.get("offload_optimizer") or {}).get("device", "none") or "none"
    par_dev = (zero.get("offload_param") or {}).get("device", "none") or "none"
    if stage == 0:
        return Strategy("ddp")
    return Strategy(f"zero{stage}", offload_optimizer=opt_dev if opt_dev in ("cpu", "nvme") else "none",
                    offload_params=par_dev if par_dev in ("cpu", "nvme") else "none")


def _int_or(value: Any, default: int) -> int:
    return value if isinstance(value, int) and value > 0 else default


def _inline_ds(p, text: str) -> dict[str, Any] | None:
    """The DeepSpeed config an emitted accelerate YAML carries as JSON text (toolkit.emit.accelerate), else None."""
    import yaml

    from toolkit.emit.accelerate import inline_ds_config

    if p.suffix not in (".yaml", ".yml"):
        return None
    cfg = yaml.safe_load(text) or {}
    return inline_ds_config((cfg.get("deepspeed_config") or {}).get("deepspeed_config_file")) \
        if isinstance(cfg, dict) else None


def _settings_of(path: str) -> dict[str, Any]:
    """Strategy, micro-batch, accumulation and precision a plan dir / DeepSpeed JSON / accelerate YAML states."""
    import json
    from pathlib import Path

    import yaml

    from toolkit.plan import load_plan

    p = Path(path)
    if p.is_dir() or p.name == "plan.json":
        plan = load_plan(p)
        return dict(strategy=parse_strategy(plan.strategy), micro_batch=plan.micro_batch, grad_accum=plan.grad_accum,
                    precision=plan.precision, seq_len=plan.seq_len, stages=plan.pipeline_stages,
                    partition=plan.partition, checkpointing=plan.checkpointing)
    text = p.read_text()
    if p.suffix == ".json" or _inline_ds(p, text) is not None:
        ds = json.loads(text) if p.suffix == ".json" else _inline_ds(p, text)
        precision = "bf16" if (ds.get("bf16") or {}).get("enabled") is True else \
            "fp16" if (ds.get("fp16") or {}).get("enabled") is True else "fp32"
        return dict(strategy=_strategy_from_ds(ds), micro_batch=_int_or(ds.get("train_micro_batch_size_per_gpu"), 1),
                    grad_accum=_int_or(ds.get("gradient_accumulation_steps"), 1), precision=precision)
    cfg = yaml.safe_load(text) or {}
    ds_file = (cfg.get("deepspeed_config") or {}).get("deepspeed_config_file")
    if ds_file:
        ds_path = Path(ds_file) if Path(ds_file).is_absolute() else p.parent / ds_file
        if ds_path.is_file():
            return _settings_of(str(ds_path))
    precision = {"bf16": "bf16", "fp16": "fp16"}.get(str(cfg.get("mixed_precision", "no")), "fp32")
    if cfg.get("distributed_type") == "FSDP":
        fsdp = cfg.get("fsdp_config") or {}
        mode = "full" if fsdp.get("fsdp_reshard_after_forward", True) in (True, "FULL_SHARD") else "grad_op"
        return dict(strategy=Strategy("fsdp2", fsdp_mode=mode), micro_batch=1, grad_accum=1, precision=precision)
    return dict(strategy=Strategy("ddp"), micro_batch=1, grad_accum=1, precision=precision)


def fit_problems(path: str, *, model: str, gpus: str | None, seq_len: int | None = None) -> list[str]:
    """One line per GPU (or host) that the described configuration would overflow with `model`."""
    from toolkit.hardware import parse_hardware
    from toolkit.modelspec import resolve_model

    if not gpus:
        raise UserError("--model needs --gpus with a GPU type, e.g. --gpus 8xH100-80GB")
    try:
        s = _settings_of(path)
    except (OSError, ValueError) as exc:
        return [f"cannot read the settings for the fit check: {exc}"]
    hw = parse_hardware(gpus)
    spec = resolve_model(model)
    seq = seq_len or s.get("seq_len") or min(spec.max_positions or 2048, 2048)
    job = Job(seq_len=seq, micro_batch=s["micro_batch"], grad_accum=s["grad_accum"], precision=s["precision"],
              checkpointing=bool(s.get("checkpointing", False)))
    stages = s.get("stages", 1)
    partition = s.get("partition")
    if s["strategy"].is_pipeline and partition is None:
        partition = _partition(spec, stages)
    memory = estimate_memory(spec, s["strategy"], job, hw, pipeline_stages=stages, partition=partition)
    problems = []
    if not memory.fits:
        problems.append(f"{spec.name} with {s['strategy'].name}, micro-batch {job.micro_batch}, seq {seq}: needs "
                        f"{memory.required_bytes / GIB:.1f} GiB of {memory.capacity_bytes / GIB:.1f} per GPU "
                        f"(run `toolkit plan {model} --gpus {gpus} --seq {seq} ...` for one that fits)")
    if memory.cpu_bytes_per_node > hw.cpu_ram_bytes_per_node * (1 - CPU_RAM_RESERVE):
        problems.append(f"offload needs {memory.cpu_bytes_per_node / GIB:.0f} GiB host RAM per node of "
                        f"{hw.cpu_ram_bytes_per_node / GIB:.0f}")
    return problems
