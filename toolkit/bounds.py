"""Sane bounds for every number a user types, and the argparse types that enforce them where input enters.

A value outside its bound is refused as one line naming the flag, the value and the range, before anything runs:
NaN, inf, negative and zero counts, and absurd sizes (10^20 GPUs per node, 100,000 layers) never reach the
planner, where they would hang a model build or print a meaningless answer.

Each upper bound is far above the largest real instance (the source is given beside it), so no real job is
refused; it only stops sizes that cannot describe hardware or a model that exists.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from toolkit.errors import UserError


@dataclass(frozen=True)
class Bound:
    low: float
    high: float
    why: str
    """What the upper bound is measured against (printed in the refusal)."""
    low_inclusive: bool = True


# Model shape. Largest published dense decoders: Llama-3.1-405B has 126 layers, hidden 16384, 128 heads, 8 KV heads,
# FFN 53248, vocab 128256 (its config.json); Megatron-LM's 1T configuration has 128 layers and hidden 25600
# (Narayanan et al. 2021, table 1); Gemma-2's vocab is 256000 (its config.json).
LAYERS = Bound(1, 1024, "8x the deepest published decoder (126 layers)")
HIDDEN = Bound(1, 131072, "5x the widest published decoder (hidden 25600)")
HEADS = Bound(1, 4096, "32x the most heads of a published decoder (128)")
FFN = Bound(1, 1048576, "about 20x the widest published FFN (53248)")
VOCAB = Bound(1, 16777216, "64x the largest published vocabulary (256000)")
PARAMS = Bound(1, 1e15, "1000x the largest published dense model (1T)")
SEQ = Bound(1, 16777216, "16x the longest published context window (1M tokens)")
IMAGES = Bound(1, 4096, "4096 images (or video frames) in one sample")
IMAGE_SIDE = Bound(1, 65536, "65536 pixels a side, 4x a 16K frame")

# Hardware. The largest NVLink domain is GB200 NVL72 (72 GPUs); the largest reported clusters hold about 10^5
# GPUs (about 1.3 x 10^4 nodes of 8), so nodes are bounded at 2^16 and per-node GPUs at 1024. The plan.json schema
# (toolkit/plan/schema.py) bounds the same fields; these are kept at or inside its bounds, so a flag accepted here never
# makes a plan the schema refuses.
GPUS_PER_NODE = Bound(1, 1024, "14x the largest NVLink domain (NVL72)")
PROCESSES = Bound(1, 1024, "as many processes as GPUs per node (--processes of launch)")
NODES = Bound(1, 65536, "5x the nodes of the largest reported GPU clusters (~10^5 GPUs)")
INTER_NODE_GBPS = Bound(0.1, 100000, "100 TB/s per node, 100x an 8 x 800G-rail node")
"""At least 0.1 GB/s, below one 1 Gb/s Ethernet port (0.125 GB/s): a slower link is no cluster, and 1e-300 made a
step time of 300 digits."""
CPU_RAM_GIB = Bound(0, 1048576, "1 PiB of host RAM per node", low_inclusive=False)
POWER_LIMIT_W = Bound(0, 10000, "10 kW per GPU, 10x the 1000 W board power of a B200 (HGX B200 datasheet)",
                      low_inclusive=False)
"""--power-limit-w: the GPU's own datasheet points bound it further (toolkit.inputs.hardware.power_limited)."""

# LoRA (toolkit.inputs.lora.Adapter applies the adapter's own rules inside these: dropout below 1, a rank no larger
# than the widest adapted matrix).
LORA_RANK = Bound(1, 16777216, "the largest side of any matrix an allowed model has (--vocab)")
LORA_ALPHA = Bound(0, 1e6, "10^6, 30,000x the default 32", low_inclusive=False)
LORA_DROPOUT = Bound(0, 1, "a probability")
DPO_BETA = Bound(0, 1e3, "10^3, 10,000x TRL's default 0.1", low_inclusive=False)
ROPE_FACTOR = Bound(1.0, 1024, "25x DeepSeek-V3's YaRN factor 40 (its config.json)")
"""--rope-factor: transformers' rope validation asks for a factor >= 1 (modeling_rope_utils.py)."""
GRPO_BETA = Bound(0, 1e3, "10^3, 10^6x the 0.001 DeepSeek-R1 used (GRPOConfig.beta's help)")
NUM_GENERATIONS = Bound(2, 65536, "64x the 1024 completions of the largest published GRPO groups")
"""At least 2: GRPOConfig.__post_init__ refuses fewer (the group advantage needs two)."""
VLLM_GPU_MEMORY_UTILIZATION = Bound(0, 1, "a fraction of the GPU's memory", low_inclusive=False)

