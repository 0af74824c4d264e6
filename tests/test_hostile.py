"""A hostile user's corpus: every bad input to every command is one line on stderr, exit code 2, no traceback, and
nothing changed on disk.

Run in-process through toolkit.cli.main (argument parsing and every check before a process starts are in-process),
so the whole corpus takes seconds. Placeholders: {W} a scratch world folder (the working directory, snapshotted
before and after each case), {M} a tiny Llama folder, {P} an emitted DDP plan of it, {Z} an emitted ZeRO-2 plan,
{D} a small text corpus. plan.json field contents are the plan schema's tests (toolkit/plan/schema.py), not these.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from toolkit.cli import main

GOLDEN_MESSAGES = Path(__file__).parent / "golden" / "hostile_messages.json"
"""Each case's error line as recorded before the layout of issue 16 moved the code, the world's folders written as
{W}, {M}, ...; TOOLKIT_RECORD_GOLDEN=1 records them again (a changed error line is a change to the public CLI)."""

BAD_NUMBERS = ("nan", "inf", "-inf", "-1", "0", "1e20", "abc", "")
"""Values no count or size may take (0 and -1 are fine for none of the flags below)."""

MODEL_SHAPE_FLAGS = ("--layers", "--hidden", "--heads", "--kv-heads", "--ffn", "--vocab")
SHAPE = "--layers 2 --hidden 64 --heads 4"


def _cases() -> list[tuple[str, list[str]]]:
    cases: list[tuple[str, list[str]]] = []

    def add(name: str, *argv: str) -> None:
        if argv[:1] in (("estimate",), ("plan",)) and "{M}" in argv and "--seq" not in argv:
            argv = (argv[0], "--seq", "64", *argv[1:])  # the tiny model's 256 positions: no note about --seq
        cases.append((name, list(argv)))

    # Every numeric flag of estimate against every bad number.
    for flag in MODEL_SHAPE_FLAGS:
        for value in BAD_NUMBERS:
            add(f"estimate {flag} {value!r}", "estimate", *SHAPE.split(), flag, value)
    for flag in ("--params", "--nodes", "--inter-node-gbps", "--cpu-ram-gib", "--seq", "--micro-batch",
                 "--accumulation"):
        for value in BAD_NUMBERS:
            add(f"estimate {flag} {value!r}", "estimate", "{M}", flag, value)
    for value in BAD_NUMBERS:
        add(f"estimate --pipeline-stages {value!r}", "estimate", "{M}", "--strategy", "pipeline", "--gpus",
            "2xH100-80GB",
            "--pipeline-stages", value)
    # plan's own numbers.
    for flag in ("--global-batch", "--micro-batch", "--accumulation", "--top", "--seq", "--pipeline-stages"):
        for value in ("nan", "-1", "0", "1e20", "2.5"):
            add(f"plan {flag} {value!r}", "plan", "{M}", "--micro-batch", "1", flag, value)
    for flag in ("--steps", "--micro-batch", "--seq"):
        for value in ("nan", "0", "-3", "1e20"):
            add(f"profile {flag} {value!r}", "profile", *SHAPE.split(), flag, value)
    for value in ("0", "-5", "nan", "1e20"):
        add(f"demo --steps {value!r}", "demo", "--steps", value, "--workdir", "{W}/demo")

    # Sizes a real cluster or model never has.
    add("10^20 GPUs per node", "estimate", "{M}", "--gpus", "100000000000000000000xH100")
    add("10^20 nodes in the spec", "estimate", "{M}", "--gpus", "100000000000000000000x8xH100")
    add("2000 GPUs per node", "estimate", "{M}", "--gpus", "2000xH100")
    add("100000 layers", "estimate", "--layers", "100000", "--hidden", "64", "--heads", "4")
    add("params 1e30", "estimate", "--params", "1e30")
    add("params 7Q", "estimate", "--params", "7Q")
    add("gpu spec empty", "estimate", "{M}", "--gpus", "")
    add("gpu spec newline", "estimate", "{M}", "--gpus", "8xH100\nrm -rf /")
    add("gpu spec unknown", "estimate", "{M}", "--gpus", "8xNOPE")
    add("gpu spec negative", "estimate", "{M}", "--gpus", "-8xH100")
    add("gpu spec nodes disagree", "estimate", "{M}", "--gpus", "2x8xH100", "--nodes", "3")

    # Contradictions are refused, not ignored.
    add("params beside a model name", "estimate", "{M}", "--params", "7e9")
    add("layers beside a model name", "estimate", "{M}", "--layers", "4")
    add("params beside a shape", "estimate", "--params", "7e9", *SHAPE.split())
    add("stages with zero2", "estimate", "{M}", "--strategy", "zero2", "--pipeline-stages", "2")
    add("stages with ddp", "estimate", "{M}", "--strategy", "ddp", "--pipeline-stages", "2")
    add("bf16 on V100 (estimate)", "estimate", "{M}", "--gpus", "8xV100-16GB", "--precision", "bf16")
    add("bf16-pure on T4 (estimate)", "estimate", "{M}", "--gpus", "1xT4", "--precision", "bf16-pure")
    add("bf16 on V100 (plan)", "plan", "{M}", "--gpus", "8xV100-16GB", "--micro-batch", "1")
    add("plan params beside a model name", "plan", "{M}", "--params", "7e9", "--micro-batch", "1")
    add("plan stages with zero2 only", "plan", "{M}", "--strategies", "zero2", "--pipeline-stages", "2",
        "--micro-batch", "1")
    add("shape: kv heads not dividing heads", "estimate", "--layers", "2", "--hidden", "64", "--heads", "4",
        "--kv-heads", "3")
    add("shape: kv heads above heads", "estimate", "--layers", "2", "--hidden", "64", "--heads", "4",
        "--kv-heads", "8")
    add("shape: hidden not dividing heads", "estimate", "--layers", "2", "--hidden", "63", "--heads", "4")
    add("shape: partial", "estimate", "--layers", "2", "--hidden", "64")
    # Issue 17's bad degrees, each refused before any trace: the engines' own rules (docs/ENGINE_FACTS.md).
    add("tensor parallel not dividing the KV heads", "estimate", "llama-3.1-8b", "--gpus", "2x16xH100-80GB",
        "--strategy", "fsdp2", "--tensor-parallel", "16")
    add("sequence parallel above the sequence", "estimate", "llama-3.1-8b", "--strategy", "zero3",
        "--sequence-parallel", "8", "--seq", "4")
    add("context parallel with eager attention", "estimate", "llama-3.1-8b", "--strategy", "fsdp2",
        "--context-parallel", "2", "--attention", "eager")
    add("context parallel on sliding-window layers", "estimate", "mistral-7b", "--strategy", "fsdp2",
        "--context-parallel", "2", "--seq", "4096")
    add("context parallel on soft-capped attention", "estimate", "gemma-2-2b", "--strategy", "fsdp2",
        "--context-parallel", "2", "--seq", "4096")
    add("sequence parallel with sdpa past a sliding window", "estimate", "mistral-7b", "--strategy", "zero3",
        "--sequence-parallel", "2", "--seq", "8192")
    add("sequence parallel on an eager-only model", "estimate", "gemma-2-2b", "--strategy", "zero3",
        "--sequence-parallel", "2", "--seq", "4096")
    add("--seq above the model's positions", "estimate", "{M}", "--seq", "100000")
    add("--seq max: positions stop before the grid's shortest length", "estimate", "{M}", "--seq", "max",
        "--strategy", "fsdp2", "--gpus", "3xH100-80GB", "--context-parallel", "3")
    add("--tiled with a strategy that does not run it", "estimate", "{M}", "--strategy", "fsdp2", "--tiled")

    # LoRA / QLoRA flags (their rules are toolkit.inputs.job's; here: that they reach the user as one line).
    for flag, value in (("--lora-r", "0"), ("--lora-r", "1e20"), ("--lora-alpha", "nan"), ("--lora-dropout", "2"),
                        ("--lora-dropout", "nan"), ("--lora-targets", ""), ("--method", "bogus")):
        method = () if flag == "--method" else ("--method", "lora")
        add(f"estimate lora {flag} {value!r}", "estimate", "{M}", *method, flag, value)

    # Choices.
    for flag, value in (("--precision", "fp8"), ("--optimizer", "lion"), ("--attention", "flash9"),
                        ("--device-kind", "tpu"), ("--strategy", "zero9"), ("--strategy", "")):
        add(f"estimate {flag} {value!r}", "estimate", "{M}", flag, value)
    add("plan --strategies zero9", "plan", "{M}", "--strategies", "zero9", "--micro-batch", "1")
    add("plan --strategies empty", "plan", "{M}", "--strategies", "", "--micro-batch", "1")
    add("plan --choose unknown", "plan", "{M}", "--choose", "nope", "--micro-batch", "1")
    add("plan --checkpointing maybe", "plan", "{M}", "--checkpointing", "maybe", "--micro-batch", "1")
    add("plan --checkpointing op", "plan", "{M}", "--checkpointing", "op", "--micro-batch", "1")
    add("plan --compile-blocks", "plan", "{M}", "--compile-blocks", "--micro-batch", "1")
    add("estimate --checkpointing maybe", "estimate", "{M}", "--checkpointing", "maybe")
    # Issue 33: flags and names read as something else, silently.
    add("--compile with --compile-blocks", "estimate", "{M}", "--compile", "--compile-blocks")
    add("--seq given twice", "estimate", "{M}", "--seq", "32", "--seq", "64")
    add("an abbreviated flag", "plan", "{M}", "--micro", "1")
    add("a GPU family (A100: 40 or 80 GB)", "estimate", "{M}", "--gpus", "8xA100")
    add("a GPU family (H100)", "plan", "{M}", "--gpus", "8xH100", "--micro-batch", "1")
    add("--inter-node-gbps 1e-300", "estimate", "{M}", "--gpus", "2x8xH100-80GB", "--inter-node-gbps", "1e-300")
    add("plan: pipeline under --tensor-parallel", "plan", "{M}", "--strategies", "pipeline", "--tensor-parallel", "2",
        "--micro-batch", "1")
    add("plan: ddp under --sequence-parallel", "plan", "{M}", "--strategies", "ddp", "--sequence-parallel", "2",
        "--micro-batch", "1")
    add("plan --seq max with --global-batch", "plan", "{M}", "--seq", "max", "--global-batch", "8")
    add("plan --seq max with --choose", "plan", "{M}", "--seq", "max", "--choose", "zero2")
    add("plan: --tiled on with ddp and pipeline", "plan", "{M}", "--tiled", "on", "--strategies", "ddp,pipeline",
        "--micro-batch", "1")
    add("profile --device tpu", "profile", *SHAPE.split(), "--device", "tpu")
    add("profile --device cuda;ls", "profile", *SHAPE.split(), "--device", "cuda;ls")

    # Models that do not exist or do not hold a config.
    add("unknown model", "estimate", "nope-model")
    add("relative path missing", "estimate", "./nope")
    add("absolute path missing", "estimate", "/nope/nope")
    add("no model at all", "estimate")
    add("empty model", "estimate", "")
    add("model with a newline", "estimate", "{M}\nrm -rf /")
    add("folder without config", "estimate", "{W}/empty")
    add("a file that is not JSON", "estimate", "{W}/notes.txt")
    for bad in sorted(set(BAD_CONFIGS) - {"gpt2_other"}):  # gpt2_other is a good config of another model
        add(f"config: {bad}", "estimate", f"{{W}}/bad/{bad}")
        add(f"config for plan: {bad}", "plan", f"{{W}}/bad/{bad}", "--micro-batch", "1", "--out", "{W}/never")

    # Output folders.
    add("plan --out empty", "plan", "{M}", "--micro-batch", "1", "--out", "")
    add("plan --out blank", "plan", "{M}", "--micro-batch", "1", "--out", "  ")
    add("plan --out a file", "plan", "{M}", "--micro-batch", "1", "--out", "{W}/notes.txt")
    add("plan --out under a file", "plan", "{M}", "--micro-batch", "1", "--out", "{W}/notes.txt/sub")
    add("plan --out existing plan without --force", "plan", "{M}", "--micro-batch", "1", "--out", "{P}")
    add("plan --out with a newline", "plan", "{M}", "--micro-batch", "1", "--out", "{W}/a\nb")
    add("plan --hosts with a newline", "plan", "{M}", "--micro-batch", "1", "--out", "{W}/h", "--hosts", "a\nb")
    add("plan --hosts with a semicolon", "plan", "{M}", "--micro-batch", "1", "--out", "{W}/h", "--hosts", "a;rm")
    add("plan --hosts empty entry", "plan", "{M}", "--micro-batch", "1", "--out", "{W}/h", "--hosts", "a,,b")
    add("plan --hosts count", "plan", "{M}", "--micro-batch", "1", "--out", "{W}/h", "--hosts", "a,b")
    add("plan --nvme-path empty", "plan", "{M}", "--micro-batch", "1", "--out", "{W}/h", "--nvme-path", "")

    # emit.
    add("emit missing", "emit", "{W}/nope")
    add("emit a text file", "emit", "{W}/notes.txt")
    add("emit a folder without plan", "emit", "{W}/empty")
    add("emit over itself without --force", "emit", "{P}")
    add("emit --out a file", "emit", "{P}", "--out", "{W}/notes.txt", "--force")
    add("emit --out empty", "emit", "{P}", "--out", "")
    add("emit --out under a file", "emit", "{P}", "--out", "{W}/notes.txt/x")
    add("emit --hosts too many", "emit", "{P}", "--out", "{W}/e", "--hosts", "a,b,c")
    add("emit --hosts injection", "emit", "{P}", "--out", "{W}/e", "--hosts", "$(reboot)")
    add("emit empty plan arg", "emit", "")

    # check (its file contents are issue 10's corpus; here: its arguments).
    add("check nothing", "check")
    add("check --gpus zero", "check", "{P}", "--gpus", "0xH100")
    add("check --seq nan", "check", "{P}", "--seq", "nan")
    add("check --seq 0", "check", "{P}", "--seq", "0")
    add("check empty path", "check", "")

    # launch and the training arguments after --.
    add("launch missing folder", "launch", "{W}/nope")
    add("launch a folder without plan", "launch", "{W}/empty")
    add("launch empty", "launch", "")
    base = ["launch", "{P}", "--dry-run", "--"]
    run_args = ["--data", "{D}", "--output", "{W}/run"]
    add("train --output a file", *base, "--data", "{D}", "--output", "{W}/notes.txt")
    add("train --output empty", *base, "--data", "{D}", "--output", "")
    add("train --tokenizer /nope", *base, *run_args, "--tokenizer", "/nope")
    add("train --model ./nope", *base, *run_args, "--model", "./nope")
    add("train --data missing", *base, "--data", "{W}/nope.txt", "--output", "{W}/run")
    add("train --data empty", *base, "--data", "", "--output", "{W}/run")
    add("train --log-dir a file", *base, *run_args, "--log-dir", "{W}/notes.txt")
    for flag, value in (("--lr", "nan"), ("--lr", "inf"), ("--lr", "-1"), ("--lr", "0"), ("--lr", "abc"),
                        ("--epochs", "nan"), ("--epochs", "0"), ("--epochs", "inf"), ("--max-steps", "0"),
                        ("--max-steps", "-2"), ("--save-steps", "0"), ("--logging-steps", "-1"),
                        ("--eval-steps", "0"), ("--eval-fraction", "1"), ("--eval-fraction", "nan"),
                        ("--weight-decay", "nan"), ("--weight-decay", "-1"), ("--max-grad-norm", "inf"),
                        ("--warmup-steps", "-1"), ("--save-total-limit", "0"), ("--seed", "x")):
        add(f"train {flag} {value}", *base, *run_args, flag, value)
    add("train unknown flag", *base, *run_args, "--bogus", "1")
    add("train --lr-scheduler unknown", *base, *run_args, "--lr-scheduler", "nope")
    add("train --data a binary .txt", *base, "--data", "{W}/binary.txt", "--output", "{W}/run")
    add("train --data a folder with a binary .jsonl", *base, "--data", "{W}/bin-data", "--output", "{W}/run")
    add("train --data a .jsonl with a broken line", *base, "--data", "{W}/bad-lines.jsonl", "--output", "{W}/run")
    add("train --data a .json that is neither JSON nor JSON Lines", *base, "--data", "{W}/bad.json", "--output",
        "{W}/run")
    add("rehearse with a bad learning rate", "launch", "{P}", "--rehearse", "--", *run_args, "--lr", "nan")
    add("rehearse a plan folder without plan", "launch", "{W}/empty", "--rehearse")
    zbase = ["launch", "{W}/z-bad", "--dry-run", "--", *run_args]
    add("rehearse a truncated ds_config", "launch", "{W}/z-cut", "--rehearse", "--dry-run")
    add("launch a truncated ds_config", "launch", "{W}/z-cut", "--dry-run", "--", *run_args)
    add("launch a ds_config that is a list", "launch", "{W}/z-list", "--dry-run", "--", *run_args)
    add("launch a ds_config with a list and a string for numbers", *zbase)
    add("train missing --data", *base, "--output", "{W}/run")
    add("train --plan given", *base, *run_args, "--plan", "{P}")
    add("train args to a non-launch command", "estimate", "{M}", "--", "--lr", "1")
    add("train a model that is not the plan's", *base, *run_args, "--model", "{W}/bad/gpt2_other")

    # demo.
    add("demo --workdir empty", "demo", "--workdir", "")
    add("demo --workdir a file", "demo", "--workdir", "{W}/notes.txt")

    # The command line itself.
    add("no command", )
    add("unknown command", "train")
    add("models with an argument", "models", "extra")
    add("gpus with a flag", "gpus", "--all")
    add("estimate unknown flag", "estimate", "{M}", "--nope")
    add("estimate flag without value", "estimate", "{M}", "--seq")

    # RoPE scaling (issue 32): factors transformers would not scale by, types it or the model lacks, flags alone.
    for value in ("0", "-1", "nan", "0.5"):
        add(f"rope factor {value}", "estimate", "{M}", "--rope-scaling", "yarn", "--rope-factor", value)
    add("rope factor nan in plan", "plan", "{M}", "--micro-batch", "1", "--rope-scaling", "yarn", "--rope-factor",
        "nan", "--out", "{W}/never")
    add("rope unknown type", "estimate", "{M}", "--rope-scaling", "longrope", "--rope-factor", "2")
    add("rope llama3 without its frequency factors", "plan", "{M}", "--micro-batch", "1", "--rope-scaling",
        "llama3", "--rope-factor", "2", "--out", "{W}/never")
    add("rope on a model without rotary embeddings", "estimate", "gpt2", "--seq", "64", "--rope-scaling", "yarn",
        "--rope-factor", "2")
    add("rope factor without a type", "estimate", "{M}", "--rope-factor", "2")
    add("rope type without a factor", "plan", "{M}", "--micro-batch", "1", "--rope-scaling", "yarn")
    add("rope factor too small for --seq", "estimate", "{M}", "--seq", "1024", "--rope-scaling", "yarn",
        "--rope-factor", "2")
    # calibration files (toolkit tune --export-calibration): corrupted, missing, not one, both flags
    add("calibration not JSON", "estimate", "{M}", "--calibration", "{W}/bad.json")
    add("calibration missing", "plan", "{M}", "--micro-batch", "1", "--calibration", "{W}/no-such.json", "--out",
        "{W}/never")
    add("calibration that is a list", "estimate", "{M}", "--calibration", "{W}/z-list/ds_config.json")
    add("calibration and no calibration", "estimate", "{M}", "--calibration", "{W}/bad.json", "--no-calibration")
    add("tune export into no folder", "tune", "{P}", "--cpu", "--export-calibration", "{W}/nowhere/cal.json")
    return cases


BAD_CONFIGS = {
    "zero_heads": {"num_attention_heads": 0},
    "hidden_string": {"hidden_size": "64"},
    "hidden_float": {"hidden_size": 64.5},
    "hidden_nan": {"hidden_size": float("nan")},
    "hidden_null": {"hidden_size": None},
    "hidden_not_divisible": {"hidden_size": 66},
    "kv_heads_not_dividing": {"num_key_value_heads": 3},
    "layers_negative": {"num_hidden_layers": -2},
    "layers_absurd": {"num_hidden_layers": 100000},
    "vocab_zero": {"vocab_size": 0},
    "vocab_bool": {"vocab_size": True},
    "ffn_list": {"intermediate_size": [128]},
    "model_type_number": {"model_type": 7},
    "model_type_unknown": {"model_type": "nopeformer"},
    "no_model_type": {"model_type": None},
    "binary": None,
    "json_list": [],
    "deep": "deep",
    "gpt2_other": "gpt2",
}


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_llama_dir, tiny_gpt2_dir, corpus_dir):
    from toolkit.run.launcher import emit_plan_files
    from toolkit.run.rehearsal import plan_for_model

    w = tmp_path_factory.mktemp("hostile")
    (w / "empty").mkdir()
    (w / "notes.txt").write_text("not a config\n")
    (w / "binary.bin").write_bytes(bytes(range(256)) * 4)
    (w / "binary.txt").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4)
    (w / "bin-data").mkdir()
    (w / "bin-data" / "train.jsonl").write_bytes(b'{"text": "\xff\xfe"}\n' * 10)
    (w / "bad-lines.jsonl").write_text('{"text": "fine"}\n' * 5 + '{"text": "cut\n' + '{"text": "fine"}\n')
    (w / "bad.json").write_text('[{"text": "a"}, {"text": ')
    base = json.loads((tiny_llama_dir / "config.json").read_text())
    for name, change in BAD_CONFIGS.items():
        folder = w / "bad" / name
        folder.mkdir(parents=True)
        target = folder / "config.json"
        if change is None:
            target.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)))
        elif change == "deep":
            target.write_text("[" * 100_000 + "]" * 100_000)
        elif change == "gpt2":
            target.write_text((tiny_gpt2_dir / "config.json").read_text())
        elif isinstance(change, list):
            target.write_text("[]")
        else:
            target.write_text(json.dumps({**base, **change}))  # NaN is written as the bare token NaN, as Python does
    plan_dir = emit_plan_files(plan_for_model(tiny_llama_dir, "ddp", micro_batch=2, seq_len=32), w / "plan")
    zero_dir = emit_plan_files(plan_for_model(tiny_llama_dir, "zero2", micro_batch=2, seq_len=32), w / "plan-z2")
    (w / "tmp").mkdir()
    ds_text = (zero_dir / "ds_config.json").read_text()
    for name, text in (("z-cut", ds_text[:100]), ("z-list", "[1, 2]"),
                       ("z-bad", json.dumps({**json.loads(ds_text), "train_micro_batch_size_per_gpu": [2],
                                             "gradient_clipping": "big"}))):
        shutil.copytree(zero_dir, w / name)
        (w / name / "ds_config.json").write_text(text)
    return {"W": w, "M": tiny_llama_dir, "P": plan_dir, "Z": zero_dir, "D": corpus_dir}


def _snapshot(*roots: Path) -> dict[str, str]:
    state = {}
    for root in roots:
        for p in sorted(root.rglob("*")):
            if p.is_symlink():
                state[str(p)] = "link:" + os.readlink(p)
            elif p.is_file():
                state[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest() + f":{p.stat().st_mode:o}"
            else:
                state[str(p)] = "dir"
    return state


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """toolkit.cli.main in this process: (exit code, stdout, stderr). Any exception escaping main is a bug and
    propagates (the traceback a user would see)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse's --help or a bare exit: the code it would leave with
            code = exc.code if isinstance(exc.code, int) else 1
    return code, out.getvalue(), err.getvalue()


