"""The training job: what one step does, independent of the hardware and the strategy."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from toolkit.errors import UserError
from toolkit.inputs.lora import FULL, Adapter, quantized_base_sharded
from toolkit.inputs.strategy import Engine

if TYPE_CHECKING:
    from toolkit.inputs.hardware import Gpu, Hardware
    from toolkit.inputs.grpo import Grpo
    from toolkit.inputs.preference import Dpo
    from toolkit.inputs.modelspec import ModelSpec
    from toolkit.inputs.strategy import Strategy

from toolkit.inputs.choices import (ATTENTIONS, CHECKPOINTING_OP, COMPILE_BLOCKS, DEVICE_KINDS,  # noqa: F401
                                    OPTIMIZER_IMPLS, OPTIMIZERS, PRECISIONS, Attention, DeviceKind, Optimizer,
                                    OptimizerImpl, Precision, VISION_TOWER_MODES, LOSSES, TRL_LOSS)
from toolkit.inputs.choices import GIB


def loss_problem(loss: str, *, tiled: bool | None = False, chunked_loss: int = 0, compile: bool | str = False,
                 preference: bool = False) -> str | None:
    """Why --loss `loss` cannot run with the rest of the job, or None. Liger composes with it: TRL's SFTTrainer keeps
    Liger's layer kernels and turns off only Liger's fused cross-entropy (trl/trainer/sft_trainer.py __init__)."""
    if loss != TRL_LOSS:
        return None
    if tiled or chunked_loss:
        return (f"--loss trl with {'--tiled' if tiled else '--chunked-loss'}: both replace the logits + loss; give "
                "one of them")
    if compile:
        return "--loss trl with --compile / --compile-blocks: TRL's fused head is traced eagerly only; drop --compile"
    if preference:
        return ("--loss trl with --method dpo / grpo: TRL's DPOTrainer and GRPOTrainer always run their chunked "
                "log-prob head, and the estimate always traces it; drop --loss trl")
    return None


def checkpointing_words(checkpointing: bool | str) -> str:
    """The job summaries' words for a checkpointing setting: ", checkpointing", ", per-op selective checkpointing"
    or nothing."""
    if checkpointing == CHECKPOINTING_OP:
        return ", per-op selective checkpointing"
    return ", checkpointing" if checkpointing else ""


def compile_words(compile: bool | str) -> str:
    """The job summaries' words for a compile setting."""
    if compile == COMPILE_BLOCKS:
        return ", torch.compile per decoder layer"
    return ", torch.compile" if compile else ""


BLOCKS_COMPILE_PROBLEM = ("--compile-blocks (each decoder layer compiled apart, as torchtitan does) is modelled by "
                          "estimate only: TrainingArguments torch_compile compiles the whole model; use --compile")
OP_CHECKPOINTING_PROBLEM = ("--checkpointing op (torchtitan's per-op selective policy) is modelled by estimate and "
                            "profile only: the HF Trainer, accelerate and DeepSpeed have no setting that applies it; "
                            "use --checkpointing on or off")


ALLOC_CONF_PATTERN = re.compile(r"[A-Za-z0-9_.:, ]{0,200}")
"""What an allocator setting may hold: torch's key:value,key:value (it reaches the launch scripts)."""


