"""Resolving a model name, one rule for every command: what `toolkit estimate / plan` read, what plan.json records,
what the emitted scripts and `toolkit launch` load, and what toolkit.train trains.

Precedence (locate_model): an existing local path (a model folder or a config.json, `~` expanded) first, then a
toolkit catalog name (toolkit/catalog/models/NAME.json, any case), then a hub id. A folder you point at is the model
you mean, as from_pretrained also prefers a local folder over the hub: a folder that happens to be spelled like a
catalog entry is read as that folder, never silently replaced by the catalog's config.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal


@dataclass(frozen=True)
class ModelLocation:
    name: str
    """The name as given."""
    kind: Literal["local", "catalog", "hub"]
    path: Path | None = None
    """local: the folder or file (absolute); catalog: the catalog entry; hub: None."""


def catalog_entry(name: str) -> Path | None:
    """The catalog file of `name` (case-insensitive), or None."""
    from toolkit.paths import MODEL_CATALOG_DIR

    entry = MODEL_CATALOG_DIR / f"{name.lower()}.json"
    return entry if entry.is_file() else None


def locate_model(name: str) -> ModelLocation:
    """Where `name` comes from, by the one precedence (module docstring): local path, catalog, hub."""
    path = Path(name).expanduser()
    if path.exists():
        return ModelLocation(name, "local", path.resolve())
    entry = catalog_entry(name)
    if entry is not None:
        return ModelLocation(name, "catalog", entry)
    return ModelLocation(name, "hub")


def catalog_hub_id(name: str) -> str | None:
    """The hub id of a toolkit catalog entry (presets/models/NAME.json "_hub_id"), None for any other name."""
    entry = catalog_entry(name)
    if entry is None:
        return None
    hub_id = json.loads(entry.read_text()).get("_hub_id")
    return hub_id if isinstance(hub_id, str) and hub_id else None


def loadable_model(name: str) -> str:
    """A plan's model name as from_pretrained takes it: a local folder (or config.json) as an absolute path, a
    catalog name as its hub id, anything else unchanged (a hub id). launch.sh and slurm.sbatch name this."""
    where = locate_model(name)
    if where.kind == "local":
        return str(where.path)
    return (catalog_hub_id(name) if where.kind == "catalog" else None) or name


def recorded_model(name: str | None) -> str | None:
    """The model name plan.json records: a local path as an absolute path (a plan launched from another folder
    still finds it); catalog names and hub ids as given."""
    if not name:
        return name
    where = locate_model(name)
    return str(where.path) if where.kind == "local" else name


def catalog_name_of_hub_id(hub_id: str) -> str | None:
    """The catalog entry whose "_hub_id" is `hub_id` (case as the hub spells it), None for any other id. Its
    config ships in the package: a config lookup for it needs no network (the hub's config.json is the entry
    without its "_" keys)."""
    from toolkit.paths import MODEL_CATALOG_DIR

    if hub_id.count("/") != 1 or locate_model(hub_id).kind != "hub":
        return None
    for entry in sorted(MODEL_CATALOG_DIR.glob("*.json")):
        try:
            if json.loads(entry.read_text()).get("_hub_id") == hub_id:
                return entry.stem
        except (OSError, ValueError):
            continue
    return None
