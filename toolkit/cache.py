"""A small on-disk cache for what is slow to compute and never changes for the same inputs: model specs built on
the meta device and activation traces.

A hit needs no torch and no transformers import, so repeated estimates and plans of the same model start in a
fraction of a second. Keys hash the model's config.json text and every argument; entries also hash the code that
produced them and the installed torch / transformers versions, so a change to any of them is a miss, never a stale
answer. The code is found from the function that computes the value (`code=`): the source of its module and of
every toolkit module that module imports (at the top or inside a function), followed transitively. There is no list
of file names to keep up to date: a moved or a new module is covered as soon as it is imported. Set
TOOLKIT_CACHE_DIR to move it, TOOLKIT_NO_CACHE=1 to bypass it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

from toolkit.fileio import write_atomic

_IMPORT = re.compile(r"^[ \t]*(?:from[ \t]+(toolkit(?:\.\w+)*)[ \t]+import[ \t]+(\([^)]*\)|[\w \t,]+)"
                     r"|import[ \t]+(toolkit(?:\.\w+)*))", re.M)
"""`from toolkit.x import a, b` / `import toolkit.x`, at any indentation (imports inside functions count)."""


def enabled() -> bool:
    return os.environ.get("TOOLKIT_NO_CACHE", "") in ("", "0")


def cache_dir() -> Path:
    root = os.environ.get("TOOLKIT_CACHE_DIR")
    if root:
        return Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "toolkit"


@lru_cache(maxsize=None)
def _source_file(module: str) -> Path | None:
    """The source of a toolkit module (a package's __init__.py), found without importing it."""
    base = Path(__file__).resolve().parent.parent.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def code_closure(module: str) -> list[Path]:
    """The source files of `module` and of every toolkit module it imports, transitively."""
    seen: dict[str, Path] = {}
    todo = [module, __name__]  # and this module: the entries' format
    while todo:
        name = todo.pop()
        path = _source_file(name)
        if name in seen or path is None:
            continue
        seen[name] = path
        todo += _imported(path)
    return sorted(set(seen.values()))


@lru_cache(maxsize=None)
def _imported(path: Path) -> tuple[str, ...]:
    """The toolkit modules (and, for `from toolkit.x import a`, the names that may be modules) `path` imports."""
    found: list[str] = []
    for base, names, plain in _IMPORT.findall(path.read_text()):
        found.append(plain or base)
        if base:  # `from toolkit import cache`: the names may be modules
            found += [f"{base}.{n.split()[0]}" for n in names.strip("()").split(",") if n.strip()]
    return tuple(found)


@lru_cache(maxsize=None)
def installed_version(package: str) -> str | None:
    """The installed version of `package` (None when absent), read once per process: importlib.metadata parses the
    package's METADATA file on every call, and cache keys ask for it per candidate."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


@lru_cache(maxsize=None)
def fingerprint(module: str) -> str:
    """The code (module's closure) and library versions a value computed in `module` depends on."""
    if _source_file(module) is None:
        raise ValueError(f"the cache keys values by the toolkit module that computes them; {module} is not one")
    h = hashlib.sha256()
    for path in code_closure(module):
        h.update(path.read_bytes())
    for package in ("torch", "transformers"):
        h.update(f"{package}={installed_version(package) or 'none'}".encode())
    return h.hexdigest()[:16]


def _path(kind: str, key: Any, code: Callable[..., Any]) -> Path:
    digest = hashlib.sha256(json.dumps([fingerprint(code.__module__), key], sort_keys=True, default=str)
                            .encode()).hexdigest()
    return cache_dir() / kind / f"{digest[:32]}.json"


def get(kind: str, key: Any, *, code: Callable[..., Any], decode: Callable[[Any], Any] | None = None) -> Any | None:
    """The value stored for `key` by `code` (the function that computes it), passed through `decode`, or None: a
    missing, unreadable or corrupted entry (valid JSON with the wrong fields, say) is a miss, never an error; the
    caller computes and stores it again."""
    if not enabled():
        return None
    path = _path(kind, key, code)
    try:
        value = json.loads(path.read_text())
        return decode(value) if decode is not None else value
    except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError):
        return None


def put(kind: str, key: Any, value: Any, *, code: Callable[..., Any]) -> None:
    if not enabled():
        return
    path = _path(kind, key, code)
    try:
        write_atomic(path, json.dumps(value))
    except OSError:  # a read-only or full disk costs speed, never a result
        pass
