"""A Hugging Face decoder-only causal LM as a DeepSpeed PipelineModule, and back to HF format.

The pipeline is a flat list of layers that each take and return one tensor:

    token embedding -> [positions + dropout (GPT-2)] -> decoder layer 0 .. N-1 -> final norm -> LM head -> HF loss

Every layer wraps the original HF submodule, so the math is HF's. Only hidden states cross stages: each decoder
layer rebuilds its attention mask (HF's own mask functions) and rotary embeddings (the model's own rotary module)
from the hidden states' shape, as the packed training data has no padding. Tied embeddings (GPT-2, or any config
with tie_word_embeddings) are one TiedLayerSpec on the first and the last stage: DeepSpeed all-reduces the tied
weight's gradient between them, so it gets the sum of both uses, as in HF.

Each rank builds only its stage's layers: the model skeleton lives on the meta device (no memory), and a layer is
materialised on CPU and filled from the safetensors files (sharded index or a single file) when its stage builds it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from toolkit.inputs.decoder_parts import NotStandard, find_parts
from toolkit.errors import UserError
from toolkit.inputs.modelconfig import auto_model_class, text_config


class Source:
    """One rank's view of the HF model: config, a meta-device skeleton, and lazy access to the weight files.

    `weights` is a folder with model.safetensors or model.safetensors.index.json; None means random init (HF's own
    initialisation of each layer, seeded by layer so every rank that builds a layer builds the same one).
    """

    def __init__(self, config: Any, weights: str | Path | None, *, seed: int = 0, checkpointing: bool = False,
                 attention: str | None = None):
        self.config = config
        self.weights = Path(weights) if weights is not None else None
        self.seed = seed
        self.checkpointing = checkpointing
        self.attention = attention
        """HF attn_implementation (eager | sdpa | flash_attention_2); None: transformers' default."""
        try:
            self.parts = find_parts(self.skeleton, config)
        except NotStandard as exc:
            raise UserError(f"pipeline conversion cannot split this model: {exc}; use a ZeRO or FSDP2 strategy "
                            "for it") from None
        self.text_config = text_config(config)

    @property
    def num_layers(self) -> int:
        return self.text_config.num_hidden_layers

    @property
    def tied(self) -> bool:
        return bool(getattr(self.config.get_text_config(), "tie_word_embeddings", False))

    @cached_property
    def skeleton(self) -> nn.Module:
        options = {"attn_implementation": self.attention} if self.attention else {}
        try:
            with torch.device("meta"):
                # from_config keeps self.config as the model's config, so the masks see the chosen attention.
                return auto_model_class(self.config).from_config(self.config, dtype=torch.float32, **options)
        except (ValueError, ImportError) as exc:
            raise UserError(f"cannot build {self.config.model_type} with attention {self.attention}: "
                            f"{str(exc).strip().splitlines()[0]}") from None

    @cached_property
    def rotary(self) -> nn.Module | None:
        """The model's rotary module, built for real on CPU, kept outside every stage's module tree: DeepSpeed's
        bf16 cast would otherwise round its fp32 inv_freq buffer, which HF keeps in fp32."""
        if self.parts.rotary is None:
            return None
        return type(self.skeleton.get_submodule(self.parts.rotary))(config=self.text_config)

    def rotary_embeddings(self, index: int, hidden: torch.Tensor, position_ids: torch.Tensor):
        """(cos, sin) for layer `index` at these positions, from the rotary module moved once to the stage's
        device (Gemma-3's takes the layer type: local and global layers use different rope bases)."""
        rotary = self.rotary
        buffer = next(rotary.buffers(), None)
        if buffer is not None and buffer.device != hidden.device:
            rotary.to(hidden.device)
        if self.parts.rotary_per_layer_type:
            return rotary(hidden, position_ids, self.text_config.layer_types[index])
        return rotary(hidden, position_ids)

    @cached_property
    def _files(self) -> dict[str, Path]:
        """Tensor name -> safetensors file holding it."""
        assert self.weights is not None
        index = self.weights / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            return {name: self.weights / file for name, file in weight_map.items()}
        single = self.weights / "model.safetensors"
        if not single.is_file():
            raise UserError(f"model folder {self.weights} has no model.safetensors(.index.json); the pipeline "
                            "runner loads safetensors only (convert .bin weights with save_pretrained)")
        from safetensors import safe_open

        with safe_open(str(single), framework="pt") as f:
            return {name: single for name in f.keys()}

    @cached_property
    def _conversions(self) -> tuple[list, list, list]:
        """transformers' checkpoint conversions for this model (renamings such as GPT-NeoX's embed_out -> lm_head,
        converters such as the fusing of per-expert MoE weights): (all of them, renamings, converters)."""
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming

        mapping = get_model_conversion_mapping(self.skeleton)
        return (mapping, [m for m in mapping if isinstance(m, WeightRenaming)],
                [m for m in mapping if isinstance(m, WeightConverter)])

    def _stored_names_for(self, path: str) -> list[str]:
        """The names in the files of the tensors that load into the module at `path`, found by transformers' own
        key renaming (which also adds or strips the base-model prefix: old GPT-2 files store 'h.0...')."""
        from transformers.core_model_loading import rename_source_key

        _, renamings, converters = self._conversions
        meta = self.__dict__.setdefault("_meta_state", dict.fromkeys(self.skeleton.state_dict()))
        prefix = getattr(self.skeleton, "base_model_prefix", None)
        names = [name for name in self._files
                 if (rename_source_key(name, renamings, converters, prefix, meta)[0] + ".").startswith(path + ".")]
        if not names:
            raise UserError(f"weights in {self.weights} have no tensors for '{path}'; is this the planned model?")
        return names

    def materialise(self, path: str, seed_offset: int = 0) -> nn.Module:
        """The skeleton's submodule at `path`, on CPU in fp32, with its weights (only its own tensors are read)."""
        module = self.skeleton.get_submodule(path).to_empty(device="cpu")
        if self.weights is None:
            # HF's own init; apply() visits children before parents, as HF does, so GPT-2's scaled c_proj init
            # (set from the parent attention/MLP) is the one that stays.
            torch.manual_seed(self.seed + seed_offset)
            module.apply(self.skeleton._init_weights)
            return module
        from safetensors import safe_open
        from transformers.core_model_loading import convert_and_load_state_dict_in_model
        from transformers.modeling_utils import LoadStateDictConfig

        for sub in module.modules():  # non-persistent buffers (Gemma's embedding scale) are not in the files
            if getattr(sub, "_non_persistent_buffers_set", None):
                self.skeleton._init_weights(sub)
        expected = {f"{path}.{k}" for k in module.state_dict()} - {f"{path}.{b}" for b in _non_persistent(module)}
        if not expected:  # nothing stored (a dropout)
            return module
        state: dict[str, torch.Tensor] = {}
        by_file: dict[Path, list[str]] = {}
        for stored in self._stored_names_for(path):
            by_file.setdefault(self._files[stored], []).append(stored)
        for file, names in by_file.items():
            with safe_open(str(file), framework="pt") as f:
                for name in names:
                    state[name] = f.get_tensor(name).float()
        # transformers' loader applies the model's conversions and fills the skeleton's (now real) submodule; the
        # rest of the skeleton stays on the meta device, reported as missing, which it is on this stage.
        info, _ = convert_and_load_state_dict_in_model(
            model=self.skeleton, state_dict=state,
            load_config=LoadStateDictConfig(weight_mapping=self._conversions[0], dtype=torch.float32))
        missing = sorted(expected & set(info.missing_keys))
        if missing:
            raise UserError(f"weights in {self.weights} have no tensor '{missing[0]}'; is this the planned model?")
        return module

    def attention_mask(self, index: int, hidden: torch.Tensor, position_ids: torch.Tensor):
        """The mask HF's own forward would give layer `index` for unpadded input (None when SDPA can use
        is_causal). Sliding-window layers (Mistral, Qwen2 layer_types) get HF's sliding-window mask."""
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        layer_types = getattr(self.text_config, "layer_types", None)
        if layer_types is not None:
            sliding = layer_types[index] == "sliding_attention"
        else:
            sliding = getattr(self.text_config, "sliding_window", None) is not None
        make = create_sliding_window_causal_mask if sliding else create_causal_mask
        return make(config=self.text_config, inputs_embeds=hidden, attention_mask=None, cache=None,
                    position_ids=position_ids)


