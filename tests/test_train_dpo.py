"""toolkit.train runs a DPO plan with TRL's DPOTrainer, on the engines and the batch the plan says.

The runs train a tiny Llama (random weights) on the same 4 preference pairs every step (global batch 4), fp32, at
a constant learning rate. At step 1 the policy is the reference, so every pair's log-ratio is 0 and the sigmoid loss
is -log sigmoid(0) = ln 2 exactly; on the same pairs it then goes down. One process (micro 2 x accumulation 2) and
ZeRO-2 on two processes (micro 2 x 2 ranks) step over the same pairs (the Trainer's seeded sampler, sharded by
accelerate), so their losses agree up to reduction order (measured: equal to 1e-6).
"""

from __future__ import annotations

import json
import math
import pytest

from toolkit.errors import UserError
from toolkit.inputs.preference import Dpo
from toolkit.run.rehearsal import plan_for_model

STEPS = 6
SEQ = 48
LOSS_TOLERANCE = 1e-3
COMMON = ("--max-steps", str(STEPS), "--logging-steps", "1", "--save-steps", "100", "--lr", "3e-3",
          "--lr-scheduler", "constant", "--seed", "7", "--random-init", "--no-save-final", "--eval-fraction", "0")


def _plan(model_dir, strategy, *, world, micro, accum, reference="kept", checkpointing=False):
    plan = plan_for_model(model_dir, strategy, gpus_per_node=world, micro_batch=micro, grad_accum=accum,
                          seq_len=SEQ, precision="fp32", checkpointing=checkpointing)
    return plan.replace(dpo=Dpo(reference=reference).to_dict())


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    from toolkit.run import tiny

    return tiny.write_preference_corpus(tmp_path_factory.mktemp("pairs"), pairs=4) / "train.jsonl"


@pytest.fixture(scope="module")
def one_process_runs(runs_side_by_side, tiny_llama_dir, pairs):
    """The module's three one-process runs, started side by side (one after the other each left a core idle): the
    kept reference ("kept"), the precomputed one ("precomputed"), and the kept one with TRL's activation
    offloading over checkpointed layers ("offloaded": toolkit.patches.actoffload around DPOTrainer.training_step,
    as DPOTrainer runs its own)."""
    plans = {"kept": _plan(tiny_llama_dir, "ddp", world=1, micro=2, accum=2),
             "precomputed": _plan(tiny_llama_dir, "ddp", world=1, micro=2, accum=2, reference="precomputed"),
             "offloaded": _plan(tiny_llama_dir, "ddp", world=1, micro=2, accum=2, checkpointing=True)
             .replace(activation_offloading=True)}
    runs = runs_side_by_side({name: (plan, f"dpo-{name}", "--data", str(pairs), *COMMON)
                              for name, plan in plans.items()})
    return {name: run.check() for name, run in runs.items()}


@pytest.fixture(scope="module")
def single(one_process_runs):
    """One process, micro 2 x accumulation 2, the reference kept: the losses the other runs must give."""
    return one_process_runs["kept"]


@pytest.mark.multiprocess
def test_dpo_starts_at_ln2_and_the_loss_goes_down(single):
    losses = single.losses()
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert losses[1] == pytest.approx(math.log(2), abs=1e-3)
    assert all(losses[s + 1] < losses[s] for s in range(1, STEPS)), losses
    assert losses[STEPS] < losses[1] - 0.3
    history = single.ranks[0]["log_history"]
    assert max(e["rewards/accuracies"] for e in history if "loss" in e) == 1.0  # chosen now outscores rejected


@pytest.mark.multiprocess
def test_a_precomputed_reference_gives_the_kept_references_losses(one_process_runs, single):
    """The reference's log-probs computed over the data before training (by the policy at step 0) are those a kept
    reference computes in every step."""
    ref, got = single.losses(), one_process_runs["precomputed"].losses()
    assert got.keys() == ref.keys()
    for step in ref:
        assert got[step] == pytest.approx(ref[step], abs=1e-5), step


@pytest.mark.multiprocess
def test_zero2_on_two_processes_matches_one_process(run_training, tiny_llama_dir, pairs, single):
    plan = _plan(tiny_llama_dir, "zero2", world=2, micro=2, accum=1)
    run = run_training(plan, "dpo-zero2", "--data", str(pairs), *COMMON).check()
    assert len(run.ranks) == 2
    ref, got = single.losses(), run.losses()
    assert got.keys() == ref.keys()
    for step in ref:
        assert got[step] == pytest.approx(ref[step], abs=LOSS_TOLERANCE), (step, got, ref)
    assert run.losses(1) == got  # both ranks log the same (gathered) loss


def test_dpo_data_without_rejected_is_refused_before_anything_starts(tiny_llama_dir, tmp_path):
    from toolkit.run.launcher import emit_plan_files
    from toolkit.run.preflight import preflight

    plan = _plan(tiny_llama_dir, "zero2", world=2, micro=2, accum=1)
    plan_dir = emit_plan_files(plan, tmp_path / "plan")
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"prompt": "Say hi\n", "chosen": "hi"}) + "\n" for _ in range(8)))
    with pytest.raises(UserError) as exc:
        preflight(plan, plan_dir, ["--data", str(data), "--output", str(tmp_path / "out"), "--random-init"])
    assert str(exc.value) == (f"DPO data {data}: pairs.jsonl line 1 has no 'rejected'; DPO data needs 'prompt', "
                              "'chosen' and 'rejected' in every row (TRL's preference format)")
    assert not (tmp_path / "out").exists()


