"""Every flag a command shows reaches its work or is refused (issue 27, Deliver 2).

The walk reads each command's flags from its argparse parser (a new flag is walked without editing this file) and
gives each a value other than its default, derived from the parser: a choice other than the default, the bare flag
for a switch, a number from its bound for a numeric flag; only flags whose value cannot be derived (a name, a path,
a member of a closed set the parser checks itself) take one from VALUES, and a flag missing there fails by name.
Run in-process through toolkit.cli.main, each flag's run is compared with a run without it: what the command
prints (its JSON without the keys that echo its input) and the files it writes must differ, or the flag is refused
in one line with exit code 2.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest

from toolkit.cli import build_parser, main
from toolkit.inputs import choices
from toolkit.inputs.strategy import ALL_STRATEGY_NAMES

CLOSED_SETS = {"--method": choices.METHODS, "--qlora-quant-type": choices.QUANT_TYPES,
               "--qlora-compute-dtype": choices.COMPUTE_DTYPES, "--qlora-quant-storage": choices.QUANT_STORAGE_DTYPES,
               "--precision": choices.PRECISIONS, "--strategy": ALL_STRATEGY_NAMES,
               "--reference": choices.REFERENCES[1:], "--dpo-loss": choices.DPO_LOSS_TYPES[1:],
               "--vllm-mode": choices.VLLM_MODES[1:], "--base-dtype": choices.BASE_DTYPES,
               "--modules-to-save-dtype": choices.BASE_DTYPES}
"""Flags that take a member of a closed set the command checks itself (its help lists the set): the walk gives the
first member that is not the default."""

VALUES = {
    "--params": "1M", "--gpus": "4xH100-80GB", "--power-limit-w": "500", "--strategies": "zero3", "--choose": "zero3",
    "--lora-targets": "q_proj,v_proj", "--lora-modules-to-save": "lm_head", "--out": "{tmp}/out2",
    "--nvme-path": "{tmp}/nvme", "--hosts": "node-a,node-b", "--model": "{model}", "--device": "cuda",
    "--workdir": "{tmp}/demo", "--qlora-compute-dtype": "float32", "--runner": "deepspeed", "--data": "{corpus}",
    "--rope-original-positions": "128", "--image-size": "448x448", "--emit": "{tmp}/out2",
    "--calibration": "{tmp}/calibration.json", "--export-calibration": "{tmp}/exported.json",
    "--reward-model": "{reward}",
}
"""A value for each flag whose value the parser cannot give (names, paths), or whose derived value would not show
its effect: --power-limit-w inside the die's datasheet points; --qlora-compute-dtype float32, as float16 takes the
bytes of the default bfloat16; --runner deepspeed, the runner that reads no "auto"."""

NEEDS = {
    "--inter-node-gbps": ["--nodes", "2"],
    **{flag: ["--method", "lora"] for flag in ("--lora-r", "--lora-alpha", "--lora-dropout", "--lora-targets",
                                               "--lora-modules-to-save")},
    **{flag: ["--method", "qlora"] for flag in ("--qlora-quant-type", "--qlora-no-double-quant",
                                                "--qlora-compute-dtype")},
    "--qlora-quant-storage": ["--method", "qlora", "--strategy", "zero3"],
    "--base-dtype": ["--method", "lora", "--strategy", "ddp", "--strategies", "ddp"],  # fp32: not on DeepSpeed
    "--modules-to-save-dtype": ["--method", "lora", "--lora-modules-to-save", "lm_head", "--strategy", "ddp",
                                "--strategies", "ddp"],  # fp32 copies of a bf16 base: on DDP only
    "--nvme-path": ["--strategies", "zero3-offload-nvme", "--out", "{tmp}/out"],
    "--hosts": ["--nodes", "2", "--out", "{tmp}/out"], "--force": ["--out", "{tmp}/out"],
    "--pipeline-stages": ["--strategies", "pipeline", "--strategy", "pipeline", "--gpus", "4xH100-80GB"],
    "--savers": ["--strategies", "zero2", "--tiled", "off", "--sequence-parallel", "1", "--micro-batch", "250000"],
    "--choose": ["--strategies", "zero2,zero3"],
    "--tensor-parallel": ["--strategies", "fsdp2", "--strategy", "fsdp2"],
    "--context-parallel": ["--strategies", "fsdp2", "--strategy", "fsdp2"],
    "--sequence-parallel": ["--strategies", "zero3", "--strategy", "zero3"],
    "--tiled": ["--strategy", "zero3"], "--trace-world": ["--strategy", "fsdp2"],
    "--require-fit": ["--micro-batch", "400000"],
    # check: the fit check's pins act with --model and --gpus; launch: --nodes shapes a rehearsal
    **{flag: ["--model", "{model}", "--gpus", "2xH100-80GB"] for flag in ("--seq", "--micro-batch", "--precision",
                                                                         "--checkpointing")},
    "--model": ["--gpus", "2xH100-80GB"], "--nodes": ["--rehearse"],
    **{flag: ["--method", "dpo"] for flag in ("--reference", "--dpo-beta", "--dpo-loss")},
    # GRPO: lengths the tiny model's 256 positions take (its sequence is prompt + completion, never --seq), and a
    # generation batch of whole groups of 8 on the 2 GPUs (micro-batch 4)
    **{flag: ["--method", "grpo", "--max-prompt-length", "32", "--max-completion-length", "32", "--micro-batch", "4"]
       for flag in ("--num-generations", "--grpo-beta", "--use-vllm", "--reward-model")},
    **{flag: ["--method", "grpo", "--max-prompt-length", "32", "--max-completion-length", "32", "--micro-batch", "4",
              "--use-vllm"] for flag in ("--vllm-mode", "--vllm-gpu-memory-utilization", "--vllm-enable-sleep-mode",
                                      "--vllm-tensor-parallel-size")},
    "--max-prompt-length": ["--method", "grpo", "--max-completion-length", "32", "--micro-batch", "4"],
    "--max-completion-length": ["--method", "grpo", "--max-prompt-length", "32", "--micro-batch", "4"],
    "--epochs": ["--dataset-tokens", "1e9"], "--gpu-hour-price": ["--dataset-tokens", "1e9"],
    "--rope-scaling": ["--rope-factor", "2"], "--rope-factor": ["--rope-scaling", "yarn"],
    "--rope-original-positions": ["--rope-scaling", "yarn", "--rope-factor", "2"],
}
"""Flags that act only beside another: walked with it given in both runs (its own effect is not what is measured).
A command without the other flag drops it from the context. (--savers: a grid where a row fits only with a saver,
the tiny model at micro-batch 250000; --pipeline-stages: the 2-layer model cannot be cut otherwise than a pipeline
over every GPU, so a count is refused.)"""

BY_NUMBERS = ["--layers", "3", "--hidden", "64", "--heads", "4", "--vocab", "512"]
"""The model the flags of the "model by numbers" group are walked on, in place of the model's name (beside which
they are refused)."""

DROPS = {"--savers": {"--global-batch"}, "--params": {"--layers", "--hidden", "--heads", "--vocab"},
         **{flag: {"--seq"} for flag in ("--num-generations", "--grpo-beta", "--use-vllm", "--reward-model",
                                         "--vllm-mode",
                                         "--vllm-gpu-memory-utilization", "--vllm-enable-sleep-mode",
                                         "--vllm-tensor-parallel-size",
                                         "--max-prompt-length",
                                         "--max-completion-length")}}
"""Flags of the command's own words that the context of a walked flag leaves out."""

