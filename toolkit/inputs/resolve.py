"""Resolving a model name: a toolkit catalog name, a local folder or config.json, or a hub id, as the planner, the
emitted scripts and the training run each need it."""

from __future__ import annotations

from pathlib import Path


def catalog_hub_id(name: str) -> str | None:
    """The hub id of a toolkit catalog entry (presets/models/NAME.json "_hub_id"), None for any other name."""
    import json

    from toolkit.paths import MODEL_CATALOG_DIR

    entry = MODEL_CATALOG_DIR / f"{name.lower()}.json"
    if not entry.is_file():
        return None
    hub_id = json.loads(entry.read_text()).get("_hub_id")
    return hub_id if isinstance(hub_id, str) and hub_id else None


def loadable_model(name: str) -> str:
    """A plan's model name as from_pretrained takes it: a local folder (or config.json) as an absolute path, a
    catalog name as its hub id, anything else unchanged (a hub id). launch.sh and slurm.sbatch name this."""
    path = Path(name).expanduser()
    if path.exists():
        return str(path.resolve())
    return catalog_hub_id(name) or name
