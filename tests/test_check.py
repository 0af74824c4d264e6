"""toolkit check: each broken config in tests/check_corpus/ gives its own message; clean configs give none."""

from __future__ import annotations

import json
import re
import random
from pathlib import Path

import pytest

from toolkit.check.findings import Problem
from toolkit.check.folder import check_paths
from toolkit.check.read import parse_gpus
from toolkit.commands.check import main_check
from toolkit.emit import emit_files
from toolkit.errors import UserError
from toolkit.emit.presets import reference_plan

CORPUS = Path(__file__).parent / "check_corpus"

EXPECTED: dict[str, tuple[str, str]] = {
    # corpus entry: (severity, message fragment)
    "ds-auto-no-runner-fills.json": ("error", '"zero_optimization.allgather_bucket_size" is "auto": no runner fills it'),
    "ds-batch-not-a-multiple.json": ("error", "train_batch_size 30 is not a multiple of micro 2 x accum 4"),
    "ds-batch-wrong-for-8-gpus.json": ("error", "train_batch_size 32 != micro 2 x accum 4 x data-parallel 8"),
    "ds-bf16-and-fp16-both-enabled.json": ("error", "bf16 and fp16 are both enabled"),
    "ds-fp16-loss-scale-not-a-number.json": ("error", "fp16.loss_scale must be a number"),
    # Without "auto" values the file is likely for the deepspeed launcher, which needs no ZeRO block: a note naming
    # the runners that refuse it (--runner trainer makes it an error, test_runner_pins_the_severity).
    "ds-missing-zero-optimization.json": ("note", 'no "zero_optimization" block: accelerate refuses the file'),
    "ds-nvme-offload-without-path.json": ("error", 'offload_optimizer goes to nvme without "nvme_path"'),
    "ds-offload-optimizer-at-zero0.json": ("error", "offload_optimizer at ZeRO-0"),
    "ds-offload-param-below-zero3.json": ("error", "offload_param at ZeRO-2: offload param needs ZeRO-3"),
    # DeepSpeedConfig would count 8 / 3 data-parallel ranks (runtime/config.py divides the world by the degree).
    "ds-sequence-parallel-3-on-8-gpus.json": ("error", "sequence_parallel_size 3 does not divide the 8 processes"),
    "ds-typo-in-zero-block.json": ("error", "reduce_bucket_sise: Extra inputs are not permitted"),
    # The HF Trainer's SP loss under ZeRO-2's reduction, which divides by dp only (docs/ENGINE_FACTS.md, issue 32).
    "ds-zero2-sequence-parallel-sums-the-gradient.json": (
        "warning", 'ZeRO-2 x Ulysses SP 2: a Trainer / TRL script trains on 2 x the gradient and clips that'),
    "ds-typo-top-level-key.json": ("error", 'unknown key "gradient_acumulation_steps": DeepSpeed ignores it silently; '
                                            'did you mean "gradient_accumulation_steps"?'),
    "ds-zero-stage-4.json": ("error", "DeepSpeed/transformers refuse it: zero_optimization.stage: Input should be 0, 1, 2, 3"),
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
    # model_config leaves max_position_embeddings out: LlamaConfig's default, 2048 (toolkit.train refuses the plan)
    "plan-seq-longer-than-model-positions": (
        "error", "plan sequence length 4096 is longer than model example/llama-small supports (2048 positions)"),
    "plan-yaml-process-count-differs-from-plan": ("error", "num_processes 4 but plan.json plans 1 node(s) x 8"),
    # The Ulysses blog's (huggingface/blog ulysses-sp.md) offload snippet: accelerate drops the JSON-style key
    # (test_accelerate_itself_drops_a_json_style_offload_key).
    "yaml-deepspeed-json-keys-inline.yaml": (
        "error", "unknown key deepspeed_config.offload_optimizer: accelerate launch ignores it silently (DeepSpeed "
                   "never sees it and keeps its default); write offload_optimizer_device: cpu instead"),
    "yaml-ds-file-missing.yaml": ("error", "deepspeed_config_file no-such-ds-config.json does not exist"),
    "yaml-ds-file-with-gradient-accumulation.yaml": (
        "error", "deepspeed_config.gradient_accumulation_steps next to deepspeed_config_file: accelerate refuses it"),
    "yaml-ds-file-with-mixed-precision.yaml": ("error", "mixed_precision bf16 next to deepspeed_config_file"),
    "yaml-ds-file-with-zero-stage.yaml": ("error", 'set "zero_optimization": {"stage": ...} in the JSON'),
    "yaml-fsdp-no-wrap-policy.yaml": ("warning", "FSDP without an auto-wrap policy"),
    # accelerate wraps the model's _no_split_modules (test_fsdp_wrap_falls_back_to_no_split_modules): a note.
    "yaml-fsdp-without-layer-class.yaml": ("note", "accelerate wraps the classes the model lists in _no_split_modules"),
    "yaml-fsdp2-with-string-reshard.yaml": ("error", "accelerate launch refuses it: invalid truth value full_shard"),
    "yaml-mixed-precision-conflicts-with-json.yaml": ("error", "mixed_precision fp16 in the YAML but ds_config enables bf16"),
    "yaml-multi-cpu-many-processes.yaml": ("warning", "accelerate starts one process"),
    "yaml-processes-dont-match-2x8-gpus.yaml": ("error", "does not match 2 node(s) x 8 GPUs"),
    "yaml-processes-not-multiple-of-machines.yaml": ("error", "num_processes 9 is not a multiple of num_machines 2"),
    "yaml-parallelism-config-typo.yaml": (
        "error", 'unknown key parallelism_config.parallelism_config_sp_sise: accelerate launch ignores it silently '
                 '(the run gets the default); did you mean "parallelism_config_sp_size"?'),
    # DeepSpeed's own hostfile parser accepts both files' hosts line by line or not: the check names the line.
    "hostfile-zero-slots-on-one-host": ("error", "line 2: host node1 has slots=0"),
    "hostfile-bad-line": ("error", "line 3 is not `host slots=GPUS` (DeepSpeed's launcher refuses it)"),
    "yaml-unknown-key-typo.yaml": ("error", 'unknown key "num_proceses": accelerate refuses the file; did you mean '
                                           '"num_processes"?'),
}