def _non_persistent(module: nn.Module) -> set[str]:
    return {f"{name}.{b}" if name else b for name, sub in module.named_modules()
            for b in getattr(sub, "_non_persistent_buffers_set", ())}


def _positions(hidden: torch.Tensor) -> torch.Tensor:
    return torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)


class TokenEmbeddingPipe(nn.Module):
    """input_ids -> token embeddings (scaled inside the module for Gemma). Also the tied LM head's weight holder
    (see `tied_head`)."""

    def __init__(self, source: Source):
        super().__init__()
        self.embed = source.materialise(source.parts.embed, seed_offset=-1)
        self.cap = getattr(source.text_config, "final_logit_softcapping", None)
        self.hf_names = {"embed": source.parts.embed}

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed(input_ids)


class InputsPipe(nn.Module):
    """What runs between the token embedding and the first decoder layer, in HF's order: the input projection
    (OPT), the learned position embedding (GPT-2, OPT), the embedding dropout (GPT-2, GPT-NeoX)."""

    def __init__(self, source: Source):
        super().__init__()
        parts = source.parts
        self.take_mask = parts.positions_take_mask
        self.hf_names = {}
        for attr, path, offset in (("project_in", parts.project_in, -5), ("positions", parts.positions, -2),
                                   ("dropout", parts.dropout, 0)):
            setattr(self, attr, source.materialise(path, seed_offset=offset) if path else None)
            if path and attr != "dropout":
                self.hf_names[attr] = path

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.project_in is not None:
            hidden = self.project_in(hidden)
        if self.positions is not None:
            ids = _positions(hidden)
            hidden = hidden + (self.positions(torch.ones_like(ids), position_ids=ids) if self.take_mask
                               else self.positions(ids))
        return self.dropout(hidden) if self.dropout is not None else hidden


