"""DPO (issue 29): the job knows its objective, and its memory and time are the policy's at the concatenated batch
plus the reference as TRL 1.16 builds and prepares it. Unit tests: no process starts."""

from __future__ import annotations

import math
import re
from dataclasses import fields

import pytest

from toolkit import api
from toolkit.errors import UserError
from toolkit.inputs.choices import DPO_LOSS_TYPES, split_method
from toolkit.inputs.preference import Dpo

LLAMA_8B = "llama-3.1-8b"


@pytest.fixture(scope="module")
def llama_8b_params() -> int:
    """Llama-3.1-8B's parameter count from transformers' own model built on the meta device: independent of
    toolkit's ModelSpec counting."""
    import torch
    from transformers import AutoModelForCausalLM

    config = api.model(LLAMA_8B).hf_config()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def _dpo(strategy: str, reference: str, **job):
    return api.estimate(LLAMA_8B, "8xH100-80GB", strategy=strategy, seq_len=1024, micro_batch=1, checkpointing=True,
                        method="dpo", dpo=Dpo(reference=reference), **job).memory


@pytest.mark.parametrize("strategy,shards", [("zero2", 1), ("zero3", 8)])
def test_llama_8b_dpo_kept_needs_exactly_the_reference_more_than_precomputed(strategy, shards, llama_8b_params):
    """The must-show: on 8xH100-80GB the kept reference adds its bf16 weights (DeepSpeed casts it to the config's
    bf16), replicated under ZeRO-2 (TRL prepares it at stage 0), partitioned 8 ways under ZeRO-3, and nothing else."""
    kept, precomputed = _dpo(strategy, "kept"), _dpo(strategy, "precomputed")
    reference = math.ceil(llama_8b_params / shards) * 2
    assert llama_8b_params == 8_030_261_248
    assert kept.reference_bytes == reference
    assert precomputed.reference_bytes == 0
    assert kept.peak_bytes - precomputed.peak_bytes == reference
    assert kept.peak_phase == precomputed.peak_phase
    assert kept.fits and precomputed.fits


def test_ddp_keeps_a_replica_in_the_loaded_dtype(llama_8b_params):
    """DDP: accelerator.prepare_model leaves the reference as TRL loads it, in the policy's dtype (fp32 for mixed
    precision): 4 bytes a parameter, on every GPU, and the 8B job no longer fits."""
    kept, precomputed = _dpo("ddp", "kept"), _dpo("ddp", "precomputed")
    assert kept.reference_bytes == llama_8b_params * 4
    assert kept.peak_bytes - precomputed.peak_bytes == llama_8b_params * 4
    assert not kept.fits


def test_fsdp2_shards_the_reference(llama_8b_params):
    kept = _dpo("fsdp2", "kept")
    assert kept.reference_bytes == math.ceil(llama_8b_params / 8) * 4


def test_lora_dpo_has_no_reference_weights():
    """With PEFT the reference is the adapter-disabled base: no weights of its own, kept or precomputed."""
    for reference in ("kept", "precomputed"):
        m = api.estimate(LLAMA_8B, "8xH100-80GB", strategy="zero2", seq_len=1024, micro_batch=1,
                         method="dpo+lora", dpo=Dpo(reference=reference)).memory
        assert m.reference_bytes == 0
        assert any(t.name == "reference model" and "adapter-disabled" in t.source for t in m.terms)


def test_the_policy_runs_chosen_and_rejected_as_one_batch():
    """The policy's activations are those of a supervised step at twice the micro-batch (pairs -> sequences), with
    TRL's chunked log-prob head (SFTTrainer's --loss trl): DPOTrainer always patches it."""
    dpo = _dpo("zero3", "precomputed")
    sft = api.estimate(LLAMA_8B, "8xH100-80GB", strategy="zero3", seq_len=1024, micro_batch=2,
                       checkpointing=True, loss="trl").memory
    assert dpo.activations_bytes == sft.activations_bytes
    assert dpo.peak_bytes == sft.peak_bytes