# ds-zero2-for-yaml.json: the JSON the YAMLs name; README.md: how the corpus was made
NOT_BROKEN = {"clean", "unreadable", "ds-zero2-for-yaml.json", "README.md"}


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
    # The YAML alone does not say who reads its JSON; toolkit.train runs the HF Trainer.
    assert check_paths([str(tmp_path / "accelerate_config.yaml")], gpus=(nodes, 4), runner="trainer") == []


def test_random_emitted_plans_stay_clean(tmp_path):
    rng = random.Random(7)
    for i in range(12):
        strategy = rng.choice(["zero1", "zero2", "zero3", "pipeline", "hybrid", "fsdp2", "ddp"])
        stages = rng.choice([2, 4]) if strategy in ("pipeline", "hybrid") else 1
        nodes, gpus = rng.choice([1, 2]), rng.choice([2, 4, 8])
        if strategy == "pipeline":
            stages = nodes * gpus  # the pipeline strategy makes every GPU a stage (hybrid adds data parallel)
        if (nodes * gpus) % stages or (strategy == "hybrid" and nodes * gpus // stages < 2):
            continue
        config = {"model_type": "llama", "hidden_size": rng.choice([512, 2048]), "num_hidden_layers": 16,
                  "max_position_embeddings": 4096}  # LlamaConfig's default 2048 is shorter than the plans
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
    assert lines == ["1 path(s) checked: no findings"]
    lines.clear()
    assert main_check([str(CORPUS / "ds-bf16-and-fp16-both-enabled.json")], print_fn=lines.append) == 1
    assert len(lines) == 2 and "error: [every runner] bf16 and fp16 are both enabled" in lines[0]
    assert lines[1] == "1 path(s) checked: 1 error(s)"
    with pytest.raises(UserError, match="not valid JSON"):
        main_check([str(CORPUS / "unreadable" / "malformed-json.json")], print_fn=lines.append)


def test_warnings_exit_0_unless_strict_and_json_lists_the_findings():
    path = str(CORPUS / "ds-zero3-without-16bit-save.json")
    assert main_check([path], print_fn=lambda line: None) == 0
    assert main_check([path], strict=True, print_fn=lambda line: None) == 1
    out: list[str] = []
    assert main_check([path], as_json=True, print_fn=out.append) == 0
    report = json.loads(out[0])
    assert report["exit_code"] == 0 and [f["severity"] for f in report["findings"]] == ["warning"]
    assert report["findings"][0]["runner"] == "HF Trainer, accelerate script"


def test_main_check_runs_the_fit_callback_per_path():
    seen: list[str] = []

    def fit(path):
        seen.append(path)
        return [Problem(path, "error", "needs 93.1 GiB of 80"), Problem(path, "note", "assumed")]

    lines: list[str] = []
    path = str(CORPUS / "clean" / "plan-hybrid-2x4")
    assert main_check([path], fit=fit, print_fn=lines.append) == 1
    assert seen == [path] and len(lines) == 3 and "needs 93.1 GiB of 80" in lines[0]


def test_gpus_flag_is_nodes_x_gpus():
    assert parse_gpus("8") == (1, 8) and parse_gpus("2x8") == (2, 8)
    with pytest.raises(UserError, match="NODESxGPUS"):
        parse_gpus("eight")


# --- real-world configs (tests/real_configs/MANIFEST.tsv) --------------------------------------------------------------

REAL = Path(__file__).parent / "real_configs"
SEVERITY_ORDER = ["clean", "note", "warning", "error"]


def manifest() -> list[dict[str, str]]:
    names = ["file", "repository", "path", "commit", "licence", "verdict", "why"]
    rows = [line.split("\t") for line in (REAL / "MANIFEST.tsv").read_text().splitlines() if not line.startswith("#")]
    return [dict(zip(names, row)) for row in rows]


def test_real_corpus_is_listed_whole_with_sources():
    rows = manifest()
    on_disk = {str(p.relative_to(REAL)) for p in REAL.rglob("*") if p.is_file() and p.name != "MANIFEST.tsv"}
    assert {r["file"] for r in rows} == on_disk and len(rows) >= 40
    projects = {r["repository"] for r in rows}
    assert {"huggingface/trl", "huggingface/accelerate", "axolotl-ai-cloud/axolotl", "hiyouga/LLaMA-Factory",
            "huggingface/transformers", "microsoft/DeepSpeedExamples"} <= projects
    for row in rows:
        assert len(row["commit"]) == 40 and row["licence"] and row["verdict"] in SEVERITY_ORDER, row
        assert (REAL / row["file"]).stat().st_size < 8_000
        assert row["verdict"] == "clean" or row["why"], row


@pytest.mark.parametrize("row", manifest(), ids=lambda r: r["file"])
def test_real_config_gets_its_verdict(row):
    """No crash, no false alarm: the most severe finding on the file itself is the one the manifest records."""
    path = str(REAL / row["file"])
    found = [p for p in check_paths([path]) if p.file == path]
    verdict = max((p.severity for p in found), key=SEVERITY_ORDER.index, default="clean")
    assert verdict == row["verdict"], [str(p) for p in found]


REFUSED_BY_DEEPSPEED = {
    # DeepSpeed 0.19's CompileConfig forbids extra keys; axolotl's "disable"/"backend" are not among its fields.
    "axolotl/deepspeed_configs/zero1_torch_compile.json": "Extra inputs are not permitted",
    "axolotl/deepspeed_configs/zero2_torch_compile.json": "Extra inputs are not permitted",
    # Features DeepSpeed removed; its config refuses the leftover blocks rather than ignore them.
    "deepspeedexamples/training/bing_bert/deepspeed_bsz4k_progressive_layer_drop_config_seq128.json":
        "Progressive Layer Dropping has been removed",
    "deepspeedexamples/compression/gpt2/config/ds_config_W8A8_Qgroup64_fp16.json":
        "compression library has been removed",
}


def test_every_error_on_the_real_corpus_is_reproduced_below():
    assert {r["file"] for r in manifest() if r["verdict"] == "error"} == set(REFUSED_BY_DEEPSPEED) | {
        "transformers/tests/deepspeed/ds_config_zero3_bf16.json", "accelerate/tests/test_configs/invalid_keys.yaml",
        "trl/examples/accelerate_configs/alst_ulysses_4gpu.yaml"}  # test_accelerate_itself_drops_a_json_style_..._key


@pytest.mark.parametrize("name", sorted(REFUSED_BY_DEEPSPEED))
def test_deepspeed_itself_refuses_the_real_config(name):
    """DeepSpeed's own DeepSpeedConfig (one process: world size 1), "auto" values taken out as the runners fill them."""
    from deepspeed.runtime.config import DeepSpeedConfig

    config = json.loads((REAL / name).read_text())
    config = {k: v for k, v in config.items() if v != "auto" and k != "train_batch_size"}
    config.setdefault("train_micro_batch_size_per_gpu", 1)
    with pytest.raises(Exception, match=REFUSED_BY_DEEPSPEED[name]):
        DeepSpeedConfig(config)


def test_accelerate_itself_refuses_its_invalid_keys_test_config():
    from accelerate.commands.config.config_args import load_config_from_file

    with pytest.raises(ValueError, match="invalid_key"):
        load_config_from_file(str(REAL / "accelerate/tests/test_configs/invalid_keys.yaml"))


def test_accelerate_itself_refuses_the_unfilled_bfloat16_auto():
    """The old "bfloat16" block: the HF Trainer fills only "bf16.enabled"; accelerate then raises for the rest."""
    from accelerate.utils import DeepSpeedPlugin

    from toolkit.engines.readers import accelerate_fills, trainer_view

    config = json.loads((REAL / "transformers/tests/deepspeed/ds_config_zero3_bf16.json").read_text())
    messages = [p.message for p in check_paths([str(REAL / "transformers/tests/deepspeed/ds_config_zero3_bf16.json")])]
    assert any('"bfloat16.enabled" is "auto": no runner fills it; rename the block to "bf16"' in m for m in messages)
    filled, refused = trainer_view(config, world_size=8)
    assert refused is None and filled["bfloat16"]["enabled"] == "auto"
    plugin = DeepSpeedPlugin(hf_ds_config=filled)
    # What Accelerator._prepare_deepspeed hands to deepspeed_config_process (values do not matter, only the keys).
    with pytest.raises(ValueError, match="`bfloat16.enabled` not found in kwargs"):
        plugin.deepspeed_config_process(must_match=False, **{key: 1 for key in accelerate_fills()})


def test_accelerate_fills_are_read_from_its_source():
    from toolkit.engines.readers import accelerate_fills

    fills = accelerate_fills()
    assert {"train_micro_batch_size_per_gpu", "train_batch_size", "gradient_clipping", "fp16.enabled", "bf16.enabled",
            "zero_optimization.stage3_gather_16bit_weights_on_model_save", "zero_optimization.reduce_bucket_size",
            "zero_optimization.stage3_prefetch_bucket_size", "optimizer.params.lr"} <= fills
    assert "zero_optimization.allgather_bucket_size" not in fills and "optimizer.params.betas" not in fills


@pytest.mark.parametrize("name", ["stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save",
                                  "stage3_gather_fp16_weights_on_model_save"])
def test_every_spelling_of_the_zero3_save_flag_counts(tmp_path, name):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, name: True}}))
    found = check_paths([str(path)])
    assert not [p for p in found if "save_model" in p.message]
    deprecated = [p for p in found if "deprecated name" in p.message]
    assert [p.severity for p in deprecated] == (["note"] if "fp16" in name else [])