CASES = _cases()


def test_the_corpus_is_large_and_covers_every_command():
    assert len(CASES) >= 150
    commands = {argv[0] for _, argv in CASES if argv}
    assert commands >= {"estimate", "plan", "emit", "check", "launch", "profile", "demo", "models", "gpus"}


@pytest.mark.parametrize("name,argv", CASES, ids=[name for name, _ in CASES])
def test_hostile_input_is_one_line_exit_2_and_no_change(name, argv, world, monkeypatch):
    _one_line_exit_2_and_no_change(name, argv, world, monkeypatch)


def _one_line_exit_2_and_no_change(name: str, argv: list[str], world: dict, monkeypatch) -> str:
    """Run one case in `world`: exit 2, one line, no traceback, nothing changed on disk, the recorded line (or
    record it: TOOLKIT_RECORD_GOLDEN=1). Returns the line."""
    def fill(arg: str) -> str:
        for key, value in world.items():
            arg = arg.replace("{" + key + "}", str(value))
        return arg

    argv = [fill(a) for a in argv]
    monkeypatch.chdir(world["W"])
    monkeypatch.setattr(tempfile, "tempdir", str(world["W"] / "tmp"))  # a temporary folder left behind shows
    roots = (world["W"], world["M"])
    before = _snapshot(*roots)
    try:
        code, out, err = run_cli(argv)
        after = _snapshot(*roots)
    finally:  # a case that wrongly wrote must not fail the next ones
        for left in ("run", "never"):
            shutil.rmtree(world["W"] / left, ignore_errors=True)
    lines = err.strip().splitlines()
    assert code == 2, f"exit {code}; stdout {out[-500:]!r}; stderr {err[-1000:]!r}"
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and "Traceback" not in err
    assert after == before
    message = lines[0]
    for key, value in sorted(world.items(), key=lambda kv: -len(str(kv[1]))):
        message = message.replace(str(value), "{" + key + "}")
    if os.environ.get("TOOLKIT_RECORD_GOLDEN") == "1":
        recorded = json.loads(GOLDEN_MESSAGES.read_text()) if GOLDEN_MESSAGES.is_file() else {}
        GOLDEN_MESSAGES.write_text(json.dumps({**recorded, name: message}, indent=1, sort_keys=True) + "\n")
    assert message == json.loads(GOLDEN_MESSAGES.read_text())[name]
    return lines[0]


