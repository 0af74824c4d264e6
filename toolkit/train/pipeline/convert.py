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

from toolkit.errors import UserError


@dataclass(frozen=True)
class Family:
    """Where an HF architecture keeps its parts (attribute paths inside *ForCausalLM)."""
    embed: str
    layers: str
    norm: str
    positions: str | None = None
    """Learned absolute position embedding (GPT-2), added after the token embedding."""
    dropout: str | None = None
    """Embedding dropout (GPT-2)."""
    rotary: str | None = None
    """Rotary embedding module (Llama family); recomputed on every stage."""
    head: str = "lm_head"


_LLAMA = Family(embed="model.embed_tokens", layers="model.layers", norm="model.norm", rotary="model.rotary_emb")
FAMILIES: dict[str, Family] = {
    "gpt2": Family(embed="transformer.wte", layers="transformer.h", norm="transformer.ln_f",
                   positions="transformer.wpe", dropout="transformer.drop"),
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "qwen2": _LLAMA,
}


class Source:
    """One rank's view of the HF model: config, a meta-device skeleton, and lazy access to the weight files.

    `weights` is a folder with model.safetensors or model.safetensors.index.json; None means random init (HF's own
    initialisation of each layer, seeded by layer so every rank that builds a layer builds the same one).
    """

    def __init__(self, config: Any, weights: str | Path | None, *, seed: int = 0, checkpointing: bool = False,
                 attention: str | None = None):
        model_type = config.model_type
        if model_type not in FAMILIES:
            raise UserError(f"pipeline conversion supports {', '.join(sorted(FAMILIES))}, not model_type "
                            f"'{model_type}'; use a ZeRO or FSDP2 strategy for this model")
        self.config = config
        self.family = FAMILIES[model_type]
        self.weights = Path(weights) if weights is not None else None
        self.seed = seed
        self.checkpointing = checkpointing
        self.attention = attention
        """HF attn_implementation (eager | sdpa | flash_attention_2); None: transformers' default."""

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def tied(self) -> bool:
        return bool(getattr(self.config.get_text_config(), "tie_word_embeddings", False))

    @cached_property
    def skeleton(self) -> nn.Module:
        from transformers import AutoModelForCausalLM

        options = {"attn_implementation": self.attention} if self.attention else {}
        try:
            with torch.device("meta"):
                # from_config keeps self.config as the model's config, so the masks see the chosen attention.
                return AutoModelForCausalLM.from_config(self.config, dtype=torch.float32, **options)
        except (ValueError, ImportError) as exc:
            raise UserError(f"cannot build {self.config.model_type} with attention {self.attention}: "
                            f"{str(exc).strip().splitlines()[0]}") from None

    @cached_property
    def rotary(self) -> nn.Module | None:
        """The model's rotary module, built for real on CPU, kept outside every stage's module tree: DeepSpeed's
        bf16 cast would otherwise round its fp32 inv_freq buffer, which HF keeps in fp32."""
        if self.family.rotary is None:
            return None
        return type(self.skeleton.get_submodule(self.family.rotary))(config=self.config)

    def rotary_embeddings(self, hidden: torch.Tensor, position_ids: torch.Tensor):
        """(cos, sin) for these positions, from the rotary module moved once to the stage's device."""
        rotary = self.rotary
        if rotary.inv_freq.device != hidden.device:
            rotary.to(hidden.device)
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

    def _stored_name(self, name: str) -> str:
        """Name in the files; old GPT-2 checkpoints store the base model without its prefix ('h.0...' not
        'transformer.h.0...')."""
        if name in self._files:
            return name
        prefix = getattr(self.skeleton, "base_model_prefix", "") + "."
        if name.startswith(prefix) and name[len(prefix):] in self._files:
            return name[len(prefix):]
        raise UserError(f"weights in {self.weights} have no tensor '{name}'; is this the planned model?")

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

        wanted = {key: self._stored_name(f"{path}.{key}") for key in module.state_dict()}
        state: dict[str, torch.Tensor] = {}
        by_file: dict[Path, list[str]] = {}
        for key, stored in wanted.items():
            by_file.setdefault(self._files[stored], []).append(key)
        for file, keys in by_file.items():
            with safe_open(str(file), framework="pt") as f:
                for key in keys:
                    state[key] = f.get_tensor(wanted[key]).float()
        module.load_state_dict(state)
        return module

    def attention_mask(self, index: int, hidden: torch.Tensor, position_ids: torch.Tensor):
        """The mask HF's own forward would give layer `index` for unpadded input (None when SDPA can use
        is_causal). Sliding-window layers (Mistral, Qwen2 layer_types) get HF's sliding-window mask."""
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        layer_types = getattr(self.config, "layer_types", None)
        if layer_types is not None:
            sliding = layer_types[index] == "sliding_attention"
        else:
            sliding = getattr(self.config, "sliding_window", None) is not None
        make = create_sliding_window_causal_mask if sliding else create_causal_mask
        return make(config=self.config, inputs_embeds=hidden, attention_mask=None, cache=None,
                    position_ids=position_ids)


