"""A DeepSpeed AutoEP model back in its checkpoint's own (transformers) layout, so every model save (the final
folder, each checkpoint-N: `AutoEPSaves`) loads with `from_pretrained` (docs/ENGINE_FACTS.md, the AutoEP entry).

AutoEP (deepspeed 0.19.8, module_inject/auto_ep_layer.py `AutoEPMoELayer.__init__`) replaces every MoE block it
detects with a layer that holds: the router as `router.gate` (an nn.Linear, the block's router weight and bias
copied; an `e_score_correction_bias` copied onto the router), this rank's experts as three grouped tensors
`experts.w1 / w2 / w3` [local experts, ...] repacked by moe/ep_repack.py `repack_expert_weights` (the fused gate/up
tensor split in two, transposed where checkpoint/fused_expert_layout.py `classify_fused_gate_up_layout` says the
layout is hidden-first; a ModuleList's per-expert weights stacked), the placement saying which global experts a rank
holds (checkpoint/autoep_affine.py `autoep_experts_for_rank`), and the block's shared experts and their gate as the
same module objects under new names. Saved as it is, the file names AutoEP's tensors and holds one rank's experts:
`from_pretrained` fills the block's weights randomly.

The inverse here asks DeepSpeed itself where each tensor came from: its own detection (`AutoEP.ep_parser`) run on a
meta copy of the model class gives every block's names and storage, the expert group is gathered in the placement's
order, the fused / stacked tensors are put back in the source layout, and DeepSpeed's own `repack_expert_weights`
applied to the result must give back every rank's tensors exactly (else it raises: the inverse is checked, not
trusted). The model is then loaded strictly into a fresh transformers model and saved with `save_pretrained`, which
writes transformers' own on-disk names. Under ZeRO-3, where the engine's own 16-bit consolidation refuses AutoEP
(runtime/engine.py `_raise_if_autoep_zero3_consolidated_export`: it gathers over the global data-parallel group
only), each module is read inside DeepSpeed's GatheredParameters, which gathers every parameter over its own
partition group (an expert tensor over its expert-data-parallel group), and the expert group is gathered as above."""

from __future__ import annotations

from pathlib import Path


def is_autoep_model(model) -> bool:
    """True when DeepSpeed AutoEP replaced at least one of `model`'s blocks (its layers carry `_is_autoep_layer`)."""
    return any(getattr(m, "_is_autoep_layer", False) for m in model.modules())


class AutoEPSaves:
    """Trainer mixin (before `Trainer` in the bases): every model save of a DeepSpeed AutoEP run, the final folder
    and the model files of each `checkpoint-N` the Trainer writes at save_steps (its `_save_checkpoint` calls
    `save_model`), in the checkpoint's transformers layout (`save_autoep_model`), with the processing class and
    training_args.bin beside it as the Trainer's `_save` writes them. Resume does not read these files: under
    DeepSpeed the Trainer saves and reloads the engine's own state (`checkpoint-N/global_stepN`, AutoEP's layout,
    `engine.save_checkpoint` / `load_checkpoint`), which this leaves as it is. Any other run saves as the Trainer
    does."""

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if not (self.is_deepspeed_enabled and is_autoep_model(self.model)):
            return super().save_model(output_dir, _internal_call=_internal_call)
        output = Path(output_dir if output_dir is not None else self.args.output_dir)
        write = self.args.should_save
        save_autoep_model(self.model, self.model_wrapped._config.expert_parallel_config, output, write=write)
        if write:
            import torch
            from transformers.trainer import TRAINING_ARGS_NAME

            if self.processing_class is not None:
                self.processing_class.save_pretrained(str(output))
            torch.save(self.args, output / TRAINING_ARGS_NAME)


