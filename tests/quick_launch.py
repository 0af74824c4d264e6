"""How the tests start `accelerate launch` for a run they make themselves (tests/conftest.py's run_training,
test_two_nodes' one-launcher reference, test_faults' resume, test_pipeline's runs)."""

from __future__ import annotations

from toolkit.processes import ACCELERATE_LAUNCH

__all__ = ["ACCELERATE_LAUNCH", "quick_launch"]


def quick_launch(command: list[str]) -> list[str]:
    """command with `accelerate launch` started as toolkit launch starts it (toolkit.processes.ACCELERATE_LAUNCH:
    accelerate.commands.launch's main in this interpreter, without the `accelerate` CLI's import of its other
    subcommands and without unloading torch at the end); any other command as it is."""
    if command[:2] == ["accelerate", "launch"]:
        return [*ACCELERATE_LAUNCH, *command[2:]]
    return command