def test_top_level_keys_deepspeed_never_reads(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1},
                                "_comment": "x", "steps_per_prnt": 10, "my_own_setting": 1, "wall_clock_breakdown": 0}))
    found = {p.message.split('"')[1]: p.severity for p in check_paths([str(path)])}
    assert found == {"_comment": "note", "steps_per_prnt": "error", "my_own_setting": "warning"}


def test_keys_read_at_initialize_are_known(tmp_path):
    """sequence_parallel_size / data_parallel_size are read by deepspeed.initialize, not by the config getters."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3,
                                "stage3_gather_16bit_weights_on_model_save": True},
                                "sequence_parallel_size": 2, "data_parallel_size": 4}))
    assert check_paths([str(path)]) == []


def test_a_concrete_global_batch_with_auto_micro_batch_is_fine_when_the_gpus_are_unknown(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 64, "train_micro_batch_size_per_gpu": "auto",
                                "gradient_accumulation_steps": "auto", "zero_optimization": {"stage": 2}}))
    assert check_paths([str(path)]) == []


def test_runner_pins_the_severity():
    path = str(CORPUS / "ds-missing-zero-optimization.json")
    assert {p.severity for p in check_paths([path], runner="trainer")} == {"error"}
    assert check_paths([path], runner="deepspeed") == []


def test_fsdp_wrap_falls_back_to_no_split_modules():
    """Why the missing fsdp_transformer_layer_cls_to_wrap is a note: accelerate's plugin wraps _no_split_modules."""
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from transformers import LlamaConfig, LlamaForCausalLM

    from toolkit.engines.validate import accelerate_launch_plugins

    _, plugin, _ = accelerate_launch_plugins(REAL / "llamafactory/examples/accelerate/fsdp_config.yaml")
    assert plugin.auto_wrap_policy is transformer_auto_wrap_policy and plugin.transformer_cls_names_to_wrap is None
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, vocab_size=64))
    plugin.set_auto_wrap_policy(model)
    assert plugin.transformer_cls_names_to_wrap == ["LlamaDecoderLayer"]


def test_inline_deepspeed_yaml_is_read_as_the_config_accelerate_builds(tmp_path):
    base = (REAL / "trl/examples/accelerate_configs/deepspeed_zero2.yaml").read_text()
    assert "zero_stage: 2" in base and "offload_param_device: none" in base
    assert check_paths([str(REAL / "trl/examples/accelerate_configs/deepspeed_zero2.yaml")]) == []
    bad = tmp_path / "zero2-offload-param.yaml"
    bad.write_text(base.replace("offload_param_device: none", "offload_param_device: cpu"))
    found = check_paths([str(bad)])
    assert [(p.severity, p.runner) for p in found] == [("error", "HF Trainer, accelerate script")]
    assert "offload_param_device cpu at zero_stage 2" in found[0].message
    zero3 = tmp_path / "zero3.yaml"
    zero3.write_text(base.replace("zero_stage: 2", "zero_stage: 3"))
    assert [p.severity for p in check_paths([str(zero3)])] == ["warning"]


