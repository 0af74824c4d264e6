"""Pipeline and hybrid (pipeline x data parallel) training of an HF causal LM with DeepSpeed's pipeline engine.

Launched like every plan (`accelerate launch --config_file DIR/accelerate_config.yaml -m toolkit.train ...`):
accelerate only starts the processes; this module calls deepspeed.initialize itself with DIR/ds_config.json.

One optimizer step = `engine.train_batch()`: every data-parallel replica pulls plan.grad_accum micro-batches of
plan.micro_batch blocks, so a step sees the plan's global batch, whose loss is the mean over all of it.
Data order is a pure function of (seed, step), so resuming at step N needs only N (plus what DeepSpeed saves:
weights, optimizer, lr scheduler).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Iterator

import torch

from toolkit.errors import UserError
from toolkit.train import checkpoints
from toolkit.train.cpu import peak_memory_bytes
from toolkit.inputs.choices import GIB
from toolkit.plan.files import DS_CONFIG

LOG_FILE = "pipeline_log.jsonl"
"""One JSON line per logged step (rank 0), next to the checkpoints."""


def train_pipeline(plan, args) -> None:
    """Train `plan` (engine "pipeline") with TrainArgs `args`; every rank of the launch calls this."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology
    from toolkit.processes import start_up_done
    from toolkit.train.pipeline.convert import Source, build_pipeline
    from toolkit.train.pipeline.export import save_hf_model
    from toolkit.train.data import build_datasets
    from toolkit.train.model import check_matches_plan, check_vocab, load_config, load_tokenizer, model_source

    ds_config = read_ds_config(plan, args)
    stages = plan.pipeline_stages
    # The same model resolution as the Trainer runner: what to load, its config, and the check that it is the
    # planned model; the pipeline then needs the folder of its safetensors (each stage reads only its layers).
    name = model_source(plan, args.model, random_init=args.random_init)
    config = load_config(name, random_init=args.random_init)
    check_matches_plan(config, plan, name)
    model_dir, weights = weights_folder(name, random_init=args.random_init)
    boundaries = list(plan.partition)  # the plan checked that it splits its num_layers over its stages

    deepspeed.init_distributed()
    start_up_done()  # torch, transformers and DeepSpeed are imported (toolkit.processes)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != plan.world_size:
        raise UserError(f"the plan is for {plan.world_size} processes ({plan.pipeline_stages} stages x "
                        f"{plan.data_parallel} data-parallel) but {world} were launched; launch with the plan's "
                        "accelerate_config.yaml")
    tokenizer = load_tokenizer(args.tokenizer or model_dir)
    check_vocab(config.get_text_config(), tokenizer, name)

    torch.manual_seed(args.seed)
    train_ds, eval_ds = build_datasets(args.data, tokenizer, plan.seq_len, eval_fraction=args.eval_fraction,
                                       seed=args.seed, text_field=args.text_field,
                                       max_eval_blocks=args.max_eval_blocks)
    order = BatchOrder(len(train_ds), plan.global_batch, seed=args.seed)
    total_steps = args.max_steps if args.max_steps > 0 else max(1, int(args.epochs * order.steps_per_epoch))

    topology = PipeDataParallelTopology(num_pp=stages, num_dp=plan.data_parallel)
    source = Source(config, weights, seed=args.seed, checkpointing=plan.checkpointing, attention=plan.attention)
    module = build_pipeline(source, boundaries, topology=topology)
    optimizer = scheduler = None
    if "optimizer" not in ds_config:
        optimizer = adamw(module, lr=args.lr, weight_decay=args.weight_decay)
        if "scheduler" not in ds_config:
            from transformers import get_scheduler

            scheduler = get_scheduler(args.lr_scheduler, optimizer, num_warmup_steps=args.warmup_steps,
                                      num_training_steps=total_steps)
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, lr_scheduler=scheduler,
                                           model_parameters=[p for p in module.parameters() if p.requires_grad],
                                           config=ds_config)
    dp_rank = engine.grid.get_data_parallel_id()
    stage = engine.grid.get_stage_id()

    output = Path(args.output)
    start_step = 0
    if args.resume:
        last = checkpoints.last_complete_checkpoint(output)
        if last is None:
            if rank == 0:
                print(f"resume: no complete checkpoint in {output}; starting at step 0", flush=True)
        else:
            tag = last.name
            engine.load_checkpoint(str(output), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True)
            start_step = checkpoints.step_of(last)
            load_rng_state(last, rank)
            if rank == 0:
                print(f"resume: {tag}, continuing at step {start_step + 1} of {total_steps}", flush=True)

    if rank == 0:
        print(f"pipeline: {stages} stages x {plan.data_parallel} data-parallel, decoder layers per stage "
              f"{boundaries}, micro-batch {plan.micro_batch} x {plan.grad_accum} micro-batches x "
              f"{plan.data_parallel} = {plan.global_batch} blocks of {plan.seq_len} tokens per step, "
              f"{total_steps} steps", flush=True)
    from toolkit.train.hf_runner import refuse_untrained

    refuse_untrained(total_steps, len(train_ds), plan)  # no step to run: never save the model as trained
    log = RunLog(output, args.log_dir) if rank == 0 else None
    eval_every = args.eval_steps or args.save_steps
    window_start, window_tokens = time.perf_counter(), 0
    losses: dict[int, float] = {}
    for step in range(start_step + 1, total_steps + 1):
        batches = micro_batches(train_ds, order.step_indices(step - 1), dp_rank, plan.data_parallel,
                                plan.micro_batch, plan.grad_accum)
        loss = losses[step] = engine.train_batch(batches).item()
        window_tokens += plan.tokens_per_step
        if step % args.logging_steps == 0 or step == total_steps or step == start_step + 1:
            elapsed = time.perf_counter() - window_start
            peaks = [None] * world
            dist.all_gather_object(peaks, peak_memory_bytes())
            if rank == 0:
                log.write({"step": step, "loss": loss, "lr": engine.get_lr()[0],
                           "tokens_per_s": round(window_tokens / elapsed, 1),
                           "peak_gib_per_rank": [round(p / GIB, 3) for p in peaks]})
            window_start, window_tokens = time.perf_counter(), 0
        if eval_ds is not None and (step % eval_every == 0 or step == total_steps):
            evaluate(engine, eval_ds, plan, dp_rank, rank, step, log)
        if step % args.save_steps == 0 or step == total_steps:
            save_checkpoint(engine, output, step, rank, args.save_total_limit)
    if log is not None:
        log.close()
    write_stage_summary(engine.module, rank=rank, world=world, stage=stage, dp_rank=dp_rank, losses=losses)
    if not args.no_save_final:
        save_hf_model(engine.module, output, config=config, tokenizer=tokenizer, stage=stage, stages=stages,
                      data_rank=dp_rank, global_rank=rank, barrier=dist.barrier)
        if rank == 0:
            print(f"saved the final model in HF format to {output}", flush=True)


