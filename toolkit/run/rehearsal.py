"""Small plans of the same strategy: what `toolkit launch --rehearse` runs on 2 (or 4) CPU processes.

A rehearsal keeps everything about how a step runs (strategy, engine, ZeRO stage, offload, FSDP mode, precision,
activation checkpointing, accumulation, pipeline stages) and shrinks everything about size (layers, width,
sequence, batch, processes), so that a few steps take seconds on gloo and fail the way the real run would fail.
"""

from __future__ import annotations

import os
import shlex
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from toolkit.run import rehearsal_images, tiny
from toolkit.errors import UserError
from toolkit.inputs.grid import ParallelGrid
from toolkit.run.launcher import (LOG_NAME, emit_plan_files, free_port, is_user_script, launch_command,
                                  processes_phrase, run, run_nodes, script_log)
from toolkit.run.preflight import preflight
from toolkit.plan.schema import Plan
from toolkit.inputs.strategy import Engine, parse_strategy
from toolkit.plan.files import DS_CONFIG

if TYPE_CHECKING:
    from toolkit.inputs.grpo import Grpo

REHEARSAL_SEQ_LEN = 64
REHEARSAL_LAYERS = 4
"""4 layers: enough for two pipeline stages of two layers each, and for more than one FSDP / ZeRO-3 unit."""


def plan_for_model(model_dir: str | Path, strategy: str, *, num_machines: int = 1, gpus_per_node: int = 2,
                   micro_batch: int = 2, grad_accum: int = 1, seq_len: int = REHEARSAL_SEQ_LEN,
                   precision: str = "fp32", checkpointing: bool = False, attention: str | None = None,
                   optimizer: str = "adamw", pipeline_stages: int = 1, gpu: str = "cpu",
                   notes: list[str] | None = None, tensor: int = 1, context: int = 1, sequence: int = 1,
                   expert: int = 1, vision_tower: str = "train", images: bool = False) -> Plan:
    """A plan for a local model folder (config.json) with the given strategy; no memory prediction. `images`: the
    model as an image-and-text job loads it (toolkit.inputs.modelspec.build_spec), its image fields still to set."""
    from toolkit.inputs.job import Job
    from toolkit.inputs.modelspec import build_spec
    from toolkit.plan.build import build_plan
    from toolkit.train.model import load_config

    config = load_config(str(model_dir))
    spec = build_spec(str(model_dir), config, images=images)
    attention = spec.effective_attention(attention)  # None: transformers' pick (GPT-OSS has no sdpa: eager)
    kind = parse_strategy(strategy)
    grid = ParallelGrid.for_strategy(kind, nodes=num_machines, gpus_per_node=gpus_per_node,
                                     pipeline_stages=pipeline_stages if kind.is_pipeline else None,
                                     tensor=tensor, context=context, sequence=sequence, expert=expert)
    grid.check_model(spec)
    grid.check_sequence(seq_len, attention, spec)
    job = Job(seq_len=seq_len, micro_batch=micro_batch, grad_accum=grad_accum, precision=precision,
              optimizer=optimizer, checkpointing=checkpointing, attention=attention, vision_tower=vision_tower)
    return build_plan(
        model=str(model_dir), model_config=_plain(config.to_dict()), model_type=spec.model_type,
        layer_class=spec.layer_class, num_layers=spec.num_layers, params=spec.params, strategy=kind, grid=grid,
        job=job, gpu=gpu, partition=grid.partition(spec) if kind.is_pipeline else None, notes=list(notes or []),
        moe_block=spec.moe_block, **({"model_parts": spec.parts()} if spec.multimodal else {}),
    )


