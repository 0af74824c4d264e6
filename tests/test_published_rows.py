"""How benchmarks/published.py reads a published row's job: what it scores and what it lists (issue 28)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import published  # noqa: E402  (benchmarks/ is not a package)


def _row(row_id: str) -> dict:
    return next(r for r in published.load_rows() if r["id"] == row_id)


def test_a_reading_made_on_another_model_is_listed_with_its_reason_not_scored():
    """ms-swift's image examples kept the header Qwen2-VL-7B gave them when their model line moved to Qwen2.5-VL:
    the row names the reading's model, and published.py lists it with the reason instead of scoring it."""
    row = _row("SWIFTEX-Qwen2.5-VL-7B-1xGPU-LoRA-caption")
    assert row["job"]["reading_model"] == "qwen2-vl-7b-instruct" != row["job"]["model"]
    assert published.unmodelled(row["job"]) == ["reading_of_another_model"]
    same = dict(row["job"], reading_model=row["job"]["model"])  # a reading of the named model itself is scored
    assert published.unmodelled(same) == []


def test_a_rows_base_dtype_reaches_the_adapter_the_estimate_takes():
    """The FSDP2 row's base was upcast to fp32 by the accelerate of its time: its lora object says so, and the
    Adapter the estimate is given carries it; a row without one keeps the compute dtype (auto)."""
    fsdp2 = _row("SWIFTEX-Qwen2.5-7B-2xGPU-LoRA-FSDP2")
    spec = published._spec(fsdp2["job"]["model"])
    assert published.adapter_of(fsdp2["job"], spec, fsdp2["framework"]).base_dtype == "fp32"
    zero2 = _row("SWIFTEX-Qwen2.5-7B-2xGPU-LoRA-ZeRO2")
    assert published.adapter_of(zero2["job"], spec, zero2["framework"]).base_dtype == "auto"
