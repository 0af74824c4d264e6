"""emit_files: every strategy x precision writes files the engines accept, with one batch arithmetic everywhere."""

from __future__ import annotations

import json
import os
import random
import stat

import pytest
import yaml

from toolkit.emit import emit_files
from toolkit.emit.deepspeed import (OFFLOAD_OPTIMIZER_AUTO_KEYS, PRECISION_AUTO_KEYS, RUNNER_FILLED_AUTO_KEYS,
                                    auto_keys, ds_config)
from toolkit.engines.validate import (ConfigRejected, accelerate_launch_check, deepspeed_config_at,
                                   validate_ds_config_for_plan)
from toolkit.errors import UserError
from toolkit.plan.schema import Plan
from toolkit.emit.presets import reference_plan

STRATEGIES = {
    # strategy: grid (nodes, stages)
    "ddp": (1, 1), "zero1": (1, 1), "zero2": (1, 1), "zero3": (1, 1), "zero2-offload": (1, 1),
    "zero3-offload": (1, 1), "zero3-offload-opt": (1, 1), "fsdp2": (1, 1), "fsdp2-grad-op": (1, 1),
    "fsdp2-hybrid": (2, 1), "pipeline": (1, 8), "hybrid": (2, 2), "zero3-multinode": (2, 1),
}
PRECISIONS = ("bf16", "fp16", "fp32", "bf16-pure")


def plan_for(name: str, precision: str) -> Plan:
    nodes, stages = STRATEGIES[name]
    strategy = name.replace("-multinode", "")
    return reference_plan(strategy, precision, nodes=nodes, stages=stages, micro=2, accum=4)


def load(out, name):
    path = out / name
    return json.loads(path.read_text()) if name.endswith(".json") else yaml.safe_load(path.read_text())


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_emitted_files_pass_accelerate_and_deepspeed(tmp_path, name, precision):
    plan = plan_for(name, precision)
    written = emit_files(plan, tmp_path)
    names = {p.name for p in written}
    assert {"accelerate_config.yaml", "plan.json", "PLAN.md"} <= names
    assert ("launch.sh" in names) == (plan.num_machines == 1)
    assert ("slurm.sbatch" in names and "hostfile" in names) == (plan.num_machines > 1)
    assert ("ds_config.json" in names) == (plan.engine in ("deepspeed", "pipeline"))

    from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file

    assert isinstance(load_config_from_file(str(tmp_path / "accelerate_config.yaml")), ClusterConfig)
    args = accelerate_launch_check(tmp_path / "accelerate_config.yaml")
    assert args.num_processes == plan.world_size
    if "ds_config.json" in names:
        parsed = validate_ds_config_for_plan(load(tmp_path, "ds_config.json"), plan)
        assert parsed.train_batch_size == plan.global_batch
        assert parsed.train_micro_batch_size_per_gpu == plan.micro_batch
        assert parsed.gradient_accumulation_steps == plan.grad_accum


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_batch_arithmetic_is_the_same_in_plan_yaml_json_and_plan_md(tmp_path, name):
    plan = plan_for(name, "bf16")
    emit_files(plan, tmp_path)
    saved = Plan(**json.loads((tmp_path / "plan.json").read_text()))
    assert saved == plan
    config = load(tmp_path, "accelerate_config.yaml")
    assert config["num_processes"] == plan.data_parallel * plan.pipeline_stages
    assert config["num_machines"] == plan.num_machines
    if plan.engine in ("deepspeed", "pipeline"):
        # ZeRO plans: the runner fills ds_config.json's batch keys; the DeepSpeed-launcher file has the numbers.
        ds = load(tmp_path, "ds_config.json" if plan.engine == "pipeline" else "ds_config.deepspeed.json")
        assert ds["train_batch_size"] == ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] \
            * plan.data_parallel == plan.global_batch
    md = (tmp_path / "PLAN.md").read_text()
    assert (f"micro {plan.micro_batch} x accum {plan.grad_accum} x dp {plan.data_parallel} = "
            f"{plan.global_batch}") in md