def rehearsal_world(plan: Plan, nodes: int = 1, processes: int | None = None) -> int:
    """How many processes rehearse the plan: 2, or 4 for FSDP2 x TP and for a pipeline with data parallelism, 8
    for HSDP (x tp); for a plan with data parallelism alone, `processes` when given. Refuses a `processes` or
    `nodes` that does not fit, before anything is made."""
    tensor = rehearsal_degrees(plan)[0]
    world = 2
    if tensor > 1:
        world = 4  # FSDP2 x TP: 2 x 2 (tensor parallelism alone leaves FSDP2 nothing to shard over)
    if plan.engine == Engine.PIPELINE:
        world = 4 if plan.strategy == "hybrid" or plan.data_parallel > 1 else 2
    if plan.strategy == "fsdp2-hybrid":
        # HSDP: 2 replicas across nodes of 2 shards each (x tp inside a node: 8 processes, since tensor
        # parallelism with 1 shard leaves FSDP2 nothing to shard over)
        world = 2 * 2 * tensor
    if processes is not None and processes != world:
        if world != 2 or plan.engine == Engine.PIPELINE or plan.grid.model_parallel > 1 \
                or plan.expert_parallel > 1:
            raise UserError(f"--processes {processes}: the rehearsal of this {_label(plan)} plan runs on its {world} "
                            "processes (each model-parallel degree at 2); drop --processes")
        world = processes  # data parallelism alone: any number of ranks runs the same code path
    if world % nodes:
        raise UserError(f"--nodes {nodes} does not divide the rehearsal's {world} processes (try 2)")
    return world


def rehearsal_degrees(plan: Plan) -> tuple[int, int, int, int]:
    """(tensor, context, sequence, pipeline stages) of the rehearsal's grid: each model-parallel degree the plan has,
    at 2 (the fewest processes that still split); 2 stages for a pipeline plan."""
    tensor, context, sequence = (min(d, 2) for d in (plan.tensor_parallel, plan.context_parallel,
                                                     plan.sequence_parallel))
    return tensor, context, sequence, 2 if plan.engine == Engine.PIPELINE else 1