def save_autoep_model(model, autoep_config, output: Path, *, write: bool) -> None:
    """Every rank (ZeRO 0-3): gather each AutoEP layer's experts over its expert group (and, under ZeRO-3, every
    module's partitions, one module at a time); `write` (rank 0): save `model` in its
    transformers layout to `output` with `save_pretrained`. `autoep_config`: the engine's AutoEPConfig
    (`engine._config.expert_parallel_config`), the one its detection ran with."""
    import copy

    import torch
    from deepspeed.module_inject.auto_ep import AutoEP

    reference = _meta_model(model.config)
    specs = AutoEP(reference, copy.copy(autoep_config)).ep_parser()  # (it fills the config from the model)
    blocks = {spec.moe_module_name for spec in specs}
    state = _dense_state(model, blocks, write=write)
    for spec in specs:
        layer = model.get_submodule(spec.moe_module_name)
        with _gathered(layer.parameters()):
            experts = _gathered_experts(layer)
            if write:
                block = reference.get_submodule(spec.moe_module_name).to_empty(device="cpu")
                _restore_block(block, layer, spec, experts)
                state.update({f"{spec.moe_module_name}.{k}": v for k, v in block.state_dict().items()})
    if not write:
        return
    with torch.no_grad():
        reference.load_state_dict(state, strict=True, assign=True)  # every weight named, none left on meta
    reference.tie_weights()
    reference.save_pretrained(str(output))


def _gathered(params):
    """Under ZeRO-3, `params` whole on every rank while the block runs (DeepSpeed's GatheredParameters, read-only:
    each parameter is gathered over its own partition group, runtime/zero/partition_parameters.py
    `all_gather_coalesced`: an AutoEP expert tensor over its expert-data-parallel group, so it comes back as this
    rank's local experts whole); otherwise nothing to do."""
    import contextlib

    params = [p for p in params if hasattr(p, "ds_id")]
    if not params:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)


def _dense_state(model, blocks: set[str], *, write: bool) -> dict:
    """The model's state outside the AutoEP layers named in `blocks` (their tensors come from `_restore_block`):
    with `write`, its values on the CPU by state-dict key; every rank takes part in ZeRO-3's gathers, one module's
    own parameters at a time (as the engine's `_zero3_consolidated_16bit_state_dict` walks the model), so no rank
    holds more than one module whole."""
    state = {}
    for name, module in model.named_modules(remove_duplicate=False):
        if any(name == block or name.startswith(f"{block}.") for block in blocks):
            continue
        prefix = f"{name}." if name else ""
        with _gathered(module.parameters(recurse=False)):
            if not write:
                continue
            for key, param in module.named_parameters(recurse=False):
                state[prefix + key] = param.detach().to("cpu", copy=True)
            for key, buffer in module.named_buffers(recurse=False):
                if buffer is not None and key not in module._non_persistent_buffers_set:
                    state[prefix + key] = buffer.detach().to("cpu", copy=True)
    return state


def _meta_model(config):
    """A fresh model of the checkpoint's class on the meta device: the layout DeepSpeed's detection reads and the
    one to save (no memory held). Under the HF ZeRO-3 integration `from_config` would build it inside
    deepspeed.zero.Init and initialise its (meta) weights; transformers' own `set_zero3_state` (modeling_utils.py,
    "zero.Init already entered") keeps it a plain meta model."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.modeling_utils import set_zero3_state

    with torch.device("meta"), set_zero3_state():
        return AutoModelForCausalLM.from_config(config)


def _gathered_experts(layer) -> list:
    """The layer's three grouped tensors (w1, w2, w3) with every expert, in global expert order: each rank's
    local tensors gathered over the expert group and placed by AutoEP's own placement descriptor."""
    import torch
    import torch.distributed as dist
    from deepspeed.checkpoint.autoep_affine import autoep_experts_for_rank

    group, size = layer.ep_group, layer.ep_size
    full = []
    for local in (layer.experts.w1, layer.experts.w2, layer.experts.w3):
        local = local.detach().contiguous()
        parts = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(parts, local, group=group)
        whole = torch.empty((layer.num_experts, *local.shape[1:]), dtype=local.dtype)
        for rank, part in enumerate(parts):
            whole[autoep_experts_for_rank(layer.expert_placement_descriptor, rank)] = part.cpu()
        full.append(whole)
    return full