def test_a_relative_model_path_is_recorded_absolute(tiny_llama_dir, tmp_path, monkeypatch):
    """A plan made from `./model` must launch from any folder (the hub is never asked for a local path)."""
    shutil.copytree(tiny_llama_dir, tmp_path / "model")
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(["plan", "./model", "--seq", "64", "--micro-batch", "1", "--gpus", "2xH100-80GB",
                            "--strategies", "ddp", "--out", "p"])
    assert code == 0, err
    assert json.loads((tmp_path / "p" / "plan.json").read_text())["model"] == str(tmp_path / "model")


def test_a_rehearsal_leaves_no_temporary_folder(world, tmp_path, monkeypatch):
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    code, out, err = run_cli(["launch", str(world["P"]), "--rehearse", "--dry-run"])
    assert code == 0, err
    assert "toolkit-rehearsal-" in out  # the folder was made (the command runs in it) ...
    assert list(temp.iterdir()) == []  # ... and removed


# ------------------------------------------------------------------------------------------------------------------
# The second wave (issue 20): every input of a training run checked before anything starts, LoRA flags as a set,
# contradictions named, files of the wrong kind, disk and permissions. Each case also names a fragment of the
# message it must print (the refusal is the right one, not any one line). More placeholders: {L} a LoRA plan,
# {X} big files (outside the snapshot: 20 MB and 50 MB inputs are read, never written).