def rehearsal_plan(plan: Plan, tiny_model_dir: str | Path, nodes: int = 1,
                   processes: int | None = None) -> tuple[Plan, list[str]]:
    """The plan's strategy on a tiny model of the same architecture, on 2 processes (4 for hybrid and HSDP; for a
    plan with data parallelism alone, `processes` when given), on `nodes` launcher invocations (machine ranks) that
    split the processes evenly.

    Returns the small plan and what was changed that the user should know about.
    """
    said: list[str] = []
    precision = plan.precision
    if precision == "fp16":
        precision = "bf16"
        said.append("fp16 cannot run on these CPUs (DeepSpeed refuses it, accelerate ignores it): "
                    "rehearsing as bf16; the fp16 loss-scaling config is validated, not run")
    attention = plan.attention
    if attention == "flash_attention_2":
        attention = None  # transformers' own pick for the model: sdpa, or eager where its class has none
        said.append("flash-attention kernels need a GPU: rehearsing with the model's default attention (sdpa, or "
                    "eager where the model has no sdpa)")
    tensor, context, sequence, stages = rehearsal_degrees(plan)
    world = rehearsal_world(plan, nodes, processes)
    if plan.liger:
        said.append("Liger's Triton kernels need a GPU: rehearsing without them (the memory savers change no "
                    "engine code path)")
    if problem := plan.grid.resume_problem():
        said.append(f"{problem}; the rehearsal checks that its checkpoints and final model are written, not a "
                    "resume")
    offloading = plan.activation_offloading and not plan.grpo
    if plan.activation_offloading and not offloading:
        said.append("activation offloading: toolkit.train runs TRL's for SFT and DPO plans (GRPOConfig has no such "
                    "field); the rehearsal runs without it")
    images = rehearsal_images.rehearses_images(plan)
    if plan.images_per_sample and not images:
        said.append(f"images: the rehearsal runs the plan's strategy on text alone ({plan.images_per_sample} x "
                    f"{plan.image_size} a sample not rehearsed: {rehearsal_images.images_problem(plan)}); run "
                    "toolkit.train on your image folder for a few steps to try the images")
    # Keep accumulation > 1 when the plan accumulates (it changes the engines' code paths), but small.
    grad_accum = min(plan.grad_accum, 2) if plan.engine != Engine.PIPELINE else max(2, min(plan.grad_accum, 4))
    micro_batch = min(plan.micro_batch, 2)
    grpo = _rehearsal_grpo(plan, micro_batch * world * grad_accum, said) if plan.grpo else None
    seq_len = grpo.seq_len if grpo else min(plan.seq_len, REHEARSAL_SEQ_LEN)
    if images:  # the conversations' text, with the tiny processor's tokens for each image
        n_images, seq_len = rehearsal_images.image_seq_len(plan, tiny_model_dir, REHEARSAL_SEQ_LEN)
    small = plan_for_model(
        tiny_model_dir, plan.strategy, num_machines=nodes, gpus_per_node=world // nodes, micro_batch=micro_batch,
        grad_accum=grad_accum, seq_len=seq_len, precision=precision, images=images,
        checkpointing=plan.checkpointing, attention=attention, optimizer=plan.optimizer, pipeline_stages=stages,
        tensor=tensor, context=context, sequence=sequence,
        expert=min(plan.expert_parallel, 2),  # ep 2 x fsdp 2: each rank holds half of the tiny model's 4 experts
        notes=[f"rehearsal of {plan.model} ({plan.strategy}, {plan.world_size} GPUs)", *said])
    if images:
        small, line = rehearsal_images.with_images(small, plan, tiny_model_dir, n_images)
        said.append(line)
        small = small.replace(notes=[*small.notes, line])
    if plan.method != "full":
        # The plan's LoRA / QLoRA adapter on the tiny model of the same architecture (same module names).
        small = small.replace(method=plan.method, adapter=dict(plan.adapter))
    if plan.compile:
        # Compiled on CPU too (inductor's C++ backend): every rank compiles first, minutes on a small machine.
        said.append("torch.compile: the rehearsal compiles with inductor's CPU (C++) backend; the first step waits "
                    "for the compiler")
        small = small.replace(compile=True, notes=[*small.notes, said[-1]])
    small = small.replace(tiled=plan.tiled)  # ALST tiling runs on CPU over gloo: rehearsed as planned
    small = small.replace(loss=plan.loss)  # TRL's fused head runs on CPU (its torch folds): rehearsed as planned
    # TRL's offloading context runs on CPU (toolkit.patches.actoffload): rehearsed as planned
    small = small.replace(activation_offloading=offloading)
    if plan.dpo:  # toolkit.train and a user's TRL DPO script rehearse with the plan's DPOConfig settings
        small = small.replace(dpo=dict(plan.dpo))
    if grpo:  # likewise a user's TRL GRPO script, with the plan's GRPOConfig settings at the rehearsal's size
        small = small.replace(grpo=grpo.to_dict())
    return small, said


REHEARSAL_COMPLETION = 16
"""Tokens a GRPO rehearsal generates per completion (at most): generation on CPU decodes one token at a time."""


def _rehearsal_grpo(plan: Plan, generation_batch: int, said: list[str]) -> "Grpo":
    """The plan's GRPO settings for the rehearsal's batch: generation in the training process (vLLM needs a GPU),
    completions of at most REHEARSAL_COMPLETION tokens after prompts of up to the rest of REHEARSAL_SEQ_LEN (the
    rehearsal's own prompts, up to 36 tokens with the tiny tokenizers, whatever the plan's prompt length), and
    the most generations per prompt, up to the plan's, whose groups fill the small generation batch (GRPOConfig
    refuses partial groups); no reward model (the real one would not fit the rehearsal). Says what changed in
    `said`."""
    from dataclasses import replace

    grpo = plan.grpo_spec
    in_process, line = grpo.generating_in_process()
    completion = min(grpo.max_completion_length, REHEARSAL_COMPLETION)
    groups = [n for n in range(2, min(grpo.num_generations, generation_batch) + 1) if generation_batch % n == 0]
    small = replace(in_process, max_completion_length=completion, max_prompt_length=REHEARSAL_SEQ_LEN - completion,
                    num_generations=groups[-1] if groups else 2, reward_model=None)
    if grpo.reward_model:
        said.append(f"the reward model {grpo.reward_model} is the real run's size: the GRPO rehearsal scores with the "
                    "run's --reward functions or the built-in length reward instead")
    if line:
        said.append(line)
    if small.num_generations != grpo.num_generations:
        said.append(f"GRPO rehearses {small.num_generations} generations per prompt (the plan: "
                    f"{grpo.num_generations}), so that whole groups fill the rehearsal's generation batch of "
                    f"{generation_batch}")
    return small


