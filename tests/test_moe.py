"""Mixture-of-experts models through the default paths: plan, the MoE parts found from the model, ZeRO-3 leaf
modules (plan, toolkit.train, a user's script) and check's finding."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from toolkit.cli import main

ARCH = Path(__file__).parent / "arch_configs"


def _model_dir(name: str, root: Path) -> Path:
    folder = root / name
    folder.mkdir()
    shutil.copy(ARCH / f"{name}.json", folder / "config.json")
    return folder


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "gpt-oss-20b", "mixtral-8x7b-v0.1"])
def test_moe_models_plan_through_the_default_path(name, tmp_path, capsys):
    """`toolkit plan` of a real MoE config as a new user runs it (all strategies, automatic tiling and
    checkpointing) on one and two 8xH100 nodes plans without a traceback and tiles no MoE block (DeepSpeed's
    TiledMLP cannot run one: issue 34's Qwen3-MoE ValueError and GPT-OSS TypeError)."""
    folder = _model_dir(name, tmp_path)
    for nodes in ("1", "2"):
        assert main(["plan", str(folder), "--gpus", "8xH100-80GB", "--nodes", nodes, "--seq", "2048",
                     "--global-batch", "16", "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["chosen"] is not None and out["chosen"]["feasible"]
        assert not any(c["tiled"] for c in out["candidates"])
        assert any(c["strategy"] == "zero3" for c in out["candidates"])


@pytest.mark.parametrize("name, block, router, experts, top_k, shared, extra", [
    ("qwen3-30b-a3b", "Qwen3MoeSparseMoeBlock", "Qwen3MoeTopKRouter", 4, 8, (), {}),
    ("gpt-oss-20b", "GptOssMLP", "GptOssTopKRouter", 4, 4, (), {}),
    ("mixtral-8x7b-v0.1", "MixtralSparseMoeBlock", "MixtralTopKRouter", 4, 2, (), {}),
    ("qwen1.5-moe-a2.7b", "Qwen2MoeSparseMoeBlock", "Qwen2MoeTopKRouter", 4, 4, ("shared_expert", "shared_expert_gate"), {}),
    ("deepseek-v3", "DeepseekV3MoE", "DeepseekV3TopkRouter", 4, 8, ("shared_experts",), {"first_k_dense_replace": 1}),
])
def test_the_moe_parts_are_found_from_the_model(name, block, router, experts, top_k, shared, extra):
    """The block holding router and experts, the expert count (the fused experts' leading dimension), the router's
    top_k and the shared experts come from the meta-device model, for five architectures without a table."""
    import json

    import torch
    from transformers import AutoModelForCausalLM

    from toolkit.inputs.modelconfig import config_from_dict
    from toolkit.inputs.modelspec import spec_from_config_dict
    from toolkit.inputs.moe import find_moe
    from toolkit.run.tiny import shrink_config

    config = shrink_config(config_from_dict(json.loads((ARCH / f"{name}.json").read_text()), name), layers=2,
                           experts=experts, **extra)
    config.num_experts_per_tok = min(top_k, experts)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    parts = find_moe(model, config)
    assert (parts.block_class, parts.router_class, parts.experts, parts.top_k, parts.shared) == \
        (block, router, experts, min(top_k, experts), shared)
    assert parts.moe_layers == (1 if extra else 2)
    spec = spec_from_config_dict(config.to_dict(), name=name)
    assert (spec.moe_block, spec.moe_experts, spec.moe_top_k) == (block, experts, min(top_k, experts))


def test_a_dense_model_and_a_config_declaring_unused_experts_have_no_moe_parts():
    """Nemotron-H's config class declares 8 experts by default, but its layers hold none: the model decides."""
    from toolkit.inputs.modelspec import resolve_model

    for name in ("qwen3-0.6b", "nemotron-h-56b"):
        spec = resolve_model(str(ARCH / f"{name}.json"))
        assert (spec.moe_block, spec.moe_experts, spec.moe_top_k) == (None, 0, 0)
        assert spec.active_params == spec.params


# --- ZeRO-3 leaf modules ------------------------------------------------------------------------------------------

SEQ = 32
STEPS = 6
TRAIN = ("--max-steps", str(STEPS), "--logging-steps", "1", "--save-steps", "100", "--lr", "3e-3",
         "--lr-scheduler", "constant", "--seed", "7", "--max-eval-blocks", "8")
LOSS_TOLERANCE = 1e-3
AUTOEP_STEPS = ("--max-steps", "4", "--save-steps", "2")  # the AutoEP run: checkpoint-2 to load and resume from


@pytest.fixture(scope="module")
def tiny_moe_dir(tmp_path_factory) -> Path:
    """Qwen3-MoE, 2 layers, hidden 64, 4 experts (top-2), random weights, a locally trained tokenizer."""
    from toolkit.run import tiny

    return tiny.make_tiny_model("qwen3_moe", tmp_path_factory.mktemp("tiny-qwen3-moe"), layers=2, hidden=64,
                                experts=4, corpus_chars=100_000)


def _moe_plan(model_dir, strategy, *, world=2, micro=2, expert=1, gpu="cpu"):
    from toolkit.run.rehearsal import plan_for_model

    return plan_for_model(model_dir, strategy, gpus_per_node=world, micro_batch=micro, seq_len=SEQ,
                          precision="fp32", expert=expert, gpu=gpu)


def test_a_zero3_plan_of_an_moe_model_names_its_block_as_leaf_module(tiny_moe_dir, tmp_path):
    """The plan records the MoE block, the DeepSpeed JSON carries it as zero_optimization.leaf_module (accepted by
    DeepSpeed's own config model), PLAN.md and training_args.json say so; ZeRO-1/2 and FSDP2 plans carry none."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    from toolkit.emit.deepspeed import ds_config
    from toolkit.run.launcher import emit_plan_files

    plan = _moe_plan(tiny_moe_dir, "zero3")
    assert plan.leaf_modules == ["Qwen3MoeSparseMoeBlock"]
    zero = ds_config(plan)["zero_optimization"]
    assert DeepSpeedZeroConfig(**zero).leaf_module.classes == ["Qwen3MoeSparseMoeBlock"]
    folder = emit_plan_files(plan, tmp_path / "plan")
    assert json.loads((folder / "plan.json").read_text())["leaf_modules"] == ["Qwen3MoeSparseMoeBlock"]
    assert "ZeRO-3 leaf module: Qwen3MoeSparseMoeBlock" in (folder / "PLAN.md").read_text()
    notes = json.loads((folder / "training_args.json").read_text())["notes"]
    assert any("set_z3_leaf_modules(model, ['Qwen3MoeSparseMoeBlock'])" in n for n in notes)
    for other in ("zero2", "fsdp2"):
        assert _moe_plan(tiny_moe_dir, other).leaf_modules == []
        assert "leaf_modules" not in _moe_plan(tiny_moe_dir, other).to_dict()


@pytest.fixture(scope="module")
def moe_runs(runs_by_name, tiny_moe_dir, corpus_dir):
    """The tiny Qwen3-MoE's runs by name, fp32, global batch 4: "ref", one process on the whole batch (the others
    split it over 2 gloo ranks), started beside "zero3" (the MoE block as ZeRO-3 leaf); "ep2" (FSDP2 x EP 2) beside
    "autoep2" (DeepSpeed AutoEP 2 on zero1, 4 steps, a checkpoint at step 2): one after the other, each world of 2
    ranks left a core idle while it started, met and saved."""
    plans = {"ref": dict(strategy="ddp", world=1, micro=4), "zero3": dict(strategy="zero3"),
             "ep2": dict(strategy="fsdp2", expert=2), "autoep2": dict(strategy="zero1", expert=2)}

    def arguments(name):
        steps = AUTOEP_STEPS if name == "autoep2" else ()
        return _moe_plan(tiny_moe_dir, **plans[name]), f"moe-{name}", "--data", str(corpus_dir), *TRAIN, *steps

    return runs_by_name(arguments, together=[("ref", "zero3"), ("ep2", "autoep2")], timeout=600)


@pytest.mark.multiprocess
def test_zero3_with_the_moe_block_as_leaf_matches_one_process(moe_runs):
    """Two gloo ranks of ZeRO-3 with the MoE block as leaf module train the tiny Qwen3-MoE to the single-process
    losses (fp32, 6 steps, global batch 4); each rank's engine flagged the block (the rank summary reads
    DeepSpeed's flag off the trained model's modules)."""
    reference, zero3 = moe_runs("ref"), moe_runs("zero3")
    ref, got = reference.losses(), zero3.losses()
    assert len(ref) == STEPS and got.keys() == ref.keys()
    for step in ref:
        assert got[step] == pytest.approx(ref[step], abs=LOSS_TOLERANCE), step
    assert [r["z3_leaf_modules"] for r in zero3.ranks] == [["Qwen3MoeSparseMoeBlock"]] * 2
    assert reference.ranks[0]["z3_leaf_modules"] == []


# --- expert parallelism: transformers' DistributedConfig route --------------------------------------------------

def test_plan_with_expert_parallel_writes_ep_into_every_file_the_engines_accept(tiny_moe_dir, tmp_path, capsys):
    """`plan --expert-parallel 2 --strategies fsdp2` plans the FSDP2 x EP row alone and writes it: plan.json's expert_parallel (read
    back by the schema), a plain multi-process YAML (accelerate's own launch validation; transformers shards and
    runs FSDP2 itself), training_args.json's distributed_config (transformers' DistributedConfig accepts it: ep 2,
    efsdp 1) with save_only_model, PLAN.md's from_pretrained line; `toolkit check` of the folder finds nothing."""
    import yaml
    from transformers.distributed import DistributedConfig

    from toolkit.engines.validate import accelerate_launch_plugins
    from toolkit.plan.schema import load_plan

    out = tmp_path / "plan"
    assert main(["plan", str(tiny_moe_dir), "--gpus", "2xH100-80GB", "--seq", str(SEQ), "--global-batch", "4",
                 "--expert-parallel", "2", "--strategies", "fsdp2", "--out", str(out), "--json"]) == 0
    chosen = json.loads(capsys.readouterr().out)["chosen"]
    assert chosen["name"] == "fsdp2 (dp=2 x ep=2)" and chosen["expert_parallel"] == 2
    plan = load_plan(out)
    assert (plan.strategy, plan.expert_parallel, plan.grid.expert) == ("fsdp2", 2, 2)
    assert json.loads((out / "plan.json").read_text())["expert_parallel"] == 2
    config = yaml.safe_load((out / "accelerate_config.yaml").read_text())
    assert config["distributed_type"] == "MULTI_GPU" and "fsdp_config" not in config
    args, plugin, env = accelerate_launch_plugins(out / "accelerate_config.yaml")
    assert args.num_processes == 2 and plugin is None
    settings = json.loads((out / "training_args.json").read_text())
    dist = DistributedConfig(**settings["distributed_config"])  # transformers' own checks
    assert (dist.ep_size, dist.fsdp_size, dist.tp_size, dist.efsdp_size) == (2, 2, 1, 1)
    assert settings["training_arguments"]["save_only_model"] is True
    assert any("Expert parallelism (ep 2)" in note for note in settings["notes"])
    plan_md = (out / "PLAN.md").read_text()
    assert "distributed_config=DistributedConfig(**{'fsdp_size': 2, 'ep_size': 2, 'fsdp_mixed_precision': True})" \
        in plan_md
    assert "applied by transformers as it loads the model (DistributedConfig: expert parallel 2" in plan_md
    assert main(["check", str(out)]) == 0
    assert "error" not in capsys.readouterr().out
    from toolkit.train.own_script import model_kwargs

    kwargs = model_kwargs(out)  # what a user's own script passes to from_pretrained
    assert isinstance(kwargs["distributed_config"], DistributedConfig)
    assert (kwargs["distributed_config"].ep_size, kwargs["distributed_config"].fsdp_size) == (2, 2)


