from toolkit.cli import run

raise SystemExit(run())