def test_accelerate_itself_drops_a_json_style_offload_key():
    """The plugin accelerate builds from `offload_optimizer: {device: cpu}` under deepspeed_config offloads nothing;
    the flat offload_optimizer_device: cpu does."""
    from toolkit.engines.validate import accelerate_launch_plugins

    nested = CORPUS / "yaml-deepspeed-json-keys-inline.yaml"
    _, plugin, _ = accelerate_launch_plugins(nested)
    assert plugin.deepspeed_config["zero_optimization"]["offload_optimizer"]["device"] == "none"
    flat = nested.parent / "clean" / "yaml-deepspeed-offload-optimizer.yaml"
    _, plugin, _ = accelerate_launch_plugins(flat)
    assert plugin.deepspeed_config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    # TRL's ALST YAML: its seq_parallel_communication_data_type never reaches the config, so DeepSpeed's engine
    # reduces gradients in its fp32 default under SP (runtime/engine.py communication_data_type).
    _, plugin, _ = accelerate_launch_plugins(REAL / "trl/examples/accelerate_configs/alst_ulysses_4gpu.yaml")
    assert "seq_parallel_communication_data_type" not in plugin.deepspeed_config


def test_parallelism_config_sizes_must_multiply_to_the_processes(tmp_path):
    base = (REAL / "accelerate/examples/torch_native_parallelism/configs/tp_hsdp.yaml").read_text()
    assert check_paths([str(REAL / "accelerate/examples/torch_native_parallelism/configs/tp_hsdp.yaml")])[0].severity \
        == "note"
    bad = tmp_path / "tp.yaml"
    bad.write_text(base.replace("num_processes: 8", "num_processes: 6"))
    errors = [p for p in check_paths([str(bad)]) if p.severity == "error"]
    assert len(errors) == 1 and "ParallelismConfig total_size (8) does not match num_processes (6)" in errors[0].message


# --- robust reading: one line on stderr, exit 2, nothing on stdout ---------------------------------------------------

HOSTILE = {
    "binary.json": bytes(range(256)) * 4,
    "deep.json": b"[" * 100_000 + b"]" * 100_000,
    "deep-object.json": b'{"a":' * 100_000 + b"1" + b"}" * 100_000,
    "deep.yaml": b"a:\n" + b"[" * 100_000 + b"]" * 100_000 + b"\n",
    "deep-indent.yaml": b"".join(b"  " * i + b"k:\n" for i in range(3000)) + b"  " * 3000 + b"v: 1\n",
    "bomb.yaml": b"a: &a [x, x, x, x, x, x, x, x, x]\n" + b"".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 9)}]\n".encode() for i in range(8)),
    "self-alias.yaml": b"a: &a [*a]\n",
    "batch-list.json": json.dumps({"train_batch_size": [8], "zero_optimization": {"stage": 2}}).encode(),
    "stage-string.json": json.dumps({"zero_optimization": {"stage": "three"}}).encode(),
    "processes-string.yaml": b"distributed_type: MULTI_GPU\nnum_processes: eight\n",
    "machines-list.yaml": b"distributed_type: MULTI_GPU\nnum_machines: [1, 2]\nnum_processes: 8\n",
    "not-utf8.yaml": "distributed_type: FSDP\n# caf\u00e9\n".encode("latin-1"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_input_is_one_line_and_exit_2(tmp_path, capsys, name):
    from toolkit.cli import main

    path = tmp_path / name
    path.write_bytes(HOSTILE[name])
    assert main(["check", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {path}") and "Traceback" not in captured.err


# --- fit check -----------------------------------------------------------------------------------------------------------

def test_fit_reads_an_inline_deepspeed_yaml_as_zero3_and_states_its_assumptions():
    from toolkit.check.fit import Pins, fit_findings

    path = str(REAL / "trl/examples/accelerate_configs/deepspeed_zero3.yaml")
    found = fit_findings(path, model="llama-3-8b", gpus="8xA100-80GB")
    notes = [p.message for p in found if p.severity == "note"]
    assert any("micro-batch taken as 1 (the least it can be): train_micro_batch_size_per_gpu is \"auto\"" in n
               for n in notes)
    assert any("activation checkpointing taken as off" in n for n in notes)
    assert any("sequence length taken as 2048" in n for n in notes)
    verdict = notes[-1]
    assert "llama-3-8b with zero3, bf16, micro-batch 1, seq 2048: fits" in verdict
    used = float(verdict.split("fits, ")[1].split(" GiB")[0])
    assert 20 < used < 60  # under DDP the same model needs > 100 GiB (the bug this replaced)

    pinned = fit_findings(path, model="llama-3-8b", gpus="8xA100-80GB", seq_len=2048,
                          pins=Pins(micro_batch=4, checkpointing=True))
    assert not any("taken as" in p.message for p in pinned)
    assert "micro-batch 4, seq 2048, checkpointing" in pinned[-1].message


def test_fit_takes_auto_precision_as_bf16_and_says_so():
    from toolkit.check.fit import Pins, fit_settings

    path = str(REAL / "transformers/tests/deepspeed/ds_config_zero3.json")
    settings = fit_settings(path)
    assert settings.precision == "bf16" and settings.strategy.name == "zero3-offload"
    assert any("precision taken as bf16" in a for a in settings.assumptions)
    assert fit_settings(path, Pins(precision="fp16")).precision == "fp16"


def test_fit_of_an_fsdp_yaml_with_sync_module_states_touches_no_device():
    from toolkit.check.fit import fit_settings

    settings = fit_settings(str(REAL / "accelerate/tests/test_configs/latest_fsdp.yaml"))
    assert settings.strategy.name == "fsdp2" and settings.precision == "fp32" and settings.checkpointing is False
    assert fit_settings(str(REAL / "trl/examples/accelerate_configs/fsdp1.yaml")).precision == "bf16"


@pytest.mark.parametrize("key, value", [
    ("gradient_accumulation_steps", 2), ("gradient_clipping", 1.0), ("zero_stage", 2),
    ("offload_optimizer_device", "cpu"), ("offload_param_device", "cpu"), ("offload_optimizer_nvme_path", "/nvme"),
    ("offload_param_nvme_path", "/nvme"), ("zero3_save_16bit_model", True)])
def test_accelerate_itself_refuses_each_yaml_key_beside_a_json(tmp_path, key, value):
    """DS_FILE_IGNORED_KEYS is the set accelerate refuses next to deepspeed_config_file; this keeps it honest."""
    import yaml as _yaml

    from toolkit.check.accelerate import DS_FILE_IGNORED_KEYS
    from toolkit.engines.validate import ConfigRejected, accelerate_launch_plugins

    assert key in DS_FILE_IGNORED_KEYS
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    config = {"distributed_type": "DEEPSPEED", "num_machines": 1, "num_processes": 2,
              "deepspeed_config": {"deepspeed_config_file": str(tmp_path / "ds.json"), key: value}}
    (tmp_path / "a.yaml").write_text(_yaml.safe_dump(config))
    with pytest.raises(ConfigRejected, match=key):
        accelerate_launch_plugins(tmp_path / "a.yaml")


def test_fit_shards_fsdp_over_the_parallelism_configs_dp_shard_group():
    from toolkit.check.fit import fit_findings

    def used(found):
        return float(found[-1].message.split("fits, ")[1].split(" GiB")[0])

    hsdp = fit_findings(str(REAL / "accelerate/examples/torch_native_parallelism/configs/tp_hsdp.yaml"),
                        model="llama-3-8b", gpus="8xH100-80GB")
    full = fit_findings(str(REAL / "trl/examples/accelerate_configs/fsdp2.yaml"), model="llama-3-8b",
                        gpus="8xH100-80GB")
    assert "with fsdp2," in hsdp[-1].message and "with fsdp2," in full[-1].message
    assert any("parallelism_config: dp=2x2 x tp=2" in p.message for p in hsdp)
    # States sharded 2 (FSDP) x 2 (TP) ways instead of 8 (+15 GiB); TP splits the layers' activations (-4 GiB), and
    # FSDP2 under TP keeps only the model's fsdp_plan tail (final norm + head) unsharded, not the whole root with
    # the embedding (-2.7 GiB; measured in benchmarks/results/dimension_memory.md): tensor peaks 34.1 against 29.3
    # GiB. Both replays follow FSDP2's own backward rules (toolkit.estimate.engineevents; under TP since the
    # fsdp_plan groups got them: 41.9 -> 46.4 GiB), reserved 1.30x and 1.33x allocated (the H200 measured
    # 1.25-1.29x): 46.4 against 39.8 GiB.
    assert used(full) + 5 < used(hsdp) < used(full) + 8


def test_fit_leaves_precision_open_when_the_yaml_does_not_say_and_never_aborts_the_check(capsys):
    from toolkit.cli import main

    # The YAML names a JSON with fp16 enabled and states no mixed_precision: fp16, no assumption about it.
    yaml_path = REAL / "accelerate/examples/config_yaml_templates/deepspeed.yaml"
    code = main(["check", str(yaml_path), "--model", "qwen2.5-0.5b", "--gpus", "2xH100-80GB"])
    out = "".join(capsys.readouterr())
    assert code == 0 and "qwen2.5-0.5b with zero1, fp16, micro-batch 1" in out and "precision taken as" not in out
    # --gpus 8 against num_processes 2 is an error of the check; the fit still runs on the GPUs given.
    assert main(["check", str(yaml_path), "--model", "llama-3-8b", "--gpus", "8xH100-80GB"]) == 1
    out = "".join(capsys.readouterr())
    assert "does not match 1 node(s) x 8 GPUs" in out and "llama-3-8b with zero1" in out


def test_zero_stage_auto_is_what_accelerate_fills(tmp_path):
    """accelerate's DeepSpeedPlugin fills "stage": "auto" from --zero_stage (default 2): checked and fitted as such,
    and a rule that depends on the stage is only a warning (the launch command may say 3)."""
    from toolkit.check.fit import fit_settings

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto",
                                "zero_optimization": {"stage": "auto", "offload_param": {"device": "cpu"}}}))
    found = check_paths([str(path)])
    assert [p.severity for p in found] == ["note", "warning"]
    assert "(here 2); checked as ZeRO-2" in found[0].message and "offload_param at ZeRO-2" in found[1].message
    settings = fit_settings(str(path))
    assert settings.strategy.name == "zero2" and settings.precision == "fp32"
    assert any("ZeRO stage taken as 2" in a for a in settings.assumptions)
    assert any("precision taken as fp32" in a for a in settings.assumptions)