AFTER_A_FIRST_RUN = {"--force"}
"""Flags that matter only when the command ran once before (--force: its --out already holds the files)."""

STORED_CALIBRATION = {"--no-calibration"}
"""Flags that act on the calibration `toolkit tune` stored for this machine: walked (and their run without them)
over a cache of their own that holds one for the walk's 2 x H100 (compute x 1.5 + 10 ms a step). With nothing
stored --no-calibration is a no-op, said in a note (tests/test_tune.py)."""

TABLE_ONLY = {"--json", "--top", "--explain"}
"""Flags that shape the printed table: walked without --json."""

NOT_WALKED = {
    ("launch", "--dry-run"): "without it launch starts the training processes (tests/test_launch.py runs them)",
    ("demo", "--workdir"): "the demo trains a model in processes (tests/test_golden_output.py runs it)",
    ("demo", "--steps"): "the demo trains a model in processes (tests/test_golden_output.py runs it)",
    ("demo", "--force"): "the demo trains a model in processes (tests/test_golden_output.py runs it)",
    ("tune", "--budget-min"): "a budget a candidate fits in starts its training processes (tests/test_tune.py runs "
                              "them; its budget test skips every candidate)",
}
"""The flags this in-process walk cannot run, with where they are proven instead."""

ECHO = {"estimate": {"job", "model", "hardware", "strategy"},
        "plan": {"model", "hardware", "attention", "method"},
        "profile": {"model", "device", "seq_len", "micro_batch", "precision", "attention", "checkpointing",
                    "optimizer", "optimizer_impl", "liger", "method"}}
