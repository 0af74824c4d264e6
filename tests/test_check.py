"""toolkit check: each broken config in tests/check_corpus/ gives its own message; clean configs give none."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from toolkit.check import Problem, check_paths, main_check, parse_gpus
from toolkit.emit import emit_files
from toolkit.errors import UserError
from toolkit.presets import reference_plan

CORPUS = Path(__file__).parent / "check_corpus"

EXPECTED: dict[str, tuple[str, str]] = {
    # corpus entry: (severity, message fragment)
    "ds-auto-no-runner-fills.json": ("error", '"zero_optimization.allgather_bucket_size" is "auto": no runner fills it'),
    "ds-auto-prefetch-at-zero2.json": ("error", "the HF Trainer fills it only at ZeRO-3 (this file is ZeRO-2)"),
    "ds-batch-not-a-multiple.json": ("error", "train_batch_size 30 is not a multiple of micro 2 x accum 4"),
    "ds-batch-wrong-for-8-gpus.json": ("error", "train_batch_size 32 != micro 2 x accum 4 x data-parallel 8"),
    "ds-bf16-and-fp16-both-enabled.json": ("error", "bf16 and fp16 are both enabled"),
    "ds-fp16-loss-scale-not-a-number.json": ("error", "fp16.loss_scale must be a number"),
    "ds-missing-zero-optimization.json": ("error", 'no "zero_optimization" block: accelerate refuses the file'),
    "ds-nvme-offload-without-path.json": ("error", 'offload_optimizer goes to nvme without "nvme_path"'),
    "ds-offload-optimizer-at-zero0.json": ("error", "offload_optimizer at ZeRO-0"),
    "ds-offload-param-below-zero3.json": ("error", "offload_param at ZeRO-2: offload param needs ZeRO-3"),
    "ds-typo-in-zero-block.json": ("error", "reduce_bucket_sise: Extra inputs are not permitted"),
    "ds-typo-top-level-key.json": ("error", 'unknown key "gradient_acumulation_steps": DeepSpeed ignores it silently; '
                                            'did you mean "gradient_accumulation_steps"?'),
    "ds-zero-stage-4.json": ("error", "DeepSpeed/transformers refuse it: stage: Input should be 0, 1, 2, 3"),
    "ds-zero3-without-16bit-save.json": ("warning", "save_model writes an empty model"),
    "plan-bf16-pipeline-fp32-accumulation-at-zero0": ("error", "at ZeRO-0: DeepSpeed refuses this mix"),
    "plan-bf16-pipeline-without-fp32-accumulation": ("warning", "bf16 pipeline accumulates gradients in bf16"),
    "plan-deepspeed-yaml-for-pipeline-plan": ("error", "accelerate cannot run DeepSpeed pipelines"),
    "plan-fsdp-mixed-precision-differs-from-plan": ("error", "mixed_precision fp16 but plan.json plans bf16"),
    "plan-json-batch-differs-from-plan": ("error", "gradient_accumulation_steps 8 but plan.json plans 4"),
    "plan-json-clipping-differs-from-trainer": ("error", "ds gradient_clipping=0.5 vs hf max_grad_norm=1.0"),
    "plan-json-precision-differs-from-plan": ("error", "ds_config trains in fp16 but plan.json plans bf16"),
    "plan-json-zero-stage-differs-from-plan": ("error", "ZeRO stage 2 but plan.json plans zero3"),
    "plan-missing-ds-config": ("error", "no ds_config.json for a zero3 plan"),
    "plan-pipeline-batch-counts-all-ranks": ("error", "x data-parallel 1 (4 processes / 4 pipeline stages) = 8"),
    "plan-pipeline-with-auto-values": ("error", '"auto" in train_micro_batch_size_per_gpu: a pipeline run'),
    "plan-pipeline-with-zero2": ("error", "ZeRO-2 with pipeline parallelism"),
    "plan-yaml-process-count-differs-from-plan": ("error", "num_processes 4 but plan.json plans 1 node(s) x 8"),
    "yaml-ds-file-missing.yaml": ("error", "deepspeed_config_file no-such-ds-config.json does not exist"),
    "yaml-ds-file-with-gradient-accumulation.yaml": (
        "error", "deepspeed_config.gradient_accumulation_steps next to deepspeed_config_file: accelerate refuses it"),
    "yaml-ds-file-with-mixed-precision.yaml": ("error", "mixed_precision bf16 next to deepspeed_config_file"),
    "yaml-ds-file-with-zero-stage.yaml": ("error", 'set "zero_optimization": {"stage": ...} in the JSON'),
    "yaml-fsdp-no-wrap-policy.yaml": ("warning", "FSDP without an auto-wrap policy"),
    "yaml-fsdp-without-layer-class.yaml": ("error", "TRANSFORMER_BASED_WRAP without fsdp_transformer_layer_cls_to_wrap"),
    "yaml-fsdp2-with-string-reshard.yaml": ("error", "accelerate launch refuses it: invalid truth value full_shard"),
    "yaml-mixed-precision-conflicts-with-json.yaml": ("error", "mixed_precision fp16 in the YAML but ds_config enables bf16"),
    "yaml-multi-cpu-many-processes.yaml": ("warning", "accelerate starts one process"),
    "yaml-processes-dont-match-2x8-gpus.yaml": ("error", "does not match 2 node(s) x 8 GPUs"),
    "yaml-processes-not-multiple-of-machines.yaml": ("error", "num_processes 9 is not a multiple of num_machines 2"),
    "yaml-unknown-key-typo.yaml": ("error", 'unknown key "num_proceses": accelerate refuses the file; did you mean '
                                           '"num_processes"?'),
}

NOT_BROKEN = {"clean", "unreadable", "ds-zero2-for-yaml.json"}  # ds-zero2-for-yaml.json: the JSON the YAMLs name


def gpus_for(name: str) -> tuple[int, int] | None:
    if "2x8" in name:
        return (2, 8)
    return (1, 8) if "8-gpus" in name else None


def test_corpus_has_an_expectation_for_every_broken_config():
    broken = {p.name for p in CORPUS.iterdir()} - NOT_BROKEN
    assert broken == set(EXPECTED)
    assert len(broken) >= 25


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_broken_config_gives_its_message(name):
    severity, fragment = EXPECTED[name]
    problems = check_paths([str(CORPUS / name)], gpus=gpus_for(name))
    matching = [p for p in problems if fragment in p.message]
    assert matching, f"{name}: {[str(p) for p in problems]}"
    assert matching[0].severity == severity


@pytest.mark.parametrize("name", sorted(p.name for p in (CORPUS / "clean").iterdir()))
def test_clean_config_gives_no_problem(name):
    assert check_paths([str(CORPUS / "clean" / name)], gpus=(1, 8) if "8-gpus" in name else None) == []


@pytest.mark.parametrize("name", sorted(p.name for p in (CORPUS / "unreadable").iterdir()))
def test_unreadable_input_is_a_user_error(name):
    with pytest.raises(UserError, match="not valid|does not hold a mapping"):
        check_paths([str(CORPUS / "unreadable" / name)])


def test_missing_file_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        check_paths([str(tmp_path / "nope.json")])


@pytest.mark.parametrize("strategy,nodes,stages", [
    ("ddp", 1, 1), ("zero1", 1, 1), ("zero2", 1, 1), ("zero3", 2, 1), ("zero2-offload", 1, 1),
    ("zero3-offload", 1, 1), ("fsdp2", 1, 1), ("fsdp2-grad-op", 1, 1), ("fsdp2-hybrid", 2, 1),
    ("pipeline", 1, 4), ("hybrid", 2, 2)])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_every_emitted_directory_is_clean(tmp_path, strategy, nodes, stages, precision):
    plan = reference_plan(strategy, precision, nodes=nodes, gpus_per_node=4, stages=stages, micro=1, accum=4)
    emit_files(plan, tmp_path)
    assert check_paths([str(tmp_path)]) == []
    assert check_paths([str(tmp_path / "accelerate_config.yaml")], gpus=(nodes, 4)) == []


def test_random_emitted_plans_stay_clean(tmp_path):
    rng = random.Random(7)
    for i in range(12):
        strategy = rng.choice(["zero1", "zero2", "zero3", "pipeline", "hybrid", "fsdp2", "ddp"])
        stages = rng.choice([2, 4]) if strategy in ("pipeline", "hybrid") else 1
        nodes, gpus = rng.choice([1, 2]), rng.choice([2, 4, 8])
        if (nodes * gpus) % stages:
            continue
        config = {"model_type": "llama", "hidden_size": rng.choice([512, 2048]), "num_hidden_layers": 16}
        plan = reference_plan(strategy, rng.choice(["bf16", "fp16"]), nodes=nodes, gpus_per_node=gpus,
                              stages=stages, micro=rng.choice([1, 2]), accum=rng.choice([1, 4]), model_config=config)
        emit_files(plan, tmp_path / str(i))
        assert check_paths([str(tmp_path / str(i))]) == [], plan.strategy


def test_a_changed_accumulation_breaks_the_arithmetic_in_the_json(tmp_path):
    plan = reference_plan("zero2", nodes=1, gpus_per_node=8, micro=2, accum=4)
    emit_files(plan, tmp_path)
    data = json.loads((tmp_path / "ds_config.json").read_text())
    # Emitted, the batch keys are "auto" (the runner fills them); a hand-edited file with numbers is checked.
    data.update(train_batch_size=64, train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2)
    (tmp_path / "ds_config.json").write_text(json.dumps(data))
    messages = [p.message for p in check_paths([str(tmp_path)])]
    assert any("train_batch_size 64 != micro 2 x accum 2 x data-parallel 8" in m for m in messages)


def test_main_check_exit_codes_and_one_line_per_problem(tmp_path):
    lines: list[str] = []
    assert main_check([str(CORPUS / "clean" / "plan-hybrid-2x4")], print_fn=lines.append) == 0
    lines.clear()
    assert main_check([str(CORPUS / "ds-bf16-and-fp16-both-enabled.json")], print_fn=lines.append) == 1
    assert len(lines) == 1 and "bf16 and fp16 are both enabled" in lines[0]
    lines.clear()
    assert main_check([str(CORPUS / "unreadable" / "malformed-json.json")], print_fn=lines.append) == 2
    assert lines[0].startswith("error: ") and "not valid JSON" in lines[0]


def test_main_check_runs_the_fit_callback_per_path():
    seen: list[str] = []

    def fit(path):
        seen.append(path)
        return ["needs 93.1 GiB of 80", Problem(path, "warning", "tight")]

    lines: list[str] = []
    path = str(CORPUS / "clean" / "plan-hybrid-2x4")
    assert main_check([path], fit=fit, print_fn=lines.append) == 1
    assert seen == [path] and len(lines) == 2 and "needs 93.1 GiB of 80" in lines[0]


def test_gpus_flag_is_nodes_x_gpus():
    assert parse_gpus("8") == (1, 8) and parse_gpus("2x8") == (2, 8)
    with pytest.raises(UserError, match="NODESxGPUS"):
        parse_gpus("eight")
