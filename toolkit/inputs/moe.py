"""The mixture-of-experts parts of a Hugging Face causal LM, found in the model itself (no per-architecture table).

An MoE block is the module of a decoder layer that holds the experts (a child named `experts`: transformers 5's
fused experts module, whose 3-D weights lead with the expert count, or an older ModuleList of expert MLPs) and,
beside them, the router: the child whose weight has one row per expert (Qwen3-MoE / Mixtral's `gate`, GPT-OSS's
`router`, DeepSeek-V3's `gate`). Other children with weights are shared experts (Qwen2-MoE's `shared_expert` and its
`shared_expert_gate`, DeepSeek-V3's `shared_experts`): every token runs them. Experts per token come from the
router's (or the block's) own `top_k`, else from the config (modelconfig.moe_shape: the names MoE configs use,
which the config-only catalog listing reads too).

One place for these facts: the parameter count (ModelSpec's active parameters), the tiling probe (a block that
routes tokens is not tiled), and the ZeRO-3 leaf modules (the block's class, DeepSpeed's set_z3_leaf_modules /
zero_optimization.leaf_module) all ask this module. Torch only; meta-device models are fine.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

from toolkit.errors import options_text
from toolkit.inputs.modelconfig import text_config

@dataclass(frozen=True)
class MoeParts:
    """What a model's MoE blocks are (the first MoE block's; every MoE block of a model has the same class)."""
    block_class: str
    """The module holding the router and the experts: the unit ZeRO-3 must fetch whole (its leaf module)."""
    router_class: str
    experts_class: str
    experts: int
    """Routed experts per MoE layer."""
    top_k: int
    """Routed experts each token runs."""
    shared: tuple[str, ...]
    """Names (inside the block) of the parts every token runs besides the routed experts: shared experts, their
    gates; () when there are none."""
    moe_layers: int
    """Decoder layers with an MoE block (DeepSeek-V3's first layers are dense)."""
    expert_modules: bool = False
    """The routed experts are separate submodules (an older ModuleList of expert MLPs), which a forward calls only
    for the experts its tokens pick; False for transformers 5's fused experts module, called once a pass whatever
    the routing (docs/ENGINE_FACTS.md, "Mixture of experts under ZeRO-3")."""


def is_expert_param(param_name: str) -> bool:
    """A routed expert's parameter, by its path (`...mlp.experts.gate_up_proj`, `...experts.3.w1.weight`)."""
    return ".experts." in f".{param_name}"


def routes_to_experts(module: Any) -> bool:
    """`module` holds routed experts (a sparse-MoE block or a layer containing one)."""
    return any(is_expert_param(name) for name, _ in module.named_parameters())


def _expert_count(experts: Any) -> int:
    import torch.nn as nn

    if isinstance(experts, nn.ModuleList):
        return len(experts)
    leading = {p.shape[0] for p in experts.parameters(recurse=False) if p.dim() >= 2}
    declared = getattr(experts, "num_experts", None)
    if len(leading) == 1:
        return int(next(iter(leading)))
    return int(declared) if isinstance(declared, int) else 0


def _block_parts(block: Any, experts: int) -> tuple[Any, tuple[str, ...]] | None:
    """(the router child, names of the shared children) of a module whose `experts` child holds `experts`."""
    router, shared = None, []
    for name, child in block.named_children():
        if name == "experts" or not any(True for _ in child.parameters()):
            continue
        weight = getattr(child, "weight", None)
        if router is None and weight is not None and weight.dim() == 2 and weight.shape[0] == experts:
            router = child
        else:
            shared.append(name)
    return (router, tuple(shared)) if router is not None else None


def find_moe(model: Any, config: Any = None) -> MoeParts | None:
    """The MoE parts of `model` (a *ForCausalLM, meta device is fine), or None for a dense model."""
    from toolkit.inputs.decoder_parts import decoder_layers
    from toolkit.inputs.modelconfig import moe_shape

    layers = decoder_layers(model) or ()
    found: MoeParts | None = None
    moe_layers = 0
    for layer in layers:
        for _, block in layer.named_modules():
            experts_module = getattr(block, "experts", None)
            if experts_module is None or experts_module not in list(block.children()):
                continue
            count = _expert_count(experts_module)
            parts = _block_parts(block, count) if count >= 2 else None
            if parts is None:
                continue
            moe_layers += 1
            if found is None:
                router, shared = parts
                top_k = getattr(router, "top_k", None) or getattr(block, "top_k", None)
                if not isinstance(top_k, int):
                    text = text_config(config)
                    top_k = moe_shape(text)[1] if text is not None else 0
                found = MoeParts(block_class=type(block).__name__, router_class=type(router).__name__,
                                 experts_class=type(experts_module).__name__, experts=count, top_k=int(top_k),
                                 shared=shared, moe_layers=0,
                                 expert_modules=any(any(True for _ in child.parameters())
                                                    for child in experts_module.children()))
            break
    if found is None:
        return None
    return MoeParts(**{**found.__dict__, "moe_layers": moe_layers})


def expert_grid_problem(expert: int, *, fsdp: int, tensor: int, replicate: int = 1, context: int = 1,
                        stages: int = 1, shared_batch: bool = False) -> str | None:
    """Why an expert-parallel degree does not compose with the grid's other degrees, or None. The rules are
    transformers' own (DistributedConfig._validate_mesh_config, run here on the sizes): ep_size a multiple of
    tp_size dividing fsdp_size x tp_size; context / sequence parallelism and HSDP replicas are not planned with it.
    `shared_batch`: the expert group shares one batch, DistributedConfig(tp_size=expert, fsdp_size=fsdp,
    enable_expert_parallel=True), whose size rules are checked here (`tensor` must be 1: the dense modules are
    whole there; transformers 5.24 keeps the rules but no longer loads that call, docs/ENGINE_FACTS.md)."""
    if context > 1 or stages > 1 or replicate > 1:
        return (f"--expert-parallel {expert} is planned only with FSDP2 (and tensor parallelism) on one data-parallel "
                "shard group: no context / sequence parallelism, pipeline stages or HSDP replicas; drop those or "
                "--expert-parallel")
    from transformers.distributed import DistributedConfig

    if shared_batch:
        if tensor > 1:
            return (f"--expert-parallel {expert} sharing one batch runs the dense modules whole (tp_plan={{}}); "
                    "drop --tensor-parallel")
        try:
            with warnings.catch_warnings():  # enable_expert_parallel's FutureWarning: this is the call TRL makes
                warnings.simplefilter("ignore", FutureWarning)
                DistributedConfig(tp_size=expert, fsdp_size=fsdp, enable_expert_parallel=True)
        except ValueError as exc:
            return f"--expert-parallel {expert} sharing one batch: transformers' DistributedConfig refuses it ({exc})"
        return None
    try:
        DistributedConfig(tp_size=tensor, fsdp_size=fsdp, ep_size=expert)
    except ValueError as exc:
        fits = options_text([d for d in range(tensor * 2, fsdp * tensor + 1, tensor) if (fsdp * tensor) % d == 0])
        return (f"--expert-parallel {expert} does not fit fsdp {fsdp} x tensor {tensor} (transformers' "
                f"DistributedConfig: {str(exc).rstrip('.')}); try --expert-parallel {fits}")
    if tensor > 1:
        # transformers accepts it; this toolkit's memory and time models do not yet split the experts between the
        # tp_plan's per-rank spec and the ep_plan (they would count the split twice).
        return (f"--expert-parallel {expert} with --tensor-parallel {tensor} is not modelled yet (transformers runs "
                "it; the estimate would split the experts twice); use one of them")
    return None


def expert_parallel_problem(spec: Any, expert: int, tensor: int = 1) -> str | None:
    """Why `spec` cannot split its experts over `expert` ranks (transformers' DistributedConfig route), or None:
    a dense model; an expert count `expert` does not divide; ep > tp without the model's ep_plan token dispatch
    (`ep_dispatch_experts`, from the config's base_model_ep_plan)."""
    if not spec.moe_experts:
        return (f"--expert-parallel {expert} needs a mixture-of-experts model; {spec.name} is dense (no routed "
                "experts found in its layers); drop --expert-parallel")
    if spec.moe_experts % expert:
        fits = [d for d in range(2, spec.moe_experts + 1) if spec.moe_experts % d == 0 and d % tensor == 0]
        return (f"--expert-parallel {expert} does not divide {spec.name}'s {spec.moe_experts} experts (each rank "
                f"holds experts / ep); try {options_text(fits, limit=6)}")
    if not ep_plan_rules(spec):
        return (f"--expert-parallel {expert} needs {spec.model_type}'s ep_plan (transformers' base_model_ep_plan is "
                "empty for it); use fsdp2 or zero3 without --expert-parallel")
    if expert > tensor:
        if "ep_dispatch_experts" not in ep_plan_rules(spec):
            return (f"--expert-parallel {expert} needs {spec.model_type}'s ep_plan to dispatch tokens between ranks "
                    "(transformers' base_model_ep_plan has no 'ep_dispatch_experts' rule for it); use fsdp2 or zero3 "
                    "without --expert-parallel")
    return None


def ep_plan_rules(spec: Any) -> set[str]:
    """The styles of the model config's base_model_ep_plan (transformers 5.24), e.g. {'grouped_gemm',
    'ep_dispatch_experts'}; empty when the config has none."""
    text = spec.hf_config()
    text = text_config(text)
    return set((getattr(text, "base_model_ep_plan", None) or {}).values())


def ep_token_exchange(spec: Any, shared_batch: bool) -> str:
    """How a training step brings the experts their tokens under transformers' expert parallelism, from the model's
    ep_plan (docs/ENGINE_FACTS.md, "What an expert-parallel step runs"): "all_to_all" where the plan has
    `ep_dispatch_experts` (its "auto" implementation picks AllToAllEP whenever gradients flow) or the ranks hold
    different batches; "all_reduce" for a masked plan (`ep_router` + `moe_tp_experts`) on a shared batch: every
    rank runs its own experts on the whole batch and an all-reduce sums the outputs."""
    if not shared_batch or "ep_dispatch_experts" in ep_plan_rules(spec):
        return "all_to_all"
    return "all_reduce"


def expert_params(spec: Any) -> int:
    """Parameters of the routed experts (all of them), from the spec's exact total and active counts: active =
    total - experts x (1 - top_k / experts_count) (toolkit.inputs.modelspec); 0 for a dense model."""
    if not spec.moe_experts or not spec.moe_top_k or spec.moe_top_k >= spec.moe_experts:
        return 0
    return int(round((spec.params - spec.active_params) / (1 - spec.moe_top_k / spec.moe_experts)))


def moe_layer_count(spec: Any) -> int:
    """Decoder layers with routed experts: the largest decoder layers (every MoE layer of a model has the same
    shapes; DeepSeek-V3's first dense layers are smaller); 0 for a dense model."""
    if not spec.moe_experts:
        return 0
    largest = max(spec.layer_params)
    return sum(1 for p in spec.layer_params if p == largest)


def expert_layer_params(spec: Any) -> float:
    """Routed-expert parameters of one MoE layer: expert_params over the MoE layers."""
    total = expert_params(spec)
    return total / moe_layer_count(spec) if total else 0.0


def ep_gathered_layer_params(spec: Any, expert: int) -> int:
    """Parameters FSDP2 unshards for the largest decoder layer under expert parallelism `expert`: the dense part
    whole, and only the rank's own experts (experts / ep of them, gathered over efsdp) instead of all of them."""
    largest = max(spec.layer_params)
    return int(round(largest - expert_layer_params(spec) * (1 - 1 / expert))) if expert > 1 else largest


def ep_exchange_buffer_bytes(spec: Any, tokens: int, bytes_per_value: int, *, route: str = "all_to_all",
                             sharers: int = 1) -> int:
    """The token exchange of one MoE layer on a rank holding `tokens` tokens, `sharers` ranks sharing them.
    all_to_all: each rank dispatches tokens / sharers to top_k experts, so the send (permuted by expert) and the
    receive buffer (the same count at balanced routing) are live together while the local experts compute; the
    combine reuses that size on the way back. all_reduce (the masked route): the experts' summed output, tokens x
    hidden, reduced in place. Routing imbalance is not modelled (a rank that receives more than its share holds
    more)."""
    if route == "all_reduce":
        return tokens * spec.hidden * bytes_per_value
    return int(2 * tokens / sharers * spec.moe_top_k * spec.hidden * bytes_per_value)