"""Top-level keys of a command's --json that repeat its input: left out of the comparison, so a flag differs by
its effect, never by being printed back."""


def _subparser(command: str) -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))  # noqa: SLF001
    return sub.choices[command]


def _default(flag: str, action: argparse.Action):
    """The flag's default: argparse's, or for an adapter flag (None there, so that an unread one is refused) the
    Adapter's own."""
    from toolkit.inputs.lora import LORA_FLAGS, QLORA_FLAGS, Adapter

    fields = {f: field for field, f in {**LORA_FLAGS, **QLORA_FLAGS}.items()}
    return getattr(Adapter(), fields[flag]) if action.default is None and flag in fields else action.default


def _number(flag: str, action: argparse.Action) -> str:
    """A value other than the default, inside the flag's bound: 2 where there is no default (or the default is 1),
    1 where the default is 0 or above 1; the bound's low end (or its middle) where that is outside the bound."""
    bound = action.type.bound  # type: ignore[union-attr]
    default = _default(flag, action)
    value = 2 if default in (None, 1) else 1 if default == 0 or default > 1 else 2
    if not (bound.low <= value <= bound.high) or value == default:
        value = bound.low if bound.low != default and bound.low_inclusive else (bound.low + bound.high) / 2
    return str(value)


def walked_flags(command: str):
    """(flag, the words that give it) for every flag `toolkit COMMAND --help` shows."""
    for action in _subparser(command)._actions:  # noqa: SLF001
        if not action.option_strings or isinstance(action, argparse._HelpAction):  # noqa: SLF001
            continue
        flag = action.option_strings[0]
        if action.nargs == 0:
            yield flag, [flag]
        elif flag in VALUES:
            yield flag, [flag, VALUES[flag]]
        elif action.choices:
            yield flag, [flag, next(c for c in action.choices if c != action.default)]
        elif action.nargs == "?" and action.const not in (None, action.default):
            yield flag, [flag]  # the bare flag: its const (estimate's --checkpointing: on)
        elif flag in CLOSED_SETS:
            yield flag, [flag, next(c for c in CLOSED_SETS[flag] if c != _default(flag, action))]
        elif hasattr(action.type, "bound"):
            yield flag, [flag, _number(flag, action)]
        else:
            pytest.fail(f"toolkit {command} {flag}: the walk cannot derive a value for it; add one to VALUES in "
                        f"{Path(__file__).name}")


WARNED = Path(__file__).parent / "check_corpus" / "ds-zero3-without-16bit-save.json"
"""A DeepSpeed JSON with a warning and no error: what check's --strict and --runner act on."""

