"""A small on-disk cache for what is slow to compute and never changes for the same inputs: model specs built on
the meta device and activation traces.

A hit needs no torch and no transformers import, so repeated estimates and plans of the same model start in a
fraction of a second. Keys hash the model's config.json text and every argument; entries also hash the code that
produced them (toolkit's tracer and model-spec sources) and the installed torch / transformers versions, so a
change to any of them is a miss, never a stale answer. Set TOOLKIT_CACHE_DIR to move it, TOOLKIT_NO_CACHE=1 to
bypass it.
"""

from __future__ import annotations

import hashlib
import json
import os
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Any

from toolkit.fileio import write_atomic

_CODE_FILES = ("estimate/tracer.py", "inputs/modelspec.py", "estimate/activations.py", "cache.py", "inputs/lora.py",
               "inputs/decoder_parts.py")


def enabled() -> bool:
    return os.environ.get("TOOLKIT_NO_CACHE", "") in ("", "0")


def cache_dir() -> Path:
    root = os.environ.get("TOOLKIT_CACHE_DIR")
    if root:
        return Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "toolkit"


@lru_cache(maxsize=1)
def fingerprint() -> str:
    """The code and library versions a cached value depends on."""
    h = hashlib.sha256()
    here = Path(__file__).parent
    for name in _CODE_FILES:
        h.update((here / name).read_bytes())
    for package in ("torch", "transformers"):
        try:
            h.update(f"{package}={metadata.version(package)}".encode())
        except metadata.PackageNotFoundError:
            h.update(f"{package}=none".encode())
    return h.hexdigest()[:16]


def _path(kind: str, key: Any) -> Path:
    digest = hashlib.sha256(json.dumps([fingerprint(), key], sort_keys=True, default=str).encode()).hexdigest()
    return cache_dir() / kind / f"{digest[:32]}.json"


def get(kind: str, key: Any) -> Any | None:
    if not enabled():
        return None
    try:
        return json.loads(_path(kind, key).read_text())
    except (OSError, ValueError):
        return None


def put(kind: str, key: Any, value: Any) -> None:
    if not enabled():
        return
    try:
        write_atomic(_path(kind, key), json.dumps(value))
    except OSError:  # a read-only or full disk costs speed, never a result
        pass
