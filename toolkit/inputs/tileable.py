"""Which decoder-layer MLPs DeepSpeed's TiledMLP can run, found from the model's own modules (no per-architecture table).

TiledMLP (deepspeed/runtime/sequence_parallel/ulysses_sp.py, DeepSpeed 0.19.8) calls the MLP's forward on chunks of
the sequence: [batch, tokens, hidden] slices in its forward (under no_grad) and flattened [tokens, hidden] slices in
its backward (recomputed with grad), and concatenates / back-propagates what comes back as one tensor of the chunk's
shape. So an MLP is tileable when (1) it routes no tokens to experts: a router's logits, recorded for the
load-balancing loss during the no_grad forward, would carry no gradient, and its per-chunk calls would record
several partial routings; and (2) its forward, probed on the meta device with both chunk shapes, returns one tensor
of the input's shape (a sparse-MoE block that unpacks [batch, seq, hidden], or returns (hidden, router scores), is not).

Torch only: the planner probes the meta-device model it counts (ModelSpec.tiling_blocker), and
toolkit.patches.tiling patches only the MLPs this module passes.
"""

from __future__ import annotations

from typing import Any


def layer_mlps(model: Any) -> list[tuple[int, Any]]:
    """(decoder-layer index, its `mlp` module) for each decoder layer that has one."""
    from toolkit.inputs.decoder_parts import decoder_layers

    layers = decoder_layers(model) or ()
    return [(i, layer.mlp) for i, layer in enumerate(layers) if getattr(layer, "mlp", None) is not None]


def _probe(mlp: Any, shape: tuple[int, ...]) -> str | None:
    """Why the MLP's own forward on a meta input of `shape` is not one tensor of that shape, or None. The MLP's
    parameters and buffers are swapped for meta tensors of their shapes for the call (nothing is copied; a
    ZeRO-3-partitioned weight is probed at its full ds_shape)."""
    import torch
    from torch.func import functional_call

    def meta(t):  # bf16, as the runs train (grouped-GEMM experts refuse fp32 inputs)
        dtype = torch.bfloat16 if t.is_floating_point() else t.dtype
        return torch.empty(tuple(getattr(t, "ds_shape", t.shape)), dtype=dtype, device="meta")

    state = {n: meta(t) for n, t in [*mlp.named_parameters(), *mlp.named_buffers()]}
    x = torch.empty(shape, dtype=torch.bfloat16, device="meta")
    try:
        with torch.no_grad():
            out = functional_call(mlp, state, (x,))
    except Exception as exc:  # any failure on a chunk is a failure TiledMLP would hit
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:120]
        return f"its forward fails on a {list(shape)} chunk ({type(exc).__name__}: {first})"
    if not isinstance(out, torch.Tensor):
        return f"its forward returns a {type(out).__name__}, not one tensor"
    if tuple(out.shape) != shape:
        return f"its forward turns a {list(shape)} chunk into {list(out.shape)}"
    return None


def mlp_tiling_blocker(mlp: Any, hidden: int) -> str | None:
    """Why TiledMLP cannot run `mlp` (module docstring), or None: it can."""
    for shape in ((1, 3, hidden), (3, hidden)):  # TiledMLP's forward chunks, then its backward's flattened ones
        if problem := _probe(mlp, shape):
            return problem
    from toolkit.inputs.moe import routes_to_experts

    if routes_to_experts(mlp):
        return ("it routes tokens to experts, and TiledMLP runs the router on each chunk under no_grad first "
                "(router logits recorded for a load-balancing loss would carry no gradient)")
    if dropout := _dropout(mlp):
        return (f"it applies dropout (p={dropout:g}), and TiledMLP recomputes each chunk in backward without "
                "restoring the random state (deepspeed ulysses_sp.TiledMLP), so the gradient would follow other "
                "masks than the forward did; set the model's dropout to 0 to tile it")
    return None


def _dropout(mlp: Any) -> float:
    """The largest dropout probability of a Dropout module inside `mlp` (0: none)."""
    import torch

    return max((m.p for m in mlp.modules() if isinstance(m, torch.nn.modules.dropout._DropoutNd)), default=0.0)


def tileable_mlps(model: Any, hidden: int) -> tuple[list[Any], dict[str, str]]:
    """(the MLPs TiledMLP can run, {class name: why not} for the others); each MLP class is probed once."""
    verdicts: dict[type, str | None] = {}
    ok = []
    for _, mlp in layer_mlps(model):
        if type(mlp) not in verdicts:
            verdicts[type(mlp)] = mlp_tiling_blocker(mlp, hidden)
        if verdicts[type(mlp)] is None:
            ok.append(mlp)
    return ok, {cls.__name__: why for cls, why in verdicts.items() if why is not None}


def model_tiling_blocker(model: Any, hidden: int) -> str | None:
    """Why ALST tiling cannot be planned for `model`, or None: a decoder layer's MLP that TiledMLP cannot run (the
    plan's tiling means every layer's MLP through TiledMLP)."""
    _, refused = tileable_mlps(model, hidden)
    if not refused:
        return None
    cls, why = next(iter(refused.items()))
    return f"DeepSpeed's TiledMLP cannot run its MLP {cls}: {why}"
