"""CLI friendliness: --help with an example and the choices, the status line, --require-fit, fp16 rates."""

from __future__ import annotations

import pytest

from toolkit.cli import build_parser, main


def _help(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def test_every_command_help_has_an_example(capsys):
    commands = build_parser()._subparsers._group_actions[0].choices  # noqa: SLF001
    for name in commands:
        text = _help(capsys, name)
        assert "example" in text and f"toolkit {name}" in text.split("example", 1)[1], name
    estimate = _help(capsys, "estimate")
    assert "{fp32,bf16,fp16,bf16-pure}" in estimate and "{eager,sdpa,flash_attention_2}" in estimate
    assert "--require-fit" in estimate


def test_require_fit_exits_1_only_when_it_does_not_fit(capsys):
    small = ["estimate", "gpt2", "--gpus", "1xH100-80GB", "--seq", "1024", "--require-fit"]
    assert main(small) == 0
    assert main(["estimate", "llama-3-70b", "--gpus", "1xH100-80GB", "--seq", "4096", "--require-fit"]) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out
    assert main(["estimate", "llama-3-70b", "--gpus", "1xH100-80GB", "--seq", "4096"]) == 0  # a report, not a test


def test_gpus_without_bf16_show_their_fp16_rate(capsys):
    assert main(["gpus"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert "fp16   125.0 TFLOP/s" in lines["V100-16GB"] and "bf16 0.0" not in lines["V100-16GB"]
    h100 = next(line for name, line in lines.items() if name.startswith("H100"))
    assert " bf16 " in h100


def test_status_line_only_on_a_terminal(monkeypatch):
    import io
    import sys

    from toolkit.commands import help as cli_help

    fake = io.StringIO()
    fake.isatty = lambda: True  # type: ignore[method-assign]
    monkeypatch.setattr(sys, "stderr", fake)
    with cli_help.status("planning"):
        pass
    assert "planning" in fake.getvalue()
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    with cli_help.status("planning"):
        pass
    assert sys.stderr.getvalue() == ""