def test_check_finds_an_expert_degree_the_model_cannot_take_and_a_script_config_that_disagrees(tiny_moe_dir, tmp_path,
                                                                                                capsys):
    """A plan folder edited to ep 8 on 8 GPUs: the tiny model's 4 experts do not split 8 ways (plan.json), and
    training_args.json's distributed_config, which a script hands to from_pretrained, still says ep 2."""
    from toolkit.run.launcher import emit_plan_files

    folder = emit_plan_files(_moe_plan(tiny_moe_dir, "fsdp2", expert=2), tmp_path / "plan")
    data = json.loads((folder / "plan.json").read_text())
    data.update(gpus_per_node=8, expert_parallel=8, global_batch=16)
    (folder / "plan.json").write_text(json.dumps(data))
    capsys.readouterr()
    assert main(["check", str(folder)]) == 1
    captured = capsys.readouterr()
    lines = [line for line in (captured.out + captured.err).splitlines() if ": error: " in line]
    assert any("plan.json" in line and "--expert-parallel 8 does not divide" in line and "4 experts" in line
               for line in lines), lines
    assert any("training_args.json" in line and "'ep_size': 2" in line and "'ep_size': 8" in line
               for line in lines), lines


@pytest.mark.parametrize("dense, edit, fragment", [
    (False, {"gpus_per_node": 8, "expert_parallel": 8, "global_batch": 16}, "does not divide"),
    (True, {"expert_parallel": 2}, "is dense"),
])
def test_emit_refuses_an_edited_expert_degree_the_model_cannot_take_in_one_line(dense, edit, fragment, tiny_moe_dir,
                                                                                 tiny_llama_dir, tmp_path, capsys):
    """`toolkit emit` of a plan.json edited to an expert degree its model cannot take (ep 8 of the tiny model's 4
    experts: it stopped in the step-time model on a division by zero; ep on a dense model): one line, exit 2,
    nothing written (toolkit.plan.job.plan_job checks the plan's grid against its model)."""
    from toolkit.run.launcher import emit_plan_files

    model = tiny_llama_dir if dense else tiny_moe_dir
    folder = emit_plan_files(_moe_plan(model, "fsdp2", gpu="H100-SXM-80GB"), tmp_path / "plan")
    data = json.loads((folder / "plan.json").read_text())
    data.update(edit)
    (folder / "plan.json").write_text(json.dumps(data))
    capsys.readouterr()
    assert main(["emit", str(folder), "--out", str(tmp_path / "again")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--expert-parallel" in err[0] and fragment in err[0], err
    assert not (tmp_path / "again").exists()


@pytest.mark.parametrize("extra, fragment", [
    (["--expert-parallel", "3"], "does not fit fsdp 2"),
    (["--expert-parallel", "2", "--strategies", "ddp"], "which --strategies leaves out"),
    (["--expert-parallel", "2", "--tensor-parallel", "2", "--gpus", "4xH100-80GB"], "not modelled yet"),
    (["--expert-parallel", "2", "--dense"], "is dense"),
])
def test_plan_refuses_expert_parallel_it_cannot_run_in_one_line(extra, fragment, tiny_moe_dir, tiny_llama_dir,
                                                                  tmp_path, capsys):
    """Bad --expert-parallel on plan: one line, exit 2, nothing written (estimate's refusals, and the flags plan
    cannot combine with it)."""
    model = tiny_llama_dir if "--dense" in extra else tiny_moe_dir
    extra = [x for x in extra if x != "--dense"]
    gpus = [] if "--gpus" in extra else ["--gpus", "2xH100-80GB"]
    job = [] if "--seq" in extra else ["--seq", str(SEQ), "--global-batch", "4"]
    out = tmp_path / "plan"
    capsys.readouterr()
    assert main(["plan", str(model), *gpus, *job, *extra, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and fragment in err[0] and "Traceback" not in err[0], err
    assert not out.exists()


def test_seq_max_with_a_fixed_expert_degree_searches_that_row_alone(tiny_moe_dir, capsys):
    """`plan --seq max --expert-parallel 2`: the rows at that degree alone (FSDP2 x EP, and DeepSpeed AutoEP on
    zero1 / zero2 / zero3 for a model with an AutoEP preset, zero3 planned since dfb3551), each with its longest
    sequence and curve (the same search --seq max runs on the ep rows the planner tries by itself)."""
    capsys.readouterr()
    assert main(["plan", str(tiny_moe_dir), "--gpus", "2xH100-80GB", "--seq", "max", "--expert-parallel", "2"]) == 0
    out = capsys.readouterr().out
    rows = [line.strip() for line in out.splitlines() if ": longest sequence" in line or ": no sequence fits" in line]
    assert sorted(row.split(":")[0] for row in rows) == ["fsdp2 (dp=2 x ep=2)", "zero1 (dp=2 x autoep=2)",
                                                         "zero2 (dp=2 x autoep=2)", "zero3 (dp=2 x autoep=2)"], out
    assert all(": longest sequence" in row for row in rows), out


def test_each_autoep_zero2_rank_is_priced_with_its_own_gradient_partition(tiny_moe_dir):
    """AutoEP ZeRO-2 on 4 processes (dp 4 x autoep 2), the tiny Qwen3-MoE: DeepSpeed cuts the dense tensors (one
    group: the emitted JSON's optimizer block) into 4 partitions of 22,752 elements and each expert-data-parallel
    group's (ranks 0, 2 and 1, 3 by their rank // 2: layer 0's local experts, then layer 1's) into 2 of 24,576; a
    rank's grads_in_partition holds every tensor its partitions touch whole and is allocated by the first reduction
    that copies one of them in (stage_1_and_2.py copy_grads_in_partition), counted from its region's backward peak.
    So ranks 2 and 3 (the head's) allocate it beside the head's gradient, rank 0 at layer 0's backward (its peak is
    the head's backward with the head's gradient and no partition), rank 1 in layer 1's (`DM_STORAGES` of
    benchmarks/moe_distributed_memory.py: ranks 0, 1 peak in lm_head's backward holding its 131,072 B gradient,
    ranks 2, 3 in the final norm's beside 279,424 / 231,424 B partitions, 69,856 / 57,856 elements: ours less the
    two routers' 512 elements, which AutoEP's replacement moves to the end of the dense group, engine.py
    _remap_param_groups_after_module_replacement). The plan prices the worst rank's whole partition from the
    head's region on, above every rank."""
    from toolkit.estimate.memory import estimate_memory
    from toolkit.estimate.zeropartition import rank_gradient_partitions
    from toolkit.plan.job import plan_job

    plan = _moe_plan(tiny_moe_dir, "zero2", world=4, micro=1, expert=2).replace(gpu="H100-SXM-80GB",
                                                                                  device_kind="cpu")
    spec, hw, job = plan_job(plan, check=False)
    each = rank_gradient_partitions(spec, spec.params, 4, expert=2)
    assert each == [(32768 + 24576, 2), (49568 + 24576, 1), (45536 + 24576, 0), (32768 + 24576, 0)]
    assert [abs(n - measured) <= 512 for (n, _), measured in zip(each[2:], (69_856, 57_856))] == [True, True]
    peaks = [estimate_memory(spec, plan.strategy_spec, job, hw, grid=plan.grid, rank=r) for r in range(4)]
    worst = estimate_memory(spec, plan.strategy_spec, job, hw, grid=plan.grid)
    assert [b.peak_phase for b in peaks] == ["backward (head + loss)", "backward (layer 1)",
                                             "backward (head + loss)", "backward (head + loss)"]
    assert peaks[0].peak_bytes < peaks[1].peak_bytes < peaks[3].peak_bytes < peaks[2].peak_bytes < worst.peak_bytes
    assert peaks[2].peak_bytes - peaks[3].peak_bytes == (each[2][0] - each[3][0]) * 4  # fp32: the partitions apart
    # measured peaks of ranks 0..3 (routed rows 127, 129, 134, 122 of a balanced 128; the plan's busiest-rank
    # extra left out): within 5%, where the worst rank's figure is 9% over ranks 0 and 1
    extra = next(t.bytes for t in worst.terms if t.name == "busiest expert rank (routing)")
    for b, measured in zip(peaks, (1_816_116, 1_816_116, 2_040_532, 1_971_988)):
        assert b.peak_bytes - extra == pytest.approx(measured, rel=0.05)
    assert (worst.peak_bytes - extra) / 1_816_116 > 1.05


def _assert_states_as_planned(plan, ranks) -> list[tuple[float, float]]:
    """Every rank holds the plan's per-rank parameters_bytes and optimizer_bytes (toolkit.estimate.search
    .predict_plan, the figures PLAN.md prints; they do not depend on the GPU, so the CPU plan is priced as on
    H100s) within 1%: the local shards between steps, and AdamW's moments (its step counters, 4 bytes a tensor,
    are the rest). And its last step's peak (the rank summary's MemTracker peak) is the plan's peak_bytes priced
    for a CPU run, less its busiest-rank extra (so at balanced routing), moved by the rows the rank really received
    against the balanced ones times the traced bytes a received row keeps (toolkit.estimate.expertrows), within 5%. Returns each rank's error and
    its received / balanced rows."""
    from toolkit.estimate.experttime import expert_rows_per_rank
    from toolkit.estimate.expertrows import peak_at_received_rows, received_rows
    from toolkit.estimate.search import predict_plan
    from toolkit.inputs.moe import moe_layer_count
    from toolkit.plan.job import plan_job

    predicted = predict_plan(plan.replace(gpu="H100-SXM-80GB")).predicted
    on_cpu = plan.replace(gpu="H100-SXM-80GB", device_kind="cpu")
    spec, _, job = plan_job(on_cpu)
    ep, local = plan.expert_parallel, spec.moe_experts // plan.expert_parallel
    rows = expert_rows_per_rank(spec, job, on_cpu.grid)
    balanced = rows * moe_layer_count(spec)
    # the plan's peak is the busiest expert rank's: moved to the rows this rank received
    peak = predict_plan(on_cpu).predicted["peak_bytes"]
    routed = [r["routed_pairs"] for r in ranks]
    errors = []
    for r in ranks:
        assert r["param_bytes"] == pytest.approx(predicted["parameters_bytes"], rel=0.01), (r["rank"], predicted)
        assert r["optimizer_bytes"] == pytest.approx(predicted["optimizer_bytes"], rel=0.01), (r["rank"], predicted)
        received = received_rows(routed, r["rank"], ep, local)
        expected = peak_at_received_rows(peak, spec, job, rows, received)
        assert r["step_peak_bytes"] == pytest.approx(expected, rel=0.05), (r["rank"], received, balanced)
        errors.append((expected / r["step_peak_bytes"] - 1, received / balanced))
    return errors


@pytest.mark.multiprocess
def test_expert_parallel_trains_to_the_single_process_losses_with_half_the_experts_per_rank(
        moe_runs, tiny_moe_dir):
    """toolkit.train of an FSDP2 x EP plan (ep 2 = fsdp 2, 2 gloo processes, fp32, global batch 4): transformers
    loads the model with DistributedConfig(ep_size=2, fsdp_size=2) and the HF Trainer trains it; every step's loss
    equals the single process's (measured within 5e-7), each rank holds half of the routed experts' elements and
    the parameter and optimizer-state bytes the plan predicts a rank (measured: 378,624 of 378,624 and 757,348 of
    757,248), its last step's peak is the plan's at the rows it received (measured: the ranks received 1.27x and
    0.73x the balanced rows; predicted +2.4% and +2.6% over MemTracker's peaks of 2,611,044 and 2,434,108 B while
    the exchange's buffers were counted as a state, benchmarks/results/moe_distributed_memory.md),
    the ranks agree, and the saved model reloads whole to the trained logits."""
    import torch
    from transformers import AutoModelForCausalLM

    plan = _moe_plan(tiny_moe_dir, "fsdp2", expert=2)
    run, reference = moe_runs("ep2"), moe_runs("ref")
    ref = reference.losses()
    assert len(ref) == STEPS
    for rank in (0, 1):
        got = run.losses(rank)
        assert got.keys() == ref.keys()
        for step in ref:
            assert got[step] == pytest.approx(ref[step], abs=LOSS_TOLERANCE), (rank, step)
    held = [r["expert_numel"] for r in run.ranks]
    assert held[0][1] == held[1][1] == reference.ranks[0]["expert_numel"][0] > 0
    assert held[0][0] * 2 == held[1][0] * 2 == held[0][1], held
    errors = _assert_states_as_planned(plan, run.ranks)
    assert max(received for _, received in errors) > 1.1  # the ranks' rows were not balanced
    model = AutoModelForCausalLM.from_pretrained(run.output).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(run.ranks[0]["probe_input_ids"])).logits
    torch.testing.assert_close(logits, torch.tensor(run.ranks[0]["probe_logits"]), atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.tensor(run.ranks[1]["probe_logits"]), torch.tensor(run.ranks[0]["probe_logits"]),
                               atol=1e-6, rtol=0)


def _loads_in_transformers_as_trained(run, step: int | None = None) -> None:
    """The run's saved folder (`step`: its checkpoint-N folder) loads in transformers with every weight (no
    missing, unexpected or mismatched one) and gives the logits rank 0 recorded from the live model on its probe
    input (at the end of training, or when it wrote that checkpoint)."""
    import torch
    from transformers import AutoModelForCausalLM

    folder = run.output if step is None else run.output / f"checkpoint-{step}"
    expected = run.ranks[0]["probe_logits"] if step is None else run.ranks[0]["saved_probe_logits"][str(step)]
    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not any(info.values()), info
    with torch.no_grad():
        logits = model.eval()(input_ids=torch.tensor(run.ranks[0]["probe_input_ids"])).logits
    torch.testing.assert_close(logits, torch.tensor(expected), atol=1e-5, rtol=0)


@pytest.mark.multiprocess
def test_deepspeed_autoep_trains_to_the_single_process_losses_saves_checkpoints_for_transformers_and_resumes(
        moe_runs, run_training, tiny_moe_dir, corpus_dir, tmp_path):
    """toolkit.train of a DeepSpeed AutoEP plan (zero1, autoep_size 2, 2 gloo processes, fp32, global batch 4,
    clipping 1.0 as planned, DeepSpeed's AdamW as torch's on CPU): the engine replaces both MoE blocks, each rank
    holds the dense parameters and half of the experts, exactly the plan's per-rank parameter bytes, and steps 1-4
    lose what the single process (torch AdamW, same clipping) loses. Measured: 6.259349 / 6.232763 / 6.184993 /
    6.115284 on both ranks, steps 1-3 against 6.259349 / 6.232763 / 6.184992; 560,640 parameter bytes a rank
    (140,160 fp32 parameters, 49,152 of the 98,304 expert elements) as planned. Every model save is in the
    checkpoint's own layout (toolkit.train.autoep_export.AutoEPSaves): the final folder and checkpoint-2 (save_steps
    2) load in transformers with no weight missing and give the live model's logits at that step (before, their
    files named AutoEP's tensors and from_pretrained filled 12 expert / router weights randomly), and a run resumed
    from checkpoint-2 alone (the engine reloads its own state) loses at steps 3 and 4 what the uninterrupted run
    lost (measured: equal to every printed digit)."""
    from toolkit.estimate.search import predict_plan
    from toolkit.inputs.moe import expert_params
    from toolkit.inputs.modelspec import build_spec
    from toolkit.train.model import load_config

    plan = _moe_plan(tiny_moe_dir, "zero1", expert=2)
    assert plan.grid.autoep and plan.grid.resume_problem() is None
    run = moe_runs("autoep2")
    ref = moe_runs("ref").losses()
    for rank in (0, 1):
        got = run.losses(rank)
        assert sorted(got) == sorted(ref)[:4]
        for step in got:
            assert got[step] == pytest.approx(ref[step], abs=LOSS_TOLERANCE), (rank, step)
    spec = build_spec(str(tiny_moe_dir), load_config(str(tiny_moe_dir)))
    experts = expert_params(spec)
    predicted = predict_plan(plan.replace(gpu="H100-SXM-80GB")).predicted["parameters_bytes"]
    assert predicted == 4 * (spec.params - experts + experts // 2)
    assert [r["param_bytes"] for r in run.ranks] == [predicted] * 2
    assert [r["expert_numel"][0] for r in run.ranks] == [experts // 2] * 2
    _loads_in_transformers_as_trained(run)
    _loads_in_transformers_as_trained(run, step=2)
    shutil.copytree(run.output / "checkpoint-2", tmp_path / "resumed" / "checkpoint-2")
    resumed = run_training(plan, "moe-autoep2-resumed", "--data", str(corpus_dir), *TRAIN, *AUTOEP_STEPS, "--resume",
                           output=tmp_path / "resumed", timeout=600).check()
    assert [sorted(r["saved_probe_logits"]) for r in resumed.ranks] == [["4"]] * 2  # steps 3-4 ran, not 1-2
    uninterrupted = run.losses()
    for rank in (0, 1):
        got = resumed.losses(rank)  # steps 1-2 as checkpoint-2's trainer_state.json logged them
        assert sorted(got) == [1, 2, 3, 4], got
        for step in got:
            assert got[step] == pytest.approx(uninterrupted[step], abs=1e-5), (rank, step)


@pytest.mark.multiprocess
def test_a_zero3_autoep_model_saves_for_transformers_where_the_engine_refuses(tiny_moe_dir, tmp_path):
    """DeepSpeed AutoEP under ZeRO-3 (autoep_size 2 on 4 gloo ranks, so each expert tensor is also ZeRO-partitioned
    over its 2-rank expert-data-parallel group; fp32, every parameter partitioned), a user's own HF Trainer script
    (tests/autoep_zero3_save.py) whose saves come from toolkit.train.autoep_export.AutoEPSaves, beside one plain
    process on the same samples. The engine's own consolidation refuses (runtime/engine.py
    `_raise_if_autoep_zero3_consolidated_export`); the export gathers each module over its own partition group and
    the experts over the expert group, and checkpoint-2 and the final folder load in transformers with no weight
    missing, unexpected or mismatched and give the live model's logits within 1e-5. Measured: logits equal (max
    difference 0.0), 47,328 parameter elements a rank (91,008 dense / 4 + 98,304 expert / 2 / 2), losses 6.235588 /
    6.246290 on every rank against one process's 6.235589 / 6.246290."""
    import os
    import subprocess
    import sys

    import torch
    from transformers import AutoModelForCausalLM

    from toolkit.inputs.modelspec import build_spec
    from toolkit.inputs.moe import expert_params
    from toolkit.train.model import load_config

    script = Path(__file__).parent / "autoep_zero3_save.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    out, summary = tmp_path / "out", tmp_path / "ranks"
    launches = [[sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--standalone", str(script),
                 str(tiny_moe_dir), str(out), str(summary), "4"],
                [sys.executable, str(script), str(tiny_moe_dir), str(tmp_path / "ref"), str(summary), "reference"]]
    procs = [subprocess.Popen(c, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for c in launches]
    for proc in procs:
        output = proc.communicate(timeout=600)[0]
        assert proc.returncode == 0, output[-6000:]
    ranks = [json.loads((summary / f"rank{r}.json").read_text()) for r in range(4)]
    reference = json.loads((summary / "reference.json").read_text())["losses"]
    assert len(reference) == 2
    for r in ranks:
        assert r["losses"].keys() == reference.keys()
        for step in reference:
            assert r["losses"][step] == pytest.approx(reference[step], abs=LOSS_TOLERANCE), step
        assert "AutoEP with ZeRO Stage 3" in r["refusal"]
    spec = build_spec(str(tiny_moe_dir), load_config(str(tiny_moe_dir)))
    experts = expert_params(spec)
    assert [r["local_numel"] for r in ranks] == [(spec.params - experts) // 4 + experts // 4] * 4
    expected = torch.tensor(ranks[0]["probe_logits"])
    for folder in (out, out / "checkpoint-2"):
        model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
        assert not any(info.values()), (folder, info)
        with torch.no_grad():
            logits = model.eval()(input_ids=torch.arange(1, 17).unsqueeze(0)).logits
        torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def tiny_mixtral_dir(tmp_path_factory) -> Path:
    """Mixtral, 2 layers, hidden 64, 4 experts (top-2; fused gate/up experts, a router without bias), random weights."""
    from toolkit.run import tiny

    return tiny.make_tiny_model("mixtral", tmp_path_factory.mktemp("tiny-mixtral"), layers=2, hidden=64, experts=4,
                                corpus_chars=100_000)


@pytest.mark.multiprocess
def test_deepspeed_autoep_trains_mixtral_to_the_single_process_losses_and_saves_it_for_transformers(
        runs_side_by_side, tiny_mixtral_dir, corpus_dir):
    """A second architecture through DeepSpeed AutoEP (its mixtral preset), with expert data parallelism: zero2,
    autoep_size 2 on 4 gloo processes (ep 2 x dp 2: each expert group's ZeRO partition over 2 ranks), fp32, global
    batch 4, against one process on the whole batch. Steps 1-4 lose what the single process loses (within 1e-3),
    each rank holds half of the experts and the plan's parameter bytes, its ZeRO-2 partition is the plan's (dense
    over 4 ranks, experts over 2), and both model saves, checkpoint-2 (save_steps 2) and the final folder, load in
    transformers with every weight and give the live model's logits at that step
    (toolkit.train.autoep_export.AutoEPSaves). Measured: 6.259479 / 6.263856 / 6.177217 / 6.118142 on every rank
    against one process's 6.259479 / 6.263856 / 6.177217 / 6.118143 (within 5e-7); 98,304 of the 196,608 expert
    elements and 756,992 parameter bytes a rank, as planned; 575,112 optimizer-state bytes (71,888 partition
    elements x 2 moments x 4 B + 2 step counters), the plan's 862,656 less the fp32 master partition."""
    from toolkit.estimate.search import predict_plan

    args = ("--data", str(corpus_dir), *TRAIN, *AUTOEP_STEPS)
    plan = _moe_plan(tiny_mixtral_dir, "zero2", world=4, micro=1, expert=2)
    assert plan.grid.autoep and plan.grid.describe() == "dp=4 x autoep=2"
    runs = runs_side_by_side({"ref": (_moe_plan(tiny_mixtral_dir, "ddp", world=1, micro=4), "mixtral-ref", *args),
                              "autoep2": (plan, "mixtral-autoep2", *args)}, timeout=600)
    reference, run = runs["ref"].check(), runs["autoep2"].check()
    assert run.ranks[0]["world"] == 4
    ref = reference.losses()
    assert len(ref) == 4
    for rank in range(4):
        got = run.losses(rank)
        assert got.keys() == ref.keys()
        for step in ref:
            assert got[step] == pytest.approx(ref[step], abs=LOSS_TOLERANCE), (rank, step)
    experts = reference.ranks[0]["expert_numel"][0]
    assert experts > 0 and [r["expert_numel"][0] for r in run.ranks] == [experts // 2] * 4
    dense = reference.ranks[0]["param_bytes"] // 4 - experts
    partition = dense // 4 + experts // 2 // 2  # ZeRO-2: the dense group over 4 ranks, each expert group over 2
    predicted = predict_plan(plan.replace(gpu="H100-SXM-80GB")).predicted
    assert predicted["parameters_bytes"] == 4 * (dense + experts // 2)
    assert predicted["optimizer_bytes"] == 12 * partition  # fp32 master + AdamW's two moments
    for r in run.ranks:
        assert r["param_bytes"] == predicted["parameters_bytes"]
        # optimizer.state holds the moments and one step counter per group (dense, experts); the fp32 master
        # partition is DeepSpeed's single_partition_of_fp32_groups, beside it
        assert r["optimizer_bytes"] == 8 * partition + 2 * 4
    assert [sorted(r["saved_probe_logits"]) for r in run.ranks] == [["2", "4"]] * 4
    _loads_in_transformers_as_trained(run)
    _loads_in_transformers_as_trained(run, step=2)


@pytest.fixture(scope="module")
def tiny_gpt_oss_dir(tmp_path_factory) -> Path:
    """GPT-OSS, 2 layers, hidden 64, 4 experts (biased experts and router, attention sinks), random weights."""
    from toolkit.run import tiny

    return tiny.make_tiny_model("gpt_oss", tmp_path_factory.mktemp("tiny-gpt-oss"), layers=2, hidden=64, experts=4,
                                corpus_chars=100_000)


@pytest.mark.multiprocess
def test_expert_parallel_with_fsdp_sharded_experts_trains_gpt_oss_to_the_single_process_losses(
        runs_side_by_side, tiny_gpt_oss_dir, corpus_dir):
    """ep 2 x fsdp 4 on 4 gloo processes (efsdp 2: each expert FSDP-sharded over the 2 ranks that hold it) of
    another architecture, GPT-OSS (biased experts, eager attention with sinks): every step's loss equals one
    process's on the whole batch (measured within 1.5e-6), each rank holds a quarter of the routed experts'
    elements (half the experts, halved again by efsdp) and the parameter and optimizer-state bytes the plan
    predicts a rank, and the ranks agree. Its last step's peak is the plan's at the rows each rank received
    (measured: predicted +1.8% to +2.0% over MemTracker's 2,154,265 to 2,301,287 B, at 0.85x to 1.15x the
    balanced rows)."""
    import torch

    args = ("--data", str(corpus_dir), *TRAIN)
    plan = _moe_plan(tiny_gpt_oss_dir, "fsdp2", world=4, micro=1, expert=2)
    runs = runs_side_by_side({"ref": (_moe_plan(tiny_gpt_oss_dir, "ddp", world=1, micro=4), "gpt-oss-ref", *args),
                              "ep2-fsdp4": (plan, "gpt-oss-ep2-fsdp4", *args)}, timeout=600)
    reference, run = runs["ref"].check(), runs["ep2-fsdp4"].check()
    assert run.ranks[0]["world"] == 4
    ref = reference.losses()
    assert len(ref) == STEPS
    for rank in range(4):
        got = run.losses(rank)
        assert got.keys() == ref.keys()
        for step in ref:
            assert got[step] == pytest.approx(ref[step], abs=LOSS_TOLERANCE), (rank, step)
        local, total = run.ranks[rank]["expert_numel"]
        assert total == reference.ranks[0]["expert_numel"][0] and local * 4 == total, run.ranks[rank]["expert_numel"]
        torch.testing.assert_close(torch.tensor(run.ranks[rank]["probe_logits"]),
                                   torch.tensor(run.ranks[0]["probe_logits"]), atol=1e-6, rtol=0)
    _assert_states_as_planned(plan, run.ranks)


def test_an_expert_parallel_plan_rehearses_at_ep_2_and_a_smaller_box_must_keep_its_ep(tiny_moe_dir, tmp_path):
    """`launch --rehearse` of an ep 4 plan runs ep 2 x fsdp 2 on 2 processes (the tiny model's 4 experts split in
    half); `launch --processes N` refuses, in one line, a process count that ep does not divide."""
    from toolkit.errors import UserError
    from toolkit.run.rehearsal import rehearsal_plan
    from toolkit.run.smaller_box import box_plan

    plan = _moe_plan(tiny_moe_dir, "fsdp2", world=4, micro=1, expert=4)
    small, _ = rehearsal_plan(plan, tiny_moe_dir)
    assert (small.world_size, small.expert_parallel, small.strategy) == (2, 2, "fsdp2")
    with pytest.raises(UserError, match=r"--processes 2 cannot run expert parallel 4 \(it must divide"):
        box_plan(plan, processes=2, cpu=True)
    assert box_plan(plan, processes=4, cpu=True)[0].expert_parallel == 4


@pytest.mark.multiprocess
def test_launch_rehearses_qwen3_30b_a3b_s_expert_parallel_plan_on_cpu(tmp_path, capfd):
    """`toolkit launch --rehearse` of Qwen3-30B-A3B's fsdp2 (dp=8 x ep=8) plan on 8 x H100 (bf16, what plan picks
    for seq 2048, global batch 16) runs ep 2 x fsdp 2 on 2 gloo processes of a tiny Qwen3-MoE of the same config
    (transformers' DistributedConfig with fsdp_mixed_precision): trains 4 steps, checkpoints the model, saves and
    reloads it, and says the plan cannot resume."""
    from toolkit.commands.launch import launch_main
    from toolkit.run.launcher import emit_plan_files
    from toolkit.run.rehearsal import plan_for_model

    real = tmp_path / "qwen3-30b-a3b"
    real.mkdir()
    shutil.copy(ARCH / "qwen3-30b-a3b.json", real / "config.json")
    plan = plan_for_model(real, "fsdp2", gpus_per_node=8, micro_batch=2, seq_len=2048, precision="bf16", expert=8,
                          gpu="H100-SXM-80GB")
    assert plan.grid.describe() == "dp=8 x ep=8"
    code = launch_main(emit_plan_files(plan, tmp_path / "p"), [], rehearse=True)
    out = capfd.readouterr().out
    assert code == 0, out[-3000:]
    assert "rehearsal of fsdp2 dp=2 x ep=2 (bf16) on 2 CPU processes over gloo: qwen3_moe 4 layers" in out, out
    assert "note: expert parallelism: transformers shards the model" in out and "cannot resume" in out
    assert "rehearsal passed: fsdp2 dp=2 x ep=2 trained 4 steps, checkpointed, saved and reloaded" in out, out


@pytest.mark.multiprocess
def test_launch_rehearses_qwen3_30b_a3b_s_zero3_autoep_plan_on_cpu(tmp_path, capfd):
    """What plan picks for Qwen3-30B-A3B on 8 x H100 at seq 2048, global batch 16 since ZeRO-3 AutoEP is planned:
    zero3 (dp=8 x autoep=8). `launch --rehearse` runs zero3 autoep 2 on 2 gloo processes of a tiny Qwen3-MoE of
    the same config: trains 4 steps, checkpoints, saves through toolkit.train.autoep_export (the plan's JSON asks
    no 16-bit gather) and reloads (measured: losses 6.267 / 6.278 / 6.269 / 6.279, bf16)."""
    from toolkit.commands.launch import launch_main
    from toolkit.run.launcher import emit_plan_files
    from toolkit.run.rehearsal import plan_for_model

    real = tmp_path / "qwen3-30b-a3b"
    real.mkdir()
    shutil.copy(ARCH / "qwen3-30b-a3b.json", real / "config.json")
    plan = plan_for_model(real, "zero3", gpus_per_node=8, micro_batch=2, seq_len=2048, precision="bf16", expert=8,
                          gpu="H100-SXM-80GB")
    assert plan.grid.describe() == "dp=8 x autoep=8" and plan.leaf_modules == []
    code = launch_main(emit_plan_files(plan, tmp_path / "p"), [], rehearse=True)
    out = capfd.readouterr().out
    assert code == 0, out[-3000:]
    assert "rehearsal passed: zero3 dp=2 x autoep=2 trained 4 steps, checkpointed, saved and reloaded" in out, out


# --- toolkit check ------------------------------------------------------------------------------------------------

ZERO3 = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
         "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}}


def _small_model(name: str, folder: Path) -> Path:
    from toolkit.inputs.modelconfig import config_from_dict
    from toolkit.run.tiny import shrink_config

    config = shrink_config(config_from_dict(json.loads((ARCH / f"{name}.json").read_text()), name), layers=2,
                           experts=4)
    config.save_pretrained(folder)
    return folder


def _check(capsys, *argv) -> tuple[int, list[str]]:
    capsys.readouterr()
    code = main(["check", *argv])
    captured = capsys.readouterr()
    return code, [line for line in (captured.out + captured.err).splitlines() if "leaf" in line]


@pytest.mark.parametrize("name, zero", [
    # GPT-OSS's block is in no default list, but its experts are one fused module every rank calls once a pass
    ("gpt-oss-20b", {}),
    ("gpt-oss-20b", {"leaf_module": {"classes": ["GptOssMLP"]}}),
    # an explicit empty list turns DeepSpeed's default (Qwen3MoeSparseMoeBlock) off: fused experts again
    ("qwen3-30b-a3b", {"leaf_module": {"classes": []}}),
    ("qwen3-30b-a3b", {"stage": 2}),
    ("qwen3-0.6b", {}),
])
def test_check_says_nothing_of_leaf_modules_for_fused_experts_or_dense_models(name, zero, tmp_path, capsys):
    """`check ds.json --model M` of a ZeRO-3 JSON for transformers 5's MoE models (fused experts: one module, its 3-D
    weights fetched whole by one hook, called once a pass whatever the routing) gives no leaf-module finding, flagged
    or not: ZeRO-3's gathers and traced order are the same on every rank (measured: the tiny Qwen3-MoE with leaf
    modules off trains 2 gloo ranks to one process's losses, docs/ENGINE_FACTS.md). Before, GPT-OSS's stock ZeRO-3
    JSON was warned of a hang it cannot have."""
    model = _small_model(name, tmp_path / "model")
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({**ZERO3, "zero_optimization": {**ZERO3["zero_optimization"], **zero}}))
    code, lines = _check(capsys, str(ds), "--model", str(model), "--gpus", "8xH100-80GB")
    assert lines == []
    assert _check(capsys, str(ds))[1] == []  # a lone JSON names no model: nothing to say


def test_only_per_expert_submodules_need_the_block_as_leaf_and_check_names_the_fix():
    """The MoE parts say whether the routed experts are separate submodules (each rank calls the ones its tokens
    pick): the tiny Qwen3-MoE's fused experts are not; the same model with a ModuleList of expert MLPs (transformers
    4.x, remote-code models) is, and only then does a ZeRO-3 config without the block as leaf get the warning, with
    the JSON key or accelerate's field as the fix."""
    import torch
    from torch import nn
    from transformers import AutoConfig, AutoModelForCausalLM

    from toolkit.check.moe import leaf_module_problem, yaml_leaf_module_problem
    from toolkit.inputs.moe import find_moe

    config = AutoConfig.for_model("qwen3_moe", hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                  num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, num_experts=4,
                                  num_experts_per_tok=2, vocab_size=64)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert find_moe(model, config).expert_modules is False
    for layer in model.model.layers:
        layer.mlp.experts = nn.ModuleList(nn.ModuleDict({"w1": nn.Linear(32, 16), "w2": nn.Linear(16, 32)})
                                          for _ in range(4))
    parts = find_moe(model, config)
    assert (parts.expert_modules, parts.block_class, parts.experts) == (True, "Qwen3MoeSparseMoeBlock", 4)
    off = {**ZERO3, "zero_optimization": {**ZERO3["zero_optimization"], "leaf_module": {"classes": []}}}
    found = leaf_module_problem(off, "ds.json", model="m", moe_block=parts.block_class)
    assert found.severity == "warning" and "its experts are separate modules" in found.message
    assert '"leaf_module": {"classes": ["Qwen3MoeSparseMoeBlock"]}' in found.message
    assert leaf_module_problem(off, "ds.json", model="m", moe_block=None) is None  # fused or dense
    yaml_config = {"distributed_type": "DEEPSPEED", "deepspeed_config": {"zero_stage": 3}}
    block = "RemoteSparseMoeBlock"  # in no DeepSpeed default list (Qwen3MoeSparseMoeBlock is)
    found = yaml_leaf_module_problem(yaml_config, "a.yaml", model="m", moe_block=block)
    assert f"add deepspeed_moe_layer_cls_names: {block} to deepspeed_config" in found.message
    yaml_config["deepspeed_config"]["deepspeed_moe_layer_cls_names"] = block
    assert yaml_leaf_module_problem(yaml_config, "a.yaml", model="m", moe_block=block) is None


def test_check_of_a_plan_folder_of_fused_experts_says_nothing_of_leaf_modules(tiny_moe_dir, tmp_path, capsys):
    """The emitted ZeRO-3 folder of an MoE plan is clean, and stays clean with leaf modules turned off in
    ds_config.json: the tiny Qwen3-MoE's experts are fused (measured to train without the flag)."""
    from toolkit.run.launcher import emit_plan_files

    folder = emit_plan_files(_moe_plan(tiny_moe_dir, "zero3"), tmp_path / "plan")
    assert _check(capsys, str(folder))[1] == []
    ds = folder / "ds_config.json"
    config = json.loads(ds.read_text())
    config["zero_optimization"]["leaf_module"] = {"classes": []}
    ds.write_text(json.dumps(config))
    assert _check(capsys, str(folder))[1] == []


def test_check_of_an_accelerate_zero3_yaml_for_gpt_oss_says_nothing_of_leaf_modules(tmp_path, capsys):
    """An accelerate YAML whose own deepspeed_config fields ask ZeRO-3 for GPT-OSS (fused experts) without
    deepspeed_moe_layer_cls_names: no leaf-module finding."""
    import yaml

    model = _small_model("gpt-oss-20b", tmp_path / "model")
    config = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "DEEPSPEED", "num_machines": 1,
              "num_processes": 8, "mixed_precision": "bf16",
              "deepspeed_config": {"zero_stage": 3, "zero3_save_16bit_model": True}}
    path = tmp_path / "accelerate.yaml"
    path.write_text(yaml.safe_dump(config))
    assert _check(capsys, str(path), "--model", str(model), "--gpus", "8xH100-80GB")[1] == []


@pytest.mark.parametrize("name, section, fragment", [
    ("qwen3-30b-a3b", {"autoep_size": 2, "preset_model": "qwen3_moe"}, None),
    ("qwen3-30b-a3b", {"autoep_size": 3, "preset_model": "qwen3_moe"}, "autoep_size 3 does not divide its 4 experts"),
    ("qwen3-30b-a3b", {"autoep_size": 2, "preset_model": "mixtral"}, "preset_model mixtral is for model types mixtral, "
                                                                     "not qwen3_moe; use preset_model qwen3_moe"),
    ("gpt-oss-20b", {"autoep_size": 2}, "AutoEP has no preset for model type gpt_oss"),
    ("qwen3-0.6b", {"autoep_size": 2}, "a dense model (no MoE block)"),
])
def test_check_finds_autoep_asked_of_a_model_it_cannot_split(name, section, fragment, tmp_path, capsys):
    """DeepSpeed AutoEP's rules against the model given with --model: the expert count autoep_size must divide, a
    preset of the model's type (none: AutoEP detects nothing and trains without EP), and a model with experts."""
    model = _small_model(name, tmp_path / "model")
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
                              "zero_optimization": {"stage": 1}, "expert_parallel": {"enabled": True, **section}}))
    capsys.readouterr()
    main(["check", str(ds), "--model", str(model), "--gpus", "8xH100-80GB"])
    captured = capsys.readouterr()
    lines = [line for line in (captured.out + captured.err).splitlines()
             if "expert_parallel (DeepSpeed AutoEP)" in line]  # autoep_problems' findings
    if fragment is None:
        assert lines == []
    else:
        assert len(lines) == 1 and "error" in lines[0] and fragment in lines[0], lines


def test_check_fits_a_deepspeed_autoep_json_at_its_expert_degree(tmp_path, capsys):
    """`check ds.json --model M` of a ZeRO-2 JSON with DeepSpeed AutoEP on (autoep_size 8, the qwen3_moe preset) fits
    the AutoEP grid the section describes (16 of 128 experts a rank), the memory `estimate --strategy zero2
    --expert-parallel 8` gives. Before, the fit ignored expert_parallel and priced plain ZeRO-2, every expert on
    every rank: Qwen3-30B-A3B on 2x8xH100-80GB 'needs 97.0 GiB' (error) where the AutoEP run needs 49.5 and fits."""
    from toolkit.check.fit import Pins, fit_findings
    from toolkit.estimate.memory import estimate_memory
    from toolkit.inputs.choices import GIB
    from toolkit.inputs.grid import ParallelGrid
    from toolkit.inputs.hardware import parse_hardware
    from toolkit.inputs.job import Job
    from toolkit.inputs.modelspec import resolve_model
    from toolkit.inputs.strategy import Strategy

    model = str(ARCH / "qwen3-30b-a3b.json")
    ds = tmp_path / "ds.json"
    section = {"enabled": True, "autoep_size": 8, "preset_model": "qwen3_moe"}
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
                              "zero_optimization": {"stage": 2}, "expert_parallel": section}))
    found = fit_findings(str(ds), model=model, gpus="2x8xH100-80GB", seq_len=2048, pins=Pins(checkpointing=True))
    fit = [f for f in found if "per GPU" in f.message]
    assert len(fit) == 1 and fit[0].severity == "note" and ": fits, " in fit[0].message, fit
    assert any("expert parallelism: dp=16 x autoep=8 (16 of 128 experts a rank)" in f.message for f in found)
    hw = parse_hardware("2x8xH100-80GB")
    strategy = Strategy("zero2")
    grid = ParallelGrid.for_strategy(strategy, nodes=2, gpus_per_node=8, expert=8)
    job = Job(seq_len=2048, micro_batch=1, precision="bf16", checkpointing=True, zero_reduce_bucket=int(5e8))
    want = estimate_memory(resolve_model(model), strategy, job, hw, grid=grid).required_bytes / GIB
    assert f"fits, {want:.1f} GiB of 79.1 per GPU" in fit[0].message
    assert want < 79.1 < estimate_memory(resolve_model(model), strategy, job, hw).required_bytes / GIB
    section["enabled"] = False  # AutoEP off: plain ZeRO-2, which does not fit
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
                              "zero_optimization": {"stage": 2}, "expert_parallel": section}))
    found = fit_findings(str(ds), model=model, gpus="2x8xH100-80GB", seq_len=2048, pins=Pins(checkpointing=True))
    assert [f.severity for f in found if "per GPU" in f.message] == ["error"]


