"""Where the package's data lives: the model and GPU catalogs and the generated preset sets ship inside the
package (toolkit/catalog), so a wheel or a non-editable install has them. The top-level `presets/` of a checkout
is a link to the same folder, for browsing."""

from importlib.resources import files
from pathlib import Path

CATALOG_DIR = Path(str(files("toolkit") / "catalog"))
PRESETS_DIR = CATALOG_DIR
MODEL_CATALOG_DIR = CATALOG_DIR / "models"
GPU_CATALOG_FILE = CATALOG_DIR / "gpus.json"
SETS_DIR = CATALOG_DIR / "sets"