def test_explain_shows_the_reference_lines():
    names = [t.name for t in _dpo("zero3", "kept").terms]
    assert "reference model" in names and "reference forward (no_grad)" in names
    assert "reference forward (no_grad)" not in [t.name for t in _dpo("zero3", "precomputed").terms]


def test_the_method_names_an_objective_and_an_adapter():
    assert split_method("dpo") == ("dpo", "full")
    assert split_method("dpo+qlora") == ("dpo", "qlora")
    assert split_method("lora") == (None, "lora")


def test_reference_none_is_refused_for_every_trl_loss():
    """TRL 1.16's DPOTrainer runs a reference for every loss_type: --reference none has no loss to go with."""
    for loss in DPO_LOSS_TYPES:
        with pytest.raises(UserError, match="no reference-free DPO loss"):
            Dpo(reference="none", loss_type=loss)


def test_the_loss_types_are_trls():
    """DPO_LOSS_TYPES are the values the installed TRL's DPOConfig.loss_type documents."""
    from trl import DPOConfig

    help_text = next(f for f in fields(DPOConfig) if f.name == "loss_type").metadata["help"]
    listed = help_text.split("Possible values are:")[1].split(".")[0]
    assert tuple(re.findall(r"'(\w+)'", listed)) == DPO_LOSS_TYPES


def test_fsdp2_grad_op_keeps_the_reference_unsharded_after_its_forward(llama_8b_params):
    """reshard_after_forward False: the no_grad reference never reaches the backward that would reshard it, so it
    holds its fp32 shard and its bf16 unsharded weights."""
    kept = _dpo("fsdp2-grad-op", "kept")
    assert kept.reference_bytes == math.ceil(llama_8b_params / 8) * 4 + llama_8b_params * 2


def _dpo_timing(strategy: str, reference: str, method: str = "dpo"):
    return api.estimate(LLAMA_8B, "8xH100-80GB", strategy=strategy, seq_len=1024, micro_batch=1, checkpointing=True,
                        method=method, dpo=Dpo(reference=reference)).timing


def test_a_kept_reference_adds_its_forward_to_the_step():
    """Kept: the step gains the reference's forward of the concatenated batch, a quarter of a checkpointed full
    fine-tuning step's compute (forward of 3 + 1 recomputed); precomputed: the policy's step alone, the pass before
    training stated."""
    kept, precomputed = _dpo_timing("zero2", "kept"), _dpo_timing("zero2", "precomputed")
    assert precomputed.reference_s == 0
    assert any("precomputed: one no_grad forward over the dataset" in a for a in precomputed.assumptions)
    assert kept.compute_s == precomputed.compute_s
    assert 0.22 < kept.reference_s / kept.compute_s < 0.26
    assert kept.step_time_s == pytest.approx(precomputed.step_time_s + kept.reference_s)


def test_a_sharded_reference_gathers_again():
    kept, precomputed = _dpo_timing("zero3", "kept"), _dpo_timing("zero3", "precomputed")
    assert kept.communication_s > precomputed.communication_s
    assert kept.step_time_s == pytest.approx(precomputed.step_time_s + kept.reference_s
                                             + kept.communication_s - precomputed.communication_s)


def test_the_plan_ranks_dpo_rows_and_says_which_fit(llama_8b_params):
    """The planner ranks each DPO row with its reference (replicated under ZeRO-1/2, partitioned under ZeRO-3),
    refuses DDP (its own states alone exceed the GPU); a precomputed one holds none."""
    kept = api.plan(LLAMA_8B, "8xH100-80GB", seq_len=1024, global_batch=64, method="dpo",
                    strategies="ddp,zero1,zero2,zero3")
    pre = api.plan(LLAMA_8B, "8xH100-80GB", seq_len=1024, global_batch=64, method="dpo",
                   dpo=Dpo(reference="precomputed"), strategies="ddp,zero1,zero2,zero3")
    assert {c.strategy.name: c.memory.reference_bytes for c in kept.feasible} == {
        "zero1": llama_8b_params * 2, "zero2": llama_8b_params * 2, "zero3": math.ceil(llama_8b_params / 8) * 2}
    assert ["model states alone" in c.reason for c in kept.refused if c.strategy.name == "ddp"] == [True]
    assert all(c.memory.reference_bytes == 0 for c in pre.feasible)