def test_plain_text_for_a_dpo_plan_is_one_line_and_exit_2(train_in_process, tiny_llama_dir, corpus_dir):
    plan = _plan(tiny_llama_dir, "ddp", world=1, micro=2, accum=2)
    run = train_in_process(plan, "dpo-text", "--data", str(corpus_dir / "train.txt"), *COMMON)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert [line for line in run.stderr.splitlines() if line.startswith("error")] == [
        f"error: DPO data {corpus_dir / 'train.txt'} has no 'prompt', 'chosen', 'rejected' column (columns: text); "
        "a DPO plan trains on rows with 'prompt', 'chosen' and 'rejected' (TRL's preference format)"]


@pytest.fixture(scope="module")
def offloaded(one_process_runs):
    """The one-process run of `single` with TRL's activation offloading over checkpointed layers."""
    return one_process_runs["offloaded"]


@pytest.mark.multiprocess
def test_activation_offloading_gives_the_same_dpo_losses_and_moves_the_policys_saved_tensors(offloaded, single):
    """Offloading copies each saved tensor to the host and back: the losses are those without it (measured: equal,
    difference 0.0 at all 6 steps), and the last micro-step moved at least the policy's checkpointed layer inputs,
    2 layers x (chosen + rejected of micro 2) x seq 48 x hidden 64 x 4 bytes = 98,304 (measured: 8 tensors, 296,928
    bytes, the loss's fp32 log-probs among them; the reference's no_grad forward saves nothing)."""
    ref, got = single.losses(), offloaded.losses()
    assert got.keys() == ref.keys() and len(ref) >= 2
    for step in ref:
        assert got[step] == pytest.approx(ref[step], abs=1e-5), (step, got, ref)
    moved = offloaded.ranks[0]["activation_offloaded"]
    assert moved["bytes"] >= 2 * (2 * 2) * SEQ * 64 * 4, moved
    assert single.ranks[0]["activation_offloaded"] == {}


@pytest.mark.multiprocess
def test_activation_offloading_under_fsdp2_on_two_processes_matches_one_process(run_training, tiny_llama_dir, pairs,
                                                                                 single):
    """TRL's hooks skip FSDP2's sharded parameters (DTensor storages): each rank moves its own chosen + rejected
    layer inputs, and the losses are the single process's without offloading (measured: 2.7e-7 at most over 6
    steps; each rank moved 8 tensors, 296,928 bytes, in its last micro-step)."""
    plan = _plan(tiny_llama_dir, "fsdp2", world=2, micro=2, accum=1, checkpointing=True) \
        .replace(activation_offloading=True)
    run = run_training(plan, "dpo-fsdp2-offload", "--data", str(pairs), *COMMON).check()
    ref, got = single.losses(), run.losses()
    assert got.keys() == ref.keys()
    for step in ref:
        assert got[step] == pytest.approx(ref[step], abs=LOSS_TOLERANCE), (step, got, ref)
    for rank in run.ranks:
        assert rank["activation_offloaded"]["bytes"] >= 2 * (2 * 2) * SEQ * 64 * 4, rank["activation_offloaded"]


def test_an_offloading_dpo_plans_emitted_dpo_config_builds_trls_dpoconfig_with_offloading_on(tiny_llama_dir,
                                                                                              tmp_path):
    """training_args.json's dpo_config names TRL's own field: a user's DPOConfig(**dpo_config()) offloads."""
    from trl import DPOConfig

    from toolkit.run.launcher import emit_plan_files
    from toolkit.train.own_script import dpo_config

    plan = _plan(tiny_llama_dir, "fsdp2", world=2, micro=2, accum=1, checkpointing=True) \
        .replace(activation_offloading=True)
    settings = dpo_config(emit_plan_files(plan, tmp_path / "plan"))
    assert settings["activation_offloading"] is True
    args = DPOConfig(**{**settings, "output_dir": str(tmp_path / "out"), "report_to": []})
    assert args.activation_offloading is True and args.max_length == SEQ


def test_a_loss_trls_trainer_refuses_is_one_line_and_exit_2(train_in_process, tiny_llama_dir, pairs):
    """exo_pair needs DPOConfig.label_smoothing > 0, which DPOConfig accepts and DPOTrainer refuses; a plan sets
    no label smoothing."""
    plan = _plan(tiny_llama_dir, "ddp", world=1, micro=2, accum=2).replace(
        dpo=Dpo(loss_type="exo_pair").to_dict())
    run = train_in_process(plan, "dpo-exo", "--data", str(pairs), *COMMON)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    errors = [line for line in run.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and errors[0].startswith("error: TRL's DPOTrainer refuses the plan's DPO settings: Label "
                                                     "smoothing must be greater than 0.0 when using 'exo_pair' loss")


def test_compile_on_a_dpo_plan_is_refused_as_the_planner_refuses_it(tiny_llama_dir, tmp_path):
    from toolkit.inputs.preference import dpo_problem
    from toolkit.run.launcher import emit_plan_files
    from toolkit.run.preflight import preflight

    plan = _plan(tiny_llama_dir, "zero2", world=2, micro=2, accum=1)
    plan_dir = emit_plan_files(plan, tmp_path / "plan")
    data = tmp_path / "pairs.jsonl"
    data.write_text(json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"}) + "\n")
    with pytest.raises(UserError) as exc:
        preflight(plan, plan_dir, ["--data", str(data), "--output", str(tmp_path / "out"), "--compile"])
    assert str(exc.value) == dpo_problem(plan.dpo_spec, plan.strategy_spec, compile=True) == \
        "--method dpo with --compile is not modelled; drop --compile"