def _wave2() -> list[tuple[str, list[str], str]]:
    cases: list[tuple[str, list[str], str]] = []

    def add(name: str, expect: str, *argv: str) -> None:
        if argv[:1] in (("estimate",), ("plan",)) and "--seq" not in argv \
                and not any(a.startswith("grpo") for a in argv):  # GRPO's lengths are its own flags
            argv = (argv[0], "--seq", "64", *argv[1:])
        cases.append((name, list(argv), expect))

    # LoRA / QLoRA flags as a set: bounds from the model, flags of another method, every named module.
    lora = ("estimate", "{M}", "--method", "lora")
    add("lora rank 10^6 on hidden 64", "above the rank", *lora, "--lora-r", "1000000")
    add("lora rank one above every matrix", "rank at most 64", *lora, "--lora-r", "65")
    add("qlora rank 10^5", "above the rank", "estimate", "{M}", "--method", "qlora", "--lora-r", "100000")
    add("lora rank on q_proj only above its side", "rank at most", *lora, "--lora-targets", "q_proj",
        "--lora-r", "1000")
    for flag, value in (("--lora-r", "8"), ("--lora-alpha", "16"), ("--lora-dropout", "0.1"),
                        ("--lora-targets", "q_proj"), ("--lora-modules-to-save", "lm_head")):
        add(f"{flag} without --method lora", "applies to --method lora", "estimate", "{M}", flag, value)
        add(f"plan {flag} without --method lora", "applies to --method lora", "plan", "{M}", "--micro-batch", "1",
            flag, value)
    for flag, value in (("--qlora-quant-type", "fp4"), ("--qlora-compute-dtype", "float16"),
                        ("--qlora-quant-storage", "bfloat16")):
        add(f"{flag} under lora", "applies to --method qlora", *lora, flag, value)
        add(f"{flag} under full", "applies to --method qlora", "estimate", "{M}", flag, value)
    add("--qlora-no-double-quant under lora", "applies to --method qlora", *lora, "--qlora-no-double-quant")
    add("plan --qlora-quant-type under lora", "applies to --method qlora", "plan", "{M}", "--micro-batch", "1",
        "--method", "lora", "--qlora-quant-type", "fp4")
    # DPO (issue 29): its flags without the objective, a reference the loss cannot do without, engines it is not
    # modelled on.
    for flag, value in (("--reference", "precomputed"), ("--dpo-beta", "0.2"), ("--dpo-loss", "ipo")):
        add(f"dpo {flag} without --method dpo", "applies to --method dpo", "estimate", "{M}", flag, value)
    add("dpo plan --reference without --method dpo", "applies to --method dpo", "plan", "{M}", "--micro-batch", "1",
        "--method", "lora", "--reference", "kept")
    add("dpo --reference none", "no reference-free DPO loss", "estimate", "{M}", "--method", "dpo", "--reference",
        "none")
    add("dpo plan --reference none", "no reference-free DPO loss", "plan", "{M}", "--micro-batch", "1", "--method",
        "dpo+lora", "--reference", "none")
    add("dpo unknown loss", "not one of TRL's DPO loss types", "estimate", "{M}", "--method", "dpo", "--dpo-loss",
        "simpo")
    add("dpo+bogus", "--method 'dpo+bogus' is not known", "estimate", "{M}", "--method", "dpo+bogus")
    add("dpo+full", "--method 'dpo+full' is not known", "plan", "{M}", "--micro-batch", "1", "--method", "dpo+full")
    add("dpo --dpo-beta 0", "--dpo-beta", "estimate", "{M}", "--method", "dpo", "--dpo-beta", "0")
    add("dpo on the pipeline engine", "not the pipeline engine", "estimate", "{M}", "--method", "dpo",
        "--strategy", "pipeline", "--gpus", "2xH100-80GB")
    add("dpo with --liger", "not modelled", "estimate", "{M}", "--method", "dpo", "--liger")
    add("activation offloading on the pipeline engine", "not the pipeline engine", "estimate", "{M}",
        "--activation-offloading", "--strategy", "pipeline", "--gpus", "2xH100-80GB")
    add("profile --method dpo", "modelled by estimate and plan only", "profile", *SHAPE.split(), "--method", "dpo")
    grpo = ["estimate", "{M}", "--method", "grpo", "--max-prompt-length", "32", "--max-completion-length", "32"]
    for flag, value, expect in (("--num-generations", "0", "at least 2"), ("--num-generations", "1", "at least 2"),
                                ("--num-generations", "nan", "--num-generations"),
                                ("--vllm-gpu-memory-utilization", "1.5", "absurdly large"),
                                ("--vllm-gpu-memory-utilization", "nan", "not a finite number"),
                                ("--vllm-gpu-memory-utilization", "0", "must be positive"),
                                ("--vllm-gpu-memory-utilization", "1", "between 0 and 1"),
                                ("--grpo-beta", "nan", "not a finite number"), ("--grpo-beta", "-1", "--grpo-beta"),
                                ("--max-completion-length", "0", "--max-completion-length")):
        add(f"grpo {flag} {value}", expect, *grpo, "--use-vllm", flag, value)
    add("grpo utilization without --use-vllm", "add --use-vllm", *grpo, "--vllm-gpu-memory-utilization", "0.5")
    add("grpo utilization with server mode", "a vLLM server takes its own", *grpo, "--use-vllm", "--vllm-mode",
        "server", "--vllm-gpu-memory-utilization", "0.5")
    add("grpo sleep mode without --use-vllm", "add --use-vllm", *grpo, "--vllm-enable-sleep-mode")
    add("grpo sleep mode with server mode", "a vLLM server takes its own", *grpo, "--use-vllm", "--vllm-mode",
        "server", "--vllm-enable-sleep-mode")
    add("grpo vLLM tensor parallel 3 on 2 GPUs", "must divide the 2 training processes", *grpo, "--use-vllm",
        "--vllm-tensor-parallel-size", "3", "--gpus", "2xH100-80GB", "--micro-batch", "4")
    add("grpo vLLM tensor parallel without --use-vllm", "add --use-vllm", *grpo, "--vllm-tensor-parallel-size", "2")
    add("grpo unknown --vllm-mode", "--vllm-mode 'remote' is not known", *grpo, "--use-vllm", "--vllm-mode", "remote")
    add("grpo flag without --method grpo", "applies to --method grpo", "estimate", "{M}", "--seq", "64",
        "--num-generations", "4")
    add("grpo --seq", "--seq with --method grpo", "estimate", "{M}", "--seq", "64", "--method", "grpo")
    add("grpo partial groups", "multiple of --num-generations 8", *grpo, "--micro-batch", "3", "--gpus",
        "2xH100-80GB")
    add("grpo activation offloading", "GRPOTrainer has none", *grpo, "--activation-offloading")
    add("grpo on the pipeline engine", "not the pipeline engine", *grpo, "--strategy", "pipeline", "--gpus",
        "2xH100-80GB")
    add("profile --method grpo", "modelled by estimate and plan only", "profile", *SHAPE.split(), "--method", "grpo")
    add("grpo --reward-model without --method grpo", "--reward-model applies to --method grpo", "estimate", "{M}",
        "--reward-model", "{W}/models/reward")
    add("grpo --reward-model a causal LM", "not a sequence-classification model", *grpo, "--reward-model", "{M}")
    add("grpo --reward-model of 2 labels", "has 2 labels", *grpo, "--reward-model", "{W}/models/reward-2-labels")
    add("unknown modules_to_save", "does not have", *lora, "--lora-modules-to-save", "nope")
    add("one unknown among modules_to_save", "'nope'", *lora, "--lora-modules-to-save", "lm_head,nope")
    add("plan unknown modules_to_save", "does not have", "plan", "{M}", "--micro-batch", "1", "--method", "lora",
        "--lora-modules-to-save", "nope", "--out", "{W}/never")
    add("unknown target among known", "'nope'", *lora, "--lora-targets", "q_proj,nope")
    add("plan lora rank 10^6", "above the rank", "plan", "{M}", "--micro-batch", "1", "--method", "lora",
        "--lora-r", "1000000", "--out", "{W}/never")
    data = ["--data", "{D}", "--output", "{W}/run"]
    run = ["launch", "{P}", "--dry-run", "--", *data]
    add("launch --lora --lora-r 0", "--lora-r must be a positive", *run, "--lora", "--lora-r", "0")
    add("launch --lora --lora-r -1", "--lora-r must be a positive", *run, "--lora", "--lora-r", "-1")
    add("launch --lora --lora-r 10^6", "above the rank", *run, "--lora", "--lora-r", "1000000")
    add("launch --lora --lora-targets nope", "nope", *run, "--lora", "--lora-targets", "nope")
    add("launch --lora --lora-modules-to-save nope", "does not have", *run, "--lora", "--lora-modules-to-save",
        "nope")
    add("launch --lora --lora-dropout 1", "--lora-dropout", *run, "--lora", "--lora-dropout", "1")
    add("launch --lora-r without --lora", "need a LoRA run", *run, "--lora-r", "8")
    add("launch --lora and --qlora", "not both", *run, "--lora", "--qlora")
    add("launch a LoRA plan with an unknown target", "nope", "launch", "{W}/plan-lora-nope", "--dry-run", "--",
        *data)

    # Data: refused before the output folder (or its log) exists.
    def data_case(name: str, expect: str, path: str, *extra: str, plan: str = "{P}") -> None:
        add(name, expect, "launch", plan, "--dry-run", "--", "--data", path, "--output", "{W}/run", *extra)

    data_case("data: an empty folder", "has no .txt", "{W}/data/empty-dir")
    data_case("data: a folder of empty folders", "has no .txt", "{W}/data/only-subdirs")
    data_case("data: an empty file", "holds no rows", "{W}/data/empty.txt")
    data_case("data: blank lines only", "holds no rows", "{W}/data/blank.txt")
    data_case("data: an empty JSON Lines file", "holds no rows", "{W}/data/empty.jsonl")
    data_case("data: an empty JSON list", "holds no rows", "{W}/data/empty-list.json")
    data_case("data: a binary file without extension", "unknown kind", "{W}/data/binfile")
    data_case("data: a file of an unknown extension", "unknown kind", "{W}/data/notes.docx")
    data_case("data: a corrupt parquet", "not a readable parquet", "{W}/data/corrupt.parquet")
    data_case("data: a parquet without rows", "holds no rows", "{W}/data/empty.parquet")
    data_case("data: too few tokens", "fewer than one optimizer step", "{W}/data/tiny.txt")
    data_case("data: too few tokens in JSON Lines", "fewer than one optimizer step", "{W}/data/tiny.jsonl")
    data_case("data: no text column (numbers)", "no 'text' column", "{W}/data/notext.jsonl")
    data_case("data: no text column (two strings)", "no 'text' column", "{W}/data/twocols.jsonl")
    data_case("data: --text-field naming no column", "no 'body' column", "{W}/data/twocols.jsonl",
              "--text-field", "body")
    data_case("data: CSV without a text column", "no 'text' column", "{W}/data/notext.csv")
    data_case("data: CSV with a header only", "holds no rows", "{W}/data/header-only.csv")
    data_case("data: a text column of numbers", "not text", "{W}/data/text-numbers.jsonl")
    data_case("data: JSON Lines of lists", "not an object", "{W}/data/lists.jsonl")
    data_case("data: a JSON list of strings", "not an object", "{W}/data/strings.json")
    data_case("data: a FIFO", "FIFO", "{W}/data/fifo")
    data_case("data: a character device", "character device", "/dev/null")
    data_case("data: a 20 MB single line", "longer than", "{X}/one-line.jsonl")

    # Chat data: the right fix for each problem, before any rank starts.
    data_case("chat: an unknown role", "role 'robot'", "{W}/chat/role.jsonl")
    data_case("chat: a missing role", "role None", "{W}/chat/no-role.jsonl")
    data_case("chat: an empty messages list", "empty list", "{W}/chat/empty.jsonl")
    data_case("chat: no assistant turn", "no assistant turn", "{W}/chat/no-assistant.jsonl")
    data_case("chat: content a number", "content of type int", "{W}/chat/content-int.jsonl")
    data_case("chat: content a list", "content of type list", "{W}/chat/content-list.jsonl")
    data_case("chat: content missing", "has no 'content'", "{W}/chat/no-content.jsonl")
    data_case("chat: messages a string", "is a string", "{W}/chat/messages-string.jsonl")
    data_case("chat: messages an object", "is a dict", "{W}/chat/messages-dict.jsonl")
    data_case("chat: a turn that is a string", "turn 1 is a str", "{W}/chat/turn-string.jsonl")
    data_case("chat: chat and plain text rows mixed", "mixes chat rows", "{W}/chat/mixed.jsonl")
    data_case("chat: text rows first, then chat", "mixes chat rows", "{W}/chat/mixed-text-first.jsonl")
    data_case("chat: a JSON document mixing kinds", "mixes chat rows", "{W}/chat/mixed.json")
    data_case("chat: answers beyond the sequence", "plan a longer --seq", "{W}/chat/long-prompt.jsonl")
    data_case("chat: fewer conversations than one step", "fewer than one optimizer step", "{W}/chat/one.jsonl")
    data_case("chat: one 50 MB conversation", "longer than", "{X}/huge-chat.jsonl")

    # The model folder (issue 19 item 4) and its tokenizer.
    add("plan a config-only folder", "cannot train", "plan", "{W}/models/config-only", "--micro-batch", "1",
        "--out", "{W}/never")
    data_case("train a config-only folder", "no tokenizer", "{D}", "--model", "{W}/models/config-only")
    data_case("train a folder without weights", "no weights", "{D}", "--model", "{W}/models/no-weights")
    data_case("train a folder without a tokenizer", "no tokenizer", "{D}", "--model", "{W}/models/no-tokenizer")
    data_case("train with a tokenizer of another vocabulary", "not this model's tokenizer", "{D}", "--model",
              "{W}/models/wide-vocab")
    data_case("train with a tokenizer larger than the embedding", "embeds only", "{D}", "--model",
              "{W}/models/big-tokenizer")
    data_case("train --tokenizer an empty folder", "no tokenizer", "{D}", "--tokenizer", "{W}/empty")

    # Contradictions: named as such, by the rule that owns them.
    one = ("--gpus", "1xH100-80GB")
    add("global 16 with micro 3 x accumulation 5", "contradict", "plan", "{M}", *one, "--global-batch", "16",
        "--micro-batch", "3", "--accumulation", "5")
    add("global 16 with micro 3", "16", "plan", "{M}", *one, "--global-batch", "16", "--micro-batch", "3")
    add("global 15 with accumulation 2", "15", "plan", "{M}", *one, "--global-batch", "15", "--accumulation", "2")
    add("global 8 on 3 GPUs", "3 data-parallel", "plan", "{M}", "--gpus", "3xH100-80GB", "--global-batch", "8",
        "--strategies", "ddp")
    add("plan 3 stages on 2 GPUs", "stages", "plan", "{M}", "--gpus", "2xH100-80GB", "--micro-batch", "1",
        "--pipeline-stages", "3")
    add("plan 4 stages on 2 GPUs", "stages", "plan", "{M}", "--gpus", "2xH100-80GB", "--micro-batch", "1",
        "--pipeline-stages", "4", "--strategies", "pipeline")
    add("estimate 3 stages on 2 GPUs", "stages", "estimate", "{M}", "--gpus", "2xH100-80GB", "--strategy",
        "pipeline", "--pipeline-stages", "3")
    add("emit a plan.json whose num_layers contradicts the model", "num_layers", "emit", "{W}/plan-layers",
        "--out", "{W}/never")
    add("emit a plan.json whose model_type contradicts the model", "model_type", "emit", "{W}/plan-type",
        "--out", "{W}/never")
    add("launch a plan.json whose num_layers contradicts the model", "layers", "launch", "{W}/plan-layers",
        "--dry-run", "--", *data)
    for arch in ("bert", "roberta", "t5", "bart"):
        add(f"estimate a {arch} config", "causal", "estimate", f"{{W}}/models/{arch}")
    add("plan a bert config", "causal", "plan", "{W}/models/bert", "--micro-batch", "1")

    # Files of the wrong kind where a file is expected, read with a size limit.
    add("emit: plan.json a directory", "is a directory", "emit", "{W}/plan-dir")
    add("launch: plan.json a directory", "is a directory", "launch", "{W}/plan-dir", "--dry-run")
    add("emit: plan.json -> /dev/zero", "character device", "emit", "{W}/plan-zero", "--out", "{W}/never")
    add("launch: plan.json -> /dev/zero", "character device", "launch", "{W}/plan-zero", "--dry-run")
    add("emit: plan.json a FIFO", "FIFO", "emit", "{W}/plan-fifo", "--out", "{W}/never")
    add("emit: plan.json of 20 MB", "larger than", "emit", "{X}/plan-big", "--out", "{W}/never")
    add("launch: accelerate_config.yaml a directory", "is a directory", "launch", "{W}/plan-yaml-dir", "--dry-run",
        "--", *data)
    add("launch: ds_config.json -> /dev/zero", "character device", "launch", "{W}/z-zero", "--dry-run", "--", *data)
    add("launch: ds_config.json a directory", "is a directory", "launch", "{W}/z-dir", "--dry-run", "--", *data)
    add("launch: a script that is a directory", "is a directory", "launch", "{P}", "--dry-run", "--",
        "{W}/script-dir.py")
    add("estimate: config.json -> /dev/zero", "character device", "estimate", "{W}/models/zero-config")
    add("estimate: config.json a directory", "directory", "estimate", "{W}/models/dir-config")
    add("estimate: config.json a FIFO", "FIFO", "estimate", "{W}/models/fifo-config")
    add("check: a named FIFO", "FIFO", "check", "{W}/data/fifo")
    for name, expect in (("nan.json", "not a finite number"), ("inf.json", "not a finite number"),
                         ("neg-inf.json", "not a finite number"), ("dup.json", "twice"),
                         ("dup-nested.json", "twice"), ("dup.yaml", "twice"), ("dup-nested.yaml", "twice"),
                         ("nan.yaml", "not a finite number"), ("inf.yaml", "not a finite number")):
        add(f"check: {name}", expect, "check", f"{{W}}/cfg/{name}")
    add("check: /dev/zero", "character device", "check", "/dev/zero")

    # Disk and permissions.
    add("plan --out into a read-only folder", "read-only", "plan", "{M}", "--micro-batch", "1", "--gpus",
        "1xH100-80GB", "--out", "{W}/read-only")
    add("plan --force over a read-only folder", "read-only", "plan", "{M}", "--micro-batch", "1", "--gpus",
        "1xH100-80GB", "--out", "{W}/read-only-plan", "--force")
    add("emit --out into a read-only folder", "read-only", "emit", "{P}", "--out", "{W}/read-only")
    add("demo --workdir under a file", "is a file", "demo", "--workdir", "{W}/notes.txt/demo")
    add("demo --workdir deep under a file", "is a file", "demo", "--workdir", "{W}/notes.txt/a/b")
    add("launch --output under a file", "is a file", *run[:-1], "{W}/notes.txt/run")
    add("profile --device cuda without CUDA", "CUDA", "profile", *SHAPE.split(), "--device", "cuda")
    add("profile --device cuda:3 without CUDA", "CUDA", "profile", *SHAPE.split(), "--device", "cuda:3")
    return cases


