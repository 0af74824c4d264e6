"""One plan, one truth: the grid, the plan schema and the job rules decide each fact once, and every command agrees.

Each test here is a reproduction of a disagreement found by trying the tool as a new user would.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import pytest

from toolkit.cli import main
from toolkit.errors import UserError
from toolkit.inputs.allocconf import alloc_conf
from toolkit.inputs.grid import ParallelGrid
from toolkit.inputs.hardware import parse_hardware
from toolkit.inputs.modelspec import resolve_model
from toolkit.plan.schema import SCHEMA_FILE, json_schema, load_plan
from toolkit.estimate.request import Request
from toolkit.estimate.search import evaluate, plan_candidates, to_plan
from toolkit.inputs.strategy import ALL_STRATEGY_NAMES, parse_strategy

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def planned(tmp_path_factory) -> Path:
    """A real planner output (zero3 for gpt2 on 8 GPUs), emitted with its prediction."""
    out = tmp_path_factory.mktemp("planned") / "p"
    assert main(["plan", "gpt2", "--gpus", "8xH100-80GB", "--seq", "512", "--global-batch", "32",
                 "--strategies", "zero3", "--checkpointing", "off", "--out", str(out)]) == 0
    return out


def _edited(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    data = json.loads((dst / "plan.json").read_text())
    data.update(changes)
    (dst / "plan.json").write_text(json.dumps(data))
    return dst


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "Traceback" not in err[0], err
    return err[0]


def test_editing_the_strategy_changes_what_emit_writes_and_check_agrees(planned, tmp_path, capsys):
    plan_dir = _edited(planned, tmp_path / "edited", strategy="zero2")
    out = tmp_path / "out"
    assert main(["emit", str(plan_dir / "plan.json"), "--out", str(out)]) == 0
    assert json.loads((out / "ds_config.json").read_text())["zero_optimization"]["stage"] == 2
    assert load_plan(out).zero_stage == 2
    assert main(["check", str(out)]) == 0


def test_a_version_1_plan_whose_stored_stage_disagrees_with_its_strategy_is_refused(tmp_path, capsys):
    data = json.loads((ROOT / "presets/sets/zero3-bf16/plan.json").read_text())
    data.update(version=1, strategy="zero2", engine="deepspeed", zero_stage=3)
    (tmp_path / "plan.json").write_text(json.dumps(data))
    assert main(["emit", str(tmp_path / "plan.json"), "--out", str(tmp_path / "o")]) == 2
    assert "'zero_stage' is 3 but strategy zero2" in _one_error_line(capsys)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("field, value, fragment", [
    ("strategy", "zero4", "'strategy'"),
    ("micro_batch", "2", "'micro_batch': Input should be a valid integer"),
    ("micro_batch", 2.0, "'micro_batch'"),
    ("micro_batch", 0, "'micro_batch'"),
    ("precision", "fp8", "'precision'"),
    ("pipeline_stages", 2, "pipeline"),
    ("global_batch", 33, "batch does not multiply"),
    ("partition", [0, 12], "only for pipeline plans"),
    ("version", 3, "schema version 3"),
    ("gpu", "H100\n; rm -rf /", "'gpu'"),
    ("model", "a\nb", "control character"),
    ("layer_class", "X$(touch pwned)", "'layer_class'"),
    ("notes", ["ok", "bad\rline"], "control character"),
    ("inter_node_gbps", float("nan"), "'inter_node_gbps'"),
    ("predicted_for", "not-a-key", "'predicted_for'"),
    ("surprise", 1, "'surprise'"),
])
def test_a_malformed_plan_is_refused_with_one_line_naming_the_field(planned, tmp_path, capsys, field, value,
                                                                     fragment):
    plan_dir = _edited(planned, tmp_path / "bad", **{field: value})
    before = sorted(p.name for p in plan_dir.iterdir())
    assert main(["emit", str(plan_dir), "--out", str(tmp_path / "o")]) == 2
    line = _one_error_line(capsys)
    assert fragment in line
    assert "2222" not in line
    assert sorted(p.name for p in plan_dir.iterdir()) == before and not (tmp_path / "o").exists()


def test_a_consistent_edit_is_re_predicted_in_what_emit_writes(planned, tmp_path, capsys):
    old = load_plan(planned)
    assert not old.prediction_is_stale
    assert old.micro_batch * old.grad_accum == 4
    micro = 1 if old.micro_batch != 1 else 4
    plan_dir = _edited(planned, tmp_path / "edited", micro_batch=micro, grad_accum=4 // micro)
    assert load_plan(plan_dir).prediction_is_stale
    out = tmp_path / "out"
    assert main(["emit", str(plan_dir), "--out", str(out)]) == 0
    assert "re-predicted" in capsys.readouterr().err
    new = load_plan(out)
    assert not new.prediction_is_stale
    assert (new.predicted["activations_bytes"] > old.predicted["activations_bytes"]) == (micro > old.micro_batch)
    # The prediction equals what the planner computes for that configuration from scratch.
    spec, hw = resolve_model("gpt2"), parse_hardware("8xH100-80GB")
    fresh = [c for c in plan_candidates(spec, hw, Request(seq_len=512, global_batch=32, micro_batch=micro,
                                                          strategies=("zero3",), checkpointing=False,
                                                          allocator_conf=old.allocator_conf))][0]
    assert new.predicted["required_bytes"] == fresh.memory.required_bytes
    assert new.predicted["step_time_s"] == pytest.approx(fresh.timing.step_time_s, rel=1e-12)
    md = (out / "PLAN.md").read_text()
    assert "STALE" not in md and f"{new.predicted['required_bytes'] / 1024**3:.1f} GiB" in md


def test_a_prediction_that_cannot_be_refreshed_is_marked_stale_in_the_first_line(planned, tmp_path, capsys):
    data = json.loads((planned / "plan.json").read_text())
    data["model_config"] = {**data["model_config"], "model_type": "gpt2", "architectures": ["Nope"],
                            "n_embd": 770}  # not divisible by the heads: the spec cannot be built
    data.update(micro_batch=4, grad_accum=1)
    (tmp_path / "plan.json").write_text(json.dumps(data))
    assert main(["emit", str(tmp_path / "plan.json"), "--out", str(tmp_path / "o")]) == 0
    assert "could not be re-predicted" in capsys.readouterr().err
    assert (tmp_path / "o" / "PLAN.md").read_text().startswith("> STALE PREDICTION")


def test_check_refuses_a_sequence_the_model_cannot_take_as_estimate_does(capsys):
    code = main(["check", "presets/sets/zero3-bf16", "--model", "gpt2", "--gpus", "8xH100-80GB", "--seq", "8192"])
    assert code == 1
    captured = capsys.readouterr()
    assert "--seq 8192 is longer than gpt2 allows (1024 positions)" in captured.err  # an error: stderr
    assert "1 error" in captured.out
    assert main(["estimate", "gpt2", "--seq", "8192"]) == 2
    assert "--seq 8192 is longer than gpt2 allows (1024 positions)" in _one_error_line(capsys)
    # A config set without a plan: the model is known from --model, the length from --seq.
    assert main(["check", str(ROOT / "tests/check_corpus/clean/ds-zero2-8-gpus.json"), "--model", "gpt2", "--gpus",
                 "8xH100-80GB", "--seq", "2048"]) == 1
    assert "--seq 2048 is longer than gpt2 allows (1024 positions)" in capsys.readouterr().err


def test_the_models_positions_are_one_fact_for_estimate_plan_emit_check_and_train(tmp_path, capsys):
    """A Llama config that leaves max_position_embeddings out has transformers' default, 2048 (LlamaConfig): a
    4096 plan on it was once a 'clean' check-corpus example. Every command refuses it in one line, check finds it
    on the plan folder, and YaRN scaling (original 2048 x factor 2) extends the model for all of them alike."""
    from toolkit.inputs.modelconfig import model_positions
    from toolkit.train.model import check_matches_plan, load_config

    folder = ROOT / "tests/check_corpus/plan-seq-longer-than-model-positions"
    config = json.loads((folder / "plan.json").read_text())["model_config"]
    assert "max_position_embeddings" not in config
    short = tmp_path / "short" / "config.json"
    short.parent.mkdir()
    short.write_text(json.dumps(config))
    for argv in (["estimate", str(short), "--seq", "4096"],
                 ["plan", str(short), "--gpus", "8xH100-80GB", "--seq", "4096", "--global-batch", "32"],
                 ["emit", str(folder), "--out", str(tmp_path / "out")]):
        assert main(argv) == 2, argv
        assert "is longer than" in (line := _one_error_line(capsys)) and "(2048 positions)" in line, argv
    assert not (tmp_path / "out").exists()
    assert main(["check", str(folder)]) == 1
    assert "plan sequence length 4096 is longer than model example/llama-small supports (2048 positions)" \
        in capsys.readouterr().err
    plan = load_plan(folder)
    with pytest.raises(UserError, match=r"longer than model .* \(2048 positions\); re-plan with --seq 2048"):
        check_matches_plan(load_config(str(short)), plan, "short")  # toolkit.train, before any process starts

    yarn = tmp_path / "yarn" / "config.json"
    yarn.parent.mkdir()
    yarn.write_text(json.dumps({**config, "rope_scaling": {"rope_type": "yarn", "factor": 2.0,
                                                           "original_max_position_embeddings": 2048}}))
    assert model_positions(load_config(str(yarn))) == 4096
    check_matches_plan(load_config(str(yarn)), plan, "yarn")
    assert main(["estimate", str(yarn), "--seq", "8192"]) == 2
    assert "(4096 positions)" in _one_error_line(capsys)


def test_a_default_sequence_the_model_cannot_take_adapts_and_says_so(capsys):
    assert main(["estimate", "gpt2-xl", "--json"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["job"]["seq_len"] == 1024
    assert "using 1024" in out["notes"][0]
    assert main(["plan", "gpt2-xl", "--global-batch", "8", "--top", "1"]) == 0
    assert "using 1024" in capsys.readouterr().err


def _estimate_json(capsys, argv: list[str]) -> dict:
    assert main(["estimate", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_estimate_and_plan_print_the_same_numbers_for_a_hybrid_grid(capsys):
    """gpt2, hybrid pp2 x dp4, micro 4 x accumulation 4: estimate and plan once differed in step time (per-stage
    parameters were computed three ways)."""
    est = _estimate_json(capsys, ["gpt2", "--gpus", "8xH100-80GB", "--strategy", "hybrid", "--pipeline-stages", "2",
                                  "--seq", "1024", "--micro-batch", "4", "--accumulation", "4"])
    assert main(["plan", "gpt2", "--gpus", "8xH100-80GB", "--strategies", "hybrid", "--pipeline-stages", "2",
                 "--seq", "1024", "--micro-batch", "4", "--accumulation", "4", "--checkpointing", "off",
                 "--json"]) == 0
    chosen = json.loads(capsys.readouterr().out)["chosen"]
    assert chosen["step_time_s"] == est["timing"]["step_time_s"]
    assert chosen["peak_bytes"] == est["per_gpu"]["required_bytes"]


def test_estimate_and_plan_agree_on_random_configurations(capsys):
    """Property: for random strategy / grid / batch / checkpointing choices, the planner's candidate and the
    estimate command report identical memory and step time."""
    rng = random.Random(8)
    models = ["gpt2", "qwen2.5-0.5b", "tinyllama-1.1b"]
    checked = 0
    for _ in range(60):
        strategy = parse_strategy(rng.choice(ALL_STRATEGY_NAMES))
        nodes, gpus = rng.choice([(1, 2), (1, 4), (1, 8), (2, 4), (2, 8)])
        stages = None
        if strategy.is_pipeline:
            world = nodes * gpus
            options = [world] if strategy.kind == "pipeline" else [p for p in (2, 4) if world % p == 0 and p < world]
            if not options:
                continue
            stages = rng.choice(options)
        try:
            grid = ParallelGrid.for_strategy(strategy, nodes=nodes, gpus_per_node=gpus, pipeline_stages=stages)
        except Exception:
            continue  # e.g. fsdp2-hybrid on one node: refused by both
        model, micro, accum = rng.choice(models), rng.choice([1, 2, 4]), rng.choice([1, 2, 8])
        ckpt = rng.random() < 0.5
        spec_text = f"{nodes}x{gpus}xA100-80GB"
        argv = [model, "--gpus", spec_text, "--strategy", strategy.name, "--seq", "512", "--micro-batch", str(micro),
                "--accumulation", str(accum)] + (["--pipeline-stages", str(stages)] if stages else []) \
            + (["--checkpointing"] if ckpt else [])
        spec, hw = resolve_model(model), parse_hardware(spec_text)
        # the estimate's job exactly: no tensor / context / sequence degree, no tiling or savers the planner may add
        req = Request(seq_len=512, micro_batch=micro, grad_accum=accum, checkpointing=ckpt,
                      strategies=(strategy.name,), pipeline_stages=stages, tensor_parallel=1, context_parallel=1,
                      sequence_parallel=1, tiled=False, savers=False,
                      allocator_conf=alloc_conf("cuda", None, hw.gpu, os.environ).conf)  # as the command sets it
        planned = plan_candidates(spec, hw, req)
        code = main(["estimate", *argv, "--json"])
        captured = capsys.readouterr()
        if code == 2:  # refused by the shared rules: the planner refuses it too, for the same reason
            assert len(planned) == 1 and captured.err.strip()[len("error: "):] in planned[0].reason
            continue
        est = json.loads(captured.out)
        cands = [c for c in planned if c.memory is not None]
        if not cands:  # refused on the states floor alone: the estimate must not fit either
            assert not est["fits"]
            continue
        c = cands[0]
        assert c.global_batch == grid.global_batch(micro, accum)
        assert c.memory.required_bytes == est["per_gpu"]["required_bytes"], argv
        assert c.timing.step_time_s == est["timing"]["step_time_s"], argv
        direct = evaluate(spec, hw, strategy, c.job, grid, prune=False)
        assert direct.timing.step_time_s == c.timing.step_time_s
        checked += 1
    assert checked >= 30


def test_pipeline_stages_with_a_strategy_without_stages_is_refused(capsys):
    assert main(["estimate", "gpt2", "--seq", "512", "--strategy", "zero2", "--pipeline-stages", "2"]) == 2
    assert "--pipeline-stages 2 needs a pipeline strategy" in _one_error_line(capsys)


def test_the_grid_names_the_values_that_work():
    from toolkit.errors import UserError

    grid = ParallelGrid.for_strategy(parse_strategy("hybrid"), nodes=2, gpus_per_node=4, pipeline_stages=2)
    assert (grid.pipeline_stages, grid.data_parallel, grid.world) == (2, 4, 8)
    with pytest.raises(UserError, match="accumulation 4 makes it hold"):
        grid.check_batch(64, 4, 2)
    with pytest.raises(UserError, match=r"try 2, 4, 8"):
        ParallelGrid.for_strategy(parse_strategy("hybrid"), nodes=1, gpus_per_node=8, pipeline_stages=3)
    spec = resolve_model("gpt2")
    bounds = grid.partition(spec)
    assert bounds[0] == 0 and bounds[-1] == 12 and len(bounds) == 3
    per_stage = grid.stage_params(spec, bounds)
    # The last stage holds its own copy of the tied embedding, so the stages add up to params + that copy.
    assert sum(per_stage) == spec.params + spec.embedding_params
    hsdp = ParallelGrid.for_strategy(parse_strategy("fsdp2-hybrid"), nodes=2, gpus_per_node=8)
    assert (hsdp.dp_replicate, hsdp.dp_shard) == (2, 8)


def test_the_published_json_schema_is_the_one_the_code_validates_with():
    assert json.loads(SCHEMA_FILE.read_text()) == json.loads(json.dumps(json_schema()))


def test_version_and_errors_on_stderr(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.startswith("toolkit ")
    assert main(["estimate", "no-such-model"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("error: ")


def test_launch_preflight_applies_the_same_job_rules_as_estimate(tmp_path, capsys):
    """A plan edited to bf16 on a GPU without bf16 is refused by launch before anything starts, with the message
    estimate and plan give for the same job."""
    data = json.loads((ROOT / "presets/sets/zero2-bf16/plan.json").read_text())
    data["gpu"] = "V100-32GB"
    plan_dir = tmp_path / "p"
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "plan.json").write_text(json.dumps(data))
    assert main(["emit", str(tmp_path / "src" / "plan.json"), "--out", str(plan_dir)]) == 2  # emit refuses too
    assert "V100-32GB has no bf16" in _one_error_line(capsys)
    shutil.copytree(ROOT / "presets/sets/zero2-bf16", plan_dir)
    (plan_dir / "plan.json").write_text(json.dumps(data))
    (tmp_path / "data.txt").write_text("some text\n")
    code = main(["launch", str(plan_dir), "--dry-run", "--", "--data", str(tmp_path / "data.txt"), "--output",
                 str(tmp_path / "out")])
    assert code == 2
    assert "V100-32GB has no bf16; use --precision fp16 or fp32" in _one_error_line(capsys)
    assert main(["estimate", "llama-2-7b", "--gpus", "8xV100-32GB", "--seq", "512", "--strategy", "zero2"]) == 2
    assert "V100-32GB has no bf16; use --precision fp16 or fp32" in _one_error_line(capsys)


def test_ds_config_against_plan_json_is_one_rule_for_check_and_both_runners(tiny_llama_dir, tmp_path):
    """`toolkit check`, the Trainer runner and the pipeline runner ask one function whether ds_config.json agrees
    with plan.json (emit.deepspeed.plan_disagreements); "auto" agrees, a concrete different number does not."""
    from toolkit.check.folder import plan_json_consistency
    from toolkit.emit.deepspeed import plan_disagreements
    from toolkit.errors import UserError
    from toolkit.run.launcher import emit_plan_files
    from toolkit.run.rehearsal import plan_for_model
    from toolkit.train.args import parse_train_args
    from toolkit.train.hf_runner import check_ds_config_agrees

    plan = plan_for_model(tiny_llama_dir, "zero2", micro_batch=2, seq_len=32)
    folder = emit_plan_files(plan, tmp_path / "p")
    config = json.loads((folder / "ds_config.json").read_text())
    assert plan_disagreements(config, plan, max_grad_norm=1.0) == {}
    config.update(train_micro_batch_size_per_gpu=4, gradient_clipping=0.5, gradient_accumulation_steps="auto")
    assert plan_disagreements(config, plan, max_grad_norm=1.0) == {"train_micro_batch_size_per_gpu": (4, 2),
                                                                   "gradient_clipping": (0.5, 1.0)}
    assert [p.message.split(" but ")[0] for p in plan_json_consistency(config, "ds_config.json", plan)] == \
        ["train_micro_batch_size_per_gpu 4"]
    (folder / "ds_config.json").write_text(json.dumps(config))
    args = parse_train_args(["--plan", str(folder / "plan.json"), "--data", "x", "--output", str(tmp_path / "o")])
    with pytest.raises(UserError, match="sets train_micro_batch_size_per_gpu 4 but the plan's micro-batch is 2"):
        check_ds_config_agrees(plan, args, folder / "ds_config.json")


def test_a_local_folder_wins_over_a_catalog_name_of_the_same_spelling_everywhere(tiny_llama_dir, tmp_path,
                                                                                  monkeypatch):
    """One resolver, one precedence (toolkit.inputs.resolve): an existing local folder, then the catalog, then
    the hub. estimate / plan, plan.json, the emitted scripts and toolkit.train all read the same model."""
    from toolkit.inputs.resolve import catalog_hub_id, loadable_model, locate_model, recorded_model
    from toolkit.train.model import load_config

    (tmp_path / "elsewhere").mkdir()
    shutil.copytree(tiny_llama_dir, tmp_path / "gpt2")  # a llama folder spelled like the catalog's gpt2
    monkeypatch.chdir(tmp_path)
    assert locate_model("gpt2").kind == "local"
    assert resolve_model("gpt2").model_type == "llama"
    assert load_config("gpt2").model_type == "llama"
    assert loadable_model("gpt2") == recorded_model("gpt2") == str(tmp_path / "gpt2")

    monkeypatch.chdir(tmp_path / "elsewhere")  # no such folder here: the catalog entry
    assert locate_model("gpt2").kind == "catalog"
    assert resolve_model("gpt2").model_type == "gpt2"
    assert loadable_model("gpt2") == (catalog_hub_id("gpt2") or "gpt2") and recorded_model("gpt2") == "gpt2"


def test_plan_folder_file_names_are_spelled_once():
    """toolkit.plan.files names every file of a plan folder; code elsewhere uses its constants (a name inside a
    message or a docstring is text, not a spelling the code relies on)."""
    import ast

    from toolkit.plan import files

    names = set(files.EMITTED)
    spelled = []
    for path in (ROOT / "toolkit").rglob("*.py"):
        if path == ROOT / "toolkit" / "plan" / "files.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in names:
                spelled.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.value}")
    assert spelled == []


def test_a_strategy_the_plan_schema_lacks_is_refused_at_the_parser_in_one_line(tmp_path, capsys):
    """zero1-offload-nvme was accepted by the parser and then failed the plan schema with a pydantic traceback
    after the table printed; the strategy table is now the one list both read."""
    from toolkit.inputs.strategy import STRATEGIES
    from toolkit.plan.schema import StrategyName

    assert set(StrategyName.__args__) == set(STRATEGIES) == set(ALL_STRATEGY_NAMES)
    assert all(parse_strategy(name).name == name for name in STRATEGIES)
    out = tmp_path / "out"
    assert main(["plan", "gpt2", "--gpus", "8xH100-80GB", "--seq", "1024", "--global-batch", "64",
                 "--strategies", "zero1-offload-nvme", "--out", str(out)]) == 2
    assert "zero1-offload-nvme: DeepSpeed's ZeRO-1/2 keep an nvme-device optimizer in CPU RAM" in \
        _one_error_line(capsys) and not out.exists()


def _cycled(sets: dict[str, tuple[str, ...]]) -> list[dict[str, str]]:
    """Runs that together give every name of every set: run i takes name i of each (cycling the shorter sets)."""
    return [{flag: names[i % len(names)] for flag, names in sets.items()} for i in range(max(map(len, sets.values())))]


def _plan_folder(argv: list[str], out: Path, capsys):
    assert main([*argv, "--out", str(out)]) == 0, capsys.readouterr().err
    capsys.readouterr()
    return load_plan(out)


def test_every_strategy_name_survives_parser_plan_files_and_load(tiny_llama_dir, tmp_path, capsys):
    """Every name in the strategy table, given to `toolkit plan --strategies NAME --out`, is written to plan.json
    and read back by load_plan unchanged (the parser, the schema and the emitted files read one list)."""
    from toolkit.inputs.strategy import STRATEGIES

    for name in STRATEGIES:
        gpus = "2xH100-80GB" if name == "pipeline" else "2x2xH100-80GB"  # pipeline: every rank a stage, 2 layers
        plan = _plan_folder(["plan", str(tiny_llama_dir), "--seq", "64", "--global-batch", "16", "--gpus", gpus,
                             "--strategies", name, "--nvme-path", str(tmp_path / "nvme")], tmp_path / name, capsys)
        assert plan.strategy == name


def test_every_job_choice_survives_parser_job_plan_files_and_load(tiny_llama_dir, tmp_path, capsys):
    """Every accepted name of every closed set of the job (toolkit.inputs.choices), given to `toolkit plan --out`,
    is written to plan.json and read back by load_plan unchanged; none reaches a traceback."""
    from toolkit.inputs import choices

    job = _cycled({"--precision": choices.PRECISIONS, "--optimizer": choices.OPTIMIZERS,
                   "--attention": choices.ATTENTIONS, "--optimizer-impl": choices.OPTIMIZER_IMPLS,
                   "--method": ("full", "lora"), "--tiled": ("auto", "off", "on"),
                   "--device-kind": choices.DEVICE_KINDS,
                   "--checkpointing": tuple(m for m in choices.PLAN_CHECKPOINTING_MODES
                                            if m != choices.CHECKPOINTING_OP)})
    qlora = _cycled({"--qlora-quant-type": choices.QUANT_TYPES, "--qlora-compute-dtype": choices.COMPUTE_DTYPES,
                     "--qlora-quant-storage": choices.QUANT_STORAGE_DTYPES})
    # --compile offers compiled rows beside eager ones where the engines compose with it (not with lora, liger,
    # tiling): a run of its own; tiled on (run 2) takes no lora.
    switches = [["--liger"], [], [], ["--activation-offloading"]]
    runs = [*zip(job, switches), ({}, ["--compile"])]
    runs += [({"--method": "qlora", **flags}, []) for flags in qlora]
    for i, (given, switch) in enumerate(runs):
        plan = _plan_folder(["plan", str(tiny_llama_dir), "--seq", "64", "--global-batch", "16", "--gpus",
                             "2xH100-80GB", "--strategies", "zero2", *sum(map(list, given.items()), []), *switch],
                            tmp_path / str(i), capsys)
        for flag, name in given.items():
            field = flag[2:].replace("-", "_")
            if field.startswith("qlora_"):
                assert plan.adapter[field.removeprefix("qlora_")] == name, (flag, name)
            elif field in ("tiled", "checkpointing"):
                assert name == "auto" or getattr(plan, field) == (name == "on"), (flag, name, getattr(plan, field))
            else:
                assert getattr(plan, field) == name, (flag, name, getattr(plan, field))
        assert all(getattr(plan, flag[2:].replace("-", "_")) is True for flag in switch), switch


def test_every_objective_and_adapter_choice_survives_parser_job_plan_files_and_load(tiny_llama_dir, tmp_path,
                                                                                    capsys):
    """The closed sets of the preference, GRPO and adapter flags (toolkit.inputs.choices: every DPO loss type and
    reference a loss runs with, vLLM modes, base and modules-to-save dtypes, LM-head losses, every joined --method),
    given to `toolkit plan --out`, are written to plan.json and read back by load_plan unchanged. One strategy, one
    micro-batch, no checkpointing: the search is not what is tried here."""
    from toolkit.inputs import choices

    common = ["plan", str(tiny_llama_dir), "--global-batch", "16", "--gpus", "2xH100-80GB", "--micro-batch", "2",
              "--checkpointing", "off"]
    base = [*common, "--seq", "64"]
    methods = [f"{o}{choices.METHOD_JOIN}{m}" if m != "full" else o for o in choices.OBJECTIVES for m in choices.METHODS]
    dpo = _cycled({"--dpo-loss": choices.DPO_LOSS_TYPES, "--reference": choices.REFERENCES[:2],
                   "--method": tuple(m for m in methods if m.startswith("dpo"))})
    grpo = _cycled({"--vllm-mode": choices.VLLM_MODES,
                    "--method": tuple(m for m in methods if m.startswith("grpo") and "qlora" not in m)})
    lora = _cycled({"--base-dtype": choices.BASE_DTYPES, "--modules-to-save-dtype": choices.BASE_DTYPES})
    runs = [([*base, "--strategies", "zero2", *sum(map(list, g.items()), [])], g) for g in dpo]
    runs += [([*common, "--strategies", "zero2", "--max-prompt-length", "32", "--max-completion-length", "32",
               "--use-vllm", *sum(map(list, g.items()), [])], g) for g in grpo]
    runs += [([*base, "--strategies", "ddp", "--method", "lora", "--lora-modules-to-save", "lm_head", "--precision",
               "fp16" if g["--base-dtype"] == "fp16" else "bf16", *sum(map(list, g.items()), [])], g) for g in lora]
    runs += [([*base, "--strategies", "zero2", "--loss", name], {"--loss": name}) for name in choices.LOSSES]
    for i, (argv, given) in enumerate(runs):
        plan = _plan_folder(argv, tmp_path / str(i), capsys)
        read = {"--dpo-loss": (plan.dpo or {}).get("loss_type"), "--reference": (plan.dpo or {}).get("reference"),
                "--vllm-mode": (plan.grpo or {}).get("vllm_mode"), "--base-dtype": plan.adapter_spec.base_dtype,
                "--modules-to-save-dtype": plan.adapter_spec.saved_dtype, "--loss": plan.loss,
                "--method": "".join(("dpo" if plan.dpo else "grpo" if plan.grpo else "",
                                     "" if plan.method == "full" else choices.METHOD_JOIN + plan.method))}
        for flag, name in given.items():
            assert read[flag] == name, (argv, flag, read[flag])


def _unusual_job():
    """A Job whose every field a plan carries is off its default (the estimate-only ones excepted)."""
    from dataclasses import MISSING, fields

    from toolkit.inputs.job import Job
    from toolkit.inputs.lora import Adapter
    from toolkit.inputs.preference import Dpo
    from toolkit.plan.job import ESTIMATE_ONLY

    dpo = Dpo(beta=0.3, loss_type="ipo", reference="precomputed")
    adapter = Adapter(method="qlora", r=4, alpha=8.0, dropout=0.1, targets="q_proj,v_proj", modules_to_save="lm_head",
                      exclude="model.vision_tower", quant_type="fp4", double_quant=False, compute_dtype="float32",
                      quant_storage="bfloat16", saved_dtype="fp32", adapter_dtype="base")
    job = Job(seq_len=96, micro_batch=2, grad_accum=3, precision="fp16", optimizer="sgd", checkpointing=True,
              attention="eager", device_kind="cpu", optimizer_impl="foreach", activation_offloading=True, liger=True,
              tiled=True, compile=True, adapter=adapter, dpo=dpo, allocator_conf="max_split_size_mb:64",
              vision_tower="freeze", images_per_sample=1, image_size="448x448", image_tokens=16)
    for f in fields(Job):  # grpo: a job is DPO or GRPO, never both (_unusual_grpo_job carries it)
        # grpo and loss: _unusual_grpo_job / _unusual_trl_loss_job carry them (TRL's chunked NLL is modelled for
        # supervised fine-tuning, neither tiled nor compiled)
        assert f.name in (*ESTIMATE_ONLY, "grpo", "loss") or f.default is MISSING or getattr(job, f.name) != f.default, \
            f.name
    for f in fields(Adapter):  # base_dtype: LoRA's, not QLoRA's (_unusual_trl_loss_job carries it)
        assert f.name == "base_dtype" or getattr(adapter, f.name) != f.default, f.name
    for f in fields(Dpo):
        assert getattr(dpo, f.name) != f.default, f.name
    return job


def _unusual_grpo_job():
    """_unusual_job as GRPO (LoRA: GRPO is not modelled with QLoRA), every GRPO setting off its default."""
    from dataclasses import fields, replace

    from toolkit.inputs.grpo import Grpo
    from toolkit.inputs.lora import Adapter

    grpo = Grpo(num_generations=4, max_prompt_length=40, max_completion_length=56, beta=0.04, use_vllm=True,
                vllm_mode="server", vllm_gpu_memory_utilization=0.5, vllm_tensor_parallel_size=2,
                vllm_enable_sleep_mode=True, reward_model="/reward-model")
    for f in fields(Grpo):
        assert getattr(grpo, f.name) != f.default, f.name
    return replace(_unusual_job(), dpo=None, grpo=grpo, seq_len=grpo.seq_len, adapter=Adapter(method="lora", r=4),
                   liger=False, tiled=False, compile=False)


def _unusual_trl_loss_job():
    """_unusual_job as supervised fine-tuning with TRL's chunked NLL (loss "trl": not with DPO, tiling or compile),
    its adapter LoRA with an fp32 base (--base-dtype)."""
    from dataclasses import replace

    job = _unusual_job()
    return replace(job, dpo=None, loss="trl", tiled=False, compile=False,
                   adapter=replace(job.adapter, method="lora", base_dtype="fp32"))


@pytest.mark.parametrize("unusual", [_unusual_job, _unusual_grpo_job, _unusual_trl_loss_job],
                         ids=["dpo", "grpo", "trl-loss"])
def test_a_job_survives_job_plan_file_job_unchanged(unusual):
    """toolkit.plan.job's one mapping: a Job with every field off its default becomes plan.json's fields, the file's
    JSON, and the same Job again (a field added to Job and Plan is carried without another spelling)."""
    from toolkit.plan.build import build_plan
    from toolkit.plan.job import job_from_plan
    from toolkit.plan.schema import parse_plan

    job = unusual()
    config = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
              "max_position_embeddings": 256}
    plan = build_plan(model="/m", model_config=config, model_type="llama", layer_class="LlamaDecoderLayer",
                      num_layers=2, params=1000, strategy=parse_strategy("zero3"),
                      grid=ParallelGrid.for_strategy(parse_strategy("zero3"), nodes=1, gpus_per_node=2), job=job,
                      gpu="H100-80GB", model_parts={"language_params": 900, "vision_params": 90,
                                                    "projector_params": 10, "vision_modules": ["model.vision_tower"]})
    assert job_from_plan(plan) == job
    assert job_from_plan(parse_plan(json.loads(plan.to_json()))) == job


@pytest.mark.parametrize("field, value", [("chunked_loss", 4), ("compile", "blocks"), ("checkpointing", "op")])
def test_an_estimate_only_job_setting_cannot_become_a_plan(field, value):
    from dataclasses import replace

    from toolkit.inputs.job import Job
    from toolkit.plan.job import job_to_plan_fields

    with pytest.raises(UserError, match="estimate"):
        job_to_plan_fields(replace(Job(seq_len=64), **{field: value}))


def test_a_request_spells_its_job_once():
    """Request.job: the fields a Request holds as they are reach the Job the search evaluates (the search adds only
    the batch split, checkpointing, tiling and compile)."""
    from dataclasses import fields

    from toolkit.estimate.request import REQUEST_JOB_FIELDS, SEARCHED

    job = _unusual_job()
    req = Request(**{name: getattr(job, name) for name in REQUEST_JOB_FIELDS}, micro_batch=job.micro_batch)
    assert req.job(**{name: getattr(job, name) for name in SEARCHED}) == job
    from toolkit.inputs.job import Job

    from toolkit.plan.job import ESTIMATE_ONLY

    assert {f.name for f in fields(Job)} - set(REQUEST_JOB_FIELDS) - set(SEARCHED) <= set(ESTIMATE_ONLY)


@pytest.mark.parametrize("flags", [["--checkpointing", "op"], ["--compile-blocks"]], ids=["checkpointing-op",
                                                                                          "compile-blocks"])
def test_names_plan_cannot_take_are_refused_in_one_line_before_work(flags, tiny_llama_dir, tmp_path, capsys):
    """Names a closed set accepts that plan cannot emit (estimate-only settings): one line, nothing written."""
    out = tmp_path / "p"
    assert main(["plan", str(tiny_llama_dir), "--seq", "64", "--global-batch", "16", *flags, "--out", str(out)]) == 2
    _one_error_line(capsys)
    assert not out.exists()
