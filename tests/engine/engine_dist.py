"""Spawn ``world`` real processes joined by gloo and collect each one's return value (tests only)."""

from __future__ import annotations

from typing import Any

from agent.engine.launch import run_local


def run_workers(fn: Any, world: int, *args: Any, timeout_s: float = 240.0) -> list[Any]:
    return run_local(fn, world, *args, timeout_s=timeout_s)
