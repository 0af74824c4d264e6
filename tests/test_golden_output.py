"""The public CLI's texts, byte for byte: `toolkit --help` and every subcommand's `--help` against the files
recorded in tests/golden/help/ (recorded before the layout of issue 16 moved the code; a change to a help text is a
change to the public CLI and is made on purpose: TOOLKIT_RECORD_GOLDEN=1 rewrites the files). The hostile corpus's
error lines are recorded the same way, in tests/golden/hostile_messages.json (tests/test_hostile.py)."""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path

import pytest

from toolkit.cli import main

GOLDEN = Path(__file__).parent / "golden"
RECORD = os.environ.get("TOOLKIT_RECORD_GOLDEN") == "1"
COMMANDS = ("estimate", "plan", "emit", "check", "launch", "tune", "profile", "demo", "models", "gpus")


def help_text(argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
        main([*argv, "--help"])
    assert exit_info.value.code == 0
    return out.getvalue()


@pytest.mark.parametrize("command", ["toolkit", *COMMANDS])
def test_help_is_byte_identical_to_the_recorded_text(command, monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")  # argparse wraps at the terminal's width
    text = help_text([] if command == "toolkit" else [command])
    path = GOLDEN / "help" / f"{command}.txt"
    if RECORD:
        path.write_text(text)
    assert text == path.read_text(), f"`toolkit {command} --help` changed (TOOLKIT_RECORD_GOLDEN=1 records it)"


def test_every_subcommand_has_a_recorded_help():
    from toolkit.cli import build_parser

    commands = build_parser()._subparsers._group_actions[0].choices  # noqa: SLF001
    assert sorted(commands) == sorted(COMMANDS)