def _plain(config: dict[str, Any]) -> dict[str, Any]:
    """config.to_dict() made JSON-safe (dtype objects and the like become strings)."""
    import json

    return json.loads(json.dumps(config, default=str))


# Training arguments that say how a step runs: a rehearsal keeps them (a --max-grad-norm that disagrees with the
# DeepSpeed JSON fails here as it would on the GPUs; a GRPO run's --reward functions score the rehearsal's
# completions). Everything else (model, data, length) is the rehearsal's own.
KEPT_FLAGS = ("--lr", "--lr-scheduler", "--warmup-steps", "--weight-decay", "--max-grad-norm", "--seed", "--reward")
REHEARSAL_STEPS = 4


def rehearsal_problem(plan: Plan) -> str | None:
    """Why `plan` cannot be rehearsed on CPU processes, or None (plan's "run it" line says it when the plan is
    written; rehearse refuses with it). Everything else a plan can hold is rehearsed as it is or with a note
    (rehearsal_plan): fp16 as bf16, flash attention as the model's default, Liger without its kernels."""
    if plan.context_parallel > 1:
        from toolkit.train.dimensions import CP_NEEDS_CUDA

        return CP_NEEDS_CUDA
    return None


def rehearse(plan: Plan, plan_dir: Path, train_argv: list[str], *, dry_run: bool = False, nodes: int = 1,
             processes: int | None = None) -> int:
    """Run the plan's strategy for a few steps on CPU processes; print what failed, or that it passed. nodes > 1:
    as many launcher invocations (machine ranks 0..nodes-1) over loopback, training one model together, as the
    nodes of a real multi-node run do. processes: that many instead of 2, for a plan with data parallelism alone
    (rehearsal_plan)."""
    if problem := rehearsal_problem(plan):
        raise UserError(f"cannot rehearse on CPU: {problem}")
    rehearsal_world(plan, nodes, processes)  # a --processes / --nodes that does not fit, before anything is made

    if is_user_script(train_argv):
        return _rehearse_script(plan, plan_dir, train_argv, dry_run=dry_run, processes=processes)
    if train_argv:  # the real run's arguments, when given, are checked as the real launch would
        preflight(plan, plan_dir, train_argv, here=False)
    else:
        try:
            reward = ["--reward", "length"] if plan.grpo else []  # the model is what this checks, not rewards
            preflight(plan, plan_dir, ["--data", ".", "--output", ".", *reward], here=False)
        except UserError as exc:
            print(f"note: the real model was not checked against the plan: {exc} (give toolkit.train's arguments "
                  "after --: toolkit launch DIR --rehearse -- --model M --data D --output OUT)", flush=True)
    if plan.strategy == "fsdp2-hybrid" and nodes == 1:
        nodes = 2  # HSDP replicates across nodes: one node would be plain FSDP2 (the grid refuses it)
        print("note: HSDP shards inside a node and replicates across nodes: rehearsing it as 2 nodes on this "
              "machine (--nodes 2)", flush=True)
    work = Path(tempfile.mkdtemp(prefix="toolkit-rehearsal-"))
    code = None
    try:  # the temporary folder goes on every way out: success, failure, refusal, Ctrl-C
        code = _rehearse_in(plan, plan_dir, train_argv, work, dry_run=dry_run, nodes=nodes, processes=processes)
        return code
    finally:
        _remove_keeping_logs(work, keep=bool(code))


