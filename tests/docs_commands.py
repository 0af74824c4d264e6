"""The documentation's commands, kept true: the CLI reference generated from the parsers, and the output of every
runnable example regenerated from the program.

In docs/*.md a fenced ```console block whose first line is `$ toolkit ...` is a runnable example: the command is
run in-process (in a scratch folder, so `--out plans/x` lands there) and the lines after it are its output. Every
other `toolkit ...` line in a fenced bash / console block must at least parse with the real parser (a renamed flag
fails the docs test). docs/reference/cli.md is every command's --help.

    python tests/docs_commands.py --write     # regenerate docs/reference/cli.md and every example's output
    python tests/docs_commands.py             # say which pages differ (what tests/test_docs.py asserts)
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
CLI_REFERENCE = DOCS / "reference" / "cli.md"
API_REFERENCE = DOCS / "reference" / "api.md"
API_MARK = "<!-- generated from toolkit/api.py's docstrings below this line -->"
HELP_COLUMNS = "100"  # argparse wraps at the terminal's width: one width for the page

FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


def pages() -> list[Path]:
    return sorted(p for p in DOCS.rglob("*.md") if p != CLI_REFERENCE)


def api_reference(page: str) -> str:
    """`page` (docs/reference/api.md) with everything below API_MARK regenerated: each public name of toolkit.api
    with its signature and docstring."""
    import inspect

    import toolkit.api as api

    head = page.split(API_MARK, 1)[0]
    parts = [head + API_MARK + "\n"]
    for name in api.__all__:
        obj = getattr(api, name)
        signature = _signature(obj)
        kind = "class" if inspect.isclass(obj) else "def"
        parts.append(f"\n## {name}\n\n```python\n{kind} {name}{signature}\n```\n\n{inspect.getdoc(obj)}\n\n")
        if inspect.isclass(obj):
            for member, value in vars(obj).items():
                if member.startswith("_") or not (inspect.isfunction(value) or isinstance(value, property)):
                    continue
                doc = inspect.getdoc(value) or ""
                parts.append(f"- `{member}`" + (f": {doc.splitlines()[0]}" if doc else "") + "\n")
    return "".join(parts)


class _Shown:
    """An annotation as its source spells it (toolkit.api's are strings: `from __future__ import annotations`)."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _signature(obj) -> str:
    import inspect

    sig = inspect.signature(obj)
    shown = lambda a: a if a is inspect.Parameter.empty else _Shown(str(a).strip("'\""))  # noqa: E731
    params = [p.replace(annotation=shown(p.annotation)) for p in sig.parameters.values()]
    return str(sig.replace(parameters=params, return_annotation=shown(sig.return_annotation)))


def python_examples(text: str) -> list[str]:
    """The ```python blocks of a page (docs/reference/api.md's are run by tests/test_docs.py)."""
    return [body for lang, body in FENCE.findall(text) if lang == "python"]


def _run(argv: list[str]) -> tuple[int, str]:
    """Run `toolkit ARGV` in this process; (exit code, stdout + stderr as a user's terminal shows them)."""
    from toolkit.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            code = main(argv)
        except SystemExit as exc:  # --help and argparse exit this way
            code = int(exc.code or 0)
    return code, out.getvalue()


def help_text(argv: list[str]) -> str:
    previous = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = HELP_COLUMNS
    try:
        code, text = _run([*argv, "--help"])
    finally:
        if previous is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = previous
    assert code == 0, text
    return text


def cli_reference() -> str:
    from toolkit.commands import COMMANDS

    parts = ["# Command line\n",
             "Every command's `--help`, generated from the parsers (`python tests/docs_commands.py --write`).\n",
             "```text\n" + help_text([]) + "```\n"]
    for name in COMMANDS:
        parts.append(f"## toolkit {name}\n\n```text\n{help_text([name])}```\n")
    return "\n".join(parts)


def shown_commands(text: str) -> list[list[str]]:
    """Every `toolkit ...` command line shown in a bash / console / sh block (continuation lines joined)."""
    commands = []
    for lang, body in FENCE.findall(text):
        if lang not in ("bash", "console", "sh", "shell"):
            continue
        joined = re.sub(r"\\\n\s*", " ", body)
        for line in joined.splitlines():
            line = line.strip().removeprefix("$ ")
            if line.startswith("toolkit "):
                words = shlex.split(line.split(" #", 1)[0])
                commands.append(words[1:])
    return commands


def regenerate(text: str, scratch: Path) -> str:
    """`text` with every runnable example's output replaced by what the program prints now."""

    def refresh(match: re.Match) -> str:
        lang, body = match.group(1), match.group(2)
        first = body.splitlines()[0] if body else ""
        if lang != "console" or not first.startswith("$ toolkit "):
            return match.group(0)
        argv = shlex.split(first[2:])[1:]
        cwd = os.getcwd()
        os.chdir(scratch)
        try:
            code, output = _run(argv)
        finally:
            os.chdir(cwd)
        if code != 0:
            raise RuntimeError(f"`{first[2:]}` exited with {code}:\n{output}")
        return f"```console\n{first}\n{output.rstrip()}\n```"

    return FENCE.sub(refresh, text)


def stale_pages(write: bool = False) -> list[str]:
    """The pages whose generated parts differ from the program (rewritten when `write`)."""
    stale = []
    expected = {CLI_REFERENCE: cli_reference()}
    with tempfile.TemporaryDirectory() as scratch:
        for page in pages():
            text = page.read_text()
            if page == API_REFERENCE:
                text = api_reference(text)
            expected[page] = regenerate(text, Path(scratch))
    for page, text in expected.items():
        if not page.exists() or page.read_text() != text:
            stale.append(str(page.relative_to(ROOT)))
            if write:
                page.write_text(text)
    return stale


if __name__ == "__main__":
    changed = stale_pages(write="--write" in sys.argv)
    print(("rewrote: " if "--write" in sys.argv else "stale: ") + (", ".join(changed) or "none"))
    raise SystemExit(1 if changed and "--write" not in sys.argv else 0)