# Batch and steps.
BATCH = Bound(1, 1000000, "10^6 samples")
STAGES = Bound(1, 1024, "one stage per layer of the deepest allowed model")
DEGREE = Bound(1, 1024, "the GPUs-per-node bound; no real model has heads to split over more")
STEPS = Bound(1, 1e9, "10^9 optimizer steps")
PROFILE_STEPS = Bound(1, 10000, "timed steps of one profile run")
TOP = Bound(1, 100000, "rows to print")
TUNE_CANDIDATES = Bound(1, 100, "100 candidates, each a real run of a few steps")
TUNE_BUDGET_MIN = Bound(0, 10080, "a week of probing", low_inclusive=False)
RESTARTS = Bound(0, 1000, "1000 elastic restarts: more means the job is failing, not recovering")

# Run size (toolkit.estimate.duration). Llama 3 was pre-trained on about 15T tokens (its paper, section 3.1).
DATASET_TOKENS = Bound(1, 1e15, "about 67x the 15T tokens Llama 3 was pre-trained on")
EPOCHS = Bound(0, 10000, "10^4 passes over the data", low_inclusive=False)
GPU_HOUR_PRICE = Bound(0, 10000, "10,000 per GPU-hour, over 1000x an H100's on-demand price")


def check_number(flag: str, value: float, bound: Bound) -> None:
    """Raise UserError unless value is finite and inside bound."""
    low_ok = value >= bound.low if bound.low_inclusive else value > bound.low
    if isinstance(value, float) and not math.isfinite(value):
        raise UserError(f"{flag} {value} is not a finite number; give a number from "
                        f"{_range_text(bound)}")
    if not low_ok:
        kind = ("a positive integer" if bound.low == 1 and bound.low_inclusive and isinstance(bound.low, int) else "positive" if bound.low <= 0
                else f"at least {_show(bound.low)}")
        raise UserError(f"{flag} must be {kind}, got {_show(value)} (give {_range_text(bound)})")
    if value > bound.high:
        raise UserError(f"{flag} {_show(value)} is absurdly large (limit {_show(bound.high)}: {bound.why}); "
                        f"give a number from {_range_text(bound)}")


def _range_text(bound: Bound) -> str:
    low = _show(bound.low) if bound.low_inclusive else f"more than {_show(bound.low)}"
    return f"{low} to {_show(bound.high)}"


def _show(value: float) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e16:
        value = int(value)
    if isinstance(value, int) and abs(value) >= 10**4:
        return f"{value:,}" if abs(value) < 10**16 else f"{value:.3g}"
    return str(value)


def parse_int(flag: str, text: str, bound: Bound) -> int:
    """A whole number inside bound ('1e3' and '1_000' are read too; '2.5' is refused)."""
    t = str(text).strip().replace("_", "")
    try:
        value = int(t)
    except ValueError:
        try:
            as_float = float(t)
        except ValueError:
            raise UserError(f"{flag} '{text}' is not a whole number") from None
        check_number(flag, as_float, bound)
        if not as_float.is_integer():
            raise UserError(f"{flag} '{text}' is not a whole number")
        value = int(as_float)
    check_number(flag, value, bound)
    return value


def parse_float(flag: str, text: str, bound: Bound) -> float:
    try:
        value = float(str(text).strip())
    except ValueError:
        raise UserError(f"{flag} '{text}' is not a number") from None
    check_number(flag, value, bound)
    return value


def int_arg(flag: str, bound: Bound):
    """argparse `type=` for a bounded whole number (the refusal is a UserError: one line, exit 2)."""

    def convert(text: str) -> int:
        return parse_int(flag, text, bound)

    convert.__name__ = flag  # argparse names the type in its own messages
    convert.bound = bound  # type: ignore[attr-defined] # what tests/test_hostile.py walks every numeric flag by
    return convert


def float_arg(flag: str, bound: Bound):
    def convert(text: str) -> float:
        return parse_float(flag, text, bound)

    convert.__name__ = flag
    convert.bound = bound  # type: ignore[attr-defined]
    return convert


def text_arg(flag: str):
    """argparse `type=` for a non-empty name or path without control characters (a newline in a path would end a
    comment line in an emitted script and run the rest as a command)."""

    def convert(text: str) -> str:
        if not text.strip():
            raise UserError(f"{flag} is empty; give a value")
        check_no_control_chars(flag, text)
        return text

    convert.__name__ = flag
    return convert


def check_no_control_chars(what: str, text: str) -> None:
    bad = [c for c in text if ord(c) < 32 or ord(c) == 127]
    if bad:
        raise UserError(f"{what} {text!r} holds a control character ({bad[0]!r}); remove it")


# Checkpoint rotation (toolkit.train --save-total-limit; PLAN.md states it).
DEFAULT_SAVE_TOTAL_LIMIT = 3
"""Complete checkpoints kept by default: the newest one to resume from, two older ones in case the newest turns out
bad (a loss spike), and a bounded disk (a 70B checkpoint with its AdamW states is about 1 TB: 16 bytes a parameter).
An older one is deleted only after a newer one is complete (toolkit.train.checkpoints.rotate)."""