def _remove_keeping_logs(work: Path, *, keep: bool) -> None:
    """The rehearsal's temporary folder goes; after a failed run its launcher logs stay where the failure line
    pointed (work/out/*.log), the rest (tiny model, data, checkpoints) goes."""
    logs = sorted((work / "out").glob("*.log")) if keep and (work / "out").is_dir() else []
    if not logs:
        shutil.rmtree(work, ignore_errors=True)
        return
    for entry in work.iterdir():
        if entry.name != "out":
            shutil.rmtree(entry, ignore_errors=True)
    for entry in (work / "out").iterdir():
        if entry not in logs:
            shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)
    print(f"the rehearsal's log{'s are' if len(logs) > 1 else ' is'} kept: {', '.join(map(str, logs))}", flush=True)


def small_setup(plan: Plan, work: Path, *, chat: bool = False, nodes: int = 1,
                processes: int | None = None) -> tuple[Path, Plan, list[str], Path, Path]:
    """In `work`: the tiny model, the small plan and its emitted folder, and the tiny data of the plan's method
    (rehearsal_data; chat: for a user's script). Returns (model folder, small plan, what changed, plan folder, data
    folder)."""
    model_dir = make_rehearsal_model(plan, work / "model")
    small, said = rehearsal_plan(plan, model_dir, nodes, processes)
    small_dir = emit_plan_files(small, work / "plan")
    return model_dir, small, said, small_dir, rehearsal_data(small, work / "data", chat=chat)


def rehearsal_data(small: Plan, folder: Path, *, chat: bool = False) -> Path:
    """The rehearsal's data, made locally, in the shape the plan's method trains on: preference pairs for DPO and
    prompts for GRPO (TRL's standard formats: train.jsonl / validation.jsonl rows with prompt / chosen / rejected, or
    prompt alone, as load_dataset("json") and TRL's trainers read them), else the text corpus (train.txt /
    validation.txt) with, for a user's script (chat), its conversations beside it as train.jsonl (toolkit.train
    reads one kind of file per folder). Returns the folder."""
    if small.images_per_sample:  # TRL's VLM format, which toolkit.train and a user's TRL VLM SFT script read
        return tiny.write_image_corpus(folder, rows=rehearsal_images.REHEARSAL_IMAGE_ROWS,
                                       most_images=small.images_per_sample)
    if small.dpo:
        return tiny.write_preference_corpus(folder, max_chars=60_000)
    if small.grpo:
        return tiny.write_prompt_corpus(folder, max_chars=60_000)
    data = tiny.write_corpus(folder, max_chars=60_000)
    if chat:
        tiny.write_chat_corpus(data, max_chars=60_000)
    return data


def _rehearse_in(plan: Plan, plan_dir: Path, train_argv: list[str], work: Path, *, dry_run: bool,
                 nodes: int = 1, processes: int | None = None) -> int:
    model_dir, small, said, small_dir, data = small_setup(plan, work, nodes=nodes, processes=processes)
    argv = rehearsal_argv(data, work / "out", train_argv)
    if small.grpo and not any(a.split("=", 1)[0] == "--reward" for a in argv):
        argv += ["--reward", "length"]
        said.append("no --reward given: the GRPO rehearsal scores completions with the built-in length reward (give "
                    "the run's own after --: --reward MODULE:FUNCTION)")
    port = free_port()
    commands = [launch_command(small_dir, argv, machine_rank=r, main_host="127.0.0.1", main_port=port)
                for r in range(nodes)] if nodes > 1 else [launch_command(small_dir, argv)]
    where = f" ({nodes} launcher invocations, machine ranks 0-{nodes - 1}, over loopback)" if nodes > 1 else ""
    print(f"rehearsal of {_label(small)} ({plan.precision}) on {processes_phrase(small.world_size, cpu=True)}{where}: "
          f"{small.model_type} {small.num_layers} layers, hidden {_hidden(small)}, seq {small.seq_len}, "
          f"micro {small.micro_batch} x accum {small.grad_accum}, {REHEARSAL_STEPS} steps", flush=True)
    for line in said:
        print(f"note: {line}", flush=True)
    problems = _validate_real_configs(plan, plan_dir)
    for command in commands:
        print("$ " + shlex.join(command), flush=True)
    if dry_run:
        return 0
    env = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    # Where the ranks report what they trained: the caller's folder when it names one (kept after the run).
    summaries = Path(os.environ.get("TOOLKIT_RANK_SUMMARY_DIR") or work / "ranks")
    if nodes > 1 or small.activation_offloading or small.images_per_sample:
        env["TOOLKIT_RANK_SUMMARY_DIR"] = str(summaries)
    if nodes > 1:
        code = run_nodes(commands, env=env, output=work / "out")
        if code == 0:
            problems += _check_replicas(summaries, small)
    else:
        code = run(commands[0], env=env, output=work / "out")
    seen = ""  # what the passed line adds: TRL's offloading, the images
    if code == 0 and small.activation_offloading:
        seen, problem = _offloaded(summaries, small)
        problems += problem
    if code == 0:
        problems += _check_saved_model(work / "out", small)
    if code == 0 and small.images_per_sample:
        words, problem = rehearsal_images.check_images(summaries, small, model_dir, work / "out")
        seen, problems = seen + words, problems + problem
    if code != 0 or problems:
        for problem in problems:
            print(f"rehearsal problem: {problem}", flush=True)
        log = work / "out" / LOG_NAME
        tail = log.read_text(errors="replace").splitlines()[-15:] if log.is_file() else []
        for line in tail:  # the log itself stays (rehearse keeps a failed run's logs)
            print(f"  log: {line}", flush=True)
        print(f"rehearsal FAILED (exit code {code}); fix this before spending GPU time", flush=True)
        return code or 1
    print(f"rehearsal passed: {_label(small)} trained {REHEARSAL_STEPS} steps{seen}, checkpointed, saved and "
          "reloaded", flush=True)
    return 0