def _restore_block(block, layer, spec, experts) -> None:
    """Write AutoEP `layer`'s trained values into `block` (the transformers block it replaced, materialised), the
    inverse of AutoEPMoELayer.__init__; then check with DeepSpeed's own repack that it is the inverse."""
    import torch
    from deepspeed.checkpoint.autoep_affine import autoep_experts_for_rank
    from deepspeed.moe.ep_repack import _get_expert_weight, repack_expert_weights

    written = set()

    def put(target, value):
        with torch.no_grad():
            if tuple(target.shape) != tuple(value.shape):
                raise RuntimeError(f"AutoEP export of {spec.moe_module_name}: a trained tensor of shape "
                                   f"{tuple(value.shape)} for a weight of shape {tuple(target.shape)}")
            target.data = value.detach().to("cpu", copy=True).contiguous()
        written.add(id(target))

    gate = getattr(block, spec.router_name)
    put(gate.weight, layer.router.gate.weight)
    if getattr(gate, "bias", None) is not None and spec.gate_bias:
        put(gate.bias, layer.router.gate.bias)
    if (bias := getattr(layer.router, "e_score_correction_bias", None)) is not None:
        path = spec.e_score_correction_bias_path
        owner = gate if path is None else (block if path == "" else block.get_submodule(path))
        put(owner.e_score_correction_bias, bias)
    w1, w2, w3 = experts
    source = getattr(block, spec.experts_name)
    if spec.expert_storage == "fused_3d":
        first, second = getattr(source, spec.expert_w1_name), getattr(source, spec.expert_w2_name)
        if spec.expert_w3_name is not None:  # gate and up kept apart: the tensors as they are
            put(first, w1), put(second, w2), put(getattr(source, spec.expert_w3_name), w3)
        elif _hidden_first(first, second):
            put(first, torch.cat([w1, w3], dim=1).transpose(1, 2)), put(second, w2.transpose(1, 2))
        else:
            put(first, torch.cat([w1, w3], dim=1)), put(second, w2)
    else:  # a ModuleList: each expert's nn.Linear weights, fused gate/up where it has no third
        for index, expert in enumerate(source):
            if spec.expert_w3_name is None:
                put(_get_expert_weight(expert, spec.expert_w1_name), torch.cat([w1[index], w3[index]], dim=0))
            else:
                put(_get_expert_weight(expert, spec.expert_w1_name), w1[index])
                put(_get_expert_weight(expert, spec.expert_w3_name), w3[index])
            put(_get_expert_weight(expert, spec.expert_w2_name), w2[index])
    for name, kept in ((spec.shared_experts_name, layer.shared_experts),
                       (spec.shared_experts_gate_name, layer.shared_experts_gate)):
        if kept is not None:  # the same module objects AutoEP kept: their tensors by name
            mine = dict(getattr(block, name).named_parameters()) | dict(getattr(block, name).named_buffers())
            for key, value in [*kept.named_parameters(), *kept.named_buffers()]:
                put(mine[key], value)
    left = [k for k, v in block.state_dict(keep_vars=True).items() if id(v) not in written]
    if left:
        raise RuntimeError(f"AutoEP export of {spec.moe_module_name}: no trained value for {left} (DeepSpeed's layer "
                           "keeps no counterpart); the model cannot be saved in its transformers layout")
    for rank in range(layer.ep_size):  # DeepSpeed's own forward map on the result gives back every rank's tensors
        again = repack_expert_weights(source, spec, rank, layer.ep_size)
        held = autoep_experts_for_rank(layer.expert_placement_descriptor, rank)
        if not all(torch.equal(a, full[held]) for a, full in zip(again, experts)):
            raise RuntimeError(f"AutoEP export of {spec.moe_module_name}: DeepSpeed's repack of the restored block "
                               f"does not give back rank {rank}'s experts")


def _hidden_first(first, second) -> bool:
    """Whether a fused gate/up tensor is stored hidden-first (AutoEP transposes it), by DeepSpeed's own reading."""
    from deepspeed.moe.fused_expert_layout import classify_fused_gate_up_layout

    layout = classify_fused_gate_up_layout(tuple(first.shape), tuple(second.shape))
    if layout is None:
        raise RuntimeError(f"AutoEP export: fused expert shapes {tuple(first.shape)}, {tuple(second.shape)} are not "
                           "a layout DeepSpeed repacks")
    return layout.layout == "hidden_first"
