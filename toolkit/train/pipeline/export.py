"""The trained pipeline back in Hugging Face format, written stage by stage: no rank ever holds the whole model.

Each stage's first data-parallel rank writes its own weights as one safetensors shard under their HF names; rank 0
then writes the shard index, config.json and the tokenizer, so `AutoModelForCausalLM.from_pretrained(out)` loads
it like any sharded checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch


def shard_name(stage: int, stages: int) -> str:
    return f"model-{stage + 1:05d}-of-{stages:05d}.safetensors"


def save_hf_model(pipe, out: str | Path, *, config: Any, tokenizer: Any, stage: int, stages: int,
                  data_rank: int, global_rank: int, barrier) -> None:
    """Collective: every rank calls it. `pipe` is this rank's PipelineModule (see convert.hf_state_dict)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from toolkit.train.pipeline.convert import hf_state_dict

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    dtype = None
    if data_rank == 0:
        state = hf_state_dict(pipe)
        dtype = next(iter(state.values())).dtype
        save_file(state, str(out / shard_name(stage, stages)), metadata={"format": "pt"})
    barrier()
    if global_rank == 0:
        weight_map: dict[str, str] = {}
        total = 0
        for s in range(stages):
            name = shard_name(s, stages)
            with safe_open(str(out / name), framework="pt") as f:
                for key in f.keys():
                    weight_map[key] = name
                    sl = f.get_slice(key)
                    total += _numel(sl.get_shape()) * _itemsize(sl.get_dtype())
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        config.dtype = dtype if dtype is not None else torch.float32
        config.save_pretrained(out)
        if tokenizer is not None:
            tokenizer.save_pretrained(out)
    barrier()


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _itemsize(safetensors_dtype: str) -> int:
    return {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "U8": 1, "BOOL": 1}.get(safetensors_dtype, 4)