def _offloaded(folder: Path, small: Plan) -> tuple[str, list[str]]:
    """(words for the passed line, problems): every rank's last micro-step under TRL's activation offloading moved
    saved tensors to the host, as toolkit.train's rank summaries report them (toolkit.patches.actoffload)."""
    from toolkit.train.hf_runner import read_rank_summaries

    moved = [s.get("activation_offloaded", {}) for s in read_rank_summaries(folder)]
    if len(moved) != small.world_size or not all(m.get("bytes") for m in moved):
        return "", [f"the plan offloads activations, but {sum(1 for m in moved if m.get('bytes'))} of "
                    f"{small.world_size} ranks report TRL's offloading moving any bytes"]
    return (f" with TRL's activation offloading ({moved[0]['tensors']} tensors, {moved[0]['bytes']:,} bytes to "
            "host a micro-step on rank 0)"), []


def rehearsal_argv(data: Path, output: Path, train_argv: list[str]) -> list[str]:
    """toolkit.train's arguments in a rehearsal: the tiny model's random weights, a few steps, a checkpoint on the
    way, and the flags of the real run that say how a step runs (KEPT_FLAGS)."""
    return ["--data", str(data), "--output", str(output), "--random-init", "--max-steps", str(REHEARSAL_STEPS),
            "--save-steps", "2", "--logging-steps", "1", "--max-eval-blocks", "8", *_kept(train_argv)]


def _check_replicas(folder: Path, small: Plan) -> list[str]:
    """After a multi-node rehearsal: every rank's forward of the same probe gives the same logits (the model all
    nodes trained is one model), and ranks that hold the same shard on different nodes (HSDP's replicas) hold the
    same parameters, as toolkit.train's rank summaries report them. Pipeline: the data-parallel replicas of each
    stage hold the same parameters."""
    from toolkit.train.hf_runner import read_rank_summaries

    summaries = read_rank_summaries(folder)
    if len(summaries) != small.world_size:
        return [f"{len(summaries)} of {small.world_size} ranks reported after training"]
    problems = []
    if small.engine == Engine.PIPELINE:  # each stage holds its own layers; its data-parallel replicas hold the same
        stages: dict[int, set[float]] = {}
        for summary in summaries:
            stages.setdefault(summary["stage"], set()).add(summary["local_param_abs_sum"])
        return [f"the data-parallel replicas of pipeline stage {stage} differ after training: {sorted(sums)}"
                for stage, sums in sorted(stages.items()) if len(sums) != 1]
    if any(s["probe_logits"] != summaries[0]["probe_logits"] for s in summaries):
        problems.append("the ranks' models give different logits after training: the nodes did not train one model")
    if small.strategy == "fsdp2-hybrid":
        per_node = small.gpus_per_node
        for local in range(per_node):
            sums = {s["local_param_abs_sum"] for s in summaries[local::per_node]}
            if len(sums) != 1:
                problems.append(f"HSDP replicas of shard {local} differ across nodes after training: {sorted(sums)}")
    return problems


