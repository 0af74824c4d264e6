"""DeepSpeed's hostfile (`host slots=N` lines) as its launcher reads it (deepspeed.launcher.runner._parse_hostfile,
run on the file itself), and what a plan needs of it: read by `toolkit check` and by `toolkit launch`'s preflight.

DeepSpeed's parser accepts a host with slots=0 and hosts of unequal slots as long as each line matches; the
launcher then starts that many processes per host. A plan runs nodes x GPUs per node processes, the same number on
every node (accelerate's num_processes / num_machines, the grid's node-local groups), so per host: more than 0
slots, and every host the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from toolkit.errors import UserError


@dataclass(frozen=True)
class Host:
    name: str
    slots: int
    line: int
    """1-based line of the file that names it."""


def _refusal(lines: list[str]) -> str | None:
    """DeepSpeed's own refusal of these hostfile lines (None: it reads them)."""
    from deepspeed.launcher.runner import _parse_hostfile

    from toolkit.engines.readers import quiet_engines

    try:
        with quiet_engines():  # it logs the whole file at error level before raising
            _parse_hostfile(lines)
    except ValueError as exc:
        return str(exc)
    return None


def parse_hostfile(text: str, name: str) -> list[Host]:
    """The hosts of a hostfile's text, each with its line; UserError naming the line DeepSpeed's launcher refuses.

    Each line goes through DeepSpeed's parser alone (a blank or comment line is refused only as "empty", the same
    words as no line at all), so the line a refusal comes from is known; then the whole file, for what only the
    whole shows (a host named twice)."""
    from deepspeed.launcher.runner import _parse_hostfile

    from toolkit.engines.readers import quiet_engines

    empty = _refusal([])
    hosts: list[Host] = []
    for number, line in enumerate(text.splitlines(), 1):
        why = _refusal([line])
        if why == empty:
            continue  # a comment or blank line
        if why is not None:
            raise UserError(f"hostfile {name} line {number} is not `host slots=GPUS` (DeepSpeed's launcher refuses "
                            f"it): {line.strip()[:80]!r}; write one `host slots=GPUS` line per node")
        with quiet_engines():
            (host, slots), = _parse_hostfile([line]).items()
        earlier = next((h for h in hosts if h.name == host), None)
        if earlier is not None:
            raise UserError(f"hostfile {name} names host {host} twice (lines {earlier.line} and {number}); "
                            "DeepSpeed's launcher refuses that: give each host once")
        hosts.append(Host(host, int(slots), number))
    if not hosts:
        raise UserError(f"hostfile {name} names no host; write one `host slots=GPUS` line per node")
    why = _refusal(text.splitlines())
    if why is not None:  # a rule of a newer DeepSpeed that no single line shows
        raise UserError(f"hostfile {name}: DeepSpeed's launcher refuses it ({why})")
    return hosts


def read_hostfile(path: Path) -> list[Host]:
    """parse_hostfile of a file, read within the size limit (UserError for an unreadable one)."""
    from toolkit.fileio import read_bytes_limited

    try:
        text = read_bytes_limited(Path(path), "DeepSpeed host list").decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read hostfile {path} ({type(exc).__name__}); write `host slots=GPUS` lines") \
            from None
    return parse_hostfile(text, str(path))


def hostfile_problems(hosts: list[Host], name: str, *, world: int | None = None, nodes: int | None = None,
                      gpus_per_node: int | None = None) -> list[str]:
    """What a run of `world` processes (nodes x gpus_per_node when known) cannot use in these hosts: a host
    without slots, hosts of unequal slots, slots that do not add up to the world. One line each, with the fix."""
    out = []
    for host in hosts:
        if host.slots < 1:
            out.append(f"hostfile {name} line {host.line}: host {host.name} has slots={host.slots}; DeepSpeed's "
                       "launcher would start no process there (the slots of the others may still add up); give it "
                       f"slots={gpus_per_node or 'GPUS'} or remove the line")
    if out:
        return out
    slots = sum(h.slots for h in hosts)
    if world is not None and slots != world:
        from toolkit.engines.validate import divisors

        works = "; ".join(f"{d} host(s) x slots={world // d}" for d in divisors(world)[:12])
        grid = f" ({nodes} x {gpus_per_node})" if nodes and gpus_per_node else ""
        return [f"hostfile {name} gives {slots} slots on {len(hosts)} host(s) but the plan runs on {world} "
                f"GPUs{grid}; give {works}"]
    if len({h.slots for h in hosts}) > 1:
        shown = ", ".join(f"{h.name} slots={h.slots} (line {h.line})" for h in hosts)
        want = world // len(hosts) if world and world % len(hosts) == 0 else None
        out.append(f"hostfile {name} gives hosts unequal slots ({shown}); the plan runs the same number of "
                   f"processes on every node: give every host slots={want or 'GPUS'}")
    return out