WAVE2 = _wave2()


def test_the_second_wave_is_large():
    assert len(WAVE2) >= 80


@pytest.fixture(scope="module")
def world2(world, tmp_path_factory, tiny_llama_dir):
    """The second wave's inputs, inside the first wave's world (so its snapshot covers them)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from toolkit.run import tiny
    from toolkit.run.launcher import emit_plan_files
    from toolkit.run.rehearsal import plan_for_model

    w = world["W"]
    big = tmp_path_factory.mktemp("hostile-big")
    d = w / "data"
    d.mkdir()
    (d / "empty-dir").mkdir()
    (d / "only-subdirs" / "a" / "b").mkdir(parents=True)
    (d / "empty.txt").write_text("")
    (d / "blank.txt").write_text("\n\n   \n\n")
    (d / "empty.jsonl").write_text("\n\n")
    (d / "empty-list.json").write_text("[]")
    (d / "binfile").write_bytes(bytes(range(256)) * 8)
    (d / "notes.docx").write_text("text")
    (d / "corrupt.parquet").write_bytes(b"PAR1" + bytes(range(256)) * 4 + b"PAR1")
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), d / "empty.parquet")
    (d / "tiny.txt").write_text("hello world\n")
    (d / "tiny.jsonl").write_text('{"text": "hello"}\n' * 3)
    (d / "notext.jsonl").write_text('{"a": 1, "b": 2}\n' * 20)
    (d / "twocols.jsonl").write_text('{"x": "one", "y": "two"}\n' * 20)
    (d / "notext.csv").write_text("a,b\n1,2\n3,4\n")
    (d / "header-only.csv").write_text("text\n")
    (d / "text-numbers.jsonl").write_text('{"text": 5}\n' * 20)
    (d / "lists.jsonl").write_text("[1, 2]\n" * 5)
    (d / "strings.json").write_text('["a", "b"]')
    os.mkfifo(d / "fifo")
    (big / "one-line.jsonl").write_text('{"text": "' + "word " * 4_000_000 + '"}\n')

    cfg_dir = w / "cfg"
    cfg_dir.mkdir()
    ds = '{"train_batch_size": 8, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1'
    yml = "num_processes: 2\nnum_machines: 1\nmachine_rank: 0\ndistributed_type: MULTI_GPU\n"
    for name, text in (("nan.json", ds + ', "gradient_clipping": NaN}'), ("inf.json", ds + ', "gradient_clipping": Infinity}'),
                       ("neg-inf.json", ds + ', "optimizer": {"params": {"lr": -Infinity}}}'),
                       ("dup.json", ds + ', "train_batch_size": 16}'),
                       ("dup-nested.json", ds + ', "zero_optimization": {"stage": 2, "stage": 3}}'),
                       ("dup.yaml", yml + "num_processes: 4\n"),
                       ("dup-nested.yaml", yml + "deepspeed_config:\n  zero_stage: 2\n  zero_stage: 3\n"),
                       ("nan.yaml", yml + "gradient_clipping: .nan\n"), ("inf.yaml", yml + "x: [1, .inf]\n")):
        (cfg_dir / name).write_text(text)

    c = w / "chat"
    c.mkdir()
    good = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]

    def rows(name: str, *items) -> None:
        (c / name).write_text("".join(json.dumps(i) + "\n" for i in items))

    many = [{"messages": good}] * 10
    rows("role.jsonl", *many, {"messages": [{"role": "robot", "content": "x"}, *good]})
    rows("no-role.jsonl", {"messages": [{"content": "x"}, *good]}, *many)
    rows("empty.jsonl", *many, {"messages": []})
    rows("no-assistant.jsonl", *many, {"messages": [{"role": "user", "content": "only a question"}]})
    rows("content-int.jsonl", {"messages": [{"role": "user", "content": 5}, good[1]]}, *many)
    rows("content-list.jsonl", {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}, good[1]]})
    rows("no-content.jsonl", {"messages": [{"role": "user"}, good[1]]})
    rows("messages-string.jsonl", {"messages": "user: hi"})
    rows("messages-dict.jsonl", {"messages": {"role": "user", "content": "hi"}})
    rows("turn-string.jsonl", {"messages": ["hi", "hello"]})
    rows("mixed.jsonl", *many, {"text": "a plain document"})
    rows("mixed-text-first.jsonl", {"text": "a plain document"}, *many)
    (c / "mixed.json").write_text(json.dumps([{"messages": good}, {"text": "plain"}]))
    rows("long-prompt.jsonl", *[{"messages": [{"role": "user", "content": "word " * 200}, good[1]]}] * 10)
    rows("one.jsonl", {"messages": good})
    (big / "huge-chat.jsonl").write_text(json.dumps({"messages": [
        {"role": "user", "content": "x " * 25_000_000}, good[1]]}) + "\n")

    m = w / "models"
    only = m / "config-only"
    only.mkdir(parents=True)
    shutil.copy(tiny_llama_dir / "config.json", only / "config.json")
    shutil.copytree(tiny_llama_dir, m / "no-weights")
    for f in (m / "no-weights").glob("*.safetensors"):
        f.unlink()
    shutil.copytree(tiny_llama_dir, m / "no-tokenizer")
    for f in (m / "no-tokenizer").iterdir():
        if "token" in f.name or f.name in ("vocab.json", "merges.txt"):
            f.unlink()
    cfg = json.loads((tiny_llama_dir / "config.json").read_text())
    shutil.copytree(tiny_llama_dir, m / "wide-vocab")
    (m / "wide-vocab" / "config.json").write_text(json.dumps({**cfg, "vocab_size": 8192}))
    shutil.copytree(tiny_llama_dir, m / "big-tokenizer")
    (m / "big-tokenizer" / "config.json").write_text(json.dumps({**cfg, "vocab_size": 256}))
    for name, labels in (("reward", {"0": "LABEL_0"}), ("reward-2-labels", {"0": "A", "1": "B"})):
        (m / name).mkdir()  # a reward model's config (TRL's AutoModelForSequenceClassification), and one of 2 labels
        (m / name / "config.json").write_text(json.dumps({**cfg, "architectures": ["LlamaForSequenceClassification"],
                                                          "id2label": labels}))
    from transformers import AutoConfig

    for arch, extra in (("bert", {}), ("roberta", {}), ("t5", {"d_ff": 128, "d_kv": 16}),
                        ("bart", {"encoder_layers": 2, "decoder_layers": 2})):
        conf = AutoConfig.for_model(arch, vocab_size=512, hidden_size=64, d_model=64, num_hidden_layers=2,
                                    num_layers=2, num_attention_heads=4, num_heads=4, intermediate_size=128,
                                    **extra)
        (m / arch).mkdir()
        conf.to_json_file(str(m / arch / "config.json"))
    (m / "zero-config").mkdir()
    os.symlink("/dev/zero", m / "zero-config" / "config.json")
    (m / "dir-config" / "config.json").mkdir(parents=True)
    (m / "fifo-config").mkdir()
    os.mkfifo(m / "fifo-config" / "config.json")

    p = world["P"]
    for name in ("plan-dir", "plan-zero", "plan-fifo", "plan-layers", "plan-type", "plan-yaml-dir"):
        shutil.copytree(p, w / name)
    (w / "plan-dir" / "plan.json").unlink()
    (w / "plan-dir" / "plan.json").mkdir()
    (w / "plan-zero" / "plan.json").unlink()
    os.symlink("/dev/zero", w / "plan-zero" / "plan.json")
    (w / "plan-fifo" / "plan.json").unlink()
    os.mkfifo(w / "plan-fifo" / "plan.json")
    shutil.copytree(p, big / "plan-big")
    with open(big / "plan-big" / "plan.json", "ab") as f:
        f.truncate(20 * 1024 * 1024)
    plan = json.loads((p / "plan.json").read_text())
    (w / "plan-layers" / "plan.json").write_text(json.dumps({**plan, "num_layers": 7}))
    (w / "plan-type" / "plan.json").write_text(json.dumps({**plan, "model_type": "gpt2"}))
    (w / "plan-yaml-dir" / "accelerate_config.yaml").unlink()
    (w / "plan-yaml-dir" / "accelerate_config.yaml").mkdir()
    for name in ("z-zero", "z-dir"):
        shutil.copytree(world["Z"], w / name)
        (w / name / "ds_config.json").unlink()
    os.symlink("/dev/zero", w / "z-zero" / "ds_config.json")
    (w / "z-dir" / "ds_config.json").mkdir()
    (w / "script-dir.py").mkdir()
    from dataclasses import replace

    from toolkit.inputs.lora import Adapter

    lora_plan = replace(plan_for_model(tiny_llama_dir, "ddp", micro_batch=2, seq_len=32), method="lora",
                        adapter=Adapter(method="lora", r=4).to_dict())
    nope = emit_plan_files(lora_plan, w / "plan-lora-nope")
    text = json.loads((nope / "plan.json").read_text())
    text["adapter"]["targets"] = "nope"
    (nope / "plan.json").write_text(json.dumps(text))
    (w / "read-only").mkdir(mode=0o555)
    os.chmod(w / "read-only", 0o555)
    shutil.copytree(p, w / "read-only-plan")
    os.chmod(w / "read-only-plan", 0o555)
    return {**world, "X": big}


@pytest.mark.parametrize("name,argv,expect", WAVE2, ids=[name for name, _, _ in WAVE2])
def test_second_wave_is_one_line_exit_2_and_no_change(name, argv, expect, world2, monkeypatch):
    line = _one_line_exit_2_and_no_change(name, argv, world2, monkeypatch)
    assert expect in line, line


# ------------------------------------------------------------------------------------------------------------------
# What the second wave must still accept, and the disk cases that need a real file system.

def test_check_reads_a_process_substitution_and_stdin(world2, monkeypatch):
    text = (world2["W"] / "cfg" / "dup.yaml").read_text().rsplit("num_processes: 4", 1)[0]
    read_end, write_end = os.pipe()
    os.write(write_end, text.encode())
    os.close(write_end)
    try:
        code, out, err = run_cli(["check", f"/dev/fd/{read_end}"])  # what `check <(cat x.yaml)` names
    finally:
        os.close(read_end)
    assert code == 0 and "1 path(s) checked: no findings" in out, err
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO((world2["W"] / "cfg" / "dup.json").read_bytes())))
    code, out, err = run_cli(["check", "-"])
    assert code == 2 and err.strip() == ("error: - sets 'train_batch_size' twice in one object, to 8 and 16; keep "
                                         "the one you mean")


def test_good_chat_and_text_data_pass_the_preflight(world2, tmp_path, tiny_llama_dir):
    from toolkit.run import tiny

    chat = tiny.write_chat_corpus(tmp_path / "chat", max_chars=20_000)
    for data in (chat, world2["D"]):
        code, out, err = run_cli(["launch", str(world2["P"]), "--dry-run", "--", "--data", str(data), "--output",
                                  str(tmp_path / "out")])
        assert code == 0, err
    # a folder without weights trains from random weights when asked to
    code, _, err = run_cli(["launch", str(world2["P"]), "--dry-run", "--", "--data", str(world2["D"]), "--output",
                            str(tmp_path / "out"), "--model", str(world2["W"] / "models" / "no-weights"),
                            "--random-init"])
    assert code == 0, err
    assert not (tmp_path / "out").exists()


def test_a_corrupted_cache_entry_is_a_miss(tmp_path, monkeypatch, tiny_llama_dir):
    from toolkit import cache
    from toolkit.inputs.modelspec import resolve_model

    monkeypatch.setenv("TOOLKIT_CACHE_DIR", str(tmp_path / "cache"))
    first = resolve_model(str(tiny_llama_dir))
    for entry in (tmp_path / "cache").rglob("*.json"):
        entry.write_text(json.dumps({"wrong": "fields"}))  # valid JSON, not a spec
    assert resolve_model(str(tiny_llama_dir)).params == first.params
    from toolkit.inputs.modelspec import build_spec

    cache.put("spec", ["corrupt"], {"wrong": "fields"}, code=build_spec)
    assert cache.get("spec", ["corrupt"], code=build_spec, decode=lambda v: v["missing"]) is None


def test_runner_refuses_to_call_zero_steps_trained(tiny_llama_dir):
    from toolkit.errors import UserError
    from toolkit.run.rehearsal import plan_for_model
    from toolkit.train.hf_runner import refuse_untrained

    plan = plan_for_model(tiny_llama_dir, "ddp", micro_batch=2, seq_len=32)
    with pytest.raises(UserError, match="no optimizer step"):
        refuse_untrained(0, 1, plan)
    refuse_untrained(1, 1, plan)


def test_a_rewritten_plan_folder_keeps_its_mode(world, tmp_path):
    out = tmp_path / "p"
    assert run_cli(["emit", str(world["P"]), "--out", str(out)])[0] == 0
    os.chmod(out, 0o750)
    code, _, err = run_cli(["emit", str(world["P"]), "--out", str(out), "--force"])
    assert code == 0, err
    assert out.stat().st_mode & 0o777 == 0o750
    assert [p.name for p in tmp_path.iterdir()] == ["p"]  # no staging folder, no lock


@contextlib.contextmanager
def _tmpfs(path: Path, size: str):
    """A small real file system (root only): ENOSPC and a folder that cannot be renamed, without mocks."""
    import subprocess

    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs root to mount a tmpfs")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.mark.multiprocess
@pytest.mark.one_core
def test_a_full_disk_is_one_line_and_leaves_nothing(world, tmp_path):
    with _tmpfs(tmp_path / "full", "8k") as disk:
        (disk / "filler").write_bytes(b"x" * 4096)
        try:
            while True:  # fill the rest
                with open(disk / f"f{len(list(disk.iterdir()))}", "wb") as f:
                    f.write(b"x" * 1024)
        except OSError:
            pass
        before = sorted(p.name for p in disk.iterdir())
        code, out, err = run_cli(["emit", str(world["P"]), "--out", str(disk / "plan")])
        assert code == 2 and err.count("\n") == 1 and "disk is full" in err, err
        code, out, err = run_cli(["launch", str(world["P"]), "--", "--data", str(world["D"]), "--output",
                                  str(disk / "run" / "deep")])
        assert code == 2 and err.count("\n") == 1 and "disk is full" in err and "Traceback" not in err, err
        assert sorted(p.name for p in disk.iterdir()) == before  # no run folder, no lock, no staging folder


@pytest.mark.multiprocess
@pytest.mark.one_core
def test_plan_force_over_a_folder_it_cannot_replace(world, tmp_path):
    with _tmpfs(tmp_path / "mounted", "1m") as folder:  # a mount point cannot be renamed (EBUSY)
        assert run_cli(["emit", str(world["P"]), "--out", str(folder)])[0] == 2  # the rename fails ...
        (folder / "plan.json").write_text("{}")
        code, _, err = run_cli(["emit", str(world["P"]), "--out", str(folder), "--force"])
        assert code == 2 and err.count("\n") == 1 and "cannot write" in err, err
        assert [p.name for p in folder.iterdir()] == ["plan.json"]
        assert [p.name for p in tmp_path.iterdir()] == ["mounted"]  # ... and no staging folder or lock is left


ISSUE_20_STORY = {
    "LoRA flags": ("lora rank 10^6 on hidden 64", "--lora-r without --method lora", "--qlora-quant-type under lora",
                   "unknown modules_to_save", "launch --lora --lora-r 0"),
    "data inside the ranks": ("data: an empty folder", "data: an empty file", "data: a binary file without extension",
                              "data: a corrupt parquet", "data: too few tokens", "data: no text column (numbers)",
                              "launch a LoRA plan with an unknown target"),
    "chat data": ("chat: an unknown role", "chat: an empty messages list", "chat: no assistant turn",
                  "chat: content a number", "chat: messages a string", "chat: chat and plain text rows mixed",
                  "chat: one 50 MB conversation"),
    "contradictions": ("emit a plan.json whose num_layers contradicts the model",
                       "emit a plan.json whose model_type contradicts the model",
                       "global 16 with micro 3 x accumulation 5", "plan 3 stages on 2 GPUs", "estimate a bert config"),
    "files": ("emit: plan.json a directory", "launch: a script that is a directory",
              "launch: accelerate_config.yaml a directory", "data: a FIFO", "emit: plan.json -> /dev/zero",
              "check: nan.json", "check: inf.json", "check: dup.yaml"),
    "disk and permissions": ("plan --out into a read-only folder", "plan --force over a read-only folder",
                             "demo --workdir under a file"),
    "others": ("profile --device cuda without CUDA",),
}
"""Issue 20's story, case by case, in the second wave (exit 2, one line, nothing written: the test above); the rest
of it is in the tests here: check <(...) (test_check_reads_a_process_substitution_and_stdin), a full disk and a
folder that cannot be replaced (real tmpfs mounts), a corrupted cache entry, the runner's zero-step refusal."""


