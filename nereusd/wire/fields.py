"""The wire's bounded field types: the documented alphabet and ranges every message field is held to.

nereusd.wire.protocol (the messages) and nereusd.wire.job_models (what ``job-add`` stores) build on
them; nothing here imports more than pydantic.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, Strict, StringConstraints

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
NAME_RULE = "1-64 characters of letters, digits, '_', '.', '-', starting with a letter or digit"
MAX_INT = 2**63 - 1  # SQLite INTEGER
MAX_SECONDS = 1e7  # ~115 days: longer than any step, stage or transition
MAX_BYTES = 2**56  # 64 PiB: more than any device, node or transition holds
MAX_TOKENS = 1e7
MAX_ITEMS = 256  # devices per node, workers per node, entries of a per-stage/per-device map

# Strict: no "5" for 5, no True for 1; floats take ints but never NaN/inf (1e400 parses to inf).
Name = Annotated[str, Strict(), StringConstraints(pattern=NAME_PATTERN)]
Key = Annotated[str, Strict(), StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}$")]
Text = Annotated[str, Strict(), StringConstraints(max_length=4096)]
Count = Annotated[int, Strict(), Field(ge=0, le=MAX_INT)]
Id = Annotated[int, Strict(), Field(ge=1, le=MAX_INT)]
Bytes = Annotated[int, Strict(), Field(ge=0, le=MAX_BYTES)]
Seconds = Annotated[float, Strict(), Field(ge=0, le=MAX_SECONDS, allow_inf_nan=False)]
Tokens = Annotated[float, Strict(), Field(ge=0, le=MAX_TOKENS, allow_inf_nan=False)]
SlurmJobId = Annotated[str, Strict(), StringConstraints(pattern=r"^[0-9][0-9_+]{0,31}$")]
Positive = Annotated[int, Strict(), Field(ge=1, le=1 << 24)]


class Args(BaseModel):
    """An admin op's arguments or a part of one: unknown fields refused, the parsed value frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True)