REHEARSAL_MODEL_ENV = "TOOLKIT_REHEARSAL_MODEL"
REHEARSAL_DATA_ENV = "TOOLKIT_REHEARSAL_DATA"
"""A user's script rehearsed with `--rehearse -- SCRIPT ARGS` finds the tiny model (with its tokenizer) and a data
folder (train.txt / validation.txt, and train.jsonl / validation.jsonl chat rows; for an image plan, the processor
beside the model and image conversations in TRL's VLM format instead) here; '$TOOLKIT_REHEARSAL_MODEL'
and '$TOOLKIT_REHEARSAL_DATA' in ARGS (quoted, so the shell leaves them) are replaced by them
(toolkit.train.own_script)."""


def _rehearse_script(plan: Plan, plan_dir: Path, train_argv: list[str], *, dry_run: bool,
                     processes: int | None = None) -> int:
    """The user's own script on the rehearsal's small plan: 2 CPU processes, the plan's strategy, a tiny model of
    the same architecture. The script decides its own steps, model and data (see REHEARSAL_MODEL_ENV)."""
    if not Path(train_argv[0]).is_file():
        raise UserError(f"training script {train_argv[0]} does not exist")
    if plan.engine == Engine.PIPELINE:
        raise UserError("a pipeline plan runs DeepSpeed's pipeline engine, which only toolkit.train drives; "
                        "rehearse it without a script (toolkit launch DIR --rehearse)")
    work = Path(tempfile.mkdtemp(prefix="toolkit-rehearsal-"))
    try:
        model_dir, small, said, small_dir, data = small_setup(plan, work, chat=True, processes=processes)
        command = launch_command(small_dir, train_argv)
        handover = (rehearsal_images.script_handover(small, REHEARSAL_MODEL_ENV, REHEARSAL_DATA_ENV)
                    if small.images_per_sample else
                    f"a tiny {small.model_type} is in ${REHEARSAL_MODEL_ENV}, data in ${REHEARSAL_DATA_ENV}")
        print(f"rehearsal of your script with {plan.strategy} ({small.precision}) on "
              f"{processes_phrase(small.world_size, cpu=True)}: micro {small.micro_batch} x accum "
              f"{small.grad_accum}; {handover}", flush=True)
        for line in said:
            print(f"note: {line}", flush=True)
        print("$ " + shlex.join(command), flush=True)
        if dry_run:
            return 0
        env = {"TOOLKIT_PLAN_DIR": str(small_dir), REHEARSAL_MODEL_ENV: str(model_dir),
               REHEARSAL_DATA_ENV: str(data), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false", "CUDA_VISIBLE_DEVICES": ""}
        code = run(command, env=env, log_path=script_log(plan_dir))
        print(f"rehearsal {'passed' if code == 0 else f'FAILED (exit code {code})'}: your script with "
              f"{plan.strategy}", flush=True)
        return code
    finally:
        shutil.rmtree(work, ignore_errors=True)


def make_rehearsal_model(plan: Plan, out_dir: Path) -> Path:
    """A tiny model of the plan's own architecture (random weights) with a tokenizer trained on the local corpus:
    the plan's config shrunk by its own config class (toolkit.run.tiny.shrink_config), every non-size setting kept,
    to sizes that the rehearsal grid's degrees divide (toolkit.run.tiny.sizes_for_degrees); for an image plan whose
    images it rehearses, the whole image-text class with a tiny vision tower and its processor."""
    from toolkit.inputs.modelconfig import config_from_dict

    config = config_from_dict({**plan.model_config, "model_type": plan.model_type}, plan.model)
    tensor, _, sequence, stages = rehearsal_degrees(plan)
    sizes = tiny.sizes_for_degrees(config, tensor=tensor, sequence=sequence, stages=stages, layers=REHEARSAL_LAYERS)
    return tiny.make_tiny_model(config, out_dir, corpus_chars=100_000, images=rehearsal_images.rehearses_images(plan),
                                **sizes)


def _kept(train_argv: list[str]) -> list[str]:
    kept, i = [], 0
    while i < len(train_argv):
        flag = train_argv[i].split("=", 1)[0]
        takes_value = "=" not in train_argv[i] and i + 1 < len(train_argv)
        if flag in KEPT_FLAGS:
            kept += train_argv[i:i + 2] if takes_value else [train_argv[i]]
        i += 2 if takes_value and not train_argv[i + 1].startswith("--") else 1
    return kept


def _validate_real_configs(plan: Plan, plan_dir: Path) -> list[str]:
    """Checks on the real plan's files that the CPU run cannot make (fp16 is validated, not run)."""
    problems = []
    ds_file = plan_dir / DS_CONFIG
    if plan.engine in (Engine.DEEPSPEED, Engine.PIPELINE) and ds_file.is_file():
        import json

        from toolkit.engines.validate import validate_ds_config_for_plan

        config = json.loads(ds_file.read_text())
        try:
            validate_ds_config_for_plan(config, plan)  # at the plan's world size, "auto" resolved as the runner does
        except Exception as exc:  # any reason DeepSpeed refuses the real file is worth reporting
            problems.append(f"DeepSpeed refuses {ds_file}: {str(exc).strip().splitlines()[0]}")
        if plan.precision == "fp16" and not config.get("fp16", {}).get("enabled"):
            problems.append(f"plan is fp16 but {ds_file} does not enable fp16")
    return problems


def _check_saved_model(out: Path, small: Plan) -> list[str]:
    if small.method != "full":
        return _check_saved_adapter(out, small)
    try:
        from toolkit.inputs.modelconfig import load_pretrained

        model, info = load_pretrained(out, images=bool(small.images_per_sample), output_loading_info=True)
    except Exception as exc:
        return [f"the saved model does not load with from_pretrained: {str(exc).strip().splitlines()[0]}"]
    # from_pretrained initialises at random what the file lacks and still builds every parameter, so the count
    # below cannot see it (a file naming experts AutoEP's way, as the Trainer's own save of an AutoEP model does).
    if missing := sorted(info.get("missing_keys") or ()):
        return [f"the saved model lacks {len(missing)} of the model's weights (e.g. {missing[0]}), which "
                "from_pretrained initialises at random" + (f"; it holds {len(info['unexpected_keys'])} it does not "
                f"know (e.g. {sorted(info['unexpected_keys'])[0]})" if info.get("unexpected_keys") else "")]
    n = sum(p.numel() for p in model.parameters())
    if n != small.params:
        return [f"the saved model has {n} parameters, the model trained had {small.params}"]
    return []


def _check_saved_adapter(out: Path, small: Plan) -> list[str]:
    """A LoRA / QLoRA run saves the adapter (PEFT format): it must load onto the base it was trained on."""
    try:
        from peft import PeftModel

        from toolkit.inputs.modelconfig import load_pretrained

        PeftModel.from_pretrained(load_pretrained(small.model, images=bool(small.images_per_sample)), str(out))
    except Exception as exc:
        return [f"the saved adapter does not load with PeftModel.from_pretrained: "
                f"{str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}"]
    return []


def _label(plan: Plan) -> str:
    """The strategy, with its model-parallel degrees when it has any ("fsdp2 dp=2 x tp=2")."""
    if plan.grid.model_parallel > 1 or plan.grid.expert > 1:
        return f"{plan.strategy} {plan.grid.describe()}"
    return plan.strategy


def _hidden(plan: Plan):
    from toolkit.train.model import _HIDDEN_KEYS, config_value

    return config_value(plan.model_config, _HIDDEN_KEYS)