class DecoderLayerPipe(nn.Module):
    """One HF decoder layer; rebuilds its mask and rotary embeddings, optionally recomputed in backward.

    MoE models whose config asks for the router's load-balancing loss carry its running sums to the last stage
    next to the hidden states (see `RouterStats`)."""

    def __init__(self, source: Source, index: int):
        super().__init__()
        self.source = source
        self.index = index
        self.layer = source.materialise(f"{source.parts.layers}.{index}", seed_offset=index)
        self.hf_names = {"layer": f"{source.parts.layers}.{index}"}
        self.router = RouterStats.for_source(source)
        self._router_logits: list[torch.Tensor] = []
        if self.router is not None:
            for module in self.layer.modules():
                if type(module).__name__ == source.parts.router_class:
                    module.register_forward_hook(self._record_router)

    def _record_router(self, module, args, output):
        self._router_logits.append(output[self.source.parts.router_index] if isinstance(output, tuple) else output)

    def forward(self, x):
        if self.source.checkpointing and self.training and torch.is_grad_enabled():
            return checkpoint(self._forward, *(x if isinstance(x, tuple) else (x,)), use_reentrant=False)
        return self._forward(*(x if isinstance(x, tuple) else (x,)))

    def _forward(self, hidden: torch.Tensor, stats: torch.Tensor | None = None):
        position_ids = _positions(hidden)
        extra = {name: None for name in self.source.parts.layer_none_inputs}
        if self.source.rotary is not None:
            extra["position_embeddings"] = self.source.rotary_embeddings(self.index, hidden, position_ids)
        self._router_logits = []
        out = self.layer(hidden, attention_mask=self.source.attention_mask(self.index, hidden, position_ids),
                         position_ids=position_ids, **extra)
        hidden = out[0] if isinstance(out, tuple) else out
        if self.router is None:
            return hidden
        if stats is None:
            stats = self.router.zeros(hidden)
        for logits in self._router_logits:
            stats = stats + self.router.layer_sums(logits)
        return hidden, stats


