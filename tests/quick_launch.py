"""How the tests start `accelerate launch` for a run they make themselves (tests/conftest.py's run_training,
test_two_nodes' one-launcher reference, test_faults' resume, test_pipeline's runs)."""

from __future__ import annotations

import sys

ACCELERATE_LAUNCH = [sys.executable, "-c", "from accelerate.commands.launch import main; main()\n"
                     "from toolkit.cli import finish_process; raise SystemExit(finish_process(0))"]
"""`accelerate launch` as the tests start it: the function `accelerate launch` runs (accelerate.commands.launch's
launch_command, same arguments, same config), without the `accelerate` CLI's import of its other subcommands
(config, estimate, env, ...: about 0.9 s of CPU before any rank starts) and without unloading torch at the end (about
0.8 s more, toolkit.cli.finish_process: atexit handlers and threads as at a normal exit). A failed run raises out of
main() and leaves as before, with accelerate's traceback and exit code. Measured on a 2-rank launch of a script that
exits at once, load ~8: 4.0-4.5 s CPU (accelerate launch) -> 2.0-2.2 s; from the last rank's end to the launcher's
2.6-2.9 s -> 0.12-0.19 s. `toolkit launch` (tests/test_launch.py, test_faults, test_examples) runs the real CLI."""


def quick_launch(command: list[str]) -> list[str]:
    """command with `accelerate launch` started as ACCELERATE_LAUNCH; any other command as it is."""
    if command[:2] == ["accelerate", "launch"]:
        return [*ACCELERATE_LAUNCH, *command[2:]]
    return command