@dataclass(frozen=True)
class Job:
    seq_len: int
    """Tokens per sample (packed blocks of this length)."""
    micro_batch: int = 1
    """Samples per GPU per forward/backward (per pipeline micro-batch for pipeline plans)."""
    grad_accum: int = 1
    """Micro-batches accumulated per optimizer step (pipeline: micro-batches per step, which feed 1F1B)."""
    precision: Precision = "bf16"
    """fp32; bf16 / fp16 mixed (fp32 master weights; fp16 with dynamic loss scaling); bf16-pure (all in bf16)."""
    optimizer: Optimizer = "adamw"
    checkpointing: bool | str = False
    """Activation checkpointing of every decoder layer: True (each layer recomputed whole in backward), False, or
    CHECKPOINTING_OP ("op": torchtitan's per-op selective policy, toolkit.estimate.selective; estimate only)."""
    attention: Attention | None = None
    """The attn_implementation asked for; None: transformers' own pick for the model (sdpa, or eager where its class
    has no sdpa), which ModelSpec.effective_attention resolves (the memory trace, the time model and the plan)."""
    device_kind: DeviceKind = "cuda"
    """Whose kernels' saved tensors to model: the GPU kernels (default) or the real CPU dispatch."""
    optimizer_impl: OptimizerImpl = "fused"
    """How torch's optimizer runs its step (toolkit.estimate.savers): fused (the HF Trainer's adamw_torch_fused), foreach
    (torch's default on CUDA when fused is not asked for), for-loop (one parameter at a time)."""
    activation_offloading: bool = False
    """Saved activations of the decoder layers moved to host RAM (TRL's activation_offloading; with --tiled,
    DeepSpeed's CheckpointHiddenStatesOffload of the checkpointed layers' inputs: toolkit.estimate.savers)."""
    liger: bool = False
    """Liger kernels as the HF Trainer's use_liger_kernel=True applies them (toolkit.patches.liger)."""
    tiled: bool = False
    """ALST's tiled compute over the sequence: every decoder layer's MLP through DeepSpeed's TiledMLP and the logits
    + loss through its TiledFusedLogitsLoss, chunk by chunk (toolkit.patches.tiling)."""
    compile: bool | str = False
    """torch.compile (inductor) of the model, as TrainingArguments(torch_compile=True) has accelerate do it: the
    activations are what the compiler's partition saves (toolkit.estimate.compiled). COMPILE_BLOCKS ("blocks"):
    each decoder layer compiled on its own, embedding, head and loss eager (torchtitan's apply_compile; estimate
    only)."""
    chunked_loss: int = 0
    """torchtune's chunked cross-entropy (CEWithChunkedOutputLoss; toolkit.patches.chunkedce): logits and loss in this
    many sequence chunks, each upcast to fp32 apart; 0: the model's own loss. Estimate only."""
    loss: str = "model"
    """The LM head + loss (LOSSES): the model's own, or TRL's chunked NLL as SFTTrainer computes it
    (toolkit.patches.trlloss). Estimate only."""
    adapter: Adapter = FULL
    """Training method: full fine-tuning (default), LoRA or QLoRA with its settings (toolkit.inputs.lora)."""
    vision_tower: str = "train"
    """A multimodal class (ModelSpec.multimodal): its vision encoder and projector trained with the language model
    (full fine-tuning's default) or frozen (weights only: no gradients, no optimizer states). LoRA / QLoRA freeze
    them with the rest of the base whatever this says (the adapters exclude them, toolkit.inputs.lora)."""
    images_per_sample: int = 0
    """Images in every sample of an image-and-text job (a multimodal class; 0: text only). The language model sees
    seq_len = text tokens + images_per_sample x image_tokens (toolkit.inputs.images.image_job)."""
    image_size: str = ""
    """Each image's size as WIDTHxHEIGHT pixels, before the model's processor resizes it ("" when text only)."""
    image_tokens: int = 0
    """Tokens one image puts in the language model's sequence, from the model's own image processor at image_size
    (toolkit.inputs.images.image_tokens)."""
    dpo: Dpo | None = None
    """Preference objective: TRL's DPO with its reference kept / precomputed (toolkit.inputs.preference); None:
    supervised fine-tuning. LoRA / QLoRA (`adapter`) train the DPO policy."""
    grpo: Grpo | None = None
    """RL objective: TRL's GRPO (toolkit.inputs.grpo); seq_len is then its prompt + completion, and micro_batch counts
    completions (per_device_train_batch_size). None: not GRPO."""
    zero_reduce_bucket: int = 0
    """DeepSpeed's reduce_bucket_size (elements) where the run's config is not toolkit's own; 0: the HF Trainer's
    "auto" fill, hidden x hidden (toolkit.emit.deepspeed.zero_buckets), what the emitted JSON asks for. A config that
    leaves the key out (accelerate's inline deepspeed_config) runs DeepSpeed's default (toolkit.engines.readers
    .zero_default). ZeRO-2's backward bucket and ZeRO-3's IPG buffer are this many elements. Estimate only."""
    zero_overlap_comm: bool = False
    """The run's config sets ZeRO-1/2's overlap_comm: DeepSpeed's setup_buckets then allocates a second IPG buffer of
    reduce_bucket_size beside the first (stage_1_and_2.py, 'double buffers'). toolkit's own JSON leaves it off for
    stage 1/2, and DeepSpeed's default is off below stage 3. Estimate only."""
    allocator_conf: str = ""
    """PYTORCH_CUDA_ALLOC_CONF the step runs with ("" = torch's defaults): the reserved-memory replay takes it
    (toolkit.estimate.reserved). estimate and plan fill it from toolkit.inputs.allocconf (the user's environment,
    else expandable segments where the engines take them), the value the emitted launch scripts export."""

    def __post_init__(self) -> None:
        for field, value in (("--seq", self.seq_len), ("--micro-batch", self.micro_batch),
                             ("--accumulation", self.grad_accum)):
            if not isinstance(value, int) or value <= 0:
                raise UserError(f"{field} must be a positive integer, got {value!r}")
        check_choice("--precision", self.precision, PRECISIONS)
        check_choice("--optimizer", self.optimizer, OPTIMIZERS)
        if self.attention is not None:
            check_choice("--attention", self.attention, ATTENTIONS)
        check_choice("--device-kind", self.device_kind, DEVICE_KINDS)
        if not isinstance(self.allocator_conf, str) or not ALLOC_CONF_PATTERN.fullmatch(self.allocator_conf):
            raise UserError(f"PYTORCH_CUDA_ALLOC_CONF {self.allocator_conf!r} is not of the form key:value,key:value "
                            "(letters, digits, _ . : ,); fix or unset it")
        if not isinstance(self.zero_reduce_bucket, int) or self.zero_reduce_bucket < 0:
            raise UserError(f"reduce_bucket_size must be a non-negative integer, got {self.zero_reduce_bucket!r}")
        if not isinstance(self.zero_overlap_comm, bool):
            raise UserError(f"overlap_comm must be true or false, got {self.zero_overlap_comm!r}")
        check_choice("--optimizer-impl", self.optimizer_impl, OPTIMIZER_IMPLS)
        check_choice("--vision-tower", self.vision_tower, VISION_TOWER_MODES)
        if problem := images_problem(self.images_per_sample, self.image_size, self.image_tokens, self.seq_len):
            raise UserError(problem)
        if self.compile not in (False, True, COMPILE_BLOCKS):
            raise UserError(f"compile must be True, False or {COMPILE_BLOCKS!r}, got {self.compile!r}")
        if not isinstance(self.chunked_loss, int) or self.chunked_loss < 0:
            raise UserError(f"--chunked-loss must be a positive number of chunks, got {self.chunked_loss!r}")
        if self.chunked_loss and (self.liger or self.tiled):
            raise UserError(f"--chunked-loss with {'--liger' if self.liger else '--tiled'}: both replace the logits + "
                            "loss; give one of them")
        if self.chunked_loss and self.compile is True:
            raise UserError("--chunked-loss with --compile: the whole-model compile's head + loss are traced "
                            "unchunked; use --compile-blocks (layers compiled, head + loss eager) or drop --compile")
        check_choice("--loss", self.loss, LOSSES)
        if problem := loss_problem(self.loss, tiled=self.tiled, chunked_loss=self.chunked_loss,
                                   compile=self.compile, preference=self.dpo is not None or self.grpo is not None):
            raise UserError(problem)
        if self.checkpointing not in (False, True, CHECKPOINTING_OP):
            raise UserError(f"--checkpointing must be on, off or {CHECKPOINTING_OP}, got {self.checkpointing!r}")
        if self.grpo is not None and (self.dpo is not None or self.seq_len != self.grpo.seq_len):
            raise UserError(f"a GRPO job trains prompt + completion sequences ({self.grpo.seq_len} tokens), not "
                            f"{self.seq_len}, and no DPO beside it; set the lengths with --max-prompt-length and "
                            "--max-completion-length")

    @property
    def mixed(self) -> bool:
        """Mixed precision: low-precision compute over fp32 master weights."""
        return self.precision in ("bf16", "fp16")

    @property
    def compute_dtype_name(self) -> str:
        return {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "bf16-pure": "bfloat16"}[self.precision]

    @property
    def method(self) -> str:
        return self.adapter.method

    @property
    def image_sequence_tokens(self) -> int:
        """Tokens the images of one sample add to the language model's sequence (0: text only)."""
        return self.images_per_sample * self.image_tokens

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.seq_len * self.micro_batch


