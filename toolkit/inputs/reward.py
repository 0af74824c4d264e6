"""A GRPO job's reward model (--reward-model): what TRL 1.16's GRPOTrainer loads when reward_funcs names a model,
checked and counted from the model's own config, as the policy is (toolkit.inputs.modelspec).

TRL loads it with AutoModelForSequenceClassification.from_pretrained(name, num_labels=1, **model_init_kwargs)
(grpo_trainer.py __init__, docs/ENGINE_FACTS.md "A reward model"): a checkpoint of another kind would get a freshly
initialised score head (a causal LM) or fail on the head's shape (num_labels other than 1), so both are refused here.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from toolkit.errors import UserError
from toolkit.inputs.modelspec import ModelSpec

CLASSIFIER_SUFFIX = "ForSequenceClassification"
"""How transformers names a sequence-classification class (LlamaForSequenceClassification), as a checkpoint's
config.json lists it under `architectures`."""


@dataclass(frozen=True)
class RewardModel:
    """The reward model one GRPO job scores with."""

    name: str
    spec: ModelSpec
    """Its decoder as transformers builds it (toolkit.inputs.modelspec.resolve_model): layers, widths and matmul
    weights per token for its activations and FLOPs; the spec's LM head is not the reward model's (see params)."""
    params: int
    """Exact parameters of AutoModelForSequenceClassification(num_labels=1) built on the meta device and counted
    like the policy (tied weights once): the decoder and a score head of hidden x 1, no LM head."""
    load_bytes_per_param: int
    """The dtype TRL loads it in: transformers 5 from_pretrained's default dtype "auto" is the checkpoint's own
    (config dtype / torch_dtype; fp32 when it names none; modeling_utils.py _get_dtype), as TRL passes no dtype."""


def reward_model_of(name: str) -> RewardModel:
    """The reward model `name` names, or one line saying why TRL could not score with it."""
    return _reward_model(name)


@lru_cache(maxsize=8)
def _reward_model(name: str) -> RewardModel:
    import torch
    from transformers import AutoModelForSequenceClassification
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING

    from toolkit.inputs.choices import DTYPE_BYTES
    from toolkit.inputs.modelconfig import load_config
    from toolkit.inputs.modelspec import resolve_model, unique_numel

    config = load_config(name)
    architectures = list(getattr(config, "architectures", None) or [])
    if not any(a.endswith(CLASSIFIER_SUFFIX) for a in architectures) \
            or type(config) not in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING:
        raise UserError(f"--reward-model '{name}' is not a sequence-classification model (its config's architectures: "
                        f"{', '.join(architectures) or 'none'}); TRL loads a reward model with "
                        "AutoModelForSequenceClassification(num_labels=1), which would give this one an untrained "
                        "score head: give a reward model (a *ForSequenceClassification checkpoint)")
    if config.num_labels != 1:
        raise UserError(f"--reward-model '{name}' has {config.num_labels} labels; TRL loads it with num_labels=1 and "
                        "scores with logits[:, 0], so its score head would not load: give a reward model with one "
                        "label")
    spec = resolve_model(name)
    with torch.device("meta"):
        model = AutoModelForSequenceClassification.from_config(config)
    dtype = getattr(config, "dtype", None)
    dtype_name = str(dtype).removeprefix("torch.") if dtype is not None else "float32"
    return RewardModel(name=name, spec=spec, params=unique_numel(model.parameters()),
                       load_bytes_per_param=DTYPE_BYTES.get(dtype_name, 4))