def test_pipeline_json_has_no_auto_and_zero_at_most_1():
    for name in ("pipeline", "hybrid"):
        for precision in PRECISIONS:
            config = ds_config(plan_for(name, precision))
            assert auto_keys(config) == []
            assert config["zero_optimization"]["stage"] <= 1


def test_bf16_pipeline_accumulates_in_fp32_with_zero1():
    config = ds_config(plan_for("pipeline", "bf16"))
    assert config["data_types"] == {"grad_accum_dtype": "fp32"}
    assert config["zero_optimization"]["stage"] == 1


def test_auto_only_where_both_the_trainer_and_accelerate_fill_it():
    for name in STRATEGIES:
        plan = plan_for(name, "bf16")
        if plan.engine != "deepspeed":
            continue
        expected = list(RUNNER_FILLED_AUTO_KEYS) + list(PRECISION_AUTO_KEYS)
        if plan.offload_optimizer != "none":
            expected += list(OFFLOAD_OPTIMIZER_AUTO_KEYS)
        assert sorted(auto_keys(ds_config(plan))) == sorted(expected), name
        concrete = ds_config(plan, runner_fills=False)
        assert auto_keys(concrete) == [], name
        deepspeed_config_at(concrete, plan.data_parallel)  # the DeepSpeed-launcher file as DeepSpeed reads it


def test_buckets_follow_the_hidden_size():
    zero = ds_config(plan_for("zero3", "bf16"))["zero_optimization"]
    assert zero["reduce_bucket_size"] == 4096 * 4096
    assert zero["stage3_prefetch_bucket_size"] == int(0.9 * 4096 * 4096)
    assert zero["stage3_param_persistence_threshold"] == 10 * 4096
    assert zero["stage3_gather_16bit_weights_on_model_save"] is True


def test_gpt2_hidden_size_comes_from_n_embd():
    plan = reference_plan("zero2", model_config={"model_type": "gpt2", "n_embd": 768, "n_layer": 12},
                          layer_class="GPT2Block")
    assert ds_config(plan)["zero_optimization"]["reduce_bucket_size"] == 768 * 768


def test_fp16_uses_dynamic_loss_scaling():
    fp16 = ds_config(plan_for("zero2", "fp16"), runner_fills=False)["fp16"]
    assert fp16["enabled"] is True and fp16["loss_scale"] == 0 and fp16["initial_scale_power"] == 16
    # ds_config.json: the runner turns it on (TrainingArguments' fp16, Accelerator's mixed_precision); the loss
    # scaling it then uses is the plan's.
    filled = ds_config(plan_for("zero2", "fp16"))
    assert filled["fp16"] == {**fp16, "enabled": "auto"} and filled["bf16"] == {"enabled": "auto"}


def test_the_trainer_fills_precision_from_its_own_flags(tmp_path):
    """A script that turns bf16 off on a dev box runs fp32 instead of being refused for a mismatch."""
    from transformers import TrainingArguments
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    emit_files(plan_for("zero2", "bf16"), tmp_path)
    for bf16 in (True, False):
        args = TrainingArguments(output_dir=str(tmp_path / "o"), deepspeed=str(tmp_path / "ds_config.json"),
                                 use_cpu=True, bf16=bf16, per_device_train_batch_size=1)
        assert args.hf_deepspeed_config.config["bf16"]["enabled"] is bf16
        assert args.hf_deepspeed_config.config["fp16"]["enabled"] is False
        unset_hf_deepspeed_config()


def test_deepspeed_yaml_sets_no_key_that_accelerate_ignores_next_to_the_json(tmp_path):
    emit_files(plan_for("zero3-offload", "fp16"), tmp_path)
    config = load(tmp_path, "accelerate_config.yaml")
    assert "mixed_precision" not in config
    assert set(config["deepspeed_config"]) == {"deepspeed_config_file", "zero3_init_flag"}
    # No path: the JSON itself, one line, equal to ds_config.json (a copied folder needs nothing else).
    inline = config["deepspeed_config"]["deepspeed_config_file"]
    assert "\n" not in inline and json.loads(inline) == load(tmp_path, "ds_config.json")