def test_cli_json_is_the_whole_stdout_and_usage_errors_go_to_stderr(capsys):
    from toolkit.cli import main

    path = str(REAL / "trl/examples/accelerate_configs/deepspeed_zero3.yaml")
    assert main(["check", path, "--json", "--model", "qwen2.5-0.5b", "--gpus", "8xA100-80GB"]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["exit_code"] == 0 and all(f["severity"] == "note" for f in report["findings"])
    assert any("qwen2.5-0.5b with zero3" in f["message"] for f in report["findings"])
    assert main(["check", path, "--micro-batch", "2"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "give --model and --gpus too" in captured.err


def test_three_typos_in_a_deepspeed_json_are_all_reported_in_one_run(tmp_path):
    """Each problem DeepSpeed names is its own finding: fixing one typo never reveals the next one."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                                "zero_optimization": {"stage": 2, "overlap_com": True, "reduce_bucket_sise": 5e8},
                                "bf16": {"enable": True}, "gradient_clipin": 1.0}))
    messages = [p.message for p in check_paths([str(path)]) if p.severity == "error"]
    for typo in ("zero_optimization.overlap_com", "zero_optimization.reduce_bucket_sise", "bf16.enable",
                 "\"gradient_clipin\""):
        assert sum(typo in m for m in messages) == 1, (typo, messages)
    assert any("did you mean \"gradient_clipping\"" in m for m in messages)


def test_fsdp1_keys_under_fsdp_version_2_are_named_with_what_accelerate_does(tmp_path):
    """From accelerate's own conversion table (accelerate to-fsdp2): removed keys are ignored with a warning, a
    renamed one is read as its FSDP2 key (with the value it maps to), an unimplemented one is refused."""
    import yaml

    path = tmp_path / "fsdp.yaml"
    path.write_text(yaml.safe_dump({
        "compute_environment": "LOCAL_MACHINE", "distributed_type": "FSDP", "num_processes": 2, "num_machines": 1,
        "machine_rank": 0, "mixed_precision": "bf16",
        "fsdp_config": {"fsdp_version": 2, "fsdp_sharding_strategy": "SHARD_GRAD_OP",
                        "fsdp_backward_prefetch": "BACKWARD_PRE", "fsdp_use_orig_params": True,
                        "fsdp_forward_prefetch": True, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                        "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer"}}))
    problems = {p.message.split(" ", 1)[0]: p for p in check_paths([str(path)])
                if p.message.startswith("fsdp_config.")}
    assert set(problems) == {"fsdp_config.fsdp_sharding_strategy", "fsdp_config.fsdp_backward_prefetch",
                             "fsdp_config.fsdp_use_orig_params", "fsdp_config.fsdp_forward_prefetch"}
    assert "write fsdp_reshard_after_forward: false" in problems["fsdp_config.fsdp_sharding_strategy"].message
    assert "ignores it" in problems["fsdp_config.fsdp_use_orig_params"].message
    assert problems["fsdp_config.fsdp_forward_prefetch"].severity == "error"

    # Without the refused key accelerate gets as far as its own deprecation warning: a finding of this file (a
    # note), not a line on the terminal.
    import contextlib
    import io

    config = yaml.safe_load(path.read_text())
    del config["fsdp_config"]["fsdp_forward_prefetch"]
    path.write_text(yaml.safe_dump(config))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        found = check_paths([str(path)])
    assert printed.getvalue() == ""
    assert any(p.file == str(path) and p.severity == "note" and
               p.message.startswith("the engines said while reading it: backward_prefetch") for p in found)


# --- issue 33: DeepSpeed's world arithmetic, the files each route passes, hostfiles, complete emitted files --------

def _sp_plan(sp: int = 2, strategy: str = "zero2", offload: bool = False):
    """A ZeRO x Ulysses plan on one node of 4 (micro 4 x accum 2 x dp 4 / sp)."""
    from toolkit.plan.schema import parse_plan

    plan = reference_plan(strategy + ("-offload" if offload else ""), nodes=1, gpus_per_node=4, micro=4, accum=2)
    data = json.loads(plan.to_json())
    data.update(sequence_parallel=sp, global_batch=4 * 2 * 4 // sp)
    return parse_plan(data)


def test_deepspeeds_own_constructor_counts_the_data_parallel_world():
    from toolkit.engines.readers import deepspeed_data_parallel
    from toolkit.engines.validate import pipeline_mpu, ulysses_mpu

    assert deepspeed_data_parallel({}, 4) == 4
    assert deepspeed_data_parallel({"sequence_parallel_size": 2}, 4) == 2  # the HF zero.Init / launcher path
    assert deepspeed_data_parallel({}, 4, mpu=ulysses_mpu(2)) == 2  # accelerate's Ulysses mpu
    assert deepspeed_data_parallel({"sequence_parallel_size": 4}, 4, mpu=ulysses_mpu(2)) == 2  # the mpu decides
    assert deepspeed_data_parallel({}, 8, mpu=pipeline_mpu(2)) == 2
    assert deepspeed_data_parallel({"sequence_parallel_size": 2, "data_parallel_size": 4}, 8) == 4  # the mesh


def test_the_concrete_file_of_a_zero2_sp2_plan_is_right_for_deepspeed_on_4_gpus(tmp_path):
    emit_files(_sp_plan(), tmp_path)
    concrete = str(tmp_path / "ds_config.deepspeed.json")
    assert json.loads(Path(concrete).read_text())["train_batch_size"] == 16
    assert check_paths([concrete], gpus=(1, 4), runner="deepspeed") == []
    found = check_paths([concrete], gpus=(1, 4))
    assert not any("set train_batch_size to 32" in p.message for p in found), found
    # The HF Trainer checks a concrete batch against every process (32) while DeepSpeed wants 16: a warning for it.
    assert [(p.severity, p.runner) for p in found] == [("warning", "HF Trainer")]
    assert 'write "auto"' in found[0].message
    on_8 = check_paths([concrete], gpus=(1, 8), runner="deepspeed")
    assert [p.message for p in on_8][0].startswith("train_batch_size 16 != micro 4 x accum 2 x data-parallel 4 "
                                                     "(8 processes / sequence_parallel_size 2) = 32")
    assert check_paths([str(tmp_path)]) == []  # the folder: ds_config.json, the YAML's copy, the concrete file


def test_a_hand_edited_sequence_parallel_size_is_judged_on_the_file_the_launch_passes(tmp_path):
    emit_files(_sp_plan(), tmp_path)
    path = tmp_path / "ds_config.json"
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "sequence_parallel_size": 3}))
    found = check_paths([str(tmp_path)])
    errors = [p for p in found if p.severity == "error"]
    assert len(errors) == 1 and errors[0].file == str(path), found
    assert "sequence_parallel_size 3 but plan.json plans sequence parallel 2" in errors[0].message
    assert "does not even divide the 4 processes" in errors[0].message
    differ = [p for p in found if "differs from the copy this YAML carries" in p.message]
    assert len(differ) == 1 and "`toolkit launch` and toolkit.train use " + str(path) in differ[0].message


def test_the_yaml_copy_is_checked_when_it_differs_from_the_file(tmp_path):
    """launch.sh / `accelerate launch --config_file` with a user's script read the YAML's inline JSON."""
    import yaml

    emit_files(_sp_plan(), tmp_path)
    path = tmp_path / "accelerate_config.yaml"
    config = yaml.safe_load(path.read_text())
    inline = json.loads(config["deepspeed_config"]["deepspeed_config_file"])
    inline["zero_optimization"]["stage"] = 3
    config["deepspeed_config"]["deepspeed_config_file"] = json.dumps(inline)
    path.write_text(yaml.safe_dump(config))
    found = check_paths([str(tmp_path)])
    assert any(p.file == f"{path} (its inline deepspeed_config_file)" and "ZeRO stage 3 but plan.json plans zero2"
               in p.message for p in found), found


def test_an_edited_concrete_file_is_checked_for_the_deepspeed_launcher(tmp_path):
    emit_files(_sp_plan(), tmp_path)
    path = tmp_path / "ds_config.deepspeed.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "sequence_parallel_size": 4}))
    found = [p for p in check_paths([str(tmp_path)]) if p.file == str(path)]
    assert {p.runner for p in found} == {"deepspeed launcher"} and all(p.severity == "error" for p in found)
    assert any("= 8; set train_batch_size to 8" in p.message for p in found), found
    assert any("sequence_parallel_size 4 but plan.json plans sequence parallel 2" in p.message for p in found)


def test_a_sequence_parallel_degree_the_heads_do_not_take_is_named(tmp_path):
    config = {"model_type": "llama", "hidden_size": 384, "num_hidden_layers": 4, "num_attention_heads": 6,
              "num_key_value_heads": 6, "intermediate_size": 1024, "max_position_embeddings": 8192}
    from toolkit.plan.schema import parse_plan

    plan = reference_plan("zero2", nodes=1, gpus_per_node=4, micro=4, accum=2, model_config=config)
    plan = parse_plan({**json.loads(plan.to_json()), "sequence_parallel": 2, "global_batch": 16})
    emit_files(plan, tmp_path)
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "sequence_parallel_size": 4}))
    messages = [p.message for p in check_paths([str(tmp_path)]) if p.file == str(path)]
    assert any("does not divide" in m and "6 attention heads" in m for m in messages), messages


def test_misspelt_parallelism_config_keys_are_named_from_accelerates_parser(tmp_path):
    import yaml

    from toolkit.engines.validate import parallelism_config_keys

    assert {"parallelism_config_sp_size", "parallelism_config_dp_shard_size"} <= parallelism_config_keys()
    emit_files(_sp_plan(), tmp_path)
    path = tmp_path / "accelerate_config.yaml"
    config = yaml.safe_load(path.read_text())
    block = config["parallelism_config"]
    block["sp_size"] = block.pop("parallelism_config_sp_size")
    path.write_text(yaml.safe_dump(config))
    messages = [p.message for p in check_paths([str(path)])]
    assert any('unknown key parallelism_config.sp_size' in m and 'did you mean "parallelism_config_sp_size"' in m
               for m in messages), messages


def test_hostfiles_are_checked_per_host(tmp_path):
    from toolkit.run.preflight import check_hostfile

    plan = reference_plan("zero3", nodes=2, gpus_per_node=2)
    emit_files(plan, tmp_path, hosts=["localhost", "127.0.0.1"])
    hostfile = tmp_path / "hostfile"
    assert check_paths([str(tmp_path)]) == []
    for text, says in (("localhost slots=4\n127.0.0.1 slots=0\n", "line 2: host 127.0.0.1 has slots=0"),
                       ("localhost slots=3\n127.0.0.1 slots=1\n", "unequal slots"),
                       ("# nodes\nlocalhost slots=2\n127.0.0.1 slots 2\n", "line 3 is not `host slots=GPUS`"),
                       ("localhost slots=2\nlocalhost slots=2\n", "names host localhost twice (lines 1 and 2)")):
        hostfile.write_text(text)
        found = check_paths([str(tmp_path)])
        assert [(p.severity, p.file) for p in found] == [("error", str(hostfile))] and says in found[0].message, found
        assert check_paths([str(hostfile)], gpus=(2, 2))[0].message == found[0].message
        with pytest.raises(UserError, match=re.escape(says)):  # toolkit launch's preflight, the same rule
            check_hostfile(plan, hostfile)


def test_a_plan_json_that_is_a_folder_is_one_clear_line(tmp_path):
    (tmp_path / "plan.json").mkdir()
    for given in (tmp_path, tmp_path / "plan.json"):
        with pytest.raises(UserError) as caught:
            check_paths([str(given)])
        assert str(caught.value) == f"plan file {tmp_path / 'plan.json'} is a directory, not a file; give the file itself"
        assert "plan.json/plan.json" not in str(caught.value)


@pytest.mark.parametrize("strategy,offload", [("zero2", False), ("zero3", True)])
def test_the_launcher_file_carries_the_optimizer_and_both_files_pass(tmp_path, strategy, offload):
    from toolkit.emit.deepspeed import ADAM_BETAS, ADAM_EPSILON, LEARNING_RATE, WEIGHT_DECAY
    from toolkit.engines.validate import deepspeed_config_at, validate_ds_config_for_plan

    plan = _sp_plan(sp=1, strategy=strategy, offload=offload)
    emit_files(plan, tmp_path)
    concrete = json.loads((tmp_path / "ds_config.deepspeed.json").read_text())
    assert concrete["optimizer"] == {"type": "AdamW", "params": {
        "lr": LEARNING_RATE, "betas": list(ADAM_BETAS), "eps": ADAM_EPSILON, "weight_decay": WEIGHT_DECAY}}
    assert "scheduler" not in concrete  # the plan holds no schedule
    parsed = deepspeed_config_at(concrete, plan.world_size)  # DeepSpeed's own DeepSpeedConfig
    assert parsed.optimizer_name == "adamw" and parsed.optimizer_params["lr"] == LEARNING_RATE
    assert parsed.optimizer_params["weight_decay"] == WEIGHT_DECAY and parsed.train_batch_size == plan.global_batch
    hf = json.loads((tmp_path / "ds_config.json").read_text())
    assert ("optimizer" in hf) == offload  # the runners' file: the Trainer builds its own optimizer otherwise
    if offload:
        assert hf["optimizer"]["params"]["lr"] == "auto" and hf["optimizer"]["params"]["weight_decay"] == "auto"
    validate_ds_config_for_plan(hf, plan)
    assert check_paths([str(tmp_path)]) == []
    assert check_paths([str(tmp_path / "ds_config.deepspeed.json")], gpus=(1, 4), runner="deepspeed") == []


def test_the_launcher_files_hyper_parameters_are_toolkit_trains_defaults():
    from toolkit.emit.deepspeed import LEARNING_RATE, WEIGHT_DECAY
    from toolkit.train.args import parse_train_args

    args = parse_train_args(["--plan", "p/plan.json", "--data", "d.txt", "--output", "o"])
    assert (args.lr, args.weight_decay) == (LEARNING_RATE, WEIGHT_DECAY)


def test_the_degree_in_a_zero3_trainer_file_is_refused_as_zero_init_reads_it(tmp_path):
    """zero.Init divides the world by the file's sequence_parallel_size after the Trainer filled the batch over
    every process (issue 17: "8 != 2 * 2 * 1.0"): even the plan's own degree breaks the Trainer's file."""
    emit_files(_sp_plan(strategy="zero3"), tmp_path)
    assert check_paths([str(tmp_path)]) == []
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "sequence_parallel_size": 2}))
    found = [p for p in check_paths([str(tmp_path)]) if p.file == str(path)]
    assert [(p.severity, p.runner) for p in found] == [("error", "HF Trainer")], found
    assert "ZeRO-3's zero.Init (no mpu) divides the world by 2" in found[0].message


def test_launch_preflight_refuses_the_degree_in_a_zero3_trainer_file(tmp_path):
    """The launch's own validation (toolkit.run.preflight and the rehearsal call it) models zero.Init the same way."""
    from toolkit.engines.validate import ConfigRejected, validate_ds_config_for_plan

    plan = _sp_plan(strategy="zero3")
    emit_files(plan, tmp_path)
    config = json.loads((tmp_path / "ds_config.json").read_text())
    validate_ds_config_for_plan(config, plan)
    with pytest.raises(ConfigRejected, match="zero.Init reads sequence_parallel_size 2 .* 32 != 4 \\* 2 \\* 2"):
        validate_ds_config_for_plan({**config, "sequence_parallel_size": 2}, plan)


def test_fit_sizes_zero3s_reduce_bucket_as_deepspeed_will(tmp_path):
    """PEFT's examples/sft ZeRO-3 YAML (an inline deepspeed_config) gives DeepSpeed a zero_optimization block
    without reduce_bucket_size, so its default 5e8 sizes the IPG buffer; a JSON's "auto" keeps the HF fill (0)."""
    from toolkit.check.fit import fit_settings

    yaml = tmp_path / "deepspeed_config.yaml"
    yaml.write_text("compute_environment: LOCAL_MACHINE\ndeepspeed_config:\n  deepspeed_multinode_launcher: standard\n"
                    "  offload_optimizer_device: none\n  offload_param_device: none\n  zero3_init_flag: true\n"
                    "  zero3_save_16bit_model: true\n  zero_stage: 3\ndistributed_type: DEEPSPEED\n"
                    "mixed_precision: bf16\nnum_machines: 1\nnum_processes: 8\n")
    assert dict(fit_settings(str(yaml)).job_options)["zero_reduce_bucket"] == 500_000_000
    auto = tmp_path / "auto.json"
    auto.write_text('{"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}, "bf16": {"enabled": true}}')
    assert "zero_reduce_bucket" not in dict(fit_settings(str(auto)).job_options)
    own = tmp_path / "own.json"
    own.write_text('{"zero_optimization": {"stage": 2, "reduce_bucket_size": 2e8}, "bf16": {"enabled": true}}')
    assert dict(fit_settings(str(own)).job_options)["zero_reduce_bucket"] == 200_000_000


def test_fit_takes_zero2s_overlap_comm_from_the_config(tmp_path):
    """ms-swift 3.0's zero2.json sets overlap_comm: the fit estimates DeepSpeed's second IPG buffer; a stage-2 config
    without the key runs DeepSpeed's default (off below stage 3) and gets one."""
    from toolkit.check.fit import fit_settings

    swift = tmp_path / "zero2.json"
    swift.write_text('{"zero_optimization": {"stage": 2, "overlap_comm": true, "reduce_bucket_size": 2e8}, '
                     '"bf16": {"enabled": true}}')
    assert dict(fit_settings(str(swift)).job_options) == {"zero_reduce_bucket": 200_000_000, "zero_overlap_comm": True}
    plain = tmp_path / "plain.json"
    plain.write_text('{"zero_optimization": {"stage": 2, "reduce_bucket_size": 2e8}, "bf16": {"enabled": true}}')
    assert "zero_overlap_comm" not in dict(fit_settings(str(plain)).job_options)


@pytest.mark.parametrize("spelled, second", [('"true"', True), ('"Yes"', True), ("1", True), ('"false"', False),
                                             ("false", False)])
def test_fit_reads_overlap_comm_as_deepspeed_does(tmp_path, spelled, second):
    """DeepSpeed's config models read booleans in pydantic's lax mode, so "true" / "Yes" / 1 switch overlap_comm on
    as true does (DeepSpeedZeroConfig itself asked, below): the fit prices the second IPG buffer for each, at stage 1
    as at stage 2 (stage_1_and_2.py setup_buckets serves both)."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    from toolkit.check.fit import fit_settings
    from toolkit.emit.deepspeed import ds_bool

    for stage in (1, 2):
        block = f'{{"stage": {stage}, "overlap_comm": {spelled}, "reduce_bucket_size": 2e8}}'
        path = tmp_path / f"zero{stage}.json"
        path.write_text(f'{{"zero_optimization": {block}, "bf16": {{"enabled": {spelled}}}}}')
        engine = DeepSpeedZeroConfig(**json.loads(block)).overlap_comm
        assert engine is second and ds_bool(json.loads(spelled)) is second
        assert dict(fit_settings(str(path)).job_options).get("zero_overlap_comm", False) is second
        assert fit_settings(str(path)).precision == ("bf16" if second else "fp32")


@pytest.mark.parametrize("strategy", ["zero1", "zero2"])
def test_a_zero12_x_sp_folder_without_the_gradient_average_names_the_keys_for_its_world(tmp_path, strategy):
    """The plan's own JSON averages over dp x sp (clean); the same JSON without its two keys, as toolkit wrote it
    before issue 32, warns (the YAML's inline copy keeps them), with the factor for the plan's 8 processes."""
    plan = reference_plan(strategy, "bf16", nodes=1, gpus_per_node=8, stages=1, micro=1, accum=4).replace(
        sequence_parallel=4, attention="sdpa", global_batch=8)
    emit_files(plan, tmp_path)
    assert check_paths([str(tmp_path)]) == []
    config = json.loads((tmp_path / "ds_config.json").read_text())
    del config["gradient_predivide_factor"], config["zero_optimization"]["reduce_scatter"]
    (tmp_path / "ds_config.json").write_text(json.dumps(config))
    found = [p for p in check_paths([str(tmp_path)]) if "Ulysses SP" in p.message]
    assert [(p.file, p.severity) for p in found] == [(str(tmp_path / "ds_config.json"), "warning")]
    assert f"ZeRO-{strategy[-1]} x Ulysses SP 4: a Trainer / TRL script trains on 4 x the gradient" in found[0].message
    assert '"gradient_predivide_factor": 8 and "zero_optimization": {"reduce_scatter": false}' in found[0].message
