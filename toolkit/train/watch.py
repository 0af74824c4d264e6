"""What a training run's rank summary says about its dtypes and states (with TOOLKIT_RANK_SUMMARY_DIR set; tests read
it): the dtype a decoder layer and its first matmul compute in, the dtypes of the frozen and trained parameters, and
the parameter and optimizer bytes a rank holds, and (CPU) the peak of its last step."""

from __future__ import annotations

import os


def watch_layer_dtype(model, layer_class: str) -> dict:
    """With TOOLKIT_RANK_SUMMARY_DIR set: record the dtype the first decoder layer computes in during training
    (shows that bf16 autocast / DeepSpeed bf16 / the FSDP2 mixed-precision policy really applied)."""
    seen: dict = {}
    if not os.environ.get("TOOLKIT_RANK_SUMMARY_DIR"):
        return seen
    import torch

    layer = next((m for m in model.modules() if type(m).__name__ == layer_class), None)
    # and its first matmul's output: bf16 under autocast even where the weights and the residual stream are fp32
    # (LoRA's --base-dtype fp32)
    linear = next((m for m in layer.modules() if isinstance(m, torch.nn.Linear)), None) if layer is not None else None
    for module, key in ((layer, "train_layer_output_dtype"), (linear, "train_linear_output_dtype")):
        if module is not None:
            def hook(module, inputs, output, key=key):
                if module.training:
                    first = output[0] if isinstance(output, (tuple, list)) else output
                    seen[key] = str(getattr(first, "dtype", None))
            module.register_forward_hook(hook)
    return seen


def param_dtypes(model) -> dict[str, list[str]]:
    """The dtypes the run holds its frozen and its trained parameters in (LoRA's --base-dtype): resharded first, so
    FSDP2's stored shards, not a forward's unsharded param_dtype copies."""
    _reshard(model)
    return {f"{kind}_param_dtypes": sorted({str(p.dtype) for p in model.parameters()
                                            if p.requires_grad == (kind == "trained")})
            for kind in ("frozen", "trained")}


def held_state_bytes(model, optimizer) -> tuple[int, int]:
    """Bytes of the parameters this rank holds between steps (a DTensor's local shard: the plan's parameters_bytes)
    and of the optimizer states it holds (AdamW's moments and steps: the plan's optimizer_bytes a rank). FSDP2 keeps
    the root's parameters unsharded after a forward (the last evaluation's), so it is resharded first."""
    import torch

    _reshard(model)
    param_bytes = sum(getattr(p, "_local_tensor", p).numel() * p.element_size() for p in model.parameters())
    optimizer = getattr(optimizer, "optimizer", optimizer)
    optimizer_bytes = sum(getattr(t, "_local_tensor", t).numel() * t.element_size()
                          for state in getattr(optimizer, "state", {}).values() for t in state.values()
                          if torch.is_tensor(t))
    return param_bytes, optimizer_bytes


def _reshard(model) -> None:
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def watch_step_peak(trainer, seen: dict) -> None:
    """With TOOLKIT_RANK_SUMMARY_DIR set, on CPU, in an expert-parallel run (the runs whose tests read it; a tracked
    step is slow, and every rehearsal writes summaries): the peak of live tensor bytes over the run's last optimizer
    step (forward, backward, clipping, the optimizer step and zero_grad), what a plan's per-rank peak_bytes predicts.
    torch's MemTracker (the CPU step peak toolkit.estimate.livebytes measures in one process) opens at the step's
    on_step_begin with the model and the optimizer states tracked and closes at its on_step_end; the batch, already
    fetched, is not counted (a few KB of token ids); meta-device storages hold nothing and are left out. `seen` (the
    rank summary's) gets, once the step ran:

    - `step_peak_bytes`: that peak less `param_storage_excess_bytes`, the bytes the parameters' storages hold beyond
      the parameters (transformers cuts a rank's shard from the loaded tensor as a view, which on CPU keeps the
      whole tensor alive: benchmarks/dimension_memory.py _compact_local_shards; a GPU copies the slice);
    - under expert parallelism `routed_pairs`: for each call of an experts module transformers marked
      _is_expert_parallel, the (token, expert) pairs this rank's tokens sent to each global expert id, from which
      the rows every expert rank received follow (routing is not balanced)."""
    if not os.environ.get("TOOLKIT_RANK_SUMMARY_DIR") or trainer.args.device.type != "cpu":
        return
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker
    from transformers import TrainerCallback

    def count(module, args, kwargs):
        index = args[1] if len(args) > 1 else kwargs.get("top_k_index")
        if torch.is_tensor(index):
            seen["routed_pairs"].append(torch.bincount(index.detach().reshape(-1).long()).tolist())

    class StepPeak(TrainerCallback):
        tracker = None
        hooks: list = []

        def on_step_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
            if state.global_step != state.max_steps - 1 or not any(getattr(m, "_is_expert_parallel", False)
                                                                    for m in model.modules()):
                return  # measured where a test reads it (expert-parallel runs): a tracked step costs time
            shards = [getattr(p, "_local_tensor", p) for p in model.parameters()]
            held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in shards}
            seen["param_storage_excess_bytes"] = sum(held.values()) - sum(t.numel() * t.element_size()
                                                                          for t in shards)
            seen["routed_pairs"] = []
            self.hooks = [m.register_forward_pre_hook(count, with_kwargs=True) for m in model.modules()
                          if getattr(m, "_is_expert_parallel", False)]
            while optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
                optimizer = getattr(optimizer, "optimizer", None)  # accelerate's and DeepSpeed's wrappers hold it
            self.tracker = MemTracker()
            self.tracker.track_external(*[o for o in (model, optimizer) if o is not None])
            self.tracker.__enter__()

        def on_substep_end(self, args, state, control, **kwargs):
            # MemTracker refuses a root module's second forward in one tracking (NotImplementedError "multiple
            # iterative calls", mem_tracker.py _pre_fw_hook): clear its per-module stats between accumulated
            # micro-steps; the peak it keeps (get_tracker_snapshot("peak")) is not reset.
            if self.tracker is not None:
                self.tracker.reset_mod_stats()

        def on_step_end(self, args, state, control, **kwargs):
            if self.tracker is None:
                return
            self.tracker.__exit__(None, None, None)
            for hook in self.hooks:
                hook.remove()
            peak = sum(snap.get("Total", 0) for dev, snap in self.tracker.get_tracker_snapshot("peak").items()
                       if str(dev).startswith("cpu"))
            seen["step_peak_bytes"] = int(peak) - seen["param_storage_excess_bytes"]
            self.tracker = None

    trainer.add_callback(StepPeak())