def test_fsdp2_yaml_wraps_the_plan_layer_class(tmp_path):
    emit_files(plan_for("fsdp2-grad-op", "bf16"), tmp_path)
    fsdp = load(tmp_path, "accelerate_config.yaml")["fsdp_config"]
    assert fsdp["fsdp_version"] == 2
    assert fsdp["fsdp_transformer_layer_cls_to_wrap"] == "LlamaDecoderLayer"
    assert fsdp["fsdp_reshard_after_forward"] is False


def test_nvme_offload_needs_a_path(tmp_path):
    plan = reference_plan("zero3-offload-nvme")
    with pytest.raises(UserError, match="--nvme-path"):
        emit_files(plan, tmp_path)
    assert list(tmp_path.iterdir()) == []
    emit_files(plan, tmp_path, nvme_path="/local_nvme")
    zero = load(tmp_path, "ds_config.json")["zero_optimization"]
    assert zero["offload_param"]["nvme_path"] == zero["offload_optimizer"]["nvme_path"] == "/local_nvme"
    validate_ds_config_for_plan(load(tmp_path, "ds_config.json"), plan)


def test_launch_sh_is_executable_and_quotes_the_model(tmp_path):
    plan = reference_plan("zero2", model="/models/my llama")
    emit_files(plan, tmp_path)
    script = tmp_path / "launch.sh"
    assert script.stat().st_mode & stat.S_IXUSR
    text = script.read_text()
    assert "MODEL='/models/my llama'" in text


def test_multinode_sbatch_launches_every_node_with_its_rank(tmp_path):
    plan = plan_for("hybrid", "bf16")
    emit_files(plan, tmp_path, hosts=["gpu-a", "gpu-b"])
    sbatch = (tmp_path / "slurm.sbatch").read_text()
    assert "#SBATCH --nodes=2" in sbatch and '--machine_rank "$SLURM_NODEID"' in sbatch
    assert '--main_process_ip "$MAIN_HOST"' in sbatch
    assert (tmp_path / "hostfile").read_text() == "gpu-a slots=8\ngpu-b slots=8\n"
    assert load(tmp_path, "accelerate_config.yaml")["main_process_ip"] == "gpu-a"


