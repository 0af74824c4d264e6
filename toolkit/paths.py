"""Where the repository's data lives (catalogs and presets ship next to the package)."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PRESETS_DIR = REPO_ROOT / "presets"
MODEL_CATALOG_DIR = PRESETS_DIR / "models"
GPU_CATALOG_FILE = PRESETS_DIR / "gpus.json"
