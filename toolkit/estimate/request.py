"""What the user asks the planner for, before any strategy is chosen (Request): the job's settings, and which of
them the search may vary (None: the planner chooses)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from toolkit.errors import UserError
from toolkit.inputs.grid import ParallelGrid
from toolkit.inputs.job import Job
from toolkit.inputs.lora import FULL, Adapter
from toolkit.inputs.grpo import Grpo
from toolkit.inputs.preference import Dpo
from toolkit.inputs.strategy import ALL_STRATEGY_NAMES


@dataclass(frozen=True)
class Request:
    """What the user asked for, before any strategy is chosen."""

    seq_len: int
    global_batch: int | None = None
    micro_batch: int | None = None
    grad_accum: int | None = None
    precision: str = "bf16"
    optimizer: str = "adamw"
    attention: str | None = None
    """None: transformers' pick for the model (toolkit.inputs.job.Job.attention)."""
    device_kind: str = "cuda"
    checkpointing: bool | None = None
    """None: let the planner choose; True/False: force it."""
    optimizer_impl: str = "fused"
    activation_offloading: bool = False
    liger: bool = False
    loss: str = "model"
    """The LM head + loss (toolkit.inputs.choices.LOSSES): the model's own, or TRL's chunked NLL (never tiled)."""
    tiled: bool | None = None
    """ALST's tiled MLP and tiled logits + loss (toolkit.patches.tiling): None (plan's default, --tiled auto): the
    planner tiles where the engines run it and only tiling fits, or is faster beyond the time band (module
    docstring); True (--tiled): in every row, engines that refuse it say so; False (--tiled off): never."""
    compile: bool = False
    """torch.compile (inductor) of the model: activations from the compiler's partition, the compiled step time."""
    pipeline_stages: int | None = None
    strategies: tuple[str, ...] = ALL_STRATEGY_NAMES
    tensor_parallel: int | None = None
    """None: the planner tries every degree the model and node allow (FSDP2 x TP); 1: no tensor parallelism."""
    context_parallel: int | None = None
    """None: every degree the sequence and world allow (FSDP2 x CP); 1: none."""
    sequence_parallel: int | None = None
    """None: every degree the heads, sequence and world allow (ZeRO x Ulysses SP); 1: none."""
    expert_parallel: int | None = None
    """An expert-parallel degree the user fixed (plan --expert-parallel N): plan the FSDP2 x EP row alone, at that
    degree. None: every degree the grid admits is costed and the best ranked (toolkit.estimate.search._expert_parallel_grids); 1: none."""
    adapter: Adapter = FULL
    """Training method (full, LoRA, QLoRA) and its settings."""
    vision_tower: str = "train"
    """A multimodal class's encoder and projector trained or frozen (toolkit.inputs.job.Job.vision_tower)."""
    images_per_sample: int = 0
    image_size: str = ""
    image_tokens: int = 0
    """An image-and-text job's images (toolkit.inputs.job.Job.images_per_sample; seq_len counts their tokens)."""
    dpo: Dpo | None = None
    """Preference objective (toolkit.inputs.preference); None: supervised fine-tuning."""
    grpo: Grpo | None = None
    """RL objective (toolkit.inputs.grpo); seq_len is its prompt + completion."""
    allocator_conf: str = ""
    """PYTORCH_CUDA_ALLOC_CONF the plan emits and predicts with (toolkit.inputs.allocconf)."""
    savers: bool = True
    """The planner tries Liger kernels and activation offloading by itself where a row fits no other way
    (auto_savers); False: only what the request turns on."""

    def __post_init__(self) -> None:
        if self.global_batch is None and self.micro_batch is None:
            raise UserError("give --global-batch G, or --micro-batch B (with optional --accumulation A)")
        for flag, value in (("--global-batch", self.global_batch), ("--micro-batch", self.micro_batch),
                            ("--accumulation", self.grad_accum), ("--pipeline-stages", self.pipeline_stages),
                            ("--tensor-parallel", self.tensor_parallel), ("--context-parallel", self.context_parallel),
                            ("--sequence-parallel", self.sequence_parallel),
                            ("--expert-parallel", self.expert_parallel)):
            if value is not None and value <= 0:
                raise UserError(f"{flag} must be a positive integer, got {value}")
        self.job(tiled=self.tiled is True)  # validates the choices
        ParallelGrid.check_batch_request(self.global_batch, self.micro_batch, self.grad_accum)

    def job(self, **searched: Any) -> Job:
        """A Job of this request, with what the search chose (`searched`: the batch split, checkpointing, tiling,
        compile, a sequence length): the one spelling Request -> Job. The Job's fields the request holds under the
        same name and meaning are read from both dataclasses; SEARCHED are the search's (None in a Request means
        "let the planner choose", which a Job cannot hold)."""
        return Job(**{**{name: getattr(self, name) for name in REQUEST_JOB_FIELDS}, **searched})


SEARCHED = ("micro_batch", "grad_accum", "checkpointing", "tiled")
"""Job fields a Request may leave open (None): the search fills them in."""
REQUEST_JOB_FIELDS = tuple(f.name for f in fields(Job)
                           if f.name in Request.__dataclass_fields__ and f.name not in SEARCHED)
"""The Job's fields a Request holds as they are (seq_len, precision, ..., adapter)."""
