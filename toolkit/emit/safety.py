"""What may reach an emitted script, comment, hostfile or config: checked before anything is written.

Every plan value that a script uses is shell-quoted where it is written (toolkit.emit.launch); this module refuses
what quoting cannot make safe or what would make the files wrong: control characters (a newline ends a `#`
comment or an `#SBATCH` line and starts a command), strategy / precision / optimizer / attention names the
engines do not know, a layer class that is not a Python name, host names that are not host names.
"""

from __future__ import annotations

import re
from dataclasses import asdict
from typing import Any

from toolkit.errors import UserError
from toolkit.plan import Plan

CONTROL_CHARACTERS = re.compile(r"[\x00-\x1f\x7f]")
HOST_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
"""RFC 1123 host names (letters, digits, '-', '.'), plus '_' which clusters use in node names."""
PYTHON_NAMES = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(,\s*[A-Za-z_][A-Za-z0-9_]*)*")
"""fsdp_transformer_layer_cls_to_wrap: one class name or a comma-separated list (accelerate splits on ',')."""


def check_plan_for_emit(plan: Plan) -> None:
    """Refuse a plan.json whose values would make wrong or unsafe files (UserError: one line, exit 2)."""
    from toolkit.job import ATTENTIONS, OPTIMIZERS, PRECISIONS, check_choice
    from toolkit.strategy import parse_strategy

    for where, value in _strings(asdict(plan), "plan"):
        if CONTROL_CHARACTERS.search(value):
            raise UserError(f"{where} holds a control character ({value[:40]!r}); plan.json values end up in "
                            "scripts and comments: remove it (re-plan, or edit plan.json)")
    try:
        strategy = parse_strategy(plan.strategy)
    except UserError as exc:
        raise UserError(f"plan.json strategy: {exc}") from None
    derived = {"engine": strategy.engine, "zero_stage": strategy.zero_stage,
               "offload_optimizer": strategy.offload_optimizer, "offload_params": strategy.offload_params,
               "fsdp_mode": strategy.fsdp_mode}
    for key, wanted in derived.items():
        if getattr(plan, key) != wanted:
            raise UserError(f"plan.json {key} {getattr(plan, key)!r} contradicts strategy {plan.strategy} "
                            f"({key} {wanted!r}); fix one of them or re-plan")
    check_choice("plan.json precision", plan.precision, PRECISIONS)
    check_choice("plan.json optimizer", plan.optimizer, OPTIMIZERS)
    check_choice("plan.json attention", plan.attention, ATTENTIONS)
    if not PYTHON_NAMES.fullmatch(plan.layer_class):
        raise UserError(f"plan.json layer_class {plan.layer_class!r} is not a Python class name (e.g. "
                        "LlamaDecoderLayer); re-plan from the model's config")


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
