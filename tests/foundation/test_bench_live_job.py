"""bench/live_job.py in its quickest mode prints one JSON document with every figure it promises: per
transition kind live vs L_tran, vs raw p2p and vs checkpoint/restart, and the step-time overhead under
the driver; every ratio finite and > 0. (~40 s on 2 idle cores: it spawns 10 worker processes.)"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


@pytest.mark.timeout(240)  # a loaded shared machine starts processes slowly
def test_quick_live_job_bench_reports_every_figure() -> None:
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "live_job.py"), "--quick"], cwd=ROOT,
                         capture_output=True, text=True, timeout=230)
    assert run.returncode == 0, run.stderr[-4000:]
    doc = json.loads(run.stdout)  # stdout is the JSON alone
    assert doc["benchmark"] == "live_job" and doc["quick"] is True
    assert {"machine", "cases", "ratios", "notes", "step_overhead"} <= set(doc)
    assert doc["cases"], "no transition case"
    for case in doc["cases"]:
        for key in ("live_s", "L_tran_s", "bytes_moved", "live_Bps", "raw_p2p_Bps", "restart_s",
                    "restart_over_live", "live_over_L_tran", "live_Bps_over_raw_p2p", "samples"):
            assert key in case, (case["case"], key)
        assert case["bytes_moved"] > 0 and case["restart_s"] > case["live_s"] > 0
    over = doc["step_overhead"]
    assert over["engine_alone_step_s_median"] > 0 and over["under_driver_step_s_median"] > 0
    assert isinstance(over["meets_3pct"], bool)
    assert len(doc["ratios"]) == 4 * len(doc["cases"]) + 1
    for name, ratio in doc["ratios"].items():
        assert math.isfinite(ratio) and ratio > 0, (name, ratio)