COMMANDS = ("estimate", "plan", "profile", "emit", "check", "launch", "demo", "tune")


def _setups(tiny_llama_dir: Path, tmp: Path, plan_dir: Path, corpus: Path,
            four: Path) -> dict[str, tuple[list[str], list[str]]]:
    """command -> (its words before the walked flag, after it). tune: on a plan for 4 GPUs (so --processes 2 is
    not its default), with a budget that planning alone spends, so no candidate starts a process."""
    model = str(tiny_llama_dir)
    return {
        "estimate": ([model, "--seq", "64", "--gpus", "2xH100-80GB", "--json"], []),
        "plan": ([model, "--seq", "64", "--gpus", "2xH100-80GB", "--global-batch", "16", "--strategies", "zero3",
                  "--json", "--out", f"{tmp}/out"], []),
        "profile": ([model, "--seq", "32", "--steps", "1", "--json"], []),
        "emit": ([str(plan_dir / "plan.json"), "--out", f"{tmp}/out"], []),
        "check": ([str(plan_dir), str(WARNED)], []),
        "launch": ([str(plan_dir), "--dry-run"], ["--", "--data", str(corpus), "--output", str(tmp / "run")]),
        "demo": ([], []),
        "tune": ([str(four), "--cpu", "--budget-min", "0.0001"], []),
    }


def _plan_folder(model_dir: Path, tmp_path_factory, gpus: int) -> Path:
    folder = tmp_path_factory.mktemp("walk") / f"planned-{gpus}"
    assert main(["plan", str(model_dir), "--seq", "64", "--global-batch", "16", "--gpus", f"{gpus}xH100-80GB",
                 "--strategies", "zero2", "--out", str(folder)]) == 0
    return folder


@pytest.fixture(scope="module")
def planned(tiny_llama_dir, tmp_path_factory) -> Path:
    return _plan_folder(tiny_llama_dir, tmp_path_factory, 2)


@pytest.fixture(scope="module")
def planned_four(tiny_llama_dir, tmp_path_factory) -> Path:
    return _plan_folder(tiny_llama_dir, tmp_path_factory, 4)


def _without(words: list[str], flags: set[str], parser: argparse.ArgumentParser) -> list[str]:
    """`words` with each of `flags` (and its value) taken out."""
    takes_value = {o: a.nargs != 0 for a in parser._actions for o in a.option_strings}  # noqa: SLF001
    out, skip = [], False
    for i, word in enumerate(words):
        if skip:
            skip = False
            continue
        if word in flags:
            skip = takes_value.get(word, True) and i + 1 < len(words) and not words[i + 1].startswith("--")
            continue
        out.append(word)
    return out


def _result(command: str, argv: list[str], tmp: Path, capsys, *, fresh: bool = True):
    """What one run gives: ("refused", its line) for exit 2, else its exit code, its output (the JSON without the
    keys that echo the input; profile's measured times, which vary, left out) and the files it wrote."""
    if fresh:
        for folder in ("out", "out2"):
            shutil.rmtree(tmp / folder, ignore_errors=True)
    capsys.readouterr()
    code = main(argv)
    out, err = capsys.readouterr()
    assert "Traceback" not in err, (argv, err)
    if code == 2:
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: "), (argv, err)
        return "refused", lines[0]
    out = out.replace(str(tmp), "{tmp}")
    try:
        data = json.loads(out)
    except ValueError:
        data = out
    if isinstance(data, dict):
        data = {k: v for k, v in data.items() if k not in ECHO.get(command, ())}
        if command == "profile":
            data["measured"] = {k: v for k, v in data["measured"].items() if k not in ("step_time_s", "tokens_per_s")}
    files = {str(p.relative_to(tmp)): p.read_bytes() for folder in ("out", "out2")
             for p in sorted((tmp / folder).rglob("*")) if p.is_file()}
    return code, data, files


