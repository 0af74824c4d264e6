"""The `toolkit` subcommands, one module each (accelerate's commands/ shape): `add_parser(sub)` declares the
command's flags, `cmd_NAME(args)` runs it and prints its own output. Flags several commands share are in
common.py; the examples under each --help and the status line in help.py.

A command module imports its work (the planner, the engines, torch) inside its functions, so building the parser
(`toolkit --help`) stays cheap. `execute(argv)` is the one entry every caller goes through: the `toolkit` script
(toolkit.cli, which adds signal handling) and the demo, which runs commands as a user would.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from toolkit.errors import EXIT_USER_ERROR, UserError

COMMANDS = ("estimate", "plan", "emit", "check", "launch", "tune", "profile", "demo", "models", "gpus")
"""The subcommands in --help's order; each is toolkit/commands/NAME.py (imported by name: the registry does not
import the commands at module level, so a command such as the demo can run the others through execute)."""


class _Parser(argparse.ArgumentParser):
    """argparse that reports bad flags as one line with exit 2 (its default usage dump is noise here), and takes
    every flag whole: argparse's prefix matching (`--glob 64` read as --global-batch) is off in the top parser and
    every subcommand's, so a typo or a flag another version added is refused, never read as a neighbour."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UserError(f"{self.prog}: {message} (see --help)")


def build_parser() -> argparse.ArgumentParser:
    from toolkit import __version__
    from toolkit.commands.help import add_examples

    parser = _Parser(prog="toolkit", description="Plan, emit and run distributed training of HF causal LMs.")
    parser.add_argument("--version", action="version", version=f"toolkit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name in COMMANDS:
        importlib.import_module(f"toolkit.commands.{name}").add_parser(sub)
    add_examples(sub)
    return parser


def execute(argv: list[str]) -> int:
    """Parse `argv`, run its command; bad input anywhere is one line on stderr and exit code 2."""
    argv = list(argv)
    # `toolkit launch DIR [--rehearse] -- TRAIN ARGS`: what follows -- belongs to toolkit.train, untouched.
    passthrough: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1:]
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        _refuse_repeated_flags(parser, args.command, argv)
        if passthrough and args.command != "launch":
            raise UserError("`--` passes arguments to toolkit.train and only `toolkit launch` takes them")
        if args.command == "launch":
            args.train_args = passthrough
        return int(args.func(args) or 0)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR


def _refuse_repeated_flags(parser: argparse.ArgumentParser, command: str, argv: list[str]) -> None:
    """argparse lets the last of two flags that set one thing win silently (`--compile --compile-blocks`, `--seq 1024
    --seq 4096`): both are refused, one line naming them."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))  # noqa: SLF001
    actions = {option: action for action in sub.choices[command]._actions  # noqa: SLF001
               for option in action.option_strings}
    seen: dict[str, str] = {}
    for token in argv[argv.index(command) + 1:] if command in argv else []:
        option = token.split("=", 1)[0]
        action = actions.get(option)
        if action is None or isinstance(action, (argparse._AppendAction, argparse._CountAction)):  # noqa: SLF001
            continue
        if action.dest in seen:
            first = seen[action.dest]
            raise UserError(f"{option} is given twice; give it once" if first == option else
                            f"{first} and {option} both set {action.dest.replace('_', ' ')}; give one of them")
        seen[action.dest] = option
