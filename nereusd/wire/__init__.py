"""The torch-free wire layer that nereusd and the agents share: message models (``protocol``), the
CURVE client (``client``), key bundles (``keys``) and structured logging (``logs``). Cheap to
import; the only part of nereusd that agent/ may import (tests/foundation/test_imports.py)."""
