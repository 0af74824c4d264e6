"""Host RAM per node at load and save time, where runs run out of CPU memory before a GPU is touched.

What toolkit.train and its emitted configs do (toolkit/train/model.py, toolkit/emit/accelerate.py, emit/deepspeed.py):

load  from_pretrained / from_config builds the model on the CPU in the load dtype (fp32 for fp32 and mixed precision:
      the Trainer keeps fp32 master weights; bf16 for bf16-pure) before the engine moves or shards it.
      - DDP, ZeRO-1/2: every rank builds the whole model: ranks per node x params x load bytes.
      - pipeline: every rank builds only its stage (toolkit.train.pipeline.convert reads the stage's tensors from the
        safetensors): ranks per node x the largest stage's params x load bytes.
      - ZeRO-3 with zero3_init (emitted zero3_init_flag): parameters are partitioned as each module is built
        (deepspeed.zero.Init); a rank holds its 1/N partition and one module gathered while it is filled.
      - FSDP2 with fsdp_cpu_ram_efficient_loading (emitted): rank 0 builds the model, the others build it on the
        meta device and receive their shards by broadcast: one full copy, on the first node.
save  the final save_model (toolkit/train/hf_runner.py):
      - FSDP2 FULL_STATE_DICT: the unsharded state dict is gathered into rank 0's host RAM (offload_to_cpu,
        accelerate's FSDP2 get_state_dict): params x parameter bytes (fp32 for mixed precision).
      - ZeRO-3 (stage3_gather_16bit_weights_on_model_save): the 16-bit weights are gathered and copied to rank 0's
        host: params x 2.
      - DDP / ZeRO-1/2 / pipeline: save_pretrained copies one safetensors shard at a time to the host: at most the
        shard size (transformers' max_shard_size default) or the model if smaller.
Offloaded optimizer / parameters / activations stay allocated while the model is saved, so save adds to them.
"""

from __future__ import annotations

from dataclasses import dataclass

from toolkit.inputs.choices import weight_bytes
from toolkit.inputs.job import Job
from toolkit.inputs.strategy import Engine, Kind, Strategy

SAVE_SHARD_BYTES = 5 * 1000**3
"""transformers save_pretrained max_shard_size default "5GB" (modeling_utils.py): the host buffer of a
shard-by-shard save."""


@dataclass(frozen=True)
class HostRam:
    load_bytes_per_node: int
    """Largest host RAM any node needs while the model is built / loaded."""
    save_bytes_per_node: int
    """Host RAM of the final save on the node that saves (rank 0's), on top of the training residents."""
    resident_bytes_per_node: int
    """Held for the whole run: offloaded optimizer states, parameters, activations."""
    load_source: str
    save_source: str

    @property
    def peak_bytes_per_node(self) -> int:
        return max(self.load_bytes_per_node, self.resident_bytes_per_node + self.save_bytes_per_node)


def host_ram(*, params: int, largest_layer_params: int, strategy: Strategy, job: Job, gpus_per_node: int,
             world: int, resident_bytes_per_node: int, stage_params: int | None = None) -> HostRam:
    load_b = _load_bytes_per_param(job)
    full = params * load_b
    if strategy.kind == Kind.ZERO3:
        load = gpus_per_node * (full // world) + largest_layer_params * load_b
        load_src = "ZeRO-3 zero3_init: each rank's 1/N partition + one module gathered while loading"
    elif strategy.engine == Engine.FSDP2:
        load = full
        load_src = "FSDP2 cpu_ram_efficient_loading: one full copy on rank 0, others on the meta device"
    elif strategy.is_pipeline and stage_params is not None:
        load = gpus_per_node * stage_params * load_b
        load_src = ("pipeline: each rank builds only its stage's layers and reads their weights from the "
                    f"safetensors (toolkit.train.pipeline.convert; {gpus_per_node} x the largest stage)")
    else:
        load = gpus_per_node * full
        load_src = f"every rank builds the whole model on the CPU ({gpus_per_node} x {load_b} B/param)"
    if strategy.engine == Engine.FSDP2:
        save = full
        save_src = f"FSDP2 FULL_STATE_DICT gathered on rank 0's host ({load_b} B/param)"
    elif strategy.kind == Kind.ZERO3:
        save = params * 2
        save_src = "ZeRO-3 16-bit weights gathered on rank 0's host (2 B/param)"
    else:
        weight_b = 2 if strategy.engine in (Engine.DEEPSPEED, Engine.PIPELINE) and job.precision != "fp32" else load_b
        save = min(params * weight_b, SAVE_SHARD_BYTES)
        save_src = "save_pretrained: one safetensors shard at a time on rank 0's host"
    return HostRam(load_bytes_per_node=int(load), save_bytes_per_node=int(save),
                   resident_bytes_per_node=int(resident_bytes_per_node), load_source=load_src, save_source=save_src)


def _load_bytes_per_param(job: Job) -> int:
    """Bytes per parameter of the load dtype: LoRA / QLoRA load the frozen base in the compute dtype (the one rule,
    toolkit.inputs.lora.base_storage_bytes_per_param, that toolkit.train and PLAN.md's load dtype follow); full
    fine-tuning loads fp32 master weights, bf16 for bf16-pure."""
    if job.adapter.is_adapter:
        from toolkit.inputs.lora import base_storage_bytes_per_param

        return base_storage_bytes_per_param(job.precision, job.adapter.base_dtype)
    return weight_bytes(job.precision)
