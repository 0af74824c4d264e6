"""What `toolkit launch DIR --processes N [--cpu] -- my_train.py` does for a user's script it runs on N ranks
(toolkit.train.own_script.run_script), so that the run is what the launcher announced or stops saying why.

- A plain HF Trainer script (no toolkit import) on a machine without a GPU: accelerate's shared state is created
  over gloo for the plan's engine, and TrainingArguments use it (use_cpu, use_configured_state), as the helper
  `training_arguments()` would do. Without that set-up every rank comes up as a world of one and trains alone into
  the same output folder (FSDP2), or DeepSpeed's batch assertion fails minutes later (ZeRO): accelerate finds no
  backend on CPU (docs/ENGINE_FACTS.md "Running the engines without a GPU").
- Any TrainingArguments (Trainer, TRL's SFTConfig) that still see a world other than the launch's, or a batch
  other than the plan's, stop the rank as they are created, before the model loads: one line naming the cause and
  the helper (toolkit.train.own_script.training_arguments).
- Any script that ends without ever joining a process group of the launch's size (each rank trained alone) is a
  failure, not an exit 0.

The hooks wrap TrainingArguments.__post_init__ (subclasses such as SFTConfig call it), Accelerator.__init__ (when
the script imports them) and torch.distributed.init_process_group (accelerate and DeepSpeed call it by attribute),
only in a rank started by the launcher with WORLD_SIZE > 1.
"""

from __future__ import annotations

import os
from typing import Any, Callable

HELPER = ("create TrainingArguments with **training_arguments() from toolkit.train.own_script (PLAN.md shows the "
          "lines)")


def launched_world() -> int:
    """The number of ranks the launcher started (its WORLD_SIZE; 1 when not launched)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


class LaunchGuard:
    """Installed in a rank before the user's script runs; `finished_alone()` after it returns. Its refusals are
    SystemExit(str), which the runner reports as the script's own bad input (exit 2)."""

    def __init__(self, plan_settings: Callable[[], dict[str, Any]], prepare_this_box: Callable[[], bool]):
        # toolkit.train.own_script's, passed in (it imports this module): the reader of the plan's
        # training_args.json, and the CPU set-up training_arguments() does
        self.plan_settings, self.prepare_this_box = plan_settings, prepare_this_box
        self.world = launched_world()
        self.joined: list[int] = []  # world sizes of the process groups this rank created

    def install(self) -> LaunchGuard:
        if self.world <= 1:
            return self
        self._wrap_init_process_group()
        self._wrap_training_arguments()
        self._wrap_accelerator()
        return self

    def finished_alone(self) -> str | None:
        """Why an exit 0 is not a success: the script never joined the launch's process group."""
        if self.world <= 1 or self.world in self.joined:
            return None
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() == self.world:
            return None
        return (f"ran as {self.world} separate single-process runs: no rank joined a process group of the launch's "
                f"{self.world} processes (each trained alone, into the same output folder); use the HF Trainer or "
                f"accelerate's Accelerator, and {HELPER}")

    def _wrap_init_process_group(self) -> None:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d

        original = distributed_c10d.init_process_group
        joined = self.joined

        def init_process_group(*args, **kwargs):
            result = original(*args, **kwargs)
            joined.append(dist.get_world_size())
            return result

        dist.init_process_group = distributed_c10d.init_process_group = init_process_group

    def _wrap_training_arguments(self) -> None:
        """When (and only if) the script imports transformers' TrainingArguments."""
        guard = self

        def patch(module) -> None:
            cls = module.TrainingArguments
            original = cls.__post_init__

            def __post_init__(args, *more, **kwargs):
                guard._check_batch(args)  # first: no process group, no engine started for a run that stops
                guard._adopt_this_box(args)
                original(args, *more, **kwargs)
                guard._check_world(args)

            cls.__post_init__ = __post_init__

        after_import("transformers.training_args", patch)

    def _wrap_accelerator(self) -> None:
        """A custom accelerate loop: the gloo state before the Accelerator (as accelerate_loop() makes it), and the
        same world check after."""
        guard = self

        def patch(module) -> None:
            cls = module.Accelerator
            original = cls.__init__

            def __init__(accelerator, *args, **kwargs):
                guard.prepare_this_box()
                original(accelerator, *args, **kwargs)
                if accelerator.num_processes != guard.world:
                    raise SystemExit(f"the Accelerator came up as a world of {accelerator.num_processes} under a "
                                     f"launch of {guard.world} processes: every rank would train alone; call "
                                     "accelerate_loop() from toolkit.train.own_script before creating it")

            cls.__init__ = __init__

        after_import("accelerate.accelerator", patch)

    def _adopt_this_box(self, args) -> None:
        """On a machine without a GPU, what training_arguments() would have added (nothing when it did)."""
        if not self.prepare_this_box():
            return
        args.use_cpu = True
        config = args.accelerator_config
        if config is None or isinstance(config, dict):
            args.accelerator_config = {**(config or {}), "use_configured_state": True}
        elif hasattr(config, "use_configured_state"):  # an AcceleratorConfig object
            config.use_configured_state = True
        # a JSON file's path is left as it is: the world check below stops the run if it does not say so

    def _check_batch(self, args) -> None:
        problem = batch_problem(args.per_device_train_batch_size, args.gradient_accumulation_steps,
                                self.plan_settings)
        if problem:
            raise SystemExit(f"{problem}; {HELPER}")

    def _check_world(self, args) -> None:
        if args.world_size != self.world:
            raise SystemExit(f"TrainingArguments came up as a world of {args.world_size} under a launch of "
                             f"{self.world} processes: every rank would train alone into {args.output_dir}; {HELPER}")


def batch_problem(micro: int, accumulation: int, plan_settings: Callable[[], dict[str, Any]]) -> str | None:
    """Why a script's per-device batch and accumulation are not the plan's (for this box; `plan_settings()` reads
    the plan's training_args.json): a larger micro-batch than planned needs memory the plan did not count, and a
    different micro x accumulation another global batch. None when they agree, or when no plan settings can be
    read."""
    try:
        planned: dict[str, Any] = plan_settings()["training_arguments"]
        plan_micro = int(planned["per_device_train_batch_size"])
        plan_accum = int(planned["gradient_accumulation_steps"])
    except (SystemExit, KeyError, TypeError, ValueError):
        return None
    if micro <= plan_micro and micro * accumulation == plan_micro * plan_accum:
        return None
    return (f"the script trains per_device_train_batch_size {micro} x gradient_accumulation_steps {accumulation} "
            f"per process, the plan {plan_micro} x {plan_accum}")


def after_import(name: str, then) -> None:
    """Call then(module) right after module `name` is first imported (at once if it already is)."""
    import sys

    from toolkit.processes import on_import

    if name in sys.modules:
        then(sys.modules[name])
        return

    def run_then(run, module) -> None:
        run()
        then(module)

    on_import(name, run_then)