class RouterStats:
    """The MoE load-balancing loss of HF's load_balancing_loss_func (Switch Transformer, eqs. 4-6), split over
    stages: it is a product of two means over every routed layer's tokens, so each layer adds its sums to a
    [2, experts + 1] tensor that travels with the hidden states (row 0: top-k assignments per expert and the
    token-row count, no gradient; row 1: router probabilities per expert), and the loss is formed on the last stage.
    None when the config does not ask for the loss (output_router_logits false: HF adds nothing either)."""

    def __init__(self, experts: int, top_k: int, coefficient: float):
        self.experts, self.top_k, self.coefficient = experts, top_k, coefficient

    @classmethod
    def for_source(cls, source: Source) -> "RouterStats | None":
        if source.parts.router_class is None:
            return None
        model = source.skeleton
        return cls(int(model.num_experts), int(model.num_experts_per_tok), float(model.router_aux_loss_coef))

    def zeros(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.zeros(2, self.experts + 1, dtype=torch.float32, device=hidden.device)

    def layer_sums(self, router_logits: torch.Tensor) -> torch.Tensor:
        weights = F.softmax(router_logits.float(), dim=-1)
        _, selected = torch.topk(weights, self.top_k, dim=-1)
        # histc as HF: float on CPU (supported, deterministic), int32 on accelerators (deterministic there).
        dtype = torch.float32 if weights.device.type in ("cpu", "mps") else torch.int32
        counts = torch.histc(selected.reshape(-1).to(dtype), bins=self.experts, min=0, max=self.experts).float()
        rows = torch.full((1,), float(weights.shape[0]), device=weights.device)
        assigned = torch.cat([counts, rows]).detach()
        probs = torch.cat([weights.sum(dim=0), torch.zeros(1, device=weights.device)])
        return torch.stack([assigned, probs])

    def loss(self, stats: torch.Tensor) -> torch.Tensor:
        rows = stats[0, -1]
        return torch.sum(stats[0, :-1] / rows * (stats[1, :-1] / rows)) * self.experts


def _split(x):
    """(hidden, carried) from what a layer received: a tensor, or hidden states with the router sums."""
    return (x[0], x[1:]) if isinstance(x, tuple) else (x, ())


class NormPipe(nn.Module):
    """The final norm and, where the model has one, the output projection (OPT's project_out)."""

    def __init__(self, source: Source):
        super().__init__()
        parts = source.parts
        self.norm = source.materialise(parts.norm, seed_offset=-3) if parts.norm else None
        self.project_out = source.materialise(parts.project_out, seed_offset=-6) if parts.project_out else None
        self.hf_names = {k: v for k, v in (("norm", parts.norm), ("project_out", parts.project_out)) if v}

    def forward(self, x):
        hidden, carried = _split(x)
        if self.norm is not None:
            hidden = self.norm(hidden)
        if self.project_out is not None:
            hidden = self.project_out(hidden)
        return (hidden, *carried) if carried else hidden


def _soft_cap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Gemma-2's final logit soft-capping, as its ForCausalLM applies it: cap * tanh(logits / cap)."""
    return logits if not cap else torch.tanh(logits / cap) * cap


class HeadPipe(nn.Module):
    """Untied LM head: hidden -> logits (soft-capped where the config says so)."""

    def __init__(self, source: Source):
        super().__init__()
        self.head = source.materialise(source.parts.head, seed_offset=-4)
        self.cap = getattr(source.text_config, "final_logit_softcapping", None)
        self.hf_names = {"head": source.parts.head}

    def forward(self, x):
        hidden, carried = _split(x)
        logits = _soft_cap(self.head(hidden), self.cap)
        return (logits, *carried) if carried else logits


def tied_head(embedding: TokenEmbeddingPipe, x):
    """Tied LM head: logits with the token embedding's weight (HF's bias-free lm_head tied to it)."""
    hidden, carried = _split(x)
    logits = _soft_cap(F.linear(hidden, embedding.embed.weight), embedding.cap)
    return (logits, *carried) if carried else logits


class CausalLMLoss:
    """HF's causal-LM loss (shift labels by one, mean cross-entropy in fp32, -100 ignored), plus the MoE router's
    load-balancing loss times its coefficient when the model carries it (as HF's MoE ForCausalLM adds it)."""

    def __init__(self, vocab_size: int, router: "RouterStats | None" = None):
        self.vocab_size = vocab_size
        self.router = router
        self.__name__ = "ForCausalLMLoss"

    def __call__(self, outputs, labels: torch.Tensor) -> torch.Tensor:
        from transformers.loss.loss_utils import ForCausalLMLoss

        logits, carried = _split(outputs)
        loss = ForCausalLMLoss(logits, labels, vocab_size=self.vocab_size)
        if self.router is not None and carried:
            loss = loss + self.router.coefficient * self.router.loss(carried[0]).to(loss.device)
        return loss


def layer_specs(source: Source) -> tuple[list, int]:
    """The pipeline's layer specs, and how many of them come before decoder layer 0."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    if source.tied:
        first = [TiedLayerSpec("embed", TokenEmbeddingPipe, source, tied_weight_attr=["embed.weight"])]
        last = [TiedLayerSpec("embed", TokenEmbeddingPipe, source, forward_fn=tied_head,
                              tied_weight_attr=["embed.weight"])]
    else:
        first = [LayerSpec(TokenEmbeddingPipe, source)]
        last = [LayerSpec(HeadPipe, source)]
    parts = source.parts
    if parts.positions is not None or parts.dropout is not None or parts.project_in is not None:
        first.append(LayerSpec(InputsPipe, source))
    blocks = [LayerSpec(DecoderLayerPipe, source, i) for i in range(source.num_layers)]
    return first + blocks + [LayerSpec(NormPipe, source)] + last, len(first)


def build_pipeline(source: Source, boundaries: list[int], *, topology=None, num_stages: int | None = None):
    """A PipelineModule whose stage s runs decoder layers [boundaries[s], boundaries[s+1]) (stage 0 also the
    embeddings, the last stage also the final norm, head and loss). Call after deepspeed.init_distributed."""
    from deepspeed.pipe import PipelineModule

    specs, n_first = layer_specs(source)
    stages = len(boundaries) - 1
    parts = [0] + [n_first + b for b in boundaries[1:-1]] + [len(specs)]

    class HFPipelineModule(PipelineModule):
        def _partition_layers(self, method="uniform"):
            self.parts = parts
            self._set_bounds(start=parts[self.stage_id], stop=parts[self.stage_id + 1])

    # no_grad: the constructor broadcasts tied weights in place; recorded by autograd, that broadcast would sit in
    # every later backward graph (torch warns "c10d::broadcast_: an autograd kernel was not registered").
    with torch.no_grad():
        pipe = HFPipelineModule(specs, num_stages=None if topology is not None else stages, topology=topology,
                                loss_fn=CausalLMLoss(source.text_config.vocab_size, RouterStats.for_source(source)), partition_method="uniform")
    # Gradient clipping without ZeRO (engine.clip_fp32_gradients -> runtime.utils.clip_grad_norm_) counts a
    # parameter on stages other than the first only when it is marked model-parallel, so unmarked it clips by
    # stage 0's gradient norm alone. Marking every parameter, except the second copy of a tied weight, makes the
    # norm the whole model's, as in HF. ZeRO-1 and the bf16 optimizer count every stage already; the mark does
    # not change them (they also skip ds_pipe_replicated copies).
    for p in pipe.parameters():
        p.model_parallel = not getattr(p, "ds_pipe_replicated", False)
    return pipe


def hf_state_dict(pipe: nn.Module) -> dict[str, torch.Tensor]:
    """This stage's weights under their HF names (the tied head is left out: HF re-ties it on load)."""
    out: dict[str, torch.Tensor] = {}
    for name, module in pipe.named_modules():
        if name.startswith("tied_modules.") and getattr(pipe, "stage_id", 0) != 0:
            continue  # the first stage writes the tied embedding
        for attr, prefix in getattr(module, "hf_names", {}).items():
            for key, tensor in getattr(module, attr).state_dict().items():
                out[f"{prefix}.{key}"] = tensor.detach().to("cpu").contiguous().clone()
    return out
