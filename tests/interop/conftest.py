"""The interop harness's modules are imported by plain name (they are not a package)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
