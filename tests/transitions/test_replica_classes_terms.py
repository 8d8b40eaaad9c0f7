"""transitions.replica_classes: terms pinned one by one (mutation survivors of the replica-class fast path)."""

from __future__ import annotations
