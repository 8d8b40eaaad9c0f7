"""The engine CLI's progress display: one line per RL step while it runs (step, reward, KL, length,
time per step, elapsed and left); on a terminal the line is rewritten in place."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO


class Progress:
    def __init__(self, total: int, stream: TextIO | None = None) -> None:
        self.total, self.stream = total, stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.t0 = time.monotonic()

    def line(self, step: int, result: Any) -> str:
        done = step + 1
        elapsed = time.monotonic() - self.t0
        left = elapsed / done * (self.total - done)
        st = result.stats
        kl = f"  kl {st.actor['kl'] / st.actor['weight']:.4f}" if st and st.actor.get("weight") else ""
        return (f"step {done:>{len(str(self.total))}}/{self.total}  reward {result.mean_score:+.4f}{kl}  "
                f"len {result.mean_response_tokens:5.1f}  {result.seconds:6.2f} s/step  "
                f"elapsed {elapsed:5.0f} s  left {left:5.0f} s")

    def update(self, step: int, result: Any) -> None:
        text = self.line(step, result)
        if self.tty:
            self.stream.write("\r\x1b[2K" + text + ("\n" if step + 1 == self.total else ""))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()