def test_the_plan_costs_its_first_row_with_the_reference_kept_and_precomputed(llama_8b_params, capsys):
    """Issue 29's must-show: plan prints #1 (ZeRO-2 here) with its reference both ways at the same batch; the peaks
    differ by exactly the kept reference's bf16 weights (a replica under ZeRO-2), and it says which fits."""
    from toolkit.cli import main

    assert main(["plan", LLAMA_8B, "--gpus", "8xH100-80GB", "--method", "dpo", "--seq", "1024", "--global-batch", "64",
                 "--strategies", "zero2"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("reference on #1 (zero2,"))
    kept, pre, diff, weights = map(float, re.search(r"kept ([\d.]+) GiB peak, fits; precomputed ([\d.]+) GiB, "
                                                   r"fits; the difference ([\d.]+) GiB is the reference's ([\d.]+)",
                                                   line).groups())
    assert diff == weights == round(llama_8b_params * 2 / 2**30, 2) and round(kept - pre, 2) == diff
    phases = next(x for x in out.splitlines() if x.startswith("#1 memory by phase"))
    assert phases.startswith("#1 memory by phase (tensors, GiB per GPU): forward ")
    assert f"backward {kept:.2f} (peak)" in phases and "reference forward (no_grad) " in phases


def test_emit_writes_trls_dpo_config_and_plan_md_names_the_method(tmp_path):
    """training_args.json carries DPOConfig's settings (built by TRL's own DPOConfig in the emit validation path),
    no sft_config; PLAN.md says the method; `toolkit check` of the folder finds nothing."""
    import json

    from toolkit.check.folder import check_plan_dir
    from toolkit.engines.validate import validate_dpo_config

    result = api.plan(LLAMA_8B, "8xH100-80GB", seq_len=1024, global_batch=64, method="dpo+lora",
                      dpo=Dpo(beta=0.2, loss_type="ipo", reference="precomputed"), strategies="zero2")
    api.emit(result, tmp_path / "p")
    settings = json.loads((tmp_path / "p" / "training_args.json").read_text())
    assert "sft_config" not in settings
    dpo = settings["dpo_config"]
    assert (dpo["beta"], dpo["loss_type"], dpo["max_length"], dpo["precompute_ref_log_probs"]) == \
        (0.2, ["ipo"], 1024, True)
    config = validate_dpo_config(dpo)
    assert (config.beta, config.loss_type, config.precompute_ref_log_probs) == (0.2, ["ipo"], True)
    assert config.per_device_train_batch_size == result.chosen.job.micro_batch
    assert "- method: DPO through TRL's DPOTrainer (loss ipo, beta 0.2, reference precomputed)" in \
        (tmp_path / "p" / "PLAN.md").read_text()
    assert api.load_plan(tmp_path / "p").dpo_spec == Dpo(beta=0.2, loss_type="ipo", reference="precomputed")
    assert [p for p in check_plan_dir(tmp_path / "p", gpus=None) if p.severity == "error"] == []


def test_trls_dpo_config_refuses_what_the_plan_could_not_mean():
    from toolkit.engines.validate import ConfigRejected, validate_dpo_config

    with pytest.raises(ConfigRejected, match="not one of TRL's DPO losses"):
        validate_dpo_config({"loss_type": ["simpo"]})
    with pytest.raises(ConfigRejected, match="DPOConfig refuses"):
        validate_dpo_config({"loss_type": ["sigmoid", "ipo"], "loss_weights": [1.0]})


def test_time_to_train_adds_the_precompute_pass_once():
    """Precomputed: the reference's forward over the dataset runs once before training, whatever the epochs; kept:
    no pass, its forward is in every step."""
    precomputed = api.estimate(LLAMA_8B, "8xH100-80GB", strategy="zero3", seq_len=1024, micro_batch=1,
                               method="dpo", dpo=Dpo(reference="precomputed"))
    run = precomputed.time_to_train(1e9, epochs=2)
    passes = math.ceil(1e9 / run.tokens_per_step)
    assert precomputed.timing.precompute_s > 0
    assert run.precompute_s == pytest.approx(passes * precomputed.timing.precompute_s)
    assert run.seconds == pytest.approx(run.steps * run.step_time_s + run.precompute_s)
    assert "precompute pass before training" in run.text()
    kept = api.estimate(LLAMA_8B, "8xH100-80GB", strategy="zero3", seq_len=1024, micro_batch=1, method="dpo")
    assert kept.time_to_train(1e9, epochs=2).precompute_s == 0


def test_a_rehearsal_of_a_dpo_plan_keeps_its_dpo_settings(tiny_llama_dir):
    """The small plan a user's TRL DPO script is rehearsed with carries the plan's DPO settings, so dpo_config()
    answers there as on the real box."""
    from toolkit.emit.user_settings import settings
    from toolkit.run.rehearsal import plan_for_model, rehearsal_plan

    dpo = Dpo(beta=0.2, reference="precomputed")
    plan = plan_for_model(tiny_llama_dir, "zero2", micro_batch=2, seq_len=32).replace(dpo=dpo.to_dict())
    small, _ = rehearsal_plan(plan, tiny_llama_dir)
    assert small.dpo_spec == dpo
    assert settings(small)["dpo_config"]["precompute_ref_log_probs"] is True


def test_dpo_activation_offloading_moves_the_policys_chosen_and_rejected_saved_bytes():
    """With TRL's offloading (DPOConfig activation_offloading) the policy's decoder-layer saved bytes of the
    concatenated batch (2 x micro-batch: chosen and rejected) leave the GPU for pinned host RAM, twice what the same
    micro-batch moves in SFT; the reference's no_grad forward saves nothing, so its term is the same with and
    without; the host line and the PCIe time count what TRL's rule moves of that batch (the layers' and the loss's
    saves), the same bytes the memory puts in host RAM."""
    from dataclasses import replace

    from toolkit.estimate.memory import estimate_memory
    from toolkit.estimate.savers import offload_copies, offloaded_bytes
    from toolkit.estimate.traces import scaled_trace
    from toolkit.inputs.hardware import parse_hardware
    from toolkit.inputs.job import Job, policy_job
    from toolkit.inputs.modelspec import resolve_model
    from toolkit.inputs.strategy import parse_strategy

    spec, hw, ddp = resolve_model("qwen2.5-0.5b"), parse_hardware("1xA100-80GB"), parse_strategy("ddp")
    job = Job(seq_len=2048, micro_batch=2, checkpointing=True, dpo=Dpo())
    plain = estimate_memory(spec, ddp, job, hw)
    off = estimate_memory(spec, ddp, replace(job, activation_offloading=True), hw)
    policy = sum(r.saved_bytes for r in scaled_trace(spec, policy_job(job), ddp).layers)
    sft = sum(r.saved_bytes for r in scaled_trace(spec, replace(job, dpo=None), ddp).layers)
    # Checkpointed: one layer input per layer and sequence, plus the rotary tables, which do not grow with the batch
    # (measured: 705,708,032 bytes for 4 sequences of 2,048 vs 353,386,496 for 2, 0.15% under twice).
    assert policy == pytest.approx(2 * sft, rel=0.002) and policy > 1.99 * sft
    offloading = replace(job, activation_offloading=True)
    moved = offloaded_bytes(scaled_trace(spec, policy_job(offloading), ddp))  # TRL's rule: layers' and loss's saves
    assert moved >= policy
    assert off.cpu_bytes_per_node - plain.cpu_bytes_per_node == moved
    assert off.activations_bytes == plain.activations_bytes - policy
    assert off.reference_bytes == plain.reference_bytes > 0
    # With TRL's chunked head (no whole logits) this step peaks in the tied embedding's backward, after every layer's
    # saved bytes are freed: offloading lowers the activations, not that peak (measured: 10,986,771,976 B both).
    assert off.peak_bytes == plain.peak_bytes and plain.peak_phase == "backward (embedding)"
    rank_bytes, seconds = offload_copies(spec, offloading, ddp, hw)
    assert rank_bytes == moved and seconds == pytest.approx(2 * moved / (hw.gpu.pcie_gbps * 1e9))


def test_the_dpo_step_peak_is_trls_chunked_head_as_a_real_dpotrainer_step_measures(tiny_llama_dir, tmp_path):
    """TRL's DPOTrainer patches policy and reference with its chunked log-prob head (add_fused_lm_head) and scores
    both with fused_lm_head=True, so the estimate traces that head (policy_job). One real DPOTrainer.training_step
    on CPU (fp32, 2 pairs of 1,100 tokens: 4 x 1,099 = 4,396 scored tokens, past the head's 4,096-token tile, so the
    trace at 4 sequences is not the affine one from 1 and 2): MemTracker's peak over the steady step equals the
    estimate's (measured 643,417,232 B, predicted 643,311,416 B). The tile buffer is 4,096 x 32,768 fp32 (512 MiB)
    whatever the vocabulary; the whole-logits trace this replaced predicted 74,982,932 B (-88%)."""
    import copy

    import torch
    from datasets import Dataset
    from torch.distributed._tools.mem_tracker import MemTracker
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    from toolkit.estimate.memory import estimate_memory
    from toolkit.estimate.profile import build_model
    from toolkit.inputs.hardware import parse_hardware
    from toolkit.inputs.job import Job
    from toolkit.inputs.modelspec import build_spec
    from toolkit.inputs.strategy import parse_strategy
    from toolkit.run.tiny import tiny_config

    pairs, seq = 2, 1100
    config = tiny_config("llama", vocab_size=512, max_positions=2048, hidden=64, layers=2, heads=4, kv_heads=2,
                         ffn=128)
    torch.manual_seed(0)
    model = build_model(config, "fp32", "sdpa", False, "cpu")
    args = DPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=pairs, use_cpu=True, report_to=[],
                     max_length=seq, save_strategy="no")
    trainer = DPOTrainer(model=model, ref_model=copy.deepcopy(model).eval(), args=args,
                         train_dataset=Dataset.from_list([{"prompt": "a", "chosen": " b", "rejected": " c"}] * 2),
                         processing_class=AutoTokenizer.from_pretrained(tiny_llama_dir))
    trainer.create_optimizer_and_scheduler(num_training_steps=2)
    trainer.current_gradient_accumulation_steps = 1
    ids = torch.randint(0, 512, (2 * pairs, seq))
    completion = torch.ones_like(ids)
    completion[:, 0] = 0
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "completion_mask": completion}

    def step() -> None:
        trainer.training_step(trainer.model, batch)
        trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)

    step()  # the optimizer states exist from here on
    tracker = MemTracker()
    # The reference's parameters as plain tensors: MemTracker hooks the gradients of the modules it tracks.
    tracker.track_external(trainer.model, trainer.optimizer, *trainer.ref_model.parameters(), *batch.values())
    with tracker:
        step()
    measured = sum(dev["Total"] for dev in tracker.get_tracker_snapshot("peak").values())
    job = Job(seq_len=seq, micro_batch=pairs, precision="fp32", device_kind="cpu", dpo=Dpo())
    predicted = estimate_memory(build_spec("llama", config), parse_strategy("ddp"), job, parse_hardware("1xH200"))
    assert predicted.peak_bytes == pytest.approx(measured, rel=0.01), (predicted.peak_phase, measured)
    assert predicted.reference_bytes == sum(p.numel() for p in model.parameters()) * 4