def test_check_of_an_expert_parallel_plan_folder_fits_what_the_plan_predicted(tmp_path, capsys):
    """`check FOLDER --model M --gpus G` of the fsdp2 x ep=8 plan of Qwen3-30B-A3B on 2x8xH100-80GB fits the plan's own
    grid and allocator: the required bytes plan.json predicted (40.8 GiB). Before, the fit priced plain FSDP2 with
    the default allocator (49.2 GiB), then the expert grid without the plan's expandable segments (45.9 GiB)."""
    from toolkit.check.fit import fit_findings
    from toolkit.inputs.choices import GIB

    model, folder = str(ARCH / "qwen3-30b-a3b.json"), tmp_path / "plan"
    assert main(["plan", model, "--gpus", "2x8xH100-80GB", "--seq", "2048", "--global-batch", "64",
                 "--expert-parallel", "8", "--strategies", "fsdp2", "--out", str(folder)]) == 0
    predicted = json.loads((folder / "plan.json").read_text())["predicted"]["required_bytes"] / GIB
    found = fit_findings(str(folder), model=model, gpus="2x8xH100-80GB")
    assert any("expert parallelism: dp=16 x ep=8 (16 of 128 experts a rank)" in f.message for f in found)
    fit = [f.message for f in found if "per GPU" in f.message]
    assert len(fit) == 1 and f"fits, {predicted:.1f} GiB of 79.1 per GPU" in fit[0], (predicted, fit)


