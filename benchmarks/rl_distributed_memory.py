"""DPO and GRPO on 2 CPU processes: predicted vs measured per-rank memory of the training and generation phases
(issue 29).

    python benchmarks/rl_distributed_memory.py             # writes benchmarks/results/rl_distributed_memory.{md,json}
    python benchmarks/rl_distributed_memory.py dpo:zero3    # one row, printed only
    python benchmarks/rl_distributed_memory.py --md         # rewrite the .md from the stored .json
    python benchmarks/rl_distributed_memory.py --add grpo-long:zero3   # measure rows into the stored table (each
                                                                     # row keeps the date and commit it ran at)

Each row is a real `toolkit.train` run of a DPO or GRPO plan (toolkit.run.rehearsal.plan_for_model with the plan's
DPO / GRPO settings, emitted by toolkit.run.launcher.emit_plan_files and started by its `accelerate launch` command,
so DeepSpeed and FSDP2 run the configs the emitter writes) on a tiny Llama, 2 processes over gloo, fp32. On every rank
the measurement is benchmarks/distributed_memory.py's: torch's MemTracker active from before the model, the reference
and the engine are made, CPU storages only (distributed_memory._total). Measured: the live bytes just before the
measured step (persistent) and the peak of the training phase of that step: from the moment the step's inputs are
ready (for GRPO: after TRL's _prepare_inputs, i.e. after generation, reward and the reference's scoring) through
compute_loss, backward and the optimizer step. Predicted: toolkit.estimate.memory.estimate_memory for the plan's job
(toolkit.plan.job.plan_job; device kind cpu), its training-phase peak per rank; for GRPO with the prompt length the
run padded to (TRL pads prompts to the batch's longest, not to max_prompt_length).

GRPO's generation phase is measured on every GRPO row: the peak from the moment TRL's _generate_single_turn starts
(before unwrap_model_for_generation gathers ZeRO-3's parameters) to its return, in the measured step, against
Breakdown.generation_bytes (what toolkit.estimate.grpo.with_generation puts beside the bytes held between steps).
The `grpo-long` rows generate 8 completions a prompt of 256 tokens, 16 sequences a rank at once (micro-batch 4 x
steps_per_generation 4), so generate's own bytes (cache, eager attention's repeated keys and values, sampling)
outweigh the states it runs beside; their measured step is the first micro-step of the second optimizer step,
the one that generates.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from distributed_memory import _total  # noqa: E402  (the one measurement of per-rank live bytes)
from provenance import toolkit_commit  # noqa: E402

OUT = Path(__file__).parent / "results"
WORLD = 2
STEPS = 4
MEASURED = 3  # steps 1-2 make the optimizer states and warm the engines; step 3's training phase is measured
STRATEGIES = ("ddp", "zero2", "zero3", "fsdp2")
METHODS = ("dpo", "grpo", "grpo-long")
DPO_SEQ, DPO_MICRO = 64, 2
GRPO = {"num_generations": 2, "max_prompt_length": 16, "max_completion_length": 24, "beta": 0.1}
GRPO_MICRO = 4
# Generation-heavy GRPO: 16 sequences a rank generated at once, 256-token completions.
GRPO_LONG = {"num_generations": 8, "max_prompt_length": 16, "max_completion_length": 256, "beta": 0.1}
GRPO_LONG_MICRO, GRPO_LONG_ACCUM = 4, 4
MEASURED_CALL = {"dpo": MEASURED, "grpo": MEASURED, "grpo-long": GRPO_LONG_ACCUM + 1}
"""The training_step call measured: step 3 of the one-micro-step rows; the first micro-step of optimizer step 2 (the
one that generates, after step 1 made the optimizer states) of the grpo-long rows."""
MEASURED_CALL_ENV = "RL_MEASURED_CALL"
"""How launch_measured tells each rank's worker the call to measure (MEASURED when unset)."""
COMMON = ("--max-steps", str(STEPS), "--logging-steps", "100", "--save-steps", "100", "--lr", "1e-3",
          "--lr-scheduler", "constant", "--seed", "7", "--random-init", "--no-save-final")
