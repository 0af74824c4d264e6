"""The parallel grid: how a job's processes are arranged, and the batch and layer arithmetic that follows from it.

`ParallelGrid` is the one owner of
  - world = nodes x GPUs per node, and its factorisation into degrees:
    pipeline stages x data-parallel (replicate x shard) x tensor x context == world
    (tensor and context degrees are kept at 1 until the planner plans them);
  - the batch identity every engine asserts: global batch = micro-batch x accumulation x data-parallel
    (DeepSpeed: `train_batch_size == train_micro_batch_size_per_gpu * gradient_accumulation_steps * dp` with
    dp = world / pipeline stages, deepspeed/runtime/config.py `_batch_assertion`);
  - the split of a model's decoder layers over the pipeline stages and the parameters each stage holds.
It validates once, where it is built, and its errors name the knob to change and the values that work. The planner,
estimate, timing, emit, check, launch and both training runners take their numbers from it.

Modelled on torchtitan's ParallelDims (dp_replicate x dp_shard x cp x tp x pp == world_size, checked with a message
naming the degree) and accelerate's ParallelismConfig (dp_replicate / dp_shard / tp / cp sizes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from toolkit.errors import UserError
from toolkit.pipeline.partition import balanced_partition, check_partition, check_stage_count
from toolkit.strategy import Kind, Strategy

if TYPE_CHECKING:
    from toolkit.hardware import Hardware
    from toolkit.modelspec import ModelSpec

MAX_MICRO_BATCH = 64
"""Largest micro-batch the planner tries: beyond it per-GPU throughput no longer grows on any catalog GPU."""


@dataclass(frozen=True)
class ParallelGrid:
    nodes: int
    gpus_per_node: int
    pipeline_stages: int = 1
    """Pipeline stages (1 unless the engine is DeepSpeed's pipeline engine)."""
    dp_replicate: int = 1
    """Data-parallel replicas that each hold the whole (stage's) model states: DDP, and HSDP across nodes."""
    dp_shard: int = 1
    """Data-parallel ranks that shard the states between them: ZeRO, FSDP2, HSDP inside a node."""
    tensor: int = 1
    """Tensor-parallel degree. Not planned yet: always 1."""
    context: int = 1
    """Context (sequence) parallel degree. Not planned yet: always 1."""

    def __post_init__(self) -> None:
        for name, value in (("nodes", self.nodes), ("GPUs per node", self.gpus_per_node),
                            ("pipeline stages", self.pipeline_stages), ("data-parallel replicas", self.dp_replicate),
                            ("data-parallel shards", self.dp_shard), ("tensor degree", self.tensor),
                            ("context degree", self.context)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UserError(f"{name} must be a positive integer, got {value!r}")
        if self.tensor != 1 or self.context != 1:
            raise UserError("tensor and context parallelism are not planned yet; use degree 1")
        product = self.pipeline_stages * self.dp_replicate * self.dp_shard * self.tensor * self.context
        if product != self.world:
            raise UserError(
                f"parallel degrees do not multiply to the GPU count: pipeline {self.pipeline_stages} x data-parallel "
                f"{self.dp_replicate} x {self.dp_shard} = {product}, but {self.nodes} node(s) x {self.gpus_per_node} "
                f"= {self.world} GPUs; change --pipeline-stages or --gpus")

    # --- construction -------------------------------------------------------------------------------------------

    @classmethod
    def for_strategy(cls, strategy: Strategy, *, nodes: int, gpus_per_node: int,
                     pipeline_stages: int | None = None) -> "ParallelGrid":
        """The grid a strategy runs on. `pipeline_stages` None: the strategy's default (pipeline: every GPU a
        stage; hybrid: one stage per node, at least 2). Raises UserError saying why the strategy cannot run here."""
        world = nodes * gpus_per_node
        if not strategy.is_pipeline:
            if pipeline_stages not in (None, 1):
                raise UserError(f"--pipeline-stages {pipeline_stages} needs a pipeline strategy (pipeline or "
                                f"hybrid), not {strategy.name}; drop the flag or choose --strategy hybrid")
            if strategy.kind == Kind.DDP:
                return cls(nodes, gpus_per_node, dp_replicate=world)
            if strategy.kind == Kind.FSDP2 and strategy.fsdp_mode == "hybrid":
                if nodes < 2:
                    raise UserError("HSDP (fsdp2-hybrid) shards inside a node and replicates across nodes; it "
                                    "needs 2+ nodes (use fsdp2 on one node)")
                return cls(nodes, gpus_per_node, dp_replicate=nodes, dp_shard=gpus_per_node)
            return cls(nodes, gpus_per_node, dp_shard=world)
        if world < 2:
            raise UserError(f"{strategy.name} needs 2+ GPUs (one per stage)")
        stages = pipeline_stages if pipeline_stages is not None else default_stages(strategy, nodes, gpus_per_node)
        if stages < 1 or world % stages:
            raise UserError(f"--pipeline-stages {stages} does not divide {world} GPUs into whole data-parallel "
                            f"replicas (try {', '.join(str(s) for s in _divisors(world) if s > 1)})")
        dp = world // stages
        if strategy.kind == Kind.PIPELINE and dp != 1:
            raise UserError(f"pipeline uses every GPU as a stage ({world} stages); for {stages} stages x {dp} "
                            "data-parallel use --strategy hybrid")
        if strategy.kind == Kind.HYBRID and dp < 2:
            raise UserError(f"hybrid needs data-parallel 2+ ({stages} stages on {world} GPUs leaves 1); "
                            "use --strategy pipeline or fewer stages")
        # The pipeline engine's ZeRO-1 (hybrid, and bf16 pipelines) partitions optimizer states over dp.
        return cls(nodes, gpus_per_node, pipeline_stages=stages, dp_shard=dp)

    # --- degrees ------------------------------------------------------------------------------------------------

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def data_parallel(self) -> int:
        """Ranks that see different data (world / (pipeline x tensor x context))."""
        return self.dp_replicate * self.dp_shard

    @property
    def shard_group(self) -> int:
        """Ranks one sharded state is split over (1: replicated)."""
        return self.dp_shard

    # --- batch arithmetic -------------------------------------------------------------------------------------

    def global_batch(self, micro_batch: int, grad_accum: int) -> int:
        return micro_batch * grad_accum * self.data_parallel

    def tokens_per_step(self, micro_batch: int, grad_accum: int, seq_len: int) -> int:
        return self.global_batch(micro_batch, grad_accum) * seq_len

    def check_batch(self, global_batch: int, micro_batch: int, grad_accum: int) -> None:
        """The batch identity, with the values that would make it hold."""
        if self.global_batch(micro_batch, grad_accum) == global_batch:
            return
        got = self.global_batch(micro_batch, grad_accum)
        hint = ""
        if global_batch % (micro_batch * self.data_parallel) == 0:
            hint = f"; accumulation {global_batch // (micro_batch * self.data_parallel)} makes it hold"
        raise UserError(f"batch does not multiply: micro-batch {micro_batch} x accumulation {grad_accum} x "
                        f"data-parallel {self.data_parallel} = {got}, not the global batch {global_batch}{hint}")

    def batch_splits(self, global_batch: int | None, *, micro_batch: int | None = None,
                     grad_accum: int | None = None, max_micro_batch: int = MAX_MICRO_BATCH) -> list[tuple[int, int]]:
        """Every (micro-batch, accumulation) pair that meets `global_batch` exactly on this grid, honouring the
        ones the user fixed. Without a global batch: the user's micro-batch and accumulation as given."""
        dp = self.data_parallel
        if global_batch is None:
            if micro_batch is None:
                raise UserError("give --global-batch G, or --micro-batch B (with optional --accumulation A)")
            return [(micro_batch, grad_accum or 1)]
        if global_batch % dp:
            raise UserError(f"global batch {global_batch} does not divide over {dp} data-parallel ranks (use a "
                            f"multiple of {dp})")
        per_rank = global_batch // dp
        if micro_batch is not None:
            if per_rank % micro_batch:
                raise UserError(f"global batch {global_batch} / {dp} ranks = {per_rank} per rank is not a multiple "
                                f"of micro-batch {micro_batch}")
            if grad_accum is not None:
                self.check_batch(global_batch, micro_batch, grad_accum)
            return [(micro_batch, per_rank // micro_batch)]
        if grad_accum is not None:
            if per_rank % grad_accum:
                raise UserError(f"{per_rank} samples per rank do not split into {grad_accum} accumulation steps")
            return [(per_rank // grad_accum, grad_accum)]
        return [(b, per_rank // b) for b in _divisors(per_rank) if b <= max_micro_batch]

    # --- layers over stages --------------------------------------------------------------------------------------

    def check_model(self, spec: "ModelSpec") -> None:
        """Whether this grid's stages can hold `spec` (a stage per layer at least; a convertible architecture)."""
        if self.pipeline_stages == 1:
            return
        if spec.pipeline_blocker:
            raise UserError(f"pipeline conversion cannot split {spec.model_type} ({spec.pipeline_blocker}); ZeRO "
                            "and FSDP2 run it")
        check_stage_count(spec.num_layers, self.pipeline_stages, self.world)

    def partition(self, spec: "ModelSpec") -> list[int]:
        """Decoder-layer boundaries per stage ([0, L] for one stage), balanced by parameters with the embedding on
        the first stage and the final norm + head (and a tied head's own copy) on the last."""
        if self.pipeline_stages == 1:
            return [0, spec.num_layers]
        self.check_model(spec)
        head = spec.post_layer_params + (spec.embedding_params if spec.tied else 0)
        return balanced_partition([float(p) for p in spec.layer_params], self.pipeline_stages,
                                  first_extra=float(spec.pre_layer_params), last_extra=float(head))

    def even_partition(self, num_layers: int) -> list[int]:
        """Layer boundaries with the same number of layers per stage (within one), for callers without a spec."""
        check_stage_count(num_layers, self.pipeline_stages)
        return balanced_partition([1.0] * num_layers, self.pipeline_stages)

    def check_partition(self, partition: list[int], num_layers: int) -> None:
        check_partition(partition, num_layers, self.pipeline_stages)

    def stage_params(self, spec: "ModelSpec", partition: list[int] | None = None) -> list[int]:
        """Parameters each stage holds: its layers, the embedding on the first, the final norm + head on the last,
        and with tied embeddings on 2+ stages the last stage's own copy of the tied matrix (DeepSpeed's
        TiedLayerSpec keeps one per stage that uses it, runtime/pipe/module.py)."""
        bounds = partition if partition is not None else self.partition(spec)
        stages = len(bounds) - 1
        out = [sum(spec.layer_params[a:b]) for a, b in zip(bounds, bounds[1:])]
        out[0] += spec.pre_layer_params
        out[-1] += spec.post_layer_params
        if spec.tied and stages > 1:
            out[-1] += spec.embedding_params
        return out

    def describe(self) -> str:
        if self.pipeline_stages > 1:
            return f"pp={self.pipeline_stages} x dp={self.data_parallel}"
        if self.dp_replicate > 1 and self.dp_shard > 1:
            return f"dp={self.dp_replicate} replicas x {self.dp_shard} shards"
        return f"dp={self.data_parallel}"


def grid_of(strategy: Strategy, hw: "Hardware", pipeline_stages: int | None = 1) -> ParallelGrid:
    """The grid `strategy` runs on with `hw` (pipeline_stages counts only for pipeline strategies; None: the
    strategy's default)."""
    return ParallelGrid.for_strategy(strategy, nodes=hw.nodes, gpus_per_node=hw.gpus_per_node,
                                     pipeline_stages=pipeline_stages if strategy.is_pipeline else None)


def default_stages(strategy: Strategy, nodes: int, gpus_per_node: int) -> int:
    """Stage count when the user names none: pipeline uses every GPU; hybrid one stage per node (at least 2)."""
    world = nodes * gpus_per_node
    if strategy.kind == Kind.PIPELINE:
        return world
    return max(2, nodes) if world % max(2, nodes) == 0 else 2


def stage_options(strategy: Strategy, nodes: int, gpus_per_node: int) -> list[int]:
    """Stage counts the planner tries for a strategy."""
    world = nodes * gpus_per_node
    if not strategy.is_pipeline:
        return [1]
    if strategy.kind == Kind.PIPELINE:
        return [world]
    return [p for p in _divisors(world) if 1 < p < world]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