def _store_a_calibration(patch: pytest.MonkeyPatch, cache: Path) -> None:
    """TOOLKIT_CACHE_DIR set to `cache`, which holds a calibration of this machine for 2 x H100 (STORED_CALIBRATION)."""
    from dataclasses import replace

    from toolkit.inputs import calibration as cal
    from toolkit.inputs.hardware import find_gpu

    patch.setenv("TOOLKIT_CACHE_DIR", str(cache))
    cal.store(replace(cal.combine(find_gpu("H100-SXM-80GB"), 2, [1.5], None), step_overhead_s=0.01))


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_reaches_its_work_or_is_refused(command, tiny_llama_dir, planned, planned_four, corpus_dir, tmp_path,
                                                   capsys, tiny_reward_dir):
    """Each flag `toolkit COMMAND --help` shows, given once, changes what the command prints or writes (its numbers
    or files, not an echo of its input), or is refused in one line with exit code 2."""
    parser = _subparser(command)
    before, after = _setups(tiny_llama_dir, tmp_path, planned, corpus_dir, planned_four)[command]
    fill = {"{tmp}": str(tmp_path), "{model}": str(tiny_llama_dir), "{corpus}": str(corpus_dir),
            "{reward}": str(tiny_reward_dir)}
    known = {o for a in parser._actions for o in a.option_strings}  # noqa: SLF001
    by_numbers = {o for g in parser._action_groups if g.title and g.title.startswith("model by numbers")  # noqa: SLF001
                  for a in g._group_actions for o in a.option_strings}  # noqa: SLF001

    def argv(base: list[str], *words: str) -> list[str]:
        out = [command, *base, *words, *after]
        for key, value in fill.items():
            out = [w.replace(key, value) for w in out]
        return out

    silent, baselines = [], {}
    for flag, given in walked_flags(command):
        if (command, flag) in NOT_WALKED:
            continue
        needs = _without(NEEDS.get(flag, []), {w for w in NEEDS.get(flag, []) if w.startswith("--")} - known,
                         parser)
        base = before
        if flag in by_numbers:
            base = [w for w in base if w != str(tiny_llama_dir)] + BY_NUMBERS
        base = _without(base, {flag, *DROPS.get(flag, ()), *(w for w in needs if w.startswith("--"))}, parser)
        if flag in TABLE_ONLY:
            base = _without(base, {"--json"}, parser)
        key = (tuple(base), tuple(needs))
        if flag in STORED_CALIBRATION:
            with pytest.MonkeyPatch.context() as patch:
                _store_a_calibration(patch, tmp_path / "calibrated")
                without = _result(command, argv(base, *needs), tmp_path, capsys)
                with_it = _result(command, argv(base, *needs, *given), tmp_path, capsys)
        elif flag in AFTER_A_FIRST_RUN:
            _result(command, argv(base, *needs), tmp_path, capsys)
            without = _result(command, argv(base, *needs), tmp_path, capsys, fresh=False)
            with_it = _result(command, argv(base, *needs, *given), tmp_path, capsys, fresh=False)
        else:
            if key not in baselines:
                baselines[key] = _result(command, argv(base, *needs), tmp_path, capsys)
            without = baselines[key]
            with_it = _result(command, argv(base, *needs, *given), tmp_path, capsys)
        if with_it[0] != "refused" and with_it == without:
            silent.append(" ".join(given))
    assert silent == [], f"toolkit {command}: these flags change nothing and are not refused: {silent}"


def test_the_walk_names_real_flags():
    """The hand lists name flags the parsers have, so a renamed flag cannot leave a stale entry behind."""
    every = {o for c in COMMANDS for a in _subparser(c)._actions for o in a.option_strings}  # noqa: SLF001
    for flag in [*VALUES, *NEEDS, *CLOSED_SETS, *AFTER_A_FIRST_RUN, *STORED_CALIBRATION, *TABLE_ONLY, *DROPS]:
        assert flag in every, flag
    for command, flag in NOT_WALKED:
        assert flag in dict(walked_flags(command)), (command, flag)
