"""The closed sets a job is spelled from, each written once, and the numbers derived from them.

The CLI's choices, the Job's checks, the plan schema's enums (plan.schema.json), the tracer and the help all read
these tuples; a typing `Literal` beside each is built from the tuple, never written again. Strategies are their own
table (toolkit.inputs.strategy.STRATEGIES), since each name carries a Strategy value.

Nothing here imports beyond the standard library: a training process and `toolkit --help` read it cheaply.
"""

from __future__ import annotations

from typing import Literal

PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16", "bf16-pure")
"""fp32; bf16 / fp16 mixed (fp32 master weights, low-precision compute); bf16-pure (everything in bf16)."""
OPTIMIZERS: tuple[str, ...] = ("adamw", "adamw-8bit", "sgd", "adafactor")
ATTENTIONS: tuple[str, ...] = ("eager", "sdpa", "flash_attention_2")
"""transformers' attn_implementation values the estimate models."""
DEVICE_KINDS: tuple[str, ...] = ("cuda", "cpu")
"""Whose kernels' saved tensors the trace models."""
OPTIMIZER_IMPLS: tuple[str, ...] = ("fused", "foreach", "for-loop")
"""How torch's optimizer runs its step (toolkit.estimate.savers)."""
METHODS: tuple[str, ...] = ("full", "lora", "qlora")
VISION_TOWER_MODES: tuple[str, ...] = ("train", "freeze")
"""--vision-tower of a multimodal class fine-tuned on text: train (what the HF Trainer does with the class as
loaded: every parameter requires grad) or freeze (the encoder and projector keep their weights only)."""
"""Training method: full fine-tuning, LoRA, QLoRA (toolkit.inputs.lora)."""
OBJECTIVES: tuple[str, ...] = ("dpo", "grpo")
"""Preference / RL objectives --method names before an adapter (toolkit.inputs.preference, toolkit.inputs.grpo):
`dpo` / `grpo` train every weight, `dpo+lora` / `grpo+lora` train adapters on the policy (the reference is then the
adapter-disabled base)."""
METHOD_JOIN = "+"
"""Joins an objective and an adapter in one --method value: dpo+lora."""
REFERENCES: tuple[str, ...] = ("kept", "precomputed", "none")
"""--reference of a DPO job: the reference model kept beside the policy, its log-probs precomputed over the dataset
before training (TRL DPOConfig precompute_ref_log_probs), or none (a reference-free loss)."""
DPO_DEFAULT_BETA = 0.1
"""DPOConfig.beta's default (TRL 1.16)."""
DPO_LOSS_TYPES: tuple[str, ...] = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair",
                                   "sppo_hard", "aot", "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft",
                                   "sigmoid_norm")
"""TRL 1.16 DPOConfig.loss_type values (trl/trainer/dpo_config.py, the field's help; tests/test_preference.py reads
them back from the installed TRL so a new release's list is noticed)."""
GRPO_DEFAULTS = {"num_generations": 8, "max_completion_length": 512, "beta": 0.0, "vllm_gpu_memory_utilization": 0.3,
                 "vllm_tensor_parallel_size": 1, "vllm_enable_sleep_mode": False}
"""TRL 1.16 GRPOConfig defaults of the settings toolkit models (trl/trainer/grpo_config.py; tests/test_grpo.py reads
them back from the installed TRL)."""
GRPO_PROMPT_LENGTH = 512
"""--max-prompt-length's default: the longest prompt in tokens (TRL 1.16's GRPOConfig has no prompt limit of its own)."""
VLLM_MODES: tuple[str, ...] = ("colocate", "server")
"""GRPOConfig.vllm_mode when use_vllm: vLLM on the training GPUs, or a separate `trl vllm-serve` on other GPUs."""
QUANT_TYPES: tuple[str, ...] = ("nf4", "fp4")
"""bitsandbytes 4-bit code books (BitsAndBytesConfig.bnb_4bit_quant_type)."""
COMPUTE_DTYPES: tuple[str, ...] = ("bfloat16", "float16", "float32")
"""QLoRA compute dtype (bnb_4bit_compute_dtype)."""
QUANT_STORAGE_DTYPES: tuple[str, ...] = ("uint8", "bfloat16", "float16", "float32")
"""QLoRA storage dtype of the packed 4-bit codes (bnb_4bit_quant_storage)."""
BASE_DTYPES: tuple[str, ...] = ("auto", "fp32", "bf16", "fp16")
"""--base-dtype: the dtype LoRA's frozen base is loaded in (from_pretrained's dtype). auto: the compute dtype of
--precision; fp32: full-precision weights under bf16 / fp16 autocast, as published LoRA examples load them."""
BASE_DTYPE_NAMES: dict[str, str] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
"""--base-dtype value -> torch dtype attribute name."""

