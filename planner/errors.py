"""Typed errors of the planner: every user-facing failure names the field and the allowed values."""

from __future__ import annotations


class NereusError(Exception):
    """Base class of every error Nereus raises on purpose."""


class SpecError(NereusError, ValueError):
    """A specification (preset name, layout, workload, cluster) is invalid.

    ``field`` names the offending input, ``allowed`` says what would be accepted.
    """

    def __init__(self, field: str, message: str, allowed: str | None = None) -> None:
        self.field = field
        self.allowed = allowed
        text = f"{field}: {message}"
        if allowed:
            text += f" (allowed: {allowed})"
        super().__init__(text)


class InfeasibleError(NereusError):
    """No plan fits: ``reasons`` lists, per model-stage, why (which GPU/stage, how many bytes over)."""

    def __init__(self, message: str, reasons: tuple[str, ...] = ()) -> None:
        self.reasons = reasons
        super().__init__(message + ("".join(f"\n  - {r}" for r in reasons)))


def unknown_preset(field: str, name: str, known: list[str] | tuple[str, ...]) -> SpecError:
    return SpecError(field, f"unknown preset {name!r}", ", ".join(sorted(known)))
