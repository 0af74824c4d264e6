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
        add(f"estimate --pipeline-stages {value!r}", "estimate", "{M}", "--strategy", "pipeline", "--gpus", "2xH100",
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
    add("bf16 on V100 (estimate)", "estimate", "{M}", "--gpus", "8xV100", "--precision", "bf16")
    add("bf16-pure on T4 (estimate)", "estimate", "{M}", "--gpus", "1xT4", "--precision", "bf16-pure")
    add("bf16 on V100 (plan)", "plan", "{M}", "--gpus", "8xV100", "--micro-batch", "1")
    add("plan params beside a model name", "plan", "{M}", "--params", "7e9", "--micro-batch", "1")
    add("plan stages with zero2 only", "plan", "{M}", "--strategies", "zero2", "--pipeline-stages", "2",
        "--micro-batch", "1")
    add("shape: kv heads not dividing heads", "estimate", "--layers", "2", "--hidden", "64", "--heads", "4",
        "--kv-heads", "3")
    add("shape: kv heads above heads", "estimate", "--layers", "2", "--hidden", "64", "--heads", "4",
        "--kv-heads", "8")
    add("shape: hidden not dividing heads", "estimate", "--layers", "2", "--hidden", "63", "--heads", "4")
    add("shape: partial", "estimate", "--layers", "2", "--hidden", "64")
    add("--seq above the model's positions", "estimate", "{M}", "--seq", "100000")

    # LoRA / QLoRA flags (their rules are toolkit.inputs.job's; here: that they reach the user as one line).
    for flag, value in (("--lora-r", "0"), ("--lora-r", "1e20"), ("--lora-alpha", "nan"), ("--lora-dropout", "2"),
                        ("--lora-dropout", "nan"), ("--lora-targets", ""), ("--method", "bogus")):
        add(f"estimate lora {flag} {value!r}", "estimate", "{M}", "--method", "lora", flag, value)

    # Choices.
    for flag, value in (("--precision", "fp8"), ("--optimizer", "lion"), ("--attention", "flash9"),
                        ("--device-kind", "tpu"), ("--strategy", "zero9"), ("--strategy", "")):
        add(f"estimate {flag} {value!r}", "estimate", "{M}", flag, value)
    add("plan --strategies zero9", "plan", "{M}", "--strategies", "zero9", "--micro-batch", "1")
    add("plan --strategies empty", "plan", "{M}", "--strategies", "", "--micro-batch", "1")
    add("plan --choose unknown", "plan", "{M}", "--choose", "nope", "--micro-batch", "1")
    add("plan --checkpointing maybe", "plan", "{M}", "--checkpointing", "maybe", "--micro-batch", "1")
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
    def fill(arg: str) -> str:
        for key, value in world.items():
            arg = arg.replace("{" + key + "}", str(value))
        return arg

    argv = [fill(a) for a in argv]
    monkeypatch.chdir(world["W"])
    monkeypatch.setattr(tempfile, "tempdir", str(world["W"] / "tmp"))  # a temporary folder left behind shows
    roots = (world["W"], world["M"])
    before = _snapshot(*roots)
    code, out, err = run_cli(argv)
    lines = err.strip().splitlines()
    assert code == 2, f"exit {code}; stdout {out[-500:]!r}; stderr {err[-1000:]!r}"
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and "Traceback" not in err
    assert _snapshot(*roots) == before
    message = lines[0]
    for key, value in sorted(world.items(), key=lambda kv: -len(str(kv[1]))):
        message = message.replace(str(value), "{" + key + "}")
    if os.environ.get("TOOLKIT_RECORD_GOLDEN") == "1":
        recorded = json.loads(GOLDEN_MESSAGES.read_text()) if GOLDEN_MESSAGES.is_file() else {}
        GOLDEN_MESSAGES.write_text(json.dumps({**recorded, name: message}, indent=1, sort_keys=True) + "\n")
    assert message == json.loads(GOLDEN_MESSAGES.read_text())[name]


def test_a_relative_model_path_is_recorded_absolute(tiny_llama_dir, tmp_path, monkeypatch):
    """A plan made from `./model` must launch from any folder (the hub is never asked for a local path)."""
    shutil.copytree(tiny_llama_dir, tmp_path / "model")
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(["plan", "./model", "--seq", "64", "--micro-batch", "1", "--gpus", "2xH100",
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
