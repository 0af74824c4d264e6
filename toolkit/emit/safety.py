"""What may reach an emitted script, comment, hostfile or config: checked before anything is written.

Every plan value that a script uses is shell-quoted where it is written (toolkit.emit.scripts); this module refuses
what quoting cannot make safe: control characters (a newline ends a `#` comment or an `#SBATCH` line and starts a
command) and host names that are not host names. Names the engines must know are the plan schema's (toolkit.plan.schema).
"""

from __future__ import annotations

import re
from dataclasses import asdict
from typing import Any

from toolkit.errors import UserError
from toolkit.plan.schema import Plan

CONTROL_CHARACTERS = re.compile(r"[\x00-\x1f\x7f]")
HOST_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
"""RFC 1123 host names (letters, digits, '-', '.'), plus '_' which clusters use in node names."""


def check_plan_for_emit(plan: Plan) -> None:
    """Refuse a plan whose strings hold control characters (UserError: one line, exit 2).

    The plan schema (toolkit.plan.schema) already refuses unknown strategies / precisions / optimizers, malformed
    layer-class and GPU names, and control characters in the model, GPU and notes; this also covers every other
    string a plan carries (model_config, predictions), which reach PLAN.md and the YAML."""
    for where, value in _strings(asdict(plan), "plan"):
        if CONTROL_CHARACTERS.search(value):
            raise UserError(f"{where} holds a control character ({value[:40]!r}); plan.json values end up in "
                            "scripts and comments: remove it (re-plan, or edit plan.json)")


def check_hosts(hosts: list[str]) -> None:
    for host in hosts:
        if not HOST_NAME.fullmatch(host):
            raise UserError(f"host name {host!r} is not a host name (letters, digits, '.', '-', '_'); "
                            "give --hosts as node1,node2,...")


def check_path_text(flag: str, value: str | None) -> None:
    if value is not None and CONTROL_CHARACTERS.search(value):
        raise UserError(f"{flag} {value!r} holds a control character; give a plain directory path")


def _strings(value: Any, where: str):
    """(dotted location, text) of every string in a JSON-like value."""
    if isinstance(value, str):
        yield where, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _strings(str(key), f"{where} key")
            yield from _strings(item, f"{where}.{key}")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _strings(item, f"{where}[{i}]")
