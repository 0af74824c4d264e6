"""Reinforcement fine-tuning with TRL's GRPOTrainer: the settings that move memory and time, checked once for every
command (estimate, plan, check, emit), with TRL 1.16 GRPOConfig's own names.

What TRL does with them (docs/ENGINE_FACTS.md, "GRPO"): each process generates completions for its share of the
generation batch (per_device_train_batch_size x steps_per_generation completions, num_generations of them per
prompt), in the training process (transformers' generate on the policy) or by vLLM, colocated on the training GPUs
with a fixed share of their memory (vllm_gpu_memory_utilization) or as a server on other GPUs (vllm_mode "server");
the reference model exists only when beta != 0; the policy then trains on prompt + completion sequences,
per_device_train_batch_size of them per micro-step.

Nothing here imports beyond the standard library and toolkit's ground.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

from toolkit.errors import UserError
from toolkit.inputs.choices import GRPO_DEFAULTS, GRPO_PROMPT_LENGTH, METHOD_JOIN, VLLM_MODES

if TYPE_CHECKING:
    from toolkit.inputs.strategy import Strategy

GENERATE = "generate"
"""No vLLM: transformers' generate in the training process (GRPOConfig use_vllm False)."""
COLOCATE, SERVER = VLLM_MODES


@dataclass(frozen=True)
class Grpo:
    """A GRPO job's settings (TRL GRPOConfig, same names)."""

    num_generations: int = GRPO_DEFAULTS["num_generations"]
    """Completions per prompt; the generation batch must hold whole groups (GRPOConfig.__post_init__)."""
    max_prompt_length: int = GRPO_PROMPT_LENGTH
    """The longest prompt in tokens (the data's; TRL 1.16 has no such setting, vllm_max_model_length covers it)."""
    max_completion_length: int = GRPO_DEFAULTS["max_completion_length"]
    beta: float = GRPO_DEFAULTS["beta"]
    """KL coefficient; 0 (TRL's default): no reference model is loaded (GRPOTrainer.__init__)."""
    use_vllm: bool = False
    vllm_mode: str = COLOCATE
    vllm_gpu_memory_utilization: float = GRPO_DEFAULTS["vllm_gpu_memory_utilization"]
    """Colocate: the fraction of each GPU's memory vLLM takes (weights, KV cache, its own reserves)."""
    vllm_tensor_parallel_size: int = 1
    """Colocate: vLLM's tensor-parallel degree; each group of that many training processes shares one engine, its
    weights split over them (trl/generation/vllm_generation.py: it must divide the world size)."""
    vllm_enable_sleep_mode: bool = False
    """Colocate: vLLM sleeps (level 2: weights and KV cache released) after each generation, so its share is taken only
    while it generates (trl/generation/vllm_generation.py)."""
    reward_model: str | None = None
    """A reward model scoring every completion (GRPOTrainer's reward_funcs given a name: a sequence-classification
    checkpoint TRL loads with num_labels=1, a catalog name, local path or hub id like the policy); None: rule-based
    rewards only (toolkit.inputs.reward checks it and counts it)."""

    def __post_init__(self) -> None:
        for flag, value in (("--num-generations", self.num_generations),
                            ("--max-prompt-length", self.max_prompt_length),
                            ("--max-completion-length", self.max_completion_length),
                            ("--vllm-tensor-parallel-size", self.vllm_tensor_parallel_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise UserError(f"{flag} must be a positive integer, got {value!r}")
        if self.num_generations < 2:
            raise UserError(f"--num-generations {self.num_generations}: GRPO needs at least 2 completions per prompt "
                            "for its group advantage (GRPOConfig refuses fewer); give 2 or more")
        if not (isinstance(self.beta, (int, float)) and not isinstance(self.beta, bool) and math.isfinite(self.beta)
                and self.beta >= 0):
            raise UserError(f"--grpo-beta must be a number >= 0, got {self.beta!r}")
        if self.vllm_mode not in VLLM_MODES:
            raise UserError(f"--vllm-mode '{self.vllm_mode}' is not known; choose one of: {', '.join(VLLM_MODES)}")
        u = self.vllm_gpu_memory_utilization
        if not (isinstance(u, (int, float)) and not isinstance(u, bool) and math.isfinite(u) and 0 < u < 1):
            raise UserError(f"--vllm-gpu-memory-utilization must be a fraction between 0 and 1 (exclusive), got {u!r}")
        if self.reward_model is not None and (not isinstance(self.reward_model, str) or not self.reward_model.strip()):
            raise UserError(f"--reward-model must name a model (catalog name, local path or hub id), got "
                            f"{self.reward_model!r}")

    @property
    def generation(self) -> str:
        """generate (in the training process), colocate or server."""
        return self.vllm_mode if self.use_vllm else GENERATE

    @property
    def seq_len(self) -> int:
        """The sequences the policy trains on: prompt + completion."""
        return self.max_prompt_length + self.max_completion_length

    @property
    def reference_kept(self) -> bool:
        """TRL's rule (GRPOTrainer.__init__): beta 0.0 loads no reference model and computes no KL term."""
        return self.beta != 0.0

    def generating_in_process(self) -> tuple[Grpo, str | None]:
        """These settings on a box without a GPU, where vLLM cannot run (TRL's GRPOTrainer refuses use_vllm without
        the vllm package): generation in the training process (transformers' generate), and the one line that says
        so (None when they already generate there)."""
        if not self.use_vllm:
            return self, None
        return replace(self, use_vllm=False), (f"vLLM ({self.vllm_mode}) needs a GPU: GRPO generates in the training "
                                               "process (transformers' generate, use_vllm False)")

    def grpo_config_kwargs(self) -> dict[str, Any]:
        """TRL GRPOConfig keyword arguments of these settings (JSON-safe). vllm_max_model_length is set to prompt +
        completion when vLLM generates (GRPOConfig's help: at least the longest prompt plus max_completion_length)."""
        out: dict[str, Any] = {"num_generations": self.num_generations,
                               "max_completion_length": self.max_completion_length, "beta": self.beta,
                               "use_vllm": self.use_vllm}
        if self.use_vllm:
            out.update(vllm_mode=self.vllm_mode, vllm_max_model_length=self.seq_len)
            if self.vllm_mode == COLOCATE:
                out.update(vllm_gpu_memory_utilization=self.vllm_gpu_memory_utilization,
                           vllm_tensor_parallel_size=self.vllm_tensor_parallel_size,
                           vllm_enable_sleep_mode=self.vllm_enable_sleep_mode)
        return out

    def to_dict(self) -> dict[str, Any]:
        """The fields, reward_model only when one is given (plans made without one stay as they were)."""
        out = asdict(self)
        if out["reward_model"] is None:
            del out["reward_model"]
        return out


GRPO_FLAGS = {"num_generations": "--num-generations", "max_prompt_length": "--max-prompt-length",
              "max_completion_length": "--max-completion-length", "beta": "--grpo-beta", "use_vllm": "--use-vllm",
              "vllm_mode": "--vllm-mode", "vllm_gpu_memory_utilization": "--vllm-gpu-memory-utilization",
              "vllm_tensor_parallel_size": "--vllm-tensor-parallel-size",
              "vllm_enable_sleep_mode": "--vllm-enable-sleep-mode", "reward_model": "--reward-model"}
"""Grpo fields with the flag that sets each."""


def grpo_from_flags(objective: str | None, **given: Any) -> Grpo | None:
    """The Grpo of a command line (None unless --method grpo); a GRPO flag without it is refused, never ignored.
    `given` holds the flags' values (None: not given)."""
    given = {k: v for k, v in given.items() if v is not None}
    if objective != "grpo":
        if given:
            flag = GRPO_FLAGS[next(iter(given))]
            raise UserError(f"{flag} applies to --method grpo (or grpo{METHOD_JOIN}lora), and --method names no GRPO "
                            f"job: it would be ignored; add --method grpo or drop {flag}")
        return None
    if not given.get("use_vllm"):
        for key in ("vllm_mode", "vllm_gpu_memory_utilization", "vllm_tensor_parallel_size", "vllm_enable_sleep_mode"):
            if key in given:
                raise UserError(f"{GRPO_FLAGS[key]} applies to vLLM generation, and without --use-vllm GRPO "
                                "generates in the training process (transformers' generate); add --use-vllm or drop "
                                f"{GRPO_FLAGS[key]}")
    for key in ("vllm_gpu_memory_utilization", "vllm_tensor_parallel_size", "vllm_enable_sleep_mode"):
        if given.get("vllm_mode") == SERVER and key in given:
            raise UserError(f"{GRPO_FLAGS[key]} applies to --vllm-mode colocate; a vLLM server takes its own "
                            "settings (trl vllm-serve): drop it here")
    return Grpo(**given)


def grpo_problem(grpo: Grpo | None, strategy: "Strategy | None", *, liger: bool = False, tiled: bool = False,
                 compile: bool | str = False, activation_offloading: bool = False,
                 chunked_loss: int = 0) -> str | None:
    """Why a GRPO job cannot be planned with `strategy` and the rest of the job, or None."""
    if grpo is None:
        return None
    if strategy is not None and strategy.is_pipeline:
        return ("GRPO runs through TRL's GRPOTrainer on the HF Trainer path, not the pipeline engine; use ddp, zero1, "
                "zero2, zero3 or fsdp2")
    if activation_offloading:  # SFTConfig and DPOConfig have the field, GRPOConfig not (trl/trainer/grpo_config.py)
        return ("--method grpo with activation offloading: TRL 1.16's GRPOTrainer has none (GRPOConfig has no "
                "activation_offloading); drop --activation-offloading")
    for on, what in ((liger, "--liger"), (tiled, "--tiled"), (compile, "--compile"),
                     (chunked_loss, "--chunked-loss")):
        if on:
            return f"--method grpo with {what} is not modelled; drop {what}"
    return None


def batch_problem(grpo: Grpo, micro_batch: int, data_parallel: int, grad_accum: int) -> str | None:
    """GRPOConfig.__post_init__'s rule with toolkit's batch: the generation batch (per_device_train_batch_size x
    processes x steps_per_generation, which defaults to gradient_accumulation_steps) holds whole groups of
    num_generations completions; and vLLM colocate's tensor-parallel groups divide the processes (GRPO runs data
    parallel only, so they are `data_parallel`)."""
    tp = grpo.vllm_tensor_parallel_size
    if grpo.generation == COLOCATE and data_parallel % tp:
        return (f"--vllm-tensor-parallel-size {tp} must divide the {data_parallel} training processes (TRL's vLLM "
                "colocate groups them); give a divisor")
    generation_batch = micro_batch * data_parallel * grad_accum
    if generation_batch % grpo.num_generations:
        return (f"GRPO's generation batch (micro-batch {micro_batch} x {data_parallel} processes x accumulation "
                f"{grad_accum} = {generation_batch} completions) must be a multiple of --num-generations "
                f"{grpo.num_generations} (GRPOConfig); change the batch or --num-generations")
    return None


def generation_batch(grpo: Grpo, micro_batch: int, data_parallel: int, grad_accum: int) -> dict[str, Any]:
    """What one optimizer step consumes (GRPOConfig's defaults: one generation per step): the generation batch in
    completions, the prompts it holds (num_generations completions each), and where the reference and generation
    are. A time-to-train over a prompt dataset counts prompts_per_step."""
    completions = micro_batch * data_parallel * grad_accum
    return {"generation_batch_size": completions, "prompts_per_step": completions // grpo.num_generations,
            "reference_model": grpo.reference_kept, "generation": grpo.generation}


MODEL_PARALLEL_GRPO_PROBLEM = ("GRPO with tensor, context, sequence or expert parallelism is not modelled (GRPOConfig "
                               "refuses context / sequence parallelism); plan it on DDP, ZeRO or FSDP2 alone")


def grpo_words(grpo: Grpo | None) -> str:
    """How job summaries name a GRPO job, or nothing."""
    if grpo is None:
        return ""
    where = {GENERATE: "generate in the training process", COLOCATE:
             f"vLLM colocate at {grpo.vllm_gpu_memory_utilization:g} of GPU memory"
             + (", sleeping while training" if grpo.vllm_enable_sleep_mode else ""),
             SERVER: "vLLM server on other GPUs"}
    return (f", GRPO ({grpo.num_generations} generations, prompt {grpo.max_prompt_length} + completion "
            f"{grpo.max_completion_length}, beta {grpo.beta:g}: reference {'kept' if grpo.reference_kept else 'none'}, "
            f"{where[grpo.generation]}"
            f"{f', reward model {grpo.reward_model}' if grpo.reward_model else ''}; micro-batch counts completions)")