def test_the_issue_20_story_is_in_the_second_wave():
    names = {name for name, _, _ in WAVE2}
    missing = [case for cases in ISSUE_20_STORY.values() for case in cases if case not in names]
    assert not missing


# ---------------------------------------------------------------------------------------------------------------
# Issue 33: every number that reaches arithmetic is bounded; paper cuts of the CLI.

HOSTILE_NUMBERS = ("0", "-1", "1e-300", "1e300", "nan", "inf")
MODEL_NUMBER_FLAGS = ("--params", *MODEL_SHAPE_FLAGS)


def _numeric_flags(command: str) -> list[tuple[str, object]]:
    """(flag, argparse type) of every flag of `command` that takes a number."""
    import argparse

    from toolkit.commands import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))  # noqa: SLF001
    return [(action.option_strings[0], action.type) for action in sub.choices[command]._actions  # noqa: SLF001
            if action.option_strings and (action.type in (int, float) or hasattr(action.type, "bound"))]


def _argv_for(command: str, flag: str, value: str, model: str) -> list[str]:
    """A command that reads `flag` (its strategy, method and GPUs set so that it is not refused for another
    reason), with `flag value` last."""
    if flag in MODEL_NUMBER_FLAGS:
        shape = [] if flag == "--params" else [a for pair in zip(SHAPE.split()[::2], SHAPE.split()[1::2])
                                               if pair[0] != flag for a in pair]
        return [command, *shape, flag, value, "--seq", "32"]
    argv = [command, model, "--gpus", "2xH100-80GB"]
    if flag != "--seq":
        argv += ["--seq", "32"]
    if command == "plan" and flag not in ("--micro-batch", "--global-batch"):
        argv += ["--micro-batch", "1"]
    if flag.startswith("--lora-"):
        argv += ["--method", "lora"]
    if flag == "--pipeline-stages":
        argv += ["--strategy" if command == "estimate" else "--strategies", "pipeline"]
    if flag in ("--tensor-parallel", "--context-parallel") and command == "estimate":
        argv += ["--strategy", "fsdp2"]
    if flag == "--sequence-parallel" and command == "estimate":
        argv += ["--strategy", "zero2"]
    return argv + [flag, value]


