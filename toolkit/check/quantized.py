"""`toolkit check`'s finding for a checkpoint stored quantized (its config.json's quantization_config: GPT-OSS's
MXFP4, the fine-grained FP8 of DeepSeek-V3 / Qwen3-FP8 releases) that nothing loads dequantized
(docs/ENGINE_FACTS.md, "Quantized checkpoints").

The rule, read in transformers 5.24:
  - a method can be loaded dequantized when its config class takes `dequantize` (utils/quantization_config.py:
    Mxfp4Config, FineGrainedFP8Config, ...; `dequantize=True` loads bf16 weights and drops the quantizer,
    quantizers/base.py `remove_quantization_config`); a checkpoint whose own quantization_config says
    `"dequantize": true` already is;
  - otherwise the model stays quantized, and the HF Trainer (trainer_utils.py `validate_quantization_for_training`)
    refuses a quantized base without PEFT adapters unless its quantizer is QAT-trainable, and refuses adapters too
    when the quantizer's `is_trainable` is False (MXFP4: "don't support training, please consider dequantizing");
  - either way, under ZeRO-3 transformers builds a quantized checkpoint on the meta device, not under
    deepspeed.zero.Init (modeling_utils.py `get_init_context`): every rank loads and dequantizes the whole model
    before the engine shards it.
What check cannot see: a script that passes its own quantization_config to from_pretrained; the finding says so and
is a warning."""

from __future__ import annotations

import inspect
from typing import Any

from toolkit.check.findings import EVERY, Problem
from toolkit.inputs.choices import GIB


def quantized_checkpoint_problem(model_config: dict[str, Any], file: str, *, model: str, params: int,
                                 method: str | None, zero3: bool) -> Problem | None:
    """A warning when `model_config` is a checkpoint stored with a quantization method that can be loaded
    dequantized, nothing here says to, and the training `method` ("full", "lora", "qlora"; None: unknown) cannot
    train it quantized; None otherwise. zero3: the files run ZeRO-3 (every rank then holds the whole model)."""
    quantization = model_config.get("quantization_config")
    if not isinstance(quantization, dict) or quantization.get("dequantize"):
        return None
    from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING

    name = quantization.get("quant_method")
    config_class, quantizer_class = AUTO_QUANTIZATION_CONFIG_MAPPING.get(name), AUTO_QUANTIZER_MAPPING.get(name)
    if config_class is None or quantizer_class is None:
        return None
    if "dequantize" not in inspect.signature(config_class.__init__).parameters:
        return None  # bitsandbytes and the like: loaded quantized on purpose (QLoRA)
    from transformers.utils import logging

    was = logging.get_verbosity()
    logging.set_verbosity_error()  # MXFP4's is_trainable logs the advice this finding gives
    try:
        quantizer = quantizer_class(config_class.from_dict(dict(quantization)), pre_quantized=True)
        trainable, qat = bool(quantizer.is_trainable), bool(getattr(quantizer, "is_qat_trainable", False))
    except Exception:  # noqa: BLE001 - a quantization_config transformers itself cannot read; loading says why
        return None
    finally:
        logging.set_verbosity(was)
    if qat or (trainable and method in ("lora", "qlora")):
        return None
    adapters = (f" and, as {quantizer_class.__name__}.is_trainable is False, with them" if not trainable else
                " (LoRA on it trains)")
    bf16 = 2 * params / GIB
    whole = ("; under ZeRO-3 each rank still loads and dequantizes the whole model before DeepSpeed shards it "
             "(transformers builds a quantized checkpoint without deepspeed.zero.Init)" if zero3 else "")
    return Problem(file, "warning", f"{model} is stored {name}-quantized (its config.json's quantization_config) "
                   f"and nothing here loads it dequantized: the HF Trainer refuses a quantized base model without "
                   f"adapters{adapters} (transformers' validate_quantization_for_training); load it with "
                   f"from_pretrained(..., quantization_config={config_class.__name__}(dequantize=True)) (bf16 "
                   f"weights, {bf16:.1f} GiB), or set \"dequantize\": true in its quantization_config{whole}; check "
                   "cannot see a script that already passes one", EVERY)
