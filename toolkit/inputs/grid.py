"""The parallel grid: how a job's processes are arranged, and the batch and layer arithmetic that follows from it.

`ParallelGrid` is the one owner of
  - world = nodes x GPUs per node, and its factorisation into degrees:
    pipeline stages x data-parallel (replicate x shard) x tensor x context x sequence == world;
  - the engines' rules for which degrees combine (docs/ENGINE_FACTS.md, "More dimensions"): tensor and context
    parallelism run under FSDP2 (accelerate's ParallelismConfig with the torch backends), sequence parallelism
    (Ulysses / ALST) under DeepSpeed ZeRO; context and sequence never together; tensor parallelism inside a node;
    the heads, KV heads and sequence each degree must divide;
  - the batch identity every engine asserts: global batch = micro-batch x accumulation x data-parallel
    (DeepSpeed: `train_batch_size == train_micro_batch_size_per_gpu * gradient_accumulation_steps * dp` with
    dp = world / pipeline stages, deepspeed/runtime/config.py `_batch_assertion`; under Ulysses accelerate sets
    train_batch_size from `ParallelismConfig.data_parallel_size`, the ranks that see different batches);
  - the split of a model's decoder layers over the pipeline stages and the parameters each stage holds.
It validates once, where it is built, and its errors name the knob to change and the values that work. The planner,
estimate, timing, emit, check, launch and both training runners take their numbers from it.

Modelled on torchtitan's ParallelDims (dp_replicate x dp_shard x cp x tp x pp == world_size, checked with a message
naming the degree) and accelerate's ParallelismConfig (dp_replicate / dp_shard / tp / cp / sp sizes).
"""

from __future__ import annotations

import math

from dataclasses import dataclass
from typing import TYPE_CHECKING

from toolkit.errors import UserError, options_text
from toolkit.inputs.attention import attention_window, context_parallel_problem
from toolkit.inputs.partition import balanced_partition, check_partition, check_stage_count
from toolkit.inputs.strategy import Engine, Kind, Strategy