CHECKPOINTING_OP = "op"
"""--checkpointing op: torchtitan's per-op selective activation checkpointing (toolkit.estimate.selective)."""
CHECKPOINTING_MODES: tuple[str, ...] = ("on", "off", CHECKPOINTING_OP)
"""--checkpointing of estimate, profile and check; plan adds auto (PLAN_CHECKPOINTING_MODES)."""
PLAN_CHECKPOINTING_MODES: tuple[str, ...] = ("auto", *CHECKPOINTING_MODES)
"""plan --checkpointing: auto lets the planner decide."""
LOSSES: tuple[str, ...] = ("model", "trl")
"""--loss: the LM head + loss the step runs. model: the model's own forward (whole logits, transformers'
ForCausalLMLoss); trl: TRL's chunked NLL, the fused LM head TRL 1.16's SFTTrainer always patches
(toolkit.patches.trlloss; docs/ENGINE_FACTS.md "TRL's chunked NLL")."""
TRL_LOSS = "trl"
COMPILE_BLOCKS = "blocks"
"""--compile-blocks: each decoder layer compiled apart, the rest eager (torchtitan's apply_compile)."""

Precision = Literal[PRECISIONS]  # type: ignore[valid-type]
Optimizer = Literal[OPTIMIZERS]  # type: ignore[valid-type]
Attention = Literal[ATTENTIONS]  # type: ignore[valid-type]
DeviceKind = Literal[DEVICE_KINDS]  # type: ignore[valid-type]
OptimizerImpl = Literal[OPTIMIZER_IMPLS]  # type: ignore[valid-type]
Method = Literal[METHODS]  # type: ignore[valid-type]
Loss = Literal[LOSSES]  # type: ignore[valid-type]


def method_words() -> str:
    """--method's help: the adapters and the objective forms."""
    forms = [o if m == "full" else f"{o}{METHOD_JOIN}{m}" for o in OBJECTIVES for m in METHODS]
    return f"{choices_words(METHODS)}; preference: {choices_words(tuple(forms))}"


def split_method(text: str) -> tuple[str | None, str]:
    """(objective or None, adapter method) of a --method value: "dpo+lora" -> ("dpo", "lora"), "dpo" -> ("dpo",
    "full"), "lora" -> (None, "lora"). Unknown words are left for the adapter's check to refuse."""
    head, sep, tail = text.partition(METHOD_JOIN)
    if head in OBJECTIVES:
        return head, tail if sep else "full"
    return None, text


def choices_words(choices: tuple[str, ...]) -> str:
    """How help and messages list a closed set: "nf4 | fp4"."""
    return " | ".join(choices)


# --- units and the bytes of a dtype -----------------------------------------------------------------------------

GIB = 1024**3
"""Bytes in a GiB: every memory figure the tool prints is in GiB."""

DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2, "uint8": 1, "int8": 1}
"""Bytes per element of a dtype, by torch's name (torch.<name>.itemsize)."""


def compute_bytes(precision: str) -> int:
    """Bytes per element of the compute dtype: 4 in fp32, 2 in bf16 / fp16 (mixed or pure)."""
    return 4 if precision == "fp32" else 2


def weight_bytes(precision: str) -> int:
    """Bytes per element of the weights a step keeps: fp32 (master or plain) except bf16-pure, where they are bf16."""
    return 2 if precision == "bf16-pure" else 4


ROPE_SCALINGS: tuple[str, ...] = ("yarn", "linear", "dynamic", "llama3")
"""The rope_type values --rope-scaling takes: keys of transformers' ROPE_INIT_FUNCTIONS (modeling_rope_utils.py)
whose only required setting beside the type is `factor` (llama3 also reads low / high_freq_factor from the model's
config; longrope's per-frequency lists and proportional's partial factor are the model's own, not a job's)."""
