"""What one routed row costs the expert rank that receives it, traced, and the routing-imbalance assumption.

Under transformers' expert parallelism (AllToAllEP, distributed/expert_parallel.py) a rank's experts run on the rows
the all-to-all brings them: their count is the routing's, not the mean. The exchange is dropless (variable split
sizes, no capacity factor), so nothing caps what one rank receives short of every sender's tokens x its experts.
The estimate is priced at balanced routing (every rank tokens x top_k rows) and names a worst-rank share as its
band: EP_WORST_RANK_SHARE (docs/ENGINE_FACTS.md, "Routing imbalance under expert parallelism")."""

from __future__ import annotations

import functools
import json
from typing import Any

EP_WORST_RANK_SHARE = 1.25
"""Assumed: the busiest expert rank of a step receives 1.25 x the mean routed rows (Switch Transformer's training
capacity factor, Fedus et al. 2021; transformers' all-to-all drops nothing, so this is an assumption about a trained
router with its load-balancing loss, not an engine limit). Measured on the random-initialised 4-expert test models:
1.27 x (Qwen3-MoE, ep 2, two layers summed) and 1.15 x (GPT-OSS) of the mean."""

ROWS = (64, 128)
"""The two row counts the experts are traced at; the difference is linear in the rows."""


def received_row_bytes(spec: Any, dtype: str) -> float:
    """Bytes one MoE layer's experts keep for backward per row a rank receives: the model's own experts module run
    as AllToAllEP runs it (received rows, local expert ids, top-1 with unit weights; grouped_mm, transformers'
    default experts_implementation) under FakeTensorMode, saved storages counted once, parameters left out; the
    difference of two row counts. 0 for a dense model."""
    if not spec.moe_experts:
        return 0.0
    return _traced(json.dumps(spec.hf_config().to_dict(), sort_keys=True, default=str), dtype)


@functools.lru_cache(maxsize=16)
def _traced(config_json: str, dtype: str) -> float:
    import torch

    from toolkit.estimate.standins import _grouped_mm_fake_fix
    from toolkit.inputs.modelconfig import auto_model_class, config_from_dict

    config = config_from_dict(json.loads(config_json), "experts")
    config._experts_implementation = "grouped_mm"
    with torch.device("meta"):
        model = auto_model_class(config).from_config(config)
    experts = next(m for name, m in model.named_modules() if name.endswith(".experts"))
    undo = _grouped_mm_fake_fix()  # the stand-in the whole-model trace runs the experts with
    try:
        saved = _saved_at_rows(experts, config, getattr(torch, dtype))
    finally:
        if undo is not None:
            undo()
    return (saved[1] - saved[0]) / (ROWS[1] - ROWS[0])


def _saved_at_rows(experts, config, torch_dtype) -> list[int]:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    saved = []
    with FakeTensorMode(allow_non_fake_inputs=True):
        for module in experts.modules():
            for name, p in list(module.named_parameters(recurse=False)):
                setattr(module, name, torch.nn.Parameter(torch.empty(p.shape, dtype=torch_dtype)))
        params = {p.untyped_storage()._cdata for p in experts.parameters()}
        for rows in ROWS:
            storages: dict[int, int] = {}

            def pack(t, storages=storages):
                st = t.untyped_storage()
                if st._cdata not in params:
                    storages[st._cdata] = st.nbytes()
                return t

            x = torch.randn(rows, config.hidden_size, dtype=torch_dtype, requires_grad=True)
            ids = torch.zeros(rows, 1, dtype=torch.long)
            weights = torch.ones(rows, 1, dtype=torch_dtype)
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                experts(x, ids, weights)
            saved.append(sum(storages.values()))
    return saved


def worst_rank_extra_bytes(spec: Any, job: Any, rows_per_layer: float) -> int:
    """Bytes the busiest expert rank holds above the balanced estimate: (EP_WORST_RANK_SHARE - 1) x the balanced
    rows of a MoE layer x what a received row keeps for backward, for every MoE layer (all are live at the
    backward's start) or, with activation checkpointing, the one layer being recomputed."""
    from toolkit.inputs.choices import compute_bytes
    from toolkit.inputs.moe import moe_layer_count

    dtype = "bfloat16" if compute_bytes(job.precision) == 2 else "float32"
    layers = 1 if job.checkpointing else moe_layer_count(spec)
    return int((EP_WORST_RANK_SHARE - 1) * rows_per_layer * layers * received_row_bytes(spec, dtype))


def received_rows(routed: list[list[list[int]]], rank: int, expert: int, local_experts: int) -> int:
    """Rows expert rank `rank` received in a step: `routed[r]` holds, for each call of an experts module on rank r,
    the (token, expert) pairs r's tokens sent to each global expert id; the ep group is `expert` contiguous ranks
    (transformers' DistributedConfig mesh and DeepSpeed's expert-parallel groups alike), and the rank's experts the
    contiguous block rank % expert."""
    first = rank // expert * expert
    mine = slice(rank % expert * local_experts, (rank % expert + 1) * local_experts)
    return sum(sum(pairs[mine]) for sender in routed[first:first + expert] for pairs in sender)


def peak_at_received_rows(peak_bytes: int, spec: Any, job: Any, rows_per_layer: float, received: int) -> int:
    """A plan's per-rank peak (the busiest expert rank's, EP_WORST_RANK_SHARE x the mean rows) moved to a rank
    that received `received` routed rows in the step, summed over its MoE layers: back to balanced routing
    (`rows_per_layer` a MoE layer, toolkit.estimate.experttime.expert_rows_per_rank), then each row above or below
    the balanced count at what a received row keeps for backward."""
    from toolkit.inputs.choices import compute_bytes
    from toolkit.inputs.moe import moe_layer_count

    dtype = "bfloat16" if compute_bytes(job.precision) == 2 else "float32"
    balanced = rows_per_layer * moe_layer_count(spec)
    return int(peak_bytes - worst_rank_extra_bytes(spec, job, rows_per_layer)
               + (received - balanced) * received_row_bytes(spec, dtype))


BUSIEST_EXPERT_RANK = "busiest expert rank (routing)"  # the Term of its extra received rows


def on_the_busiest_expert_rank(b: Any, spec: Any, job: Any, rows: float) -> Any:
    """An expert-parallel row's memory on the rank that runs out first: the trace is priced at balanced routing,
    and the busiest expert rank keeps more received rows for backward (worst_rank_extra_bytes, all of them live at
    the backward's start, the activation peak). Added to the peak and the required bytes the fit and the ranking use,
    as its own term beside the balanced activations (toolkit.estimate.memory's expert-parallel rows). `rows`: the
    balanced received rows a MoE layer (toolkit.estimate.experttime.expert_rows_per_rank)."""
    from dataclasses import replace

    from toolkit.estimate.breakdown import Term

    extra = worst_rank_extra_bytes(spec, job, rows)
    terms = list(b.terms)
    where = next(i for i, t in enumerate(terms) if t.name == "activations")
    terms.insert(where + 1, Term(BUSIEST_EXPERT_RANK, extra,
                                 f"activations are priced at balanced routing ({rows:,.0f} received rows a MoE layer, "
                                 f"the all-to-all is dropless); the busiest expert rank at {EP_WORST_RANK_SHARE:g}x "
                                 f"the mean rows (assumed) keeps this much more for backward: "
                                 f"{'the one layer recomputed' if job.checkpointing else 'every MoE layer'}"))
    return replace(b, terms=tuple(terms), peak_bytes=b.peak_bytes + extra, required_bytes=b.required_bytes + extra)