METHOD_FLAGS = {"dpo": ("--eval-fraction", "0"),
                "grpo": ("--reward", "length", "--loss_type", "grpo", "--steps_per_generation", "1"),
                "grpo-long": ("--reward", "length", "--loss_type", "grpo", "--steps_per_generation",
                              str(GRPO_LONG_ACCUM), "--max-steps", "2")}


# ----------------------------------------------------------------------------------------------------------------
# Worker (one rank, under accelerate launch)


def _tracker():
    """distributed_memory's MemTracker, letting a root module forward more than once in one tracking (generate calls
    the policy once a token; DPO's reference and policy each forward once a step): MemTracker refuses a root's
    second forward, so that root's module stats are dropped first. The live-byte accounting, and its peak, are
    untouched (toolkit.estimate.livebytes.generation_peak_bytes clears the stats after each forward instead, which a
    backward through that forward would then miss)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class Tracker(MemTracker):
        def _pre_fw_hook(self, module, inputs):
            name = self._mod_tracker.get_known_fqn(module)
            if (module in self.memory_tracking and not self._mod_tracker.is_bw
                    and set(self._mod_tracker.parents) - {name} <= {"Global"}):
                del self.memory_tracking[module]
            super()._pre_fw_hook(module, inputs)

    return Tracker()


def worker(out_path: str, *train_argv: str) -> None:
    import torch
    import transformers

    from toolkit.train.__main__ import leave_out_unused, main

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    tracker = _tracker()
    result: dict = {"rank": rank}
    original = transformers.Trainer.training_step
    calls = [0]
    measured_call = int(os.environ.get(MEASURED_CALL_ENV, MEASURED))

    def reset_peak() -> None:
        tracker._peak_mem = {dev: snap["Total"] for dev, snap in tracker.get_tracker_snapshot("current").items()}

    def training_step(self, model, inputs, *args, **kwargs):
        calls[0] += 1
        if calls[0] == measured_call + 1:  # the measured step's optimizer step and zero_grad are done
            result["peak_bytes"] = _total(tracker, "peak")
        if calls[0] != measured_call:
            return original(self, model, inputs, *args, **kwargs)
        gc.collect()
        result["persistent_bytes"] = _total(tracker)
        prepare = self._prepare_inputs

        def prepared(batch):
            ready = prepare(batch)
            if "prompt_ids" in ready:
                result["prompt_tokens"] = int(ready["prompt_ids"].shape[1])
                result["completion_tokens"] = int(ready["completion_ids"].shape[1])
            result["inputs_ready_bytes"] = _total(tracker)
            reset_peak()  # the training phase starts here (GRPO: after generation and scoring)
            return ready

        def generated(*args, **kwargs):  # GRPO's generation phase: gather (ZeRO-3), generate, release
            result["generation_start_bytes"] = _total(tracker)
            reset_peak()
            try:
                return generate(*args, **kwargs)
            finally:
                result["generation_peak_bytes"] = max(result.get("generation_peak_bytes", 0), _total(tracker, "peak"))

        self._prepare_inputs = prepared
        generate = getattr(self, "_generate_single_turn", None)
        if generate is not None:
            self._generate_single_turn = generated
        try:
            return original(self, model, inputs, *args, **kwargs)
        finally:
            del self._prepare_inputs
            if generate is not None:
                del self._generate_single_turn

    transformers.Trainer.training_step = training_step
    leave_out_unused(list(train_argv))
    with tracker:
        code = main(list(train_argv))
    result["exit"] = code
    Path(f"{out_path}.rank{rank}.json").write_text(json.dumps(result))
    os._exit(0)  # REFERENCE: avoids ZeRO-3's occasional abort at exit (as distributed_memory.worker)


# ----------------------------------------------------------------------------------------------------------------
# Driver


def make_plan(model_dir: Path, method: str, strategy: str):
    from toolkit.inputs.grpo import Grpo
    from toolkit.inputs.preference import Dpo
    from toolkit.run.rehearsal import plan_for_model

    if method == "dpo":
        plan = plan_for_model(model_dir, strategy, gpus_per_node=WORLD, micro_batch=DPO_MICRO, seq_len=DPO_SEQ,
                              precision="fp32", attention="eager")
        return plan.replace(dpo=Dpo(reference="kept").to_dict())
    long = method == "grpo-long"
    grpo = Grpo(**(GRPO_LONG if long else GRPO))
    plan = plan_for_model(model_dir, strategy, gpus_per_node=WORLD, micro_batch=GRPO_LONG_MICRO if long else GRPO_MICRO,
                          grad_accum=GRPO_LONG_ACCUM if long else 1, seq_len=grpo.seq_len, precision="fp32",
                          attention="eager")
    return plan.replace(grpo=grpo.to_dict())


def predict(plan, prompt_tokens: int | None = None) -> dict:
    from toolkit.estimate.grpo import GENERATION_PHASE
    from toolkit.estimate.memory import estimate_memory
    from toolkit.plan.job import plan_job

    spec, hw, job = plan_job(plan, check=False)
    job = replace(job, device_kind="cpu")
    if job.grpo is not None and prompt_tokens is not None:
        grpo = replace(job.grpo, max_prompt_length=prompt_tokens)
        job = replace(job, grpo=grpo, seq_len=grpo.seq_len)
    b = estimate_memory(spec, plan.strategy_spec, job, hw)
    assert b.peak_phase != GENERATION_PHASE, "the training phase must be the step's peak to be compared"
    return {"peak_bytes": int(b.peak_bytes), "peak_phase": b.peak_phase, "generation_bytes": int(b.generation_bytes),
            "persistent_bytes": int(b.between_steps_bytes), "gathered_bytes": int(b.gathered_bytes),
            "terms": {t.name: int(t.bytes) for t in b.terms}}


def launch_measured(plan, base: Path, argv: list[str], world: int, script: str = __file__,
                    measured: int = MEASURED) -> tuple[list | None, dict]:
    """Launch the plan's toolkit.train as `accelerate launch` would, with `script`'s worker in place of the module
    (it measures each rank into `base`/mem.rank<r>.json, at training_step call `measured`): (the ranks' readings, or
    None when a rank left none, and the row's start: wall seconds, and the run's output tail where it failed)."""
    from toolkit.run.launcher import emit_plan_files, launch_command

    command = launch_command(emit_plan_files(plan, base / "plan"), argv)
    entry = command.index("-m")  # `accelerate launch ... -m toolkit.train --plan P ARGS`: the worker instead
    command = [*command[:entry], script, "--worker", str(base / "mem"), *command[entry + 2:]]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "TRANSFORMERS_VERBOSITY": "error",
           MEASURED_CALL_ENV: str(measured)}
    start = time.perf_counter()
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900, check=False)
    row: dict = {"wall_s": round(time.perf_counter() - start, 1)}
    ranks = [json.loads(p.read_text()) for r in range(world) if (p := Path(f"{base / 'mem'}.rank{r}.json")).exists()]
    if len(ranks) != world or any("peak_bytes" not in r for r in ranks):
        row["error"] = (proc.stdout + proc.stderr)[-3000:]
        return None, row
    return ranks, row


def with_ratios(row: dict) -> dict:
    """The row's measured peak and between-steps bytes (the busiest rank's) and predicted / measured for each."""
    row["measured_peak_bytes"] = max(r["peak_bytes"] for r in row["ranks"])
    row["measured_persistent_bytes"] = max(r["persistent_bytes"] for r in row["ranks"])
    row["peak_ratio"] = row["predicted"]["peak_bytes"] / row["measured_peak_bytes"]
    row["persistent_ratio"] = row["predicted"]["persistent_bytes"] / row["measured_persistent_bytes"]
    if "generation_bytes" in row["predicted"] and all("generation_peak_bytes" in r for r in row["ranks"]):
        row["measured_generation_bytes"] = max(r["generation_peak_bytes"] for r in row["ranks"])
        row["generation_ratio"] = row["predicted"]["generation_bytes"] / row["measured_generation_bytes"]
    return row


def run_one(model_dir: Path, data: dict, method: str, strategy: str, workdir: Path) -> dict:
    plan = make_plan(model_dir, method, strategy)
    argv = ["--output", str(workdir / f"{method}-{strategy}" / "out"), "--data", str(data[method]), *COMMON,
            *METHOD_FLAGS[method]]
    ranks, started = launch_measured(plan, workdir / f"{method}-{strategy}", argv, WORLD,
                                     measured=MEASURED_CALL[method])
    row = {"method": method, "strategy": strategy, **started}
    if ranks is None:
        return row
    row["ranks"] = ranks
    row["predicted"] = predict(plan, ranks[0].get("prompt_tokens"))
    return with_ratios(row)


def make_inputs(scratch: Path) -> tuple[Path, dict]:
    from toolkit.run import tiny

    # 512 positions (rotary: no parameters) hold the grpo-long rows' prompt + 256-token completions.
    model_dir = tiny.make_tiny_model("llama", scratch / "llama", layers=2, hidden=64, corpus_chars=100_000,
                                     max_positions=512)
    pairs = tiny.write_preference_corpus(scratch / "pairs", pairs=16) / "train.jsonl"
    prompts = scratch / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"The number {i} is"}) + "\n" for i in range(32)))
    return model_dir, {"dpo": pairs, "grpo": prompts, "grpo-long": prompts}


def main(argv: list[str]) -> int:
    if argv[:1] == ["--worker"]:
        worker(*argv[1:])
        return 0
    if argv[:1] == ["--md"]:  # rewrite the markdown from the stored json
        rows = json.loads((OUT / "rl_distributed_memory.json").read_text())
        (OUT / "rl_distributed_memory.md").write_text(markdown(rows))
        return 0
    add = argv[:1] == ["--add"]
    argv = argv[1:] if add else argv
    pairs = [tuple(a.split(":")) for a in argv] or [(m, s) for m in METHODS for s in STRATEGIES]
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        model_dir, data = make_inputs(Path(scratch))
        for method, strategy in pairs:
            row = run_one(model_dir, data, method, strategy, Path(scratch))
            rows.append(row)
            if "error" in row:
                print(f"{method} {strategy} FAILED ({row['wall_s']} s):\n{row['error']}", flush=True)
                continue
            generation = (f"  generation {row['predicted']['generation_bytes']:,} / "
                          f"{row['measured_generation_bytes']:,} = {row['generation_ratio']:.4f}"
                          if "generation_ratio" in row else "")
            print(f"{method} {strategy}: peak {row['predicted']['peak_bytes']:,} / {row['measured_peak_bytes']:,} "
                  f"= {row['peak_ratio']:.4f}  persistent {row['predicted']['persistent_bytes']:,} / "
                  f"{row['measured_persistent_bytes']:,} = {row['persistent_ratio']:.4f}{generation}  "
                  f"({row['predicted']['peak_phase']}; {row['wall_s']} s)", flush=True)
    if argv and not add:
        return 0
    stamp = f"{time.strftime('%Y-%m-%d')}, toolkit {toolkit_commit()}"
    for row in rows:
        row["measured_at"] = stamp
    if add:  # the stored rows stay, each with the date and commit it was measured at; these replace their namesakes
        stored = json.loads((OUT / "rl_distributed_memory.json").read_text())
        fresh = {(r["method"], r["strategy"]) for r in rows}
        rows = [r for r in stored if (r["method"], r["strategy"]) not in fresh] + rows
    (OUT / "rl_distributed_memory.json").write_text(json.dumps(rows, indent=1) + "\n")
    (OUT / "rl_distributed_memory.md").write_text(markdown(rows))
    return 0


def markdown(rows: list[dict]) -> str:
    ok = [r for r in rows if "error" not in r]
    lines = ["# DPO and GRPO on 2 CPU processes: predicted vs measured per-rank memory of the training and generation "
             "phases", "",
             "; ".join(f"{stamp} ({n} row{'s' if n > 1 else ''})" for stamp, n in
                       Counter(r.get("measured_at", "unknown") for r in rows).items())
             + ", `python benchmarks/rl_distributed_memory.py` (`--add METHOD:STRATEGY` measures rows into the table)",
             "",
             "Each row is a real `toolkit.train` run of a DPO or GRPO plan on 2 processes over gloo (the plan's own "
             "accelerate config and DeepSpeed JSON as the emitter writes them, `accelerate launch`), fp32, a tiny Llama "
             "(2 layers, hidden 64, 4 heads, 2 KV heads, vocabulary 512, untied head: P = 139,584 parameters, random "
             "weights, eager attention), 4 steps at a constant learning rate. DPO: TRL's DPOTrainer, the reference "
             f"kept (a second model, prepared by TRL for the engine), micro-batch {DPO_MICRO} pairs padded to "
             f"{DPO_SEQ} tokens (chosen and rejected concatenated in one forward). GRPO: TRL's GRPOTrainer, beta "
             f"{GRPO['beta']} (the reference kept), {GRPO['num_generations']} generations a prompt, micro-batch "
             f"{GRPO_MICRO} completions of {GRPO['max_completion_length']} tokens at most, generation in the process "
             "(transformers' generate; ZeRO-3 gathers the policy for it), a rule reward (completion length). "
             "Measured on every rank as benchmarks/distributed_memory.py measures (torch's MemTracker active from "
             "before the models and the engine exist, CPU storages only; the larger rank shown): *between steps*, "
             "the live bytes just before step 3; *training phase*, the peak of step 3 from the moment its inputs are "
             "ready (for GRPO after TRL's _prepare_inputs: generation, the reward and the reference's scoring) "
             "through compute_loss, backward and the optimizer step. Predicted: `estimate_memory` of the plan's job "
             "(toolkit.plan.job.plan_job, device kind cpu; GRPO at the prompt length the run padded to): its peak "
             "(the training phase's, named) and the bytes it holds between steps (Breakdown.between_steps_bytes, "
             "beside which GRPO generates). *Earlier rule*: between steps as toolkit counted it before this table "
             "(with ZeRO-3's / FSDP2's gathered parameters). Ratios are predicted / measured. The *grpo-long* rows "
             f"generate {GRPO_LONG['num_generations']} completions a prompt of {GRPO_LONG['max_completion_length']} "
             f"tokens, {GRPO_LONG_MICRO * GRPO_LONG_ACCUM} sequences a rank at once (micro-batch {GRPO_LONG_MICRO} x "
             f"steps_per_generation = accumulation {GRPO_LONG_ACCUM}), beta {GRPO_LONG['beta']}, 2 optimizer steps; "
             "their measured step is the first micro-step of the second optimizer step, the one that generates "
             "(the model above with 512 positions, rotary: no more parameters).", "",
             "| method | strategy | training phase: predicted | measured | ratio | phase | between steps: predicted "
             "| measured | ratio | earlier rule's ratio | wall |", "|" + "---|" * 11]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['method']} | {r['strategy']} | failed (see the json) |" + " |" * 8)
            continue
        p = r["predicted"]
        earlier = (p["persistent_bytes"] + p["gathered_bytes"]) / r["measured_persistent_bytes"]
        lines.append(f"| {r['method']} | {r['strategy']} | {p['peak_bytes']:,} B | {r['measured_peak_bytes']:,} B | "
                     f"{r['peak_ratio']:.4f} | {p['peak_phase']} | {p['persistent_bytes']:,} B | "
                     f"{r['measured_persistent_bytes']:,} B | {r['persistent_ratio']:.4f} | {earlier:.4f} | "
                     f"{r['wall_s']} s |")
    worst = max((abs(r["peak_ratio"] - 1) for r in ok), default=float("nan"))
    steady = [r for r in ok if r["method"] != "grpo-long"]  # grpo-long's measured step follows a generation batch
    worst_between = max((abs(r["persistent_ratio"] - 1) for r in steady), default=float("nan"))
    long_between = [r for r in ok if r["method"] == "grpo-long"]
    long_words = (f" on the one-micro-step rows; the grpo-long rows' ratios are {_listed_ratios(long_between)}, "
                  f"TRL's buffered generation batch (below) being {buffered_batch_bytes(long_between[0]):,} B of the "
                  f"{min(r['measured_persistent_bytes'] - r['predicted']['persistent_bytes'] for r in long_between):,}-"
                  f"{max(r['measured_persistent_bytes'] - r['predicted']['persistent_bytes'] for r in long_between):,} "
                  "B missing" if long_between else "")
    lines += ["", f"Training phase: worst |ratio - 1| {worst:.2%} over {len(ok)} of {len(rows)} runs (goal 5%). "
              "The phase's peak is the backward of TRL's chunked log-prob head in both trainers (one tile of "
              "min(rows, 4,096) x 32,768 columns on a device without Triton, benchmarks/results/grpo_memory.md), "
              "beside the states each engine keeps and the reference's weights: the reference is a whole replica "
              "under DDP and ZeRO-2, and partitioned like the policy under ZeRO-3 and FSDP2 (TRL's prepare_deepspeed "
              "/ prepare_fsdp), as the estimate places it (toolkit.estimate.preference.reference_of). DPO's chosen "
              "and rejected sequences go through the policy in one forward of 2 x micro-batch rows, as traced.", "",
              f"Between steps: worst |ratio - 1| {worst_between:.2%}{long_words}. Before this table the estimate held ZeRO-3's "
              "and FSDP2's gathered parameters between steps too (States.persistent includes them: 32-36% over "
              "here, the earlier rule's column); the runs show none alive before the step (ZeRO-3 partitions every "
              "parameter again at the end of backward, FSDP2 reshards the root in its post-backward), so "
              "Breakdown.between_steps_bytes leaves them out (toolkit/estimate/memory.py). What it moves: GRPO's "
              "generation phase and the reward model's scoring phase, both counted beside between_steps_bytes. "
              "ZeRO-3's generation adds the whole policy gathered (ds3_gather_for_generation) once, where it counted "
              "the reuse-kept parameters a second time before; FSDP2's generation adds its step's gathered "
              "parameters (the root kept unsharded after forward and the layer it unshards), as before. What is "
              "left: GRPO's between steps, TRL's buffered generation batch (below); DPO's, up to 1.1% under (12-15 KB "
              "a rank), and GRPO's ZeRO-3 training phase 1.3% over (about 2 B a parameter), not attributed.", "",
              "Published rows (issue 29, like for like: TRL 1.11 or later, whose GRPO and DPO score through the "
              "chunked head toolkit traces, with model, GPUs, lengths, generations and a memory figure): none found "
              "on 2026-12-04, nor on 2026-12-05 (pages, issues and docs searched again: TRL's vLLM colocate and "
              "Liger GRPO blog posts, Unsloth's GRPO pages, OpenRLHF, verl and ms-swift docs and issues, TRL issues "
              "quoting nvidia-smi). The older-TRL rows found are in benchmarks/data/published_gpu.json, listed and "
              "scored beside the reading in benchmarks/results/published.md with what their sources leave unstated "
              "(TRL issue #3456's Qwen3-0.6B and Qwen3-1.7B nvidia-smi readings are rows there since 2026-12-05). "
              "Read and not like for like: "
              "TRL pull request #5349 (the chunked LM head for AsyncGRPOTrainer: 18.55 GB peak allocated without it, "
              "0.42 GB with 4,096-row chunks) measures the head alone, not a training step, and states no model or "
              "lengths for it; TRL issue #3456 (Qwen3-0.6B / 1.7B GRPO at 49,273 / 81,920 and 78,147 MiB, batch 4, "
              "2,048 + 1,024 tokens) ran a TRL of mid-2025 (whole logits) and leaves GPUs, engine and generations "
              "unstated; TRL issue #3678 (Qwen3-0.6B out of memory on 20 GB, TRL 0.14-0.19) and #3168 (DPO "
              "Qwen2.5-0.5B out of memory on an A100 80GB) give no peak; TRL issue #5200 (DPO Qwen2.5-0.5B, 17 GB) "
              "ran TRL 0.12 with QLoRA and flash attention, batch unstated; TRL's reducing_memory_usage guide gives no "
              "numbers; Unsloth's GRPO table (Llama 3.1 8B at 20K tokens, 'TRL + FA2' 510.8 GB) is arithmetic, not a "
              "run; the oxen.ai GRPO VRAM post ran TRL of early 2025; TRL's vLLM colocate blog publishes throughput "
              "only.", "",
              "Not measured here: the reference's and the policy's no_grad scoring forwards of GRPO as phases of "
              "their own (inside _prepare_inputs, after generate; beside the training phase's head tile they are "
              "smaller on these models), bf16 (toolkit.train's CPU runs are fp32; distributed_memory.md measures "
              "bf16 engines on supervised steps, grpo_memory.md generate under bf16), sdpa and flash attention, "
              "GPUs.", ""]
    published = next(i for i, line in enumerate(lines) if line.startswith("Published rows"))
    lines[published:published] = generation_table(ok)[1:]
    return "\n".join(lines)


def _listed_ratios(rows: list[dict]) -> str:
    return ", ".join(f"{r['persistent_ratio']:.4f} ({r['strategy']})" for r in rows)


def buffered_batch_bytes(row: dict) -> int:
    """What GRPOTrainer keeps between steps of the last generation batch (_prepare_inputs' _buffered_inputs, held
    until the next generation replaces it): its prompt and completion ids and masks (int64, padded to the batch's
    longest), the reference's per-token log-probs (fp32, beta != 0) and the advantages (fp32), for the sequences one
    rank generated (trl/trainer/grpo_trainer.py _generate_and_score_completions' output)."""
    rank = row["ranks"][0]
    grpo = GRPO_LONG if row["method"] == "grpo-long" else GRPO
    seqs = GRPO_LONG_MICRO * GRPO_LONG_ACCUM if row["method"] == "grpo-long" else GRPO_MICRO
    tokens, completion = rank["prompt_tokens"] + rank["completion_tokens"], rank["completion_tokens"]
    return seqs * (tokens * 8 * 2 + (completion * 4 if grpo["beta"] else 0) + 4)


def generation_table(rows: list[dict]) -> list[str]:
    """GRPO's generation phase, predicted (Breakdown.generation_bytes) vs measured, and what is left of it."""
    gen = [r for r in rows if "generation_ratio" in r]
    if not gen:
        return []
    lines = ["", "GRPO's generation phase (the peak from the start of TRL's _generate_single_turn, before ZeRO-3 "
             "gathers the policy, to its return; predicted: Breakdown.generation_bytes, the bytes held between steps, "
             "the gathered parameters and generate's cache and temporaries). *Generate's own* is the phase's rise "
             "over what the rank held when it began (measured: peak - start; predicted: generation_bytes - between "
             "steps).", "",
             "| method | strategy | prompt + completion tokens | generation: predicted | measured | ratio | "
             "generate's own: predicted | measured | ratio | held at the start: predicted | measured | "
             "TRL's buffered batch |", "|" + "---|" * 12]
    for r in gen:
        p, rank = r["predicted"], max(r["ranks"], key=lambda x: x["generation_peak_bytes"])
        own_p = p["generation_bytes"] - p["persistent_bytes"]
        own_m = rank["generation_peak_bytes"] - rank["generation_start_bytes"]
        lines.append(f"| {r['method']} | {r['strategy']} | {rank['prompt_tokens']} + {rank['completion_tokens']} | "
                     f"{p['generation_bytes']:,} B | {r['measured_generation_bytes']:,} B | "
                     f"{r['generation_ratio']:.4f} | {own_p:,} B | {own_m:,} B | {own_p / own_m:.4f} | "
                     f"{p['persistent_bytes']:,} B | {rank['generation_start_bytes']:,} B | "
                     f"{buffered_batch_bytes(r):,} B |")
    sharded = [r for r in gen if r["strategy"] in ("zero3", "fsdp2")]
    worst = max(abs(r["generation_ratio"] - 1) for r in gen)
    lines += ["", f"Generation phase: worst |ratio - 1| {worst:.2%} over {len(gen)} GRPO runs"
              + (f", {max(abs(r['generation_ratio'] - 1) for r in sharded):.2%} on the ZeRO-3 / FSDP2 ones"
                 if sharded else "") + " (goal 5%). ZeRO-3 gathers the whole policy for generate "
              "(ds3_gather_for_generation: P x 4 B = 558,336 B here, GatheredParameters over every parameter); FSDP2 "
              "generates with its root unsharded after forward and one layer gathered at a time by its own hooks "
              "(trl/distributed.py summon_full_params is a no-op for FSDP2); DDP and ZeRO-2 hold the whole policy "
              "already. What is left is what the rank holds when generation begins: GRPOTrainer keeps the last "
              "generation batch (_buffered_inputs: prompt and completion ids and masks, the reference's log-probs, "
              "the advantages) until the next generation replaces it, which the estimate's bytes between steps leave "
              "out (last column, computed from the run's lengths; on a GPU job a few hundred KB a rank, "
              "e.g. 8 sequences x 1,536 tokens); it is also 2,512 B of the 2,672-5,237 B the one-micro-step GRPO "
              "rows' between-steps column misses (4 sequences of 9 + 24 tokens).", ""]
    return lines


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