def _positions(hidden: torch.Tensor) -> torch.Tensor:
    return torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)


class TokenEmbeddingPipe(nn.Module):
    """input_ids -> token embeddings. Also the tied LM head's weight holder (see `tied_head`)."""

    def __init__(self, source: Source):
        super().__init__()
        self.embed = source.materialise(source.family.embed, seed_offset=-1)
        self.hf_names = {"embed": source.family.embed}

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed(input_ids)


class PositionPipe(nn.Module):
    """GPT-2: add the learned position embedding, then the embedding dropout, as GPT2Model.forward does."""

    def __init__(self, source: Source):
        super().__init__()
        self.positions = source.materialise(source.family.positions, seed_offset=-2)
        self.dropout = source.materialise(source.family.dropout)
        self.hf_names = {"positions": source.family.positions}

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.dropout(hidden + self.positions(_positions(hidden)))


class DecoderLayerPipe(nn.Module):
    """One HF decoder layer; rebuilds its mask and rotary embeddings, optionally recomputed in backward."""

    def __init__(self, source: Source, index: int):
        super().__init__()
        self.source = source
        self.index = index
        self.layer = source.materialise(f"{source.family.layers}.{index}", seed_offset=index)
        self.hf_names = {"layer": f"{source.family.layers}.{index}"}

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.source.checkpointing and self.training and torch.is_grad_enabled():
            return checkpoint(self._forward, hidden, use_reentrant=False)
        return self._forward(hidden)

    def _forward(self, hidden: torch.Tensor) -> torch.Tensor:
        position_ids = _positions(hidden)
        extra = {}
        if self.source.rotary is not None:
            extra["position_embeddings"] = self.source.rotary_embeddings(hidden, position_ids)
        out = self.layer(hidden, attention_mask=self.source.attention_mask(self.index, hidden, position_ids),
                         position_ids=position_ids, **extra)
        return out[0] if isinstance(out, tuple) else out


class NormPipe(nn.Module):
    def __init__(self, source: Source):
        super().__init__()
        self.norm = source.materialise(source.family.norm, seed_offset=-3)
        self.hf_names = {"norm": source.family.norm}

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.norm(hidden)


class HeadPipe(nn.Module):
    """Untied LM head: hidden -> logits."""

    def __init__(self, source: Source):
        super().__init__()
        self.head = source.materialise(source.family.head, seed_offset=-4)
        self.hf_names = {"head": source.family.head}

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)


def tied_head(embedding: TokenEmbeddingPipe, hidden: torch.Tensor) -> torch.Tensor:
    """Tied LM head: logits with the token embedding's weight (HF's bias-free lm_head tied to it)."""
    return F.linear(hidden, embedding.embed.weight)


class CausalLMLoss:
    """HF's causal-LM loss (shift labels by one, mean cross-entropy in fp32, -100 ignored)."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.__name__ = "ForCausalLMLoss"

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        from transformers.loss.loss_utils import ForCausalLMLoss

        return ForCausalLMLoss(logits, labels, vocab_size=self.vocab_size)


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
    if source.family.positions is not None:
        first.append(LayerSpec(PositionPipe, source))
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
                                loss_fn=CausalLMLoss(source.config.vocab_size), partition_method="uniform")
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
