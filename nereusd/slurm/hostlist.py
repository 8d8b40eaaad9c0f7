"""Expand and compress Slurm host lists (``node[1-3,7],gpu-a01`` <-> names) without calling scontrol.

    >>> expand("node[1-3,07],login")
    ('node1', 'node2', 'node3', 'node07', 'login')
"""

from __future__ import annotations

import re

from planner.errors import SpecError

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def split_top_level(text: str, brackets: str = "[]") -> list[str]:
    """Split on commas that are not inside ``brackets`` (an opening and a closing character)."""
    opening, closing = brackets[0], brackets[1]
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == opening:
            depth += 1
        elif ch == closing:
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in (p.strip() for p in parts) if p]


def _expand_one(item: str) -> list[str]:
    open_at = item.find("[")
    if open_at < 0:
        return [item]
    close_at = item.find("]", open_at)
    if close_at < 0:
        raise SpecError("hostlist", f"unbalanced bracket in {item!r}")
    prefix, body, rest = item[:open_at], item[open_at + 1:close_at], item[close_at + 1:]
    names: list[str] = []
    for part in body.split(","):
        m = _RANGE.match(part.strip())
        if not m:
            raise SpecError("hostlist", f"bad range {part!r} in {item!r}", "N or N-M")
        lo_text, hi_text = m.group(1), m.group(2) or m.group(1)
        width = len(lo_text) if lo_text.startswith("0") else 0  # node[01-10] keeps zero padding
        for n in range(int(lo_text), int(hi_text) + 1):
            names.extend(prefix + str(n).zfill(width) + tail for tail in _expand_one(rest))
    return names


def expand(hostlist: str | None) -> tuple[str, ...]:
    """All host names of a Slurm host list, in Slurm's order; '' or None gives ()."""
    if not hostlist or hostlist in ("(null)", "None"):
        return ()
    return tuple(name for item in split_top_level(hostlist) for name in _expand_one(item))


def compress(names: tuple[str, ...] | list[str]) -> str:
    """A host list Slurm accepts for these names (plain comma list: valid and unambiguous)."""
    return ",".join(names)