def write_stage_summary(module, *, rank: int, world: int, stage: int, dp_rank: int, losses: dict[int, float]) -> None:
    """Test and debugging hook (toolkit.train.hf_runner's rank summary, for a pipeline): with
    TOOLKIT_RANK_SUMMARY_DIR set, every rank writes its stage, data-parallel rank, node, the loss of each step
    (the pipeline engine hands every rank the step's loss) and a checksum of the parameters its stage holds, so
    that the replicas of a stage can be compared."""
    import os

    from toolkit.train.hf_runner import launcher_node_rank, local_param_abs_sum, write_rank_summary

    folder = os.environ.get("TOOLKIT_RANK_SUMMARY_DIR")
    if not folder:
        return
    write_rank_summary(folder, rank, {
        "rank": rank, "world": world, "node": launcher_node_rank(), "stage": stage, "data_rank": dp_rank,
        "log_history": [{"step": step, "loss": loss} for step, loss in sorted(losses.items())],
        "local_param_abs_sum": local_param_abs_sum(module)})


class BatchOrder:
    """Which training blocks step N uses: epoch e is a permutation seeded by (seed, e); each step takes the next
    global_batch blocks of it (an epoch's remainder is dropped, so every step has the same token count)."""

    def __init__(self, num_blocks: int, global_batch: int, *, seed: int):
        if num_blocks < global_batch:
            raise UserError(f"the data packs into {num_blocks} blocks, fewer than one global batch of "
                            f"{global_batch}; give more data or plan a smaller batch")
        self.num_blocks, self.global_batch, self.seed = num_blocks, global_batch, seed
        self.steps_per_epoch = num_blocks // global_batch
        self._epoch, self._perm = -1, None

    def step_indices(self, step: int) -> list[int]:
        epoch, within = divmod(step, self.steps_per_epoch)
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            self._epoch, self._perm = epoch, torch.randperm(self.num_blocks, generator=generator).tolist()
        return self._perm[within * self.global_batch:(within + 1) * self.global_batch]