def test_every_numeric_flag_of_estimate_and_plan_is_bounded():
    """Each takes its number through toolkit.bounds (a flag typed plain int / float let 1e-300 through to a
    300-digit step time)."""
    for command in ("estimate", "plan"):
        flags = _numeric_flags(command)
        assert len(flags) >= 15
        plain = [flag for flag, kind in flags if not hasattr(kind, "bound")]
        assert not plain, f"{command}: {plain} take a number without a bound (toolkit.bounds)"


@pytest.mark.parametrize("command", ["estimate", "plan"])
def test_hostile_numbers_in_every_numeric_flag(command, world, monkeypatch):
    """0, -1, 1e-300, 1e300, nan and inf in every numeric flag: exit 2 with one line naming it, or a sane result
    (no 300-digit number, no nan / inf)."""
    import re

    monkeypatch.chdir(world["W"])
    for flag, _ in _numeric_flags(command):
        for value in HOSTILE_NUMBERS:
            code, out, err = run_cli(_argv_for(command, flag, value, str(world["M"])))
            case = f"{command} {flag} {value}: exit {code}; {err[-600:]!r}"
            assert "Traceback" not in err, case
            if code == 2:
                lines = err.strip().splitlines()
                assert len(lines) == 1 and lines[0].startswith("error: "), case
                assert flag in lines[0] or flag.strip("-").split("-")[0] in lines[0].lower(), case
                continue
            assert code in (0, 1), case
            assert not re.search(r"\d{25}", out) and not re.search(r"\b(nan|inf)\b", out.lower()), case


def test_inter_node_gbps_of_1e_300_is_refused(world, monkeypatch):
    monkeypatch.chdir(world["W"])
    code, _, err = run_cli(["estimate", str(world["M"]), "--seq", "32", "--gpus", "2x8xH100-80GB",
                            "--inter-node-gbps", "1e-300"])
    assert code == 2 and "--inter-node-gbps must be at least 0.1" in err, err