def test_refuses_to_overwrite_and_writes_nothing(tmp_path):
    (tmp_path / "PLAN.md").write_text("mine")
    with pytest.raises(UserError, match="already exists"):
        emit_files(plan_for("zero2", "bf16"), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["PLAN.md"]
    assert (tmp_path / "PLAN.md").read_text() == "mine"
    emit_files(plan_for("zero2", "bf16"), tmp_path, force=True)
    assert (tmp_path / "PLAN.md").read_text() != "mine"


@pytest.mark.multiprocess
@pytest.mark.one_core
def test_a_failed_write_leaves_the_old_folder_whole(tmp_path):
    """A real write failure (the file-size limit, EFBIG) while re-emitting over an existing plan folder: the old
    folder is untouched, file for file, and no staging folder or lock is left beside it."""
    import subprocess
    import sys

    old = tmp_path / "plan"
    emit_files(plan_for("zero2", "bf16"), old)
    before = {p.name: p.read_bytes() for p in old.iterdir()}
    script = (
        "import resource, signal, sys\n"
        "from pathlib import Path\n"
        "from toolkit.emit import emit_files\n"
        "from toolkit.plan.schema import load_plan\n"
        "plan = load_plan(sys.argv[1]).replace(precision='fp16')\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (600, 600))  # plan.json is larger\n"
        "emit_files(plan, Path(sys.argv[1]), force=True)\n")
    proc = subprocess.run([sys.executable, "-c", script, str(old)], capture_output=True, text=True)
    assert proc.returncode != 0 and "File too large" in proc.stderr, proc.stderr[-2000:]
    assert {p.name: p.read_bytes() for p in old.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan"]


def test_plan_md_charts_candidates_against_capacity():
    from toolkit.emit.explain import memory_chart

    gib = 1024 ** 3
    lines = memory_chart([
        {"name": "zero3", "peak_bytes": 40 * gib, "capacity_bytes": 80 * gib, "feasible": True, "reason": None,
         "tokens_per_s": 1000.0},
        {"name": "ddp", "peak_bytes": 120 * gib, "capacity_bytes": 80 * gib, "feasible": False,
         "reason": "needs 120.0 GiB of 80", "tokens_per_s": None},
    ])
    assert lines[0].startswith("zero3 ") and "fits" in lines[0] and lines[0].index("|") > lines[0].rindex("#")
    assert "!" in lines[1] and "does not fit: needs 120.0 GiB of 80" in lines[1]


def test_deepspeed_config_at_world_size_agrees_with_deepspeed_at_world_one():
    from deepspeed.runtime.config import DeepSpeedConfig

    config = ds_config(reference_plan("zero3", nodes=1, gpus_per_node=1, micro=2, accum=4), runner_fills=False)
    ours = vars(deepspeed_config_at(config, 1))
    theirs = vars(DeepSpeedConfig(json.loads(json.dumps(config))))
    assert ours.keys() == theirs.keys()

    def shown(value):  # objects without __eq__ (comms config...) compare by their attributes
        return str(vars(value)) if hasattr(value, "__dict__") else str(value)

    assert {k: shown(v) for k, v in ours.items()} == {k: shown(v) for k, v in theirs.items()}


def test_deepspeed_config_at_world_size_enforces_the_batch_identity():
    config = ds_config(plan_for("zero2", "bf16"), runner_fills=False)
    deepspeed_config_at(config, 8)
    with pytest.raises(ConfigRejected, match="train_batch_size is not equal"):
        deepspeed_config_at(config, 4)


def test_random_plans_always_multiply_or_are_refused(tmp_path):
    rng = random.Random(1234)
    accepted = 0
    for _ in range(60):
        layers, nodes, gpus = rng.choice([12, 24, 32, 40]), rng.choice([1, 2, 4]), rng.choice([1, 2, 4, 8])
        strategy = rng.choice(["zero1", "zero2", "zero3", "pipeline", "hybrid", "ddp", "fsdp2"])
        stages = rng.choice([2, 4]) if strategy in ("pipeline", "hybrid") else 1
        micro, accum = rng.choice([1, 2, 4]), rng.choice([1, 4, 8])
        world = nodes * gpus
        config = {"model_type": "llama", "hidden_size": rng.choice([256, 1024, 4096]), "num_hidden_layers": layers}
        global_batch = micro * accum * max(world // stages, 1) + rng.choice([0, 0, 0, 1])
        try:
            plan = reference_plan(strategy, nodes=nodes, gpus_per_node=gpus, stages=stages, micro=micro,
                                  accum=accum, model_config=config).replace(global_batch=global_batch)
        except UserError:
            from toolkit.inputs.grid import ParallelGrid
            from toolkit.inputs.strategy import parse_strategy

            try:  # refused: either the grid cannot hold the strategy, or the batch does not multiply on it
                grid = ParallelGrid.for_strategy(parse_strategy(strategy), nodes=nodes, gpus_per_node=gpus,
                                                 pipeline_stages=stages if strategy in ("pipeline", "hybrid") else None)
            except UserError:
                continue
            assert grid.global_batch(micro, accum) != global_batch or grid.pipeline_stages > layers
            continue
        accepted += 1
        if plan.engine in ("deepspeed", "pipeline"):
            parsed = validate_ds_config_for_plan(ds_config(plan), plan)
            assert parsed.train_batch_size == parsed.train_micro_batch_size_per_gpu \
                * parsed.gradient_accumulation_steps * plan.data_parallel
    assert accepted > 20


@pytest.mark.parametrize("strategy", ["ddp", "zero3", "fsdp2", "zero2-offload"])
def test_single_gpu_plans_launch_as_one_process(tmp_path, strategy):
    plan = reference_plan(strategy, nodes=1, gpus_per_node=1, micro=1, accum=4)
    emit_files(plan, tmp_path)
    args = accelerate_launch_check(tmp_path / "accelerate_config.yaml")
    assert args.num_processes == 1 and not args.multi_gpu
    if plan.engine == "deepspeed":
        validate_ds_config_for_plan(load(tmp_path, "ds_config.json"), plan)


def test_hosts_must_name_every_node(tmp_path):
    with pytest.raises(UserError, match="one per node"):
        emit_files(plan_for("hybrid", "bf16"), tmp_path, hosts=["only-one"])