def micro_batches(dataset, indices: list[int], dp_rank: int, dp: int, micro: int,
                  accum: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Data-parallel replica `dp_rank` takes the contiguous share [dp_rank*micro*accum, ...) of the step's blocks,
    as `accum` micro-batches of (input_ids, labels): the first stage reads the inputs, the last the labels."""
    share = micro * accum
    mine = indices[dp_rank * share:(dp_rank + 1) * share]
    for m in range(accum):
        rows = dataset[mine[m * micro:(m + 1) * micro]]
        yield torch.tensor(rows["input_ids"]), torch.tensor(rows["labels"])


def adamw(module, *, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """torch AdamW over this stage's parameters; biases and norm weights (every parameter of fewer than two
    dimensions in these models) are exempt from weight decay, as in the HF Trainer."""
    params = [p for p in module.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=lr)


def evaluate(engine, eval_ds, plan, dp_rank: int, rank: int, step: int, log) -> None:
    """Mean loss over the held-out blocks that fill whole global batches (the engine evaluates whole batches)."""
    n_batches = len(eval_ds) // plan.global_batch
    if n_batches == 0:
        if rank == 0:
            print(f"eval skipped: {len(eval_ds)} held-out blocks are fewer than one global batch "
                  f"({plan.global_batch})", flush=True)
        return
    total = 0.0
    for b in range(n_batches):
        indices = list(range(b * plan.global_batch, (b + 1) * plan.global_batch))
        batches = micro_batches(eval_ds, indices, dp_rank, plan.data_parallel, plan.micro_batch, plan.grad_accum)
        total += engine.eval_batch(batches).item()
    loss = total / n_batches
    if rank == 0:
        log.write({"step": step, "eval_loss": loss, "eval_perplexity": math.exp(min(loss, 50.0))})


def save_checkpoint(engine, output: Path, step: int, rank: int, keep: int | None) -> None:
    """DeepSpeed checkpoint (per-layer weights, optimizer, lr scheduler) in output/checkpoint-N, marked complete
    by rank 0 once every rank has written its part."""
    import torch.distributed as dist

    tag = f"checkpoint-{step}"
    engine.save_checkpoint(str(output), tag=tag)
    torch.save(rng_state(), output / tag / f"rng_state_rank{rank:05d}.pt")
    dist.barrier()
    if rank == 0:
        checkpoints.mark_complete(output / tag)
        checkpoints.rotate(output, keep)
    dist.barrier()


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def load_rng_state(checkpoint: Path, rank: int) -> None:
    """Each rank's random state as saved (dropout masks continue as in an uninterrupted run)."""
    path = checkpoint / f"rng_state_rank{rank:05d}.pt"
    if path.is_file():
        state = torch.load(path, weights_only=True)
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])


