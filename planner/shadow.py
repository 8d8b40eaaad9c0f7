"""Detect a foreign package shadowing Nereus's ``transitions`` (the PyPI state-machine library).

``transitions`` is also the import name of a popular PyPI package. If it is installed into the same
environment, ``import transitions`` may load it instead of ours and fail in confusing ways later;
this check fails at import time with a message that says what to do.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType


class ShadowedPackageError(ImportError):
    pass


def require_nereus_transitions() -> ModuleType:
    mod = sys.modules.get("transitions") or importlib.import_module("transitions")
    if not getattr(mod, "__nereus__", False):
        where = getattr(mod, "__file__", None) or "<namespace package>"
        raise ShadowedPackageError(
            f"'import transitions' loaded {where}, which is not Nereus's transitions package. "
            "The PyPI state-machine library 'transitions' shadows it in this environment: "
            "uninstall it (pip uninstall transitions) or run Nereus in its own virtual environment."
        )
    return mod