QUANTIZED_FIX = {"gpt-oss-20b": "quantization_config=Mxfp4Config(dequantize=True)",
                 "deepseek-v3": "quantization_config=FineGrainedFP8Config(dequantize=True)"}


@pytest.mark.parametrize("name, zero, dequantize, refused", [
    # MXFP4 (GPT-OSS's published config): Mxfp4HfQuantizer.is_trainable is False, so adapters are refused too
    ("gpt-oss-20b", 3, None, "and, as Mxfp4HfQuantizer.is_trainable is False, with them"),
    ("gpt-oss-20b", 2, True, None),  # the checkpoint's own quantization_config says dequantize
    # fine-grained FP8 (DeepSeek-V3's published config): trainable with adapters, not in full
    ("deepseek-v3", 2, None, "(LoRA on it trains)"),
])
def test_check_finds_a_quantized_checkpoint_nothing_loads_dequantized(name, zero, dequantize, refused, tmp_path,
                                                                       capsys):
    """`check ds.json --model M` of a checkpoint stored MXFP4 / FP8 (its config.json's quantization_config, a method
    whose transformers config takes `dequantize`): the HF Trainer would refuse it as loaded (transformers'
    validate_quantization_for_training), so one warning names the problem and the fix, the config class read
    from transformers' own mapping; under ZeRO-3 it adds that each rank dequantizes the whole model. Nothing is
    said once the quantization_config asks for dequantize, and transformers' own log line does not leak."""
    config = json.loads((ARCH / f"{name}.json").read_text())
    if dequantize:
        config["quantization_config"]["dequantize"] = True
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(config))
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({**ZERO3, "zero_optimization": {"stage": zero, "leaf_module": {"classes": ["x"]}}}))
    capsys.readouterr()
    main(["check", str(ds), "--model", str(model), "--gpus", "8xH100-80GB"])
    captured = capsys.readouterr()
    lines = [line for line in (captured.out + captured.err).splitlines() if "quantization_config" in line]
    if refused is None:
        assert lines == []
        return
    assert len(lines) == 1 and "warning" in lines[0], lines
    assert "quantized (its config.json's quantization_config) and nothing here loads it dequantized" in lines[0]
    assert refused in lines[0] and QUANTIZED_FIX[name] in lines[0]
    assert ("each rank still loads and dequantizes the whole model" in lines[0]) == (zero == 3)


def test_a_quantized_checkpoint_a_lora_plan_can_train_gets_no_finding():
    """FP8's quantizer is trainable: LoRA on the quantized base passes the Trainer's check, full fine-tuning does
    not; MXFP4's is not, whatever the method; bitsandbytes (no `dequantize` in its config) is QLoRA's on purpose."""
    from toolkit.check.quantized import quantized_checkpoint_problem

    def found(name, method, quantization=None):
        config = json.loads((ARCH / f"{name}.json").read_text())
        if quantization:
            config["quantization_config"] = quantization
        return quantized_checkpoint_problem(config, "plan.json", model=name, params=10**9, method=method,
                                            zero3=False) is not None

    assert not found("deepseek-v3", "lora") and found("deepseek-v3", "full")
    assert found("gpt-oss-20b", "lora") and found("gpt-oss-20b", "full")
    assert not found("qwen3-0.6b", "full")
    assert not found("qwen3-0.6b", "full", {"quant_method": "bitsandbytes", "load_in_4bit": True})
