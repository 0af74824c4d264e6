"""The documentation site: it builds in strict mode, every command it shows parses with the real parser, every
runnable example's output and the CLI reference are what the program prints now (tests/docs_commands.py
regenerates them: `python tests/docs_commands.py --write`), and the README stays a front door."""

from __future__ import annotations

from pathlib import Path

import pytest

import docs_commands
from toolkit.commands import build_parser
from toolkit.errors import UserError

ROOT = Path(__file__).resolve().parents[1]


def test_the_site_builds_in_strict_mode(tmp_path):
    from mkdocs.commands.build import build
    from mkdocs.config import load_config

    config = load_config(str(ROOT / "mkdocs.yml"), site_dir=str(tmp_path / "site"), strict=True)
    build(config)  # strict: a broken link, a page missing from nav or a warning raises
    assert (tmp_path / "site" / "guides" / "long-context" / "index.html").exists()
    assert (tmp_path / "site" / "reference" / "cli" / "index.html").exists()


@pytest.mark.parametrize("page", docs_commands.pages() + [ROOT / "README.md"], ids=lambda p: p.name)
def test_every_shown_command_parses(page):
    commands = docs_commands.shown_commands(page.read_text())
    for argv in commands:
        ours = argv[:argv.index("--")] if "--" in argv else argv
        try:
            build_parser().parse_args(ours)
        except SystemExit as exc:  # --version / --help parse by exiting 0
            assert exc.code == 0, f"{page.name}: `toolkit {' '.join(argv)}` exits {exc.code}"
        except UserError as exc:
            raise AssertionError(f"{page.name}: `toolkit {' '.join(argv)}` does not parse: {exc}") from None


def test_a_renamed_flag_in_a_page_would_fail():
    with pytest.raises(UserError):
        build_parser().parse_args(docs_commands.shown_commands("```bash\ntoolkit plan gpt2 --gpus 8xH100-80GB --no-such-flag 1\n```")[0])


def test_pages_show_what_the_program_prints():
    assert docs_commands.stale_pages() == [], "run `python tests/docs_commands.py --write` and review the diff"


def test_the_python_api_page_runs(tmp_path, monkeypatch, capsys):
    page = (ROOT / "docs" / "reference" / "api.md").read_text().split(docs_commands.API_MARK)[0]  # not the signatures
    examples = docs_commands.python_examples(page)
    assert examples and "tk.plan(" in examples[0]
    monkeypatch.chdir(tmp_path)
    for code in examples:
        exec(compile(code, "docs/reference/api.md", "exec"), {})
    out = capsys.readouterr().out
    assert "zero" in out and (tmp_path / "plans" / "8b" / "plan.json").exists()


def test_the_readme_is_a_front_door():
    readme = (ROOT / "README.md").read_text().splitlines()
    assert len(readme) < 80
    assert "bash .ci/setup && .venv/bin/toolkit demo" in readme[readme.index("```bash") + 1]
    assert readme[readme.index("```bash") + 2].startswith("bash .ci/run")