if TYPE_CHECKING:
    from toolkit.inputs.hardware import Hardware
    from toolkit.inputs.modelspec import ModelSpec

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
    """Tensor-parallel degree (FSDP2 x TP): the layers' matrices split by the model's own tp_plan, inside a node."""
    context: int = 1
    """Context-parallel degree (FSDP2 x CP, torch ring attention): every rank holds seq / context tokens."""
    sequence: int = 1
    """Sequence-parallel degree (DeepSpeed Ulysses / ALST with ZeRO): seq / sequence tokens per rank outside
    attention, heads / sequence heads of the whole sequence inside it."""
    expert: int = 1
    """Expert-parallel degree (transformers' DistributedConfig ep_size on FSDP2): no ranks of its own, it reuses
    the dp_shard x tensor ranks (pp x fsdp x tp == pp x efsdp x ep); every rank holds experts / expert of each MoE
    layer, FSDP-sharded over efsdp = dp_shard x tensor / expert (docs/ENGINE_FACTS.md, "Expert parallelism")."""
    expert_shared_batch: bool = False
    """The expert group shares one batch (TRL's MoE guide: DistributedConfig(tp_size=ep, fsdp_size=D,
    enable_expert_parallel=True) on the transformers it ran; 5.24 refuses that call): only D = dp_shard ranks are
    data-parallel, the dense modules are whole on each rank of the group. False: every rank its own batch."""
    autoep: bool = False
    """The expert degree is DeepSpeed AutoEP's autoep_size under ZeRO-1/2 (toolkit.inputs.autoep), not transformers'
    ep_size: every rank its own batch, dense parameters data-parallel over the world, experts over world / expert."""

    def __post_init__(self) -> None:
        for name, value in (("nodes", self.nodes), ("GPUs per node", self.gpus_per_node),
                            ("pipeline stages", self.pipeline_stages), ("data-parallel replicas", self.dp_replicate),
                            ("data-parallel shards", self.dp_shard), ("--tensor-parallel", self.tensor),
                            ("--context-parallel", self.context), ("--sequence-parallel", self.sequence),
                            ("--expert-parallel", self.expert)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UserError(f"{name} must be a positive integer, got {value!r}")
        if self.expert > 1 and self.autoep:
            if self.model_parallel > 1 or self.pipeline_stages > 1 or self.expert_shared_batch \
                    or self.dp_shard % self.expert:
                raise UserError(f"--expert-parallel {self.expert} under DeepSpeed AutoEP needs every rank its own "
                                f"batch and an expert degree dividing the {self.dp_shard} data-parallel ranks (no "
                                "pipeline / tensor / sequence degree); change --expert-parallel")
        elif self.expert > 1:
            from toolkit.inputs.moe import expert_grid_problem

            problem = expert_grid_problem(self.expert, fsdp=self.dp_shard, tensor=self.tensor,
                                          replicate=self.dp_replicate, context=self.context * self.sequence,
                                          stages=self.pipeline_stages, shared_batch=self.expert_shared_batch)
            if problem:
                raise UserError(problem)
        if self.context > 1 and self.sequence > 1:
            # accelerate ParallelismConfig.__post_init__: "CP and SP are mutually exclusive".
            raise UserError(f"context parallel {self.context} and sequence parallel {self.sequence} cannot combine "
                            "(accelerate runs one of them); drop --context-parallel or --sequence-parallel")
        if self.pipeline_stages > 1 and self.model_parallel > 1:
            raise UserError("the pipeline engine runs no tensor / context / sequence parallelism; use a ZeRO or "
                            "FSDP2 strategy for those, or drop --pipeline-stages")
        product = self.pipeline_stages * self.dp_replicate * self.dp_shard * self.model_parallel * self.batch_sharers
        if product != self.world:
            raise UserError(
                f"parallel degrees do not multiply to the GPU count: {self.describe_degrees()} = {product}, but "
                f"{self.nodes} node(s) x {self.gpus_per_node} = {self.world} GPUs; change the degrees or --gpus")

    # --- construction -------------------------------------------------------------------------------------------

    @classmethod
    def for_strategy(cls, strategy: Strategy, *, nodes: int, gpus_per_node: int,
                     pipeline_stages: int | None = None, tensor: int = 1, context: int = 1,
                     sequence: int = 1, expert: int = 1, expert_shared_batch: bool = False) -> "ParallelGrid":
        """The grid a strategy runs on. `pipeline_stages` None: the strategy's default (pipeline: every GPU a
        stage; hybrid: one stage per node, at least 2). `tensor` / `context` / `sequence`: the model-parallel
        degrees (1: none); `expert`: the expert-parallel degree, which takes no ranks of its own (FSDP2 only);
        `expert_shared_batch`: the expert group shares one batch (ParallelGrid.expert_shared_batch).
        Raises UserError saying why the strategy cannot run here."""
        world = nodes * gpus_per_node
        if expert != 1:
            if not isinstance(expert, int) or isinstance(expert, bool) or expert < 1:
                raise UserError(f"--expert-parallel must be a positive integer, got {expert!r}")
            if strategy.engine == Engine.DEEPSPEED and not strategy.is_pipeline and not expert_shared_batch:
                from toolkit.inputs.autoep import autoep_strategy_problem

                problem = autoep_strategy_problem(strategy)
                if problem:
                    raise UserError(problem)
                grid = cls.for_strategy(strategy, nodes=nodes, gpus_per_node=gpus_per_node, tensor=tensor,
                                        context=context, sequence=sequence)
                return cls(**{**grid.__dict__, "expert": expert, "autoep": True})
            if strategy.kind != Kind.FSDP2 or strategy.fsdp_mode == "hybrid":
                raise UserError(f"expert parallelism is planned on fsdp2 (transformers' DistributedConfig ep_size) "
                                f"or zero1 / zero2 / zero3 (DeepSpeed AutoEP), not {strategy.name}; use one of those "
                                "with --expert-parallel, or zero3 (the MoE block as a leaf module) without it")
            grid = cls.for_strategy(strategy, nodes=nodes, gpus_per_node=gpus_per_node,
                                    pipeline_stages=pipeline_stages, tensor=tensor, context=context,
                                    sequence=sequence)
            if not expert_shared_batch:
                return cls(**{**grid.__dict__, "expert": expert})
            if grid.dp_shard % expert or grid.model_parallel > 1:
                raise UserError(f"--expert-parallel {expert} sharing one batch takes the expert group out of the "
                                f"{grid.dp_shard} data-parallel ranks (no tp / cp / sp); give an expert degree that "
                                f"divides {grid.dp_shard}")
            return cls(**{**grid.__dict__, "dp_shard": grid.dp_shard // expert, "expert": expert,
                          "expert_shared_batch": True})
        if (tensor, context, sequence) != (1, 1, 1):
            if strategy.is_pipeline or pipeline_stages not in (None, 1):
                raise UserError("the pipeline engine runs no tensor / context / sequence parallelism; use zero1-3 "
                                "with --sequence-parallel or fsdp2 with --tensor-parallel / --context-parallel")
            return cls._model_parallel(strategy, nodes, gpus_per_node, tensor, context, sequence)
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
                            f"replicas (try {options_text(_divisors_above(world))})")
        dp = world // stages
        if strategy.kind == Kind.PIPELINE and dp != 1:
            raise UserError(f"pipeline uses every GPU as a stage ({world} stages); for {stages} stages x {dp} "
                            "data-parallel use --strategy hybrid")
        if strategy.kind == Kind.HYBRID and dp < 2:
            raise UserError(f"hybrid needs data-parallel 2+ ({stages} stages on {world} GPUs leaves 1); "
                            "use --strategy pipeline or fewer stages")
        # The pipeline engine's ZeRO-1 (hybrid, and bf16 pipelines) partitions optimizer states over dp.
        return cls(nodes, gpus_per_node, pipeline_stages=stages, dp_shard=dp)

    @classmethod
    def _model_parallel(cls, strategy: Strategy, nodes: int, gpus_per_node: int, tensor: int, context: int,
                        sequence: int) -> "ParallelGrid":
        """FSDP2 x TP / CP and ZeRO x SP grids, with the engines' composition rules (docs/ENGINE_FACTS.md)."""
        world = nodes * gpus_per_node
        for flag, degree in (("--tensor-parallel", tensor), ("--context-parallel", context),
                             ("--sequence-parallel", sequence)):
            if not isinstance(degree, int) or isinstance(degree, bool) or degree < 1:
                raise UserError(f"{flag} must be a positive integer, got {degree!r}")
        if sequence > 1 and strategy.engine != Engine.DEEPSPEED:
            # accelerate: sp_backend "deepspeed" is the only sequence-parallel backend (ALST / Ulysses).
            raise UserError(f"sequence parallelism (Ulysses) runs under DeepSpeed ZeRO, not {strategy.name}; use "
                            "zero1, zero2 or zero3 with --sequence-parallel, or --context-parallel with fsdp2")
        if (tensor > 1 or context > 1) and strategy.kind != Kind.FSDP2:
            # accelerate state.py: cp_size > 1 needs an FSDP2 plugin; TP through ParallelismConfig is applied by
            # FSDP2's device mesh (DeepSpeed's own AutoTP is a different path this planner does not take).
            which = "tensor" if tensor > 1 else "context"
            raise UserError(f"{which} parallelism runs under FSDP2 (accelerate ParallelismConfig), not "
                            f"{strategy.name}; use fsdp2 with --{which}-parallel"
                            + (", or zero1-3 with --sequence-parallel" if which == "context" else ""))
        if context > 1 and sequence > 1:
            raise UserError(f"context parallel {context} and sequence parallel {sequence} cannot combine "
                            "(accelerate runs one of them); drop --context-parallel or --sequence-parallel")
        if tensor > 1 and context > 1:
            # TP runs through transformers' load-time sharding (DistributedConfig), which has no context parallelism;
            # accelerate's CP needs its own FSDP plugin (toolkit.emit.parallelism).
            raise UserError(f"tensor parallel {tensor} with context parallel {context} is not planned (transformers "
                            "applies TP at load without CP); use one of them")
        if tensor > 1 and gpus_per_node % tensor:
            options = [d for d in _divisors(gpus_per_node) if d > 1]
            raise UserError(f"--tensor-parallel {tensor} does not divide the {gpus_per_node} GPUs of a node "
                            f"(tensor parallelism stays inside a node's fast link; try {options_text(options)})")
        model = tensor * context * sequence
        if world % model:
            raise UserError(f"tensor {tensor} x context {context} x sequence {sequence} = {model} does not divide "
                            f"{world} GPUs (try {options_text(_divisors_above(world))})")
        if strategy.kind == Kind.FSDP2 and strategy.fsdp_mode == "hybrid":
            if nodes < 2:
                raise UserError("HSDP (fsdp2-hybrid) shards inside a node and replicates across nodes; it "
                                "needs 2+ nodes (use fsdp2 on one node)")
            if gpus_per_node % (tensor * context):
                raise UserError(f"fsdp2-hybrid keeps tensor x context = {tensor * context} inside a node of "
                                f"{gpus_per_node} GPUs; it must divide them")
            grid = cls(nodes, gpus_per_node, dp_replicate=nodes, dp_shard=gpus_per_node // (tensor * context),
                       tensor=tensor, context=context)
        else:
            grid = cls(nodes, gpus_per_node, dp_shard=world // model, tensor=tensor, context=context,
                       sequence=sequence)
        if strategy.kind == Kind.FSDP2 and grid.dp_shard * grid.context == 1:
            # accelerate Accelerator._validate_accelerator: FSDP needs dp_shard or cp to shard across.
            raise UserError(f"tensor parallel {tensor} uses every GPU, which leaves FSDP2 nothing to shard over "
                            f"(accelerate refuses it); use --tensor-parallel {tensor // 2 if tensor > 1 else 1} or less")
        return grid

    # --- degrees ------------------------------------------------------------------------------------------------

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def data_parallel(self) -> int:
        """Ranks that see different data (world / (pipeline x tensor x context x sequence))."""
        return self.dp_replicate * self.dp_shard

    @property
    def model_parallel(self) -> int:
        """Ranks that share one sample: tensor x context x sequence."""
        return self.tensor * self.context * self.sequence

    @property
    def batch_sharers(self) -> int:
        """Ranks computing one batch together besides tensor x context x sequence: a batch-sharing expert group."""
        return self.expert if self.expert_shared_batch else 1

    @property
    def expert_shard_group(self) -> int:
        """efsdp, the ranks FSDP-sharding the same experts: DistributedConfig.efsdp_size = fsdp x tp / ep (tp = ep
        on a shared batch)."""
        return self.dp_shard if self.expert_shared_batch else self.dp_shard * self.tensor // self.expert

    def mesh_stride(self, dim: str) -> int:
        """Rank distance between neighbouring members of one group of `dim`: "fsdp" (the dense modules' shard
        group), "ep" (the expert group) or "efsdp" (the ranks holding the same experts). transformers builds its
        meshes row-major, innermost dimension last (distributed/utils.py initialize_distributed_mesh: dense
        (pp, dp_replicate, fsdp, tp), experts (pp, dp_replicate, efsdp, ep)); on a shared batch tp is the expert
        group. DeepSpeed's expert groups lie alike (utils/groups.py _create_expert_and_data_parallel: an expert
        group is ep consecutive ranks, an expert-data-parallel group every ep-th rank; the dense ZeRO group is the
        world, consecutive)."""
        strides = {"ep": 1, "efsdp": self.expert, "fsdp": self.tensor * self.batch_sharers}
        return strides[dim]

    @property
    def resumable(self) -> bool:
        """Whether a run on this grid can resume from its checkpoints (resume_problem() is None)."""
        return self.resume_problem() is None

    def resume_problem(self) -> str | None:
        """Why a run on this grid cannot resume from a checkpoint, or None. Tensor parallelism (FSDP2 x TP, HSDP x
        TP) runs a model transformers shards as it loads it (from_pretrained(distributed_config=...)), and the HF
        Trainer refuses to checkpoint the optimizer of such a model (transformers 5.24 trainer.py __init__:
        "Resuming is not supported for models sharded at load time"), so its checkpoints hold the model only
        (save_only_model); expert parallelism (DistributedConfig ep_size) likewise. Every other grid resumes exactly (ZeRO / FSDP2 / DDP / SP through the Trainer's
        checkpoints, DeepSpeed AutoEP through the engine's own state in them, pipeline through the engine's own)."""
        if self.tensor > 1 or (self.expert > 1 and not self.autoep):
            return (f"{'tensor' if self.tensor > 1 else 'expert'} parallelism: transformers shards the model as it "
                    "loads it and the HF Trainer does not "
                    "checkpoint such a model's optimizer (its checkpoints hold the model only), so the run cannot "
                    "resume")
        return None

    @property
    def shard_group(self) -> int:
        """Ranks one sharded state is split over (1: replicated). FSDP2 shards over the flattened dp_shard x cp
        mesh (accelerate ParallelismConfig.dp_shard_cp_dim_names); ZeRO under Ulysses partitions over DeepSpeed's
        sequence-data-parallel group, dp x sp (deepspeed/runtime/engine.py seq_data_parallel_group). Tensor
        parallelism splits the tp_plan's matrices on top of this (toolkit.inputs.tensorplan)."""
        return self.dp_shard * self.context * self.sequence

    @property
    def seq_split(self) -> int:
        """How many ranks one sample's tokens are split over outside attention (context or sequence degree)."""
        return self.context * self.sequence

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

    @staticmethod
    def check_batch_request(global_batch: int | None, micro_batch: int | None, grad_accum: int | None) -> None:
        """The batch identity before any grid: global = micro x accumulation x data-parallel ranks, so the global
        batch is a multiple of every factor given with it, whatever the data-parallel degree. A request that
        breaks it is a contradiction of the user's own numbers (named as one), not a strategy that does not fit."""
        if global_batch is None:
            return
        given = [(flag, value) for flag, value in (("--micro-batch", micro_batch), ("--accumulation", grad_accum))
                 if value is not None]
        product = 1
        for _, value in given:
            product *= value
        if given and global_batch % product:
            names = " x ".join(f"{flag} {value}" for flag, value in given)
            fits = ", ".join(str(product * k) for k in (1, 2, 4))
            raise UserError(f"--global-batch {global_batch} contradicts {names}: the global batch is micro-batch x "
                            f"accumulation x data-parallel ranks, a multiple of {product}; give a global batch of "
                            f"{fits}, ..., or drop one of them and let the plan choose it")

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
        """Whether this grid's stages can hold `spec` (a stage per layer at least; a convertible architecture),
        and whether its heads split over the tensor / sequence degrees, its experts over the expert degree."""
        if self.expert > 1 and self.autoep:
            from toolkit.inputs.autoep import autoep_problem

            problem = autoep_problem(spec, self.expert)
            if problem:
                raise UserError(problem)
        elif self.expert > 1:
            from toolkit.inputs.moe import expert_parallel_problem

            problem = expert_parallel_problem(spec, self.expert,
                                              self.expert if self.expert_shared_batch else self.tensor)
            if problem:
                raise UserError(problem)
        split = [f"{flag} {n}" for flag, n in (("--tensor-parallel", self.tensor), ("--context-parallel",
                 self.context), ("--sequence-parallel", self.sequence)) if n > 1]
        if split and not spec.heads:
            raise UserError(f"{' and '.join(split)} split attention (by heads or around the attention ring); "
                            f"{spec.name} ({spec.model_type}) has no attention heads (a state-space or recurrent "
                            "model, or several stacks of different widths); drop it and shard with zero or fsdp2")
        if self.tensor > 1:
            from toolkit.inputs.tensorplan import tp_plan_problem

            problem = tp_plan_problem(spec, self.tensor)
            if problem:
                raise UserError(problem)
        if self.context > 1:
            problem = context_parallel_problem(spec, self.context)
            if problem:
                raise UserError(problem)
        if self.sequence > 1:
            # deepspeed/runtime/sequence_parallel/ulysses_sp.py UlyssesSPAttentionHF.__init__.
            sp, counts = self.sequence, spec.head_counts()  # every layer's (Gemma-4's global layers differ)
            fits = [d for d in _divisors_above(min(h for h, _ in counts))
                    if all(h % d == 0 and (kv % d == 0 or d % kv == 0) for h, kv in counts)]
            for heads, kv_heads in counts:
                if heads % sp:
                    raise UserError(f"--sequence-parallel {sp} does not divide {spec.name}'s {heads} attention "
                                    f"heads (Ulysses gives each rank heads / sp; try {options_text(fits)})")
                if kv_heads % sp and sp % kv_heads:
                    raise UserError(f"--sequence-parallel {sp} and {spec.name}'s {kv_heads} KV heads do not divide "
                                    f"one another (Ulysses splits or replicates the KV heads; try {options_text(fits)})")
        if self.pipeline_stages == 1:
            return
        if spec.pipeline_blocker:
            raise UserError(f"pipeline conversion cannot split {spec.model_type} ({spec.pipeline_blocker}); ZeRO "
                            "and FSDP2 run it")
        check_stage_count(spec.num_layers, self.pipeline_stages, self.world)

    def sequence_multiple(self) -> int:
        """The smallest length check_sequence's divisibility rules accept: a multiple of sp and of 2 x cp."""
        return math.lcm(self.sequence, 2 * self.context) if self.context > 1 else self.sequence

    def check_sequence(self, seq_len: int, attention: str, spec: "ModelSpec | None" = None) -> None:
        """Whether one sample of `seq_len` tokens splits over the context / sequence ranks with `attention` (and,
        given the model, whether its attention survives the split)."""
        if self.sequence > 1:
            if attention == "eager":
                # ulysses_sp.py register_with_transformers refuses eager (it needs a 4D mask); accelerate's
                # DeepSpeedSequenceParallelConfig refuses eager and flex_attention.
                others = [a for a in ("sdpa", "flash_attention_2") if spec is None or a in spec.attention_support]
                fix = (f"use --attention {' or '.join(others)}" if others else
                       f"{spec.name if spec else 'the model'} has no other attention in transformers")
                raise UserError("sequence parallelism (Ulysses) cannot run eager attention (it needs the full "
                                f"4-D mask); {fix}")
            window = attention_window(spec) if spec is not None and attention == "sdpa" else None
            if window and seq_len > window:
                # ulysses_sp.py uattn_wrapper drops the mask (attention_mask=None) and transformers' SDPA applies a
                # sliding window only through that mask; flash_attention_2 takes the window as an argument.
                raise UserError(f"--sequence-parallel {self.sequence} with sdpa would train {spec.name} at --seq "
                                f"{seq_len} with full causal attention: Ulysses drops the mask that holds its "
                                f"{window}-token sliding window; use --attention flash_attention_2 (it takes the "
                                f"window itself) or --seq {window} or less")
            if seq_len % self.sequence:
                raise UserError(f"--seq {seq_len} does not split over sequence parallel {self.sequence} (Ulysses "
                                f"needs seq divisible by sp, ulysses_sp.py); use --seq "
                                f"{_round_to(seq_len, self.sequence)}")
        if self.context > 1:
            if attention != "sdpa":
                # torch/distributed/tensor/experimental/_context_parallel/_attention.py: the ring replaces only
                # the SDPA flash / efficient / cudnn kernels.
                raise UserError(f"context parallelism (torch ring attention) needs --attention sdpa; {attention} is "
                                "not one of the SDPA kernels it replaces (or use --sequence-parallel)")
            if seq_len % (2 * self.context):
                # torch _load_balancer.py: the head-tail load balancer cuts the sequence into 2 x cp chunks.
                raise UserError(f"--seq {seq_len} does not split into 2 x context parallel = {2 * self.context} "
                                f"equal chunks (torch's causal load balancing); use --seq "
                                f"{_round_to(seq_len, 2 * self.context)}")

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

    def describe_degrees(self) -> str:
        parts = [f"pipeline {self.pipeline_stages}", f"data-parallel {self.dp_replicate} x {self.dp_shard}"]
        parts += [f"{name} {d}" for name, d in (("tensor", self.tensor), ("context", self.context),
                                                 ("sequence", self.sequence)) if d > 1]
        if self.expert_shared_batch:
            return " x ".join(parts + [f"expert {self.expert} sharing one batch"])
        over = "data-parallel, DeepSpeed AutoEP" if self.autoep else "data-parallel x tensor"
        return " x ".join(parts) + (f" (expert {self.expert} over {over})" if self.expert > 1 else "")

    def describe(self) -> str:
        extra = "".join(f" x {name}={d}" for name, d in (("tp", self.tensor), ("cp", self.context),
                                                          ("sp", self.sequence),
                                                          ("autoep" if self.autoep else "ep", self.expert)) if d > 1)
        extra += " sharing one batch" if self.expert_shared_batch else ""
        if extra:
            dp = (f"dp={self.dp_replicate}x{self.dp_shard}" if self.dp_replicate > 1 else f"dp={self.data_parallel}")
            return dp + extra
        if self.pipeline_stages > 1:
            return f"pp={self.pipeline_stages} x dp={self.data_parallel}"
        if self.dp_replicate > 1 and self.dp_shard > 1:
            return f"dp={self.dp_replicate} replicas x {self.dp_shard} shards"
        return f"dp={self.data_parallel}"


def grid_of(strategy: Strategy, hw: "Hardware", pipeline_stages: int | None = 1, *, tensor: int = 1,
            context: int = 1, sequence: int = 1, expert: int = 1, expert_shared_batch: bool = False) -> ParallelGrid:
    """The grid `strategy` runs on with `hw` (pipeline_stages counts only for pipeline strategies; None: the
    strategy's default)."""
    return ParallelGrid.for_strategy(strategy, nodes=hw.nodes, gpus_per_node=hw.gpus_per_node,
                                     pipeline_stages=pipeline_stages if strategy.is_pipeline else None,
                                     tensor=tensor, context=context, sequence=sequence, expert=expert,
                                     expert_shared_batch=expert_shared_batch)


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


def _divisors_above(n: int) -> list[int]:
    return [d for d in _divisors(n) if d > 1]


def _round_to(value: int, multiple: int) -> int:
    """The nearest multiple of `multiple` at or below `value` (or `multiple` itself)."""
    return max(multiple, value - value % multiple)