class RunLog:
    """Rank 0's log: a JSON line per record on stdout and in OUTPUT/pipeline_log.jsonl, and TensorBoard scalars
    in log_dir (default OUTPUT/runs) when tensorboard is installed."""

    def __init__(self, output: Path, log_dir: str | None):
        output.mkdir(parents=True, exist_ok=True)
        self.file = (output / LOG_FILE).open("a")
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.board = SummaryWriter(log_dir or str(output / "runs"))
        except ImportError:
            self.board = None

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps(record)
        print(line, flush=True)
        self.file.write(line + "\n")
        self.file.flush()
        if self.board is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.board.add_scalar(f"{'eval' if key.startswith('eval') else 'train'}/{key}", value,
                                          record["step"])

    def close(self) -> None:
        self.file.close()
        if self.board is not None:
            self.board.close()


def read_ds_config(plan, args) -> dict[str, Any]:
    """DIR/ds_config.json beside plan.json, checked against the plan and the flags; --max-grad-norm fills
    gradient_clipping when the JSON leaves it out, and must agree with it otherwise."""
    plan_path = Path(args.plan)
    path = (plan_path if plan_path.is_dir() else plan_path.parent) / DS_CONFIG
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{path} does not exist; a pipeline plan needs the DeepSpeed JSON that `toolkit emit` "
                        "writes beside plan.json") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno}); re-emit it") from None
    autos = [k for k, v in _flatten(config) if v == "auto"]
    if autos:
        raise UserError(f"{path} has \"auto\" values ({', '.join(autos)}); the pipeline runner fills none: "
                        "re-emit it for a pipeline plan")
    from toolkit.emit.deepspeed import plan_disagreements

    disagree = plan_disagreements(config, plan, max_grad_norm=args.max_grad_norm)
    expected = {"train_micro_batch_size_per_gpu": plan.micro_batch,
                "gradient_accumulation_steps": plan.grad_accum, "train_batch_size": plan.global_batch}
    for key in expected:
        if key in disagree:
            raise UserError(f"{path} sets {key} {config[key]} but the plan says {expected[key]}; re-emit it")
    config.update(expected)
    stage = config.get("zero_optimization", {}).get("stage", 0)
    if stage > 1:
        raise UserError(f"{path} asks for ZeRO stage {stage}; DeepSpeed's pipeline engine runs ZeRO 0 or 1 only")
    bf16 = config.get("bf16", {}).get("enabled", False)
    if bf16 and stage == 0 and config.get("data_types", {}).get("grad_accum_dtype") == "fp32":
        # DeepSpeed 0.19: NotImplementedError "unsupported mix of model_dtype=bfloat16 and grad_accum_dtype=float32".
        raise UserError(f"{path}: bf16 with fp32 gradient accumulation needs ZeRO stage 1 under the pipeline "
                        "engine (its BF16 optimizer), also with data_parallel 1; set zero_optimization.stage to 1")
    fp16 = config.get("fp16", {}).get("enabled", False)
    want = plan.precision
    if "precision" in disagree:
        raise UserError(f"{path} precision (bf16 {bf16}, fp16 {fp16}) does not match the plan's {want}; re-emit it")
    clipping = config.setdefault("gradient_clipping", args.max_grad_norm)
    if "gradient_clipping" in disagree:
        raise UserError(f"{path} sets gradient_clipping {clipping} but --max-grad-norm is {args.max_grad_norm}; "
                        "make them agree (as the HF Trainer path requires)")
    config.setdefault("steps_per_print", 10**9)
    return config


def _flatten(d: dict, prefix: str = ""):
    for key, value in d.items():
        if isinstance(value, dict):
            yield from _flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def weights_folder(name: str, *, random_init: bool) -> tuple[str, str | None]:
    """(folder or hub id for the tokenizer, folder holding the safetensors or None for random init) of a model
    that toolkit.train.model.model_source named."""
    path = Path(name).expanduser()
    if path.is_file() and path.name == "config.json":
        if not random_init:
            raise UserError(f"{name} is a config file without weights; pass --random-init or a model folder")
        return str(path.parent), None
    if path.is_dir():
        return str(path), None if random_init else str(path)
    if random_init:
        return name, None
    try:
        from huggingface_hub import snapshot_download

        local = snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt",
                                                         "*.tiktoken"])
    except Exception as exc:
        raise UserError(f"model {name} is not a local folder and could not be fetched from the hub: "
                        f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
    return local, local