def test_two_flags_that_set_one_thing_are_refused(world, monkeypatch):
    monkeypatch.chdir(world["W"])
    code, _, err = run_cli(["estimate", str(world["M"]), "--compile", "--compile-blocks"])
    assert code == 2 and err.strip() == "error: --compile and --compile-blocks both set compile; give one of them"
    code, _, err = run_cli(["plan", str(world["M"]), "--seq", "32", "--seq=64", "--micro-batch", "1"])
    assert code == 2 and "--seq is given twice" in err, err


def test_no_parser_takes_an_abbreviated_flag():
    """argparse's prefix matching is off in the top parser and every subcommand's (`--glob 8` is not
    --global-batch), and in toolkit.train's parsers."""
    import argparse

    from toolkit.commands import build_parser
    from toolkit.errors import UserError
    from toolkit.train.args import trainer_flags

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))  # noqa: SLF001
    assert parser.allow_abbrev is False
    assert all(p.allow_abbrev is False for p in sub.choices.values())
    code, _, err = run_cli(["plan", "gpt2", "--glob", "8"])
    assert code == 2 and "unrecognized arguments: --glob 8" in err, err
    with pytest.raises(UserError, match="unrecognized arguments: --learning 1"):
        trainer_flags(["--learning", "1"])


def test_a_gpu_family_is_refused_naming_its_members():
    code, _, err = run_cli(["estimate", "gpt2", "--gpus", "8xA100"])
    assert code == 2 and err.strip() == ("error: GPU 'A100' is ambiguous: the catalog has A100-40GB, A100-80GB; give "
                                         "one of them (`toolkit gpus` lists them)")


def test_choose_takes_the_row_names_the_table_prints(world, tmp_path, monkeypatch):
    monkeypatch.chdir(world["W"])
    base = ["plan", str(world["M"]), "--seq", "32", "--micro-batch", "1", "--strategies", "zero2"]
    code, out, _ = run_cli([*base, "--json"])
    rows = [r["name"] for r in json.loads(out)["candidates"] if r["feasible"]]
    row = next(name for name in rows if "sp=" in name)  # e.g. "zero2 (dp=4 x sp=2)"
    code, out, err = run_cli([*base, "--choose", row.upper(), "--out", str(tmp_path / "p")])
    assert code == 0, err
    plan = json.loads((tmp_path / "p" / "plan.json").read_text())
    assert plan["strategy"] == "zero2" and plan["sequence_parallel"] == int(row.split("sp=")[1].split(")")[0])
    code, _, err = run_cli([*base, "--choose", "zero2 (dp=3)"])
    assert code == 2 and err.count("\n") == 1 and all(name in err for name in rows), err


@pytest.mark.multiprocess
@pytest.mark.one_core
def test_models_into_a_closed_pipe_exits_quietly(tmp_path):
    """`toolkit models | head -1`: no BrokenPipeError traceback, the exit code of a program SIGPIPE ended."""
    import subprocess
    import sys

    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader has gone, as `head -1` goes after its line
    try:
        result = subprocess.run([sys.executable, "-m", "toolkit", "models"], stdout=write_end, stderr=subprocess.PIPE,
                                text=True, env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)})
    finally:
        os.close(write_end)
    assert result.returncode == 141, result
    assert "Traceback" not in result.stderr and "BrokenPipe" not in result.stderr, result


def test_a_closed_stdout_in_process_is_exit_141_without_a_traceback(monkeypatch, capsys):
    class ClosedPipe(io.StringIO):
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

    import sys

    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    assert main(["gpus"]) == 141


@pytest.mark.multiprocess
@pytest.mark.one_core
def test_deepspeeds_accelerator_choice_is_quiet_in_every_command():
    """DeepSpeed logs "Setting accelerator to CPU ..." at its first import, wherever that happens (a tiled trace, a
    config check); the CLI's filter on its logger drops it (a fresh interpreter: deepspeed not yet imported)."""
    import subprocess
    import sys

    code = ("from toolkit.cli import quiet_deepspeed_accelerator_choice as q; q(); import deepspeed; "
            "from deepspeed.utils import logger; logger.warning('other warnings still show')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)})
    both = result.stdout + result.stderr
    assert result.returncode == 0 and "other warnings still show" in both and "Setting accelerator" not in both, both


@pytest.mark.multiprocess
@pytest.mark.one_core
def test_force_over_a_folder_holding_an_immutable_file(world, tmp_path):
    """chattr +i on a file in the --out folder: refused before anything is written (the swap would move it into a
    staging folder that cannot be removed), no staging folder, no lock, and the parent's mode unchanged."""
    import subprocess

    out = tmp_path / "p"
    assert run_cli(["emit", str(world["P"]), "--out", str(out)])[0] == 0
    os.chmod(tmp_path, 0o755)
    keep = out / "notes.txt"
    keep.write_text("mine\n")
    if subprocess.run(["chattr", "+i", str(keep)], capture_output=True).returncode != 0:
        pytest.skip("needs chattr +i (root on ext4 / xfs / btrfs)")
    try:
        before = _snapshot(tmp_path)
        code, _, err = run_cli(["emit", str(world["P"]), "--out", str(out), "--force"])
        assert code == 2 and err.count("\n") == 1 and "immutable" in err and "chattr -i" in err, err
        assert _snapshot(tmp_path) == before
        assert sorted(p.name for p in tmp_path.iterdir()) == ["p"]
        assert tmp_path.stat().st_mode & 0o7777 == 0o755
    finally:
        subprocess.run(["chattr", "-i", str(keep)], check=False)


def test_removing_a_staging_copy_never_touches_the_folder_around_it(tmp_path):
    """The staging folder's removal makes folders inside it writable where it must, never its parent (it once made
    the --out folder's parent 0700 when a file inside could not be removed)."""
    from toolkit.fileio import _remove_tree

    stage = tmp_path / "stage"
    (stage / "ro").mkdir(parents=True)
    (stage / "ro" / "f").write_text("x")
    os.chmod(stage / "ro", 0o555)
    os.chmod(tmp_path, 0o755)
    _remove_tree(stage)
    assert not stage.exists() and tmp_path.stat().st_mode & 0o7777 == 0o755


def _sigint_default() -> None:
    """In the child before exec: Ctrl-C's default action. A shell starts a background job (`pytest ... &`) with
    SIGINT ignored, its children inherit that, and Python then leaves it ignored: the test would pass on nothing."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.multiprocess
@pytest.mark.one_core
def test_ctrl_c_during_plan_out_is_exit_130_one_line_and_no_partial_folder(world, tmp_path):
    """Ctrl-C at several moments of `plan --out` (reading the model, planning, writing): exit 130 with one line,
    never a C++ abort or a traceback; the folder is absent or whole, and no staging folder or lock is left."""
    import signal
    import subprocess
    import sys
    import time

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}
    for delay in (0.5, 2.0, 4.0, 6.0):
        out = tmp_path / f"p{delay}"
        proc = subprocess.Popen([sys.executable, "-m", "toolkit", "plan", str(world["M"]), "--seq", "32",
                                 "--micro-batch", "1", "--out", str(out)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, env=env, preexec_fn=_sigint_default)
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        err = proc.communicate(timeout=120)[1]
        # -SIGINT: the signal took its default action, which a shell reports as 130 too. It did when it landed while
        # the interpreter shut down (after main returned: ~3,500 modules unloaded, about a second here); since
        # toolkit.cli.run leaves with os._exit after the atexit handlers, that window is a fraction of a second, and
        # the work is done, its folder whole. One CI run saw it after the one line was printed too; the cause of
        # that one was not found.
        assert proc.returncode in (0, 130, -signal.SIGINT), (delay, proc.returncode, err)
        assert "Traceback" not in err and "terminate called" not in err, err
        if proc.returncode == 130:
            assert err.strip().splitlines()[-1].startswith("interrupted (Ctrl-C)") and "Traceback" not in err, err
        assert not out.exists() or {p.name for p in out.iterdir()} >= {"plan.json", "launch.sh"}
        assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")], list(tmp_path.iterdir())


def test_sigterm_inside_torch_leaves_at_once_and_outside_raises(monkeypatch):
    """`timeout`'s SIGTERM landing inside torch (a dispatch mode, a fake-tensor callback during a plan's trace) must
    not raise there: an exception crossing torch's C++ aborted a Gemma-4 plan killed at 15 min with `terminate called
    after throwing an instance of 'python_error'` and no traceback. Inside torch the handler removes what toolkit.fileio
    is writing and exits 143 at once, as Ctrl-C does (exit 130); in plain Python it raises Terminated, so every `finally`
    runs. os._exit is the one part replaced: this test's own process cannot exit."""
    import signal
    import sys

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from toolkit import cli
    from toolkit.fileio import undone_if_interrupted

    class FrameInDispatch(TorchDispatchMode):
        frame = None

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            FrameInDispatch.frame = sys._getframe()
            return func(*args, **(kwargs or {}))

    with FrameInDispatch():
        torch.ones(2) + 1
    previous = cli._finish_on_termination()
    try:
        on_sigterm = signal.getsignal(signal.SIGTERM)
        with pytest.raises(cli.Terminated):
            on_sigterm(signal.SIGTERM, sys._getframe())

        class Exited(BaseException):
            pass

        def exit_now(code):
            raise Exited(code)

        monkeypatch.setattr(os, "_exit", exit_now)
        cleaned = []
        with undone_if_interrupted(lambda: cleaned.append("staging removed")):
            with pytest.raises(Exited) as left:
                on_sigterm(signal.SIGTERM, FrameInDispatch.frame)
        assert left.value.args == (128 + signal.SIGTERM,) and cleaned == ["staging removed"]
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