def images_problem(images_per_sample: int, image_size: str, image_tokens: int, seq_len: int) -> str | None:
    """Why a job's image fields do not hold together, or None (all three unset: a text job)."""
    if not isinstance(images_per_sample, int) or isinstance(images_per_sample, bool) or images_per_sample < 0:
        return f"--images-per-sample must be a positive integer, got {images_per_sample!r}"
    if not images_per_sample:
        return ("--image-size needs --images-per-sample N (images in each sample); give both, or neither"
                if image_size or image_tokens else None)
    if not image_size or not isinstance(image_tokens, int) or image_tokens <= 0:
        return "--images-per-sample needs --image-size WIDTHxHEIGHT (each image's pixels); give both, or neither"
    if seq_len <= images_per_sample * image_tokens:
        return (f"sequence length {seq_len} holds no text beside {images_per_sample} x {image_tokens} image tokens; "
                "re-plan with --seq N (text tokens)")
    return None


def check_choice(flag: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise UserError(f"{flag} '{value}' is not known; choose one of: {', '.join(choices)}")


# ----------------------------------------------------------------------------------------------------------------
# The rules a job must meet on a model and hardware: estimate, plan, check (--model/--gpus) and launch's preflight
# all call these, so the same job is refused (or adapted) the same way everywhere.

DEFAULT_SEQ_LEN = 2048
"""Sequence length when none is given (adapted down to the model's positions)."""


def default_seq_len(spec: "ModelSpec", requested: int | None) -> tuple[int, str | None]:
    """The sequence length to use and, when it was adapted, the sentence that says so. A length the user gave is
    kept (and checked by `check_job`); the default shrinks to what the model can take."""
    if requested is not None:
        return requested, None
    limit = spec.max_positions
    if limit and limit < DEFAULT_SEQ_LEN:
        return limit, (f"--seq not given: using {limit}, the most {spec.name} takes (max_position_embeddings); "
                       f"the default {DEFAULT_SEQ_LEN} is longer")
    return DEFAULT_SEQ_LEN, None


def check_seq_len(spec: "ModelSpec", seq_len: int) -> None:
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len <= 0:
        raise UserError(f"--seq must be a positive integer, got {seq_len!r}")
    if spec.max_positions and seq_len > spec.max_positions:
        raise UserError(f"--seq {seq_len} is longer than {spec.name} allows ({spec.max_positions} positions); "
                        f"use --seq {spec.max_positions} or less{rope_hint(spec, seq_len)}")


def rope_hint(spec: "ModelSpec", seq_len: int) -> str:
    """The words that name RoPE scaling as the other way to a sequence past the positions, for a model whose config
    has rotary embeddings (toolkit.inputs.rope)."""
    if spec.rope_scaling is not None:
        return ", or a larger --rope-factor"
    if not spec.config_dict().get("rope_parameters"):
        return ""
    factor = math.ceil(seq_len / spec.max_positions)
    return f", or scale its RoPE (--rope-scaling yarn --rope-factor {factor if factor <= 1024 else 'F'})"


def plan_positions_problem(seq_len: int, model: str, positions: int | None, *, rotary: bool = False) -> str | None:
    """Why a plan's sequence cannot run on its model (longer than the model's positions, modelconfig.model_positions),
    or None: toolkit.train refuses it and check reports it on a plan folder. `rotary`: the model has RoPE to scale
    (its config's rope_parameters), named as the other way."""
    if positions and seq_len > positions:
        factor = math.ceil(seq_len / positions)
        rope = (f", or with --rope-scaling yarn --rope-factor {factor if factor <= 1024 else 'F'}" if rotary
                else "")
        return (f"plan sequence length {seq_len} is longer than model {model} supports ({positions} positions); "
                f"re-plan with --seq {positions} or less{rope}")
    return None


def job_problem(precision: str, gpu: "Gpu", strategy: "Strategy | None" = None, *,
                activation_offloading: bool = False, liger: bool = False, adapter: Adapter = FULL,
                compile: bool = False, attention: str | None = None, tiled: bool = False,
                dpo: Dpo | None = None, grpo: Grpo | None = None, loss: str = "model") -> str | None:
    """Why a job with `precision` (and activation offloading, Liger kernels) cannot run on `gpu` with `strategy`, or
    None. The model types Liger supports are checked in check_job (liger_problem, below)."""
    if precision in ("bf16", "bf16-pure") and not gpu.bf16_supported:
        return f"{gpu.name} has no bf16; use --precision fp16 or fp32"
    from toolkit.inputs.grpo import grpo_problem  # not at import: `toolkit --help` loads this module
    from toolkit.inputs.preference import dpo_problem

    problem = adapter_problem(adapter, strategy) \
        or base_dtype_problem(adapter, precision, strategy, objective=bool(dpo or grpo)) \
        or dpo_problem(dpo, strategy, liger=liger, tiled=tiled, compile=compile) \
        or grpo_problem(grpo, strategy, liger=liger, tiled=tiled, compile=compile,
                        activation_offloading=activation_offloading)
    if problem:
        return problem
    if strategy is not None and strategy.is_pipeline and activation_offloading:
        return "activation offloading runs with ZeRO / FSDP2 / DDP, not the pipeline engine"
    if strategy is not None and strategy.is_pipeline and liger:
        return "Liger kernels patch the Hugging Face model the Trainer runs (ZeRO / FSDP2 / DDP), not pipeline stages"
    if strategy is not None and strategy.is_pipeline and loss == TRL_LOSS:
        return ("TRL's chunked NLL patches the Hugging Face model the Trainer runs (ZeRO / FSDP2 / DDP), not pipeline "
                "stages")
    if tiled:
        problem = tiled_problem(strategy, liger=liger, adapter=adapter, compile=compile)
        if problem:
            return problem
    if compile:
        problem = compile_problem(strategy, activation_offloading=activation_offloading, liger=liger,
                                  adapter=adapter, attention=attention)
        if problem:
            return problem
    if strategy is not None and strategy.is_pipeline and precision == "bf16-pure":
        return "the pipeline engine runs bf16 with fp32 gradient accumulation; use --precision bf16"
    return None


def base_dtype_problem(adapter: Adapter, precision: str, strategy: "Strategy | None", *,
                       objective: bool = False) -> str | None:
    """Why LoRA's --base-dtype or --modules-to-save-dtype cannot run with the rest of the job, or None (the one
    rule plan, estimate, check and toolkit.train apply)."""
    return _load_dtype_problem(adapter, precision, strategy, objective=objective) \
        or saved_dtype_problem(adapter, precision, strategy, objective=objective)


def saved_dtype_problem(adapter: Adapter, precision: str, strategy: "Strategy | None", *,
                        objective: bool = False) -> str | None:
    """Why --modules-to-save-dtype cannot run, or None. The copies must compute with the rest: the compute dtype,
    or fp32 under autocast. DDP keeps them as cast; DeepSpeed's bf16 / fp16 mode casts every parameter and keeps
    its own fp32 master of the trainable ones (runtime/engine.py _configure_distributed_model), so a dtype given
    there changes nothing; accelerate's FSDP2 upcasts every trainable parameter to fp32 under mixed precision
    (utils/fsdp_utils.py fsdp2_prepare_model), so only fp32 is what it trains."""
    from toolkit.inputs.lora import base_dtype_name, saved_dtype_name

    if not adapter.is_adapter or adapter.saved_dtype == "auto":
        return None
    flag = f"--modules-to-save-dtype {adapter.saved_dtype}"
    if not adapter.save_list():
        return f"{flag} sets the dtype of --lora-modules-to-save copies, and none are named; name them or drop it"
    wanted, compute = saved_dtype_name(precision, saved_dtype=adapter.saved_dtype), base_dtype_name(precision)
    if wanted not in (compute, "float32") or (wanted != compute and precision not in ("bf16", "fp16")):
        return (f"{flag} with --precision {precision}: the copies compute in {compute}; give "
                f"{'fp32 or ' if precision in ('bf16', 'fp16') else ''}the compute dtype, or auto")
    if objective:
        return f"{flag} is modelled for supervised fine-tuning only; drop --modules-to-save-dtype (auto)"
    if strategy is not None and strategy.engine == Engine.DEEPSPEED:
        return (f"{flag} under {strategy.name}: DeepSpeed's {precision} mode casts every parameter to {precision} "
                "and keeps fp32 master copies of the trainable ones; drop --modules-to-save-dtype")
    if strategy is not None and strategy.engine == Engine.FSDP2 and wanted != "float32" and precision != "bf16-pure":
        return (f"{flag} under {strategy.name}: accelerate upcasts every trainable parameter to fp32 for FSDP2 "
                "(beside a 4-bit base it keeps the copies in the base's dtype: auto); give fp32, or drop "
                "--modules-to-save-dtype")
    if strategy is not None and strategy.engine not in (Engine.DDP, Engine.FSDP2):
        return f"{flag} under {strategy.name}: modelled on ddp and fsdp2 only; use one of them"
    return None


def _load_dtype_problem(adapter: Adapter, precision: str, strategy: "Strategy | None", *,
                        objective: bool = False) -> str | None:
    """Why LoRA's --base-dtype cannot run with the rest of the job, or None. A base in the compute dtype is what
    auto loads; an fp32 base needs autocast (bf16 / fp16 mixed precision) and an engine that keeps it fp32: DDP
    (whole), or FSDP2, which shards it in fp32 and all-gathers it in MixedPrecisionPolicy's param_dtype. DeepSpeed's
    bf16 / fp16 mode casts every parameter to that dtype (runtime/engine.py _configure_distributed_model)
    (docs/ENGINE_FACTS.md, "A LoRA base loaded in fp32")."""
    from toolkit.inputs.lora import base_dtype_name

    if not adapter.is_adapter or adapter.base_dtype == "auto" \
            or base_dtype_name(precision, adapter.base_dtype) == base_dtype_name(precision):
        return None
    if adapter.base_dtype != "fp32" or precision not in ("bf16", "fp16"):
        return (f"--base-dtype {adapter.base_dtype} with --precision {precision}: the base computes in "
                f"{base_dtype_name(precision)}; give --base-dtype fp32 with --precision bf16 or fp16 (autocast), or "
                "auto")
    if objective:
        return "--base-dtype fp32 is modelled for supervised fine-tuning only; drop --base-dtype (auto)"
    if strategy is not None and strategy.engine == Engine.DEEPSPEED:
        return (f"--base-dtype fp32 under {strategy.name}: DeepSpeed's {precision} mode casts every parameter to "
                f"{precision}; use ddp, or drop --base-dtype")
    return None


def adapter_problem(adapter: Adapter, strategy: "Strategy | None") -> str | None:
    """Why `adapter` (LoRA / QLoRA) cannot train under `strategy`, or None: the one rule the planner (a row under
    "not possible"), estimate, emit, check and toolkit.train (also for --lora / --qlora given at run time) apply."""
    if strategy is None or not adapter.is_adapter:
        return None
    if strategy.is_pipeline:
        return (f"{adapter.method} trains through PEFT on the HF Trainer path (DDP, ZeRO, FSDP2), not the pipeline "
                "engine")
    if adapter.method == "qlora" and strategy.engine == Engine.DEEPSPEED and strategy.zero_stage == 3 \
            and not quantized_base_sharded(adapter):
        # docs/ENGINE_FACTS.md "QLoRA under FSDP2 / ZeRO-3": ZeRO-3 partitions every parameter, the frozen 4-bit
        # ones included; PEFT's documented ZeRO-3 QLoRA route stores the codes in bf16 (FSDP2 instead leaves uint8
        # codes whole, which the estimate budgets).
        return ("QLoRA under ZeRO-3 needs the 4-bit base stored in a floating dtype for DeepSpeed to partition it "
                f"(--qlora-quant-storage {adapter.quant_storage} is not); plan with --qlora-quant-storage bfloat16, "
                "or use zero2 / fsdp2")
    return None


def check_job(spec: "ModelSpec", job: Job, hw: "Hardware", strategy: "Strategy | None" = None, *,
              pipeline_stages: int | None = None) -> None:
    """Raise UserError when `job` cannot run `spec` on `hw`: sequence longer than the model's positions,
    precision the GPU lacks, a pipeline grid the model cannot be split over."""
    check_seq_len(spec, job.seq_len)
    problem = job_problem(job.precision, hw.gpu, strategy, activation_offloading=job.activation_offloading,
                          liger=job.liger, adapter=job.adapter, compile=job.compile, attention=job.attention,
                          tiled=job.tiled, dpo=job.dpo, grpo=job.grpo, loss=job.loss)
    if problem is None:
        from toolkit.inputs.grpo import grpo_problem
        from toolkit.inputs.preference import dpo_problem

        problem = dpo_problem(job.dpo, strategy, chunked_loss=job.chunked_loss) \
            or grpo_problem(job.grpo, strategy, chunked_loss=job.chunked_loss) \
            or model_feature_problem(spec, liger=job.liger, tiled=job.tiled, attention=job.attention)
        problem = problem or vision_tower_problem(spec, job.vision_tower)
    if problem:
        raise UserError(problem)
    if strategy is not None and strategy.is_pipeline:
        from toolkit.inputs.grid import grid_of

        grid_of(strategy, hw, pipeline_stages).check_model(spec)


def vision_tower_problem(spec: "ModelSpec", vision_tower: str) -> str | None:
    """Why --vision-tower cannot apply to `spec` (a model without a vision encoder), or None."""
    if vision_tower != "train" and not getattr(spec, "multimodal", False):
        return (f"--vision-tower {vision_tower}: {spec.name} has no vision encoder beside its language model (it is "
                "not a multimodal class); drop --vision-tower")
    return None


def compile_problem(strategy: "Strategy | None", *, activation_offloading: bool = False, liger: bool = False,
                    adapter: Adapter = FULL, attention: str | None = None) -> str | None:
    """Why --compile cannot be planned with the rest of the job, or None (docs/ENGINE_FACTS.md, torch.compile)."""
    if strategy is not None and strategy.is_pipeline:
        # accelerate compiles the model in prepare() (torch.compile, or DeepSpeed's engine.compile()); the pipeline
        # runner builds its own DeepSpeed PipelineEngine outside accelerate's prepare and compiles nothing.
        return ("--compile runs on the HF Trainer path (DDP, ZeRO, FSDP2): toolkit's pipeline runner builds "
                "DeepSpeed's PipelineEngine outside accelerate and does not compile stages; drop --compile")
    for on, what in ((adapter.is_adapter, adapter.method), (liger, "--liger"),
                     (activation_offloading, "--activation-offloading"),
                     (attention == "flash_attention_2", "--attention flash_attention_2")):
        if on:
            return (f"--compile with {what} is not modelled yet (the compiled trace covers the model's own HF code "
                    f"with sdpa / eager attention); drop one of them")
    return None


def tiled_problem(strategy: "Strategy | None", *, liger: bool = False, adapter: Adapter = FULL,
                  compile: bool = False) -> str | None:
    """Why --tiled cannot be planned with the rest of the job, or None (docs/ENGINE_FACTS.md, "ALST tiling"). With
    --activation-offloading it is planned with DeepSpeed's own checkpoint offload (toolkit.estimate.savers)."""
    if strategy is not None and strategy.engine != Engine.DEEPSPEED:
        # TiledMLP / TiledFusedLogitsLoss back-propagate chunk by chunk and tell only ZeRO to wait for the last
        # chunk before reducing a weight's gradient (param.ds_grad_is_ready; ulysses_sp.py: "XXX: DDP, FSDP will
        # need something similar"); DDP's reducer would see each weight's gradient hook fire once per chunk.
        return (f"--tiled runs under DeepSpeed ZeRO (DeepSpeed's tiled functions hold a weight's gradient until the "
                f"last chunk only for ZeRO), not {strategy.name}; use zero1, zero2 or zero3, or drop --tiled")
    for on, what in ((liger, "--liger"), (compile, "--compile"), (adapter.is_adapter, adapter.method)):
        if on:
            return (f"--tiled with {what} is not modelled (both change how the MLP / loss run or what they save); "
                    "drop one of them")
    return None


LOSS_TILE_BYTES = GIB
"""fp32 logits per loss chunk (ArcticTraining's num_loss_logit_shards "auto": slice_size_in_gb = 1)."""


def mlp_shards(seq_len: int, hidden: int) -> int:
    """Chunks TiledMLP runs one rank's sequence in: ceil(seq / hidden) (DeepSpeed's TiledMLP example)."""
    return max(1, math.ceil(seq_len / hidden))


def loss_shards(micro_batch: int, seq_len: int, vocab: int) -> int:
    """Chunks the tiled logits + loss runs in: fp32 logits of about 1 GiB each (ArcticTraining's "auto")."""
    return max(1, math.ceil(micro_batch * seq_len * vocab * 4 / LOSS_TILE_BYTES))


def model_feature_problem(spec: "ModelSpec", *, liger: bool = False, tiled: bool = False,
                          attention: str | None = None) -> str | None:
    """Why this model cannot take the attention kernel, the Liger patch or ALST tiling asked for, or None (one rule
    for check_job and the planner). Reads the transformers config: a spec from the cache holds a plain dict."""
    if problem := spec.attention_problem(attention):
        return problem
    if liger and (problem := liger_problem(spec.model_type)):
        return problem
    if tiled and spec.tiling_blocker:
        return f"--tiled: {spec.tiling_blocker}; drop --tiled"
    return _spec_tiling_problem(spec) if tiled else None


def _spec_tiling_problem(spec: "ModelSpec") -> str | None:
    """tiling_problem of the spec's config, kept per model (its source_key) in memory and in the on-disk cache: it
    reads transformers' config class, which a repeated plan otherwise never builds."""
    from toolkit import cache

    if not spec.source_key:
        return tiling_problem(spec.hf_config())
    if spec.source_key not in _TILING:
        hit = cache.get("tiling-problem", spec.source_key, code=tiling_problem)
        if not (isinstance(hit, list) and len(hit) == 1 and (hit[0] is None or isinstance(hit[0], str))):
            hit = [tiling_problem(spec.hf_config())]
            cache.put("tiling-problem", spec.source_key, hit, code=tiling_problem)
        _TILING[spec.source_key] = hit[0]
    return _TILING[spec.source_key]


_TILING: dict[str, str | None] = {}


def tiling_problem(config) -> str | None:
    """Why the tiled logits + loss cannot stand in for this model's head, or None: it computes lm_head(hidden) and
    the model's own loss function per chunk, so a head that rescales or caps the logits is not that."""
    for key in ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale"):
        if getattr(config, key, None) not in (None, 1, 1.0):
            return (f"--tiled: {type(config).__name__} transforms its logits ({key}), which the tiled logits + loss "
                    "(lm_head then the loss, per chunk) does not; drop --tiled")
    return None


MODELLED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
"""Model types whose Liger patch (RoPE, RMSNorm, SwiGLU, fused linear cross-entropy) is modelled here."""
OTHER_LIGER_MODEL_TYPES = (
    "deepseek_v4", "exaone4", "falcon_h1", "gemma", "gemma2", "gemma3", "gemma3_text", "gemma4", "gemma4_text",
    "glm4", "glm4v", "glm4v_moe", "gpt_oss", "granite", "hunyuan_v1_dense", "hunyuan_v1_moe", "internvl", "llama4",
    "llama4_text", "llava", "ministral", "mixtral", "mllama", "mllama_text_model", "nemotron", "olmo2", "olmo3",
    "paligemma", "phi3", "pixtral", "qwen2_5_vl", "qwen2_5_vl_text", "qwen2_vl", "qwen2_vl_text", "qwen3_5",
    "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_5_text", "qwen3_moe", "qwen3_next", "qwen3_vl", "qwen3_vl_moe",
    "qwen3_vl_moe_text", "qwen3_vl_text", "smollm3", "smolvlm")
"""The other keys of Liger's MODEL_TYPE_TO_APPLY_LIGER_FN (monkey_patch.py, 0.8.2): other norms (Gemma's offset),
GeGLU, fused gate_up (Phi-3), expert MLPs, vision towers, or no fused loss (Granite); not modelled yet."""


def liger_problem(model_type: str) -> str | None:
    """Why --liger cannot be modelled for `model_type`, or None."""
    if model_type in MODELLED_MODEL_TYPES:
        return None
    modelled = ", ".join(MODELLED_MODEL_TYPES)
    if model_type in OTHER_LIGER_MODEL_TYPES:
        return (f"--liger is modelled for model types {modelled}; Liger patches {model_type} with other kernels "
                "that toolkit does not model yet: drop --liger")
    return f"Liger kernels do not support model type {model_type!r} (toolkit models {modelled}): drop --liger"


def policy_job(job: Job) -> Job:
    """The supervised job the policy's memory and time are traced as. DPO: chosen and rejected concatenated into one
    forward (TRL's _compute_loss: `batch is [chosen, rejected]`), so twice the micro-batch of pairs. GRPO: the
    micro-batch already counts prompt + completion sequences (per_device_train_batch_size). Both with TRL's chunked
    log-prob head: DPOTrainer and GRPOTrainer always patch the policy with add_fused_lm_head and score it with
    fused_lm_head=True (trl/trainer/dpo_trainer.py _compute_loss, grpo_trainer.py _get_per_token_logps_and_entropies),
    so no whole logits exist whatever --loss says (docs/ENGINE_FACTS.md, "TRL's chunked NLL")."""
    if job.grpo is not None:
        return replace(job, grpo=None, loss=TRL_LOSS)
    return replace(job, dpo=None, micro_batch=2 * job.micro_batch, loss=TRL_LOSS)
