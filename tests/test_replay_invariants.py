"""Invariants of the allocator replay (toolkit.estimate.reserved) over every strategy the planner offers: the
replay allocates what the memory model says is live, plus only the engine buffers its rules add on purpose, and
reserves at least what it allocates. A small Llama-shaped model (4 layers, hidden 256), full and LoRA, with and
without activation checkpointing; each case's replay is rebuilt from the events the estimate replayed
(reserved.replays_asked)."""

from __future__ import annotations

import pytest

from toolkit.estimate.allocator import Replayer
from toolkit.estimate.memory import estimate_memory
from toolkit.estimate.reserved import emit_step_events, replays_asked, replays_kept
from toolkit.inputs.grid import ParallelGrid
from toolkit.inputs.hardware import parse_hardware
from toolkit.inputs.job import Job
from toolkit.inputs.lora import Adapter
from toolkit.inputs.strategy import parse_strategy

ON_PURPOSE = {
    "ag": "FSDP2's all-gather output on the copy-in stream, kept to the next group's copy-out "
          "(_fsdp_param_group.py all_gather_state)",
    "cast": "FSDP2 over one rank: each fp32 shard cast to param_dtype for its copy-out (all_gather_inputs)",
    "rs_in": "FSDP2's reduce-scatter input, kept to the next group's post_backward (reduce_scatter_states)",
    "rs_out": "FSDP2's reduce-scatter output in the reduce dtype, beside its cast to the sharded fp32 gradient",
    "zcat": "ZeRO-3's bucket cat buffer on the reduce stream (coalesced_collectives.py reduce_scatter_coalesced)",
    "norm": "ZeRO-3's fp64 copy of a gradient partition for its norm (stage3.py get_grad_norm_direct)",
    "flatten": "ZeRO-3's bf16 flatten of a sub-group beside its fp32 gradient (_prepare_fp32_grad_for_sub_group)",
}
"""The engine buffers toolkit.estimate.engineevents adds on purpose: allocations the engines make that the memory
model's phase peaks do not count (each from the engine's code). Nothing else may lift the replay's allocated peak
above the memory model's tensor peak."""

FULL = ("ddp", "zero1", "zero2", "zero3", "zero3-offload-opt", "zero3-offload", "fsdp2", "fsdp2-grad-op",
        "fsdp2-offload")
DEGREES = (("fsdp2", dict(tensor=2)), ("fsdp2-grad-op", dict(tensor=2)), ("fsdp2", dict(context=2)),
           ("zero3", dict(sequence=2)), ("zero2", dict(sequence=2)))
CASES = [(s, {}, lora, ckpt) for s in FULL for lora in (False, True) for ckpt in (False, True)] + \
        [(s, d, False, ckpt) for s, d in DEGREES for ckpt in (False, True)] + \
        [(s, {}, False, ckpt) for s in ("fsdp2-hybrid", "pipeline", "hybrid") for ckpt in (False, True)]
HARDWARE = {"fsdp2-hybrid": "2x2xA100-80GB", "pipeline": "2xA100-80GB"}


@pytest.fixture(scope="module")
def small():
    from toolkit.inputs.modelconfig import shape_config
    from toolkit.inputs.modelspec import build_spec

    return build_spec("small", shape_config(layers=4, hidden=256, heads=8, kv_heads=2, vocab=1000,
                                            max_positions=65536))


class _Watched(Replayer):
    """A replay that notes, at its peak of requested bytes (the tensors' own sizes, before the allocator's
    rounding), the bytes of each kind of block alive (the key's first part;
    the traced regions' storages: 'act'), and which storages the traced events never free (those the replay frees
    after backward's last event)."""

    def __init__(self, unfreed: set) -> None:
        super().__init__()
        self.unfreed, self.steps = unfreed, -1
        self.sizes: dict = {}
        self.at_peak: dict[str, int] = {}

    def step(self) -> None:
        super().step()
        self.steps += 1

    def malloc(self, key, size: int, stream: int = 0) -> None:
        before = self.allocator.stats.peak_requested
        super().malloc(key, size, stream)
        self.sizes[key] = size
        if self.allocator.stats.peak_requested > before:
            kinds: dict[str, int] = {}
            for k, n in self.sizes.items():
                kind = "unfreed" if (self.steps, k) in self.unfreed else k[0]
                kinds[kind] = kinds.get(kind, 0) + n
            self.at_peak = kinds

    def free(self, key) -> None:
        super().free(key)
        del self.sizes[key]


def _unfreed(events) -> set:
    """(step, key) of the traced storages the events never free: the replay frees them after the step's last
    compute-stream sync (reserved.emit_step_events, `alive`)."""
    out, step, after_sync = set(), -1, False
    for e in events:
        if e[0] == "step":
            step += 1
        if e[0] == "sync" and e[1] == 0:
            after_sync = True
        elif e[0] == "free" and e[1][0] == "act" and after_sync:
            out.add((step, e[1]))
        else:
            after_sync = False
    return out


def replay_against_model(spec, strategy: str, degrees: dict, lora: bool, ckpt: bool):
    """(the memory model's tensor peak, the replay's requested, allocated and reserved peaks, the bytes alive at
    the requested peak by kind) of one case."""
    from toolkit.estimate.reserved import step_events

    hw = parse_hardware(HARDWARE.get(strategy, "4xA100-80GB"))
    s = parse_strategy(strategy)
    grid = ParallelGrid.for_strategy(s, nodes=hw.nodes, gpus_per_node=hw.gpus_per_node, **degrees) \
        if degrees else None
    job = Job(seq_len=512, micro_batch=2, checkpointing=ckpt, adapter=Adapter(method="lora", r=8) if lora else Adapter())
    with replays_kept(), replays_asked() as asked:
        b = estimate_memory(spec, s, job, hw, grid=grid, pipeline_stages=2 if s.is_pipeline else 1)
    assert asked, "no replay was asked"
    worst = None
    for regions, sizes, _ in asked:  # a pipeline's stages: the one whose replay allocates the most
        r = _Watched(_unfreed(step_events(regions, sizes)))
        emit_step_events(regions, sizes, r)
        stats = r.allocator.stats
        if worst is None or stats.peak_requested > worst[1]:
            worst = (b.peak_bytes - b.workspace_bytes, stats.peak_requested, stats.peak_allocated,
                     stats.peak_reserved, r.at_peak)
    return worst


@pytest.mark.parametrize("strategy,degrees,lora,ckpt", CASES,
                         ids=[f"{s}{''.join(f'-{k[0]}p{v}' for k, v in d.items())}-{'lora' if lo else 'full'}"
                              f"{'-ckpt' if c else ''}" for s, d, lo, c in CASES])
def test_the_replay_allocates_the_tensor_peak_and_only_the_named_engine_buffers_above_it(small, strategy, degrees,
                                                                                         lora, ckpt):
    if lora and strategy.startswith(("pipeline", "hybrid")):
        pytest.skip("LoRA runs on the HF Trainer path only")
    tensor_peak, requested, allocated, reserved, at_peak = replay_against_model(small, strategy, degrees, lora, ckpt)
    assert reserved >= allocated >= requested
    named = sum(n for kind, n in at_peak.items() if kind in ON_PURPOSE)
    unfreed = at_peak.get("unfreed", 0)
    # 0.05%: a pipeline's last stage replays 8 KiB (0.012%) above its tensor peak at the head's backward: the stage
    # cut leaves events of the traced model that the stage's own summary does not count
    assert requested - named - unfreed <= tensor_peak * 1.0005, at_peak
