"""`nereusctl plan` and `python -m nereusd.demo` as a user runs them (real subprocesses)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CTL = Path(sys.executable).parent / "nereusctl"
PPO_STAGES = ("actor-gen", "ref-inf", "critic-inf", "reward-inf", "actor-train", "critic-train")


def ctl(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [str(CTL)] if CTL.exists() else [sys.executable, "-m", "nereusd.ctl"]
    return subprocess.run(cmd + ["plan", *args], cwd=ROOT, text=True, capture_output=True, timeout=120)


BASE = ("--model", "llama-3.1-8b", "--algo", "ppo", "--device", "h200", "--prompt-tokens", "1024")


def test_plan_table_at_1024_gpus() -> None:
    p = ctl(*BASE, "--gpus", "1024", "--response-tokens", "4096")
    assert p.returncode == 0, p.stderr
    for name in PPO_STAGES:
        assert name in p.stdout
    assert "predicted step latency" in p.stdout and "peak memory per GPU" in p.stdout
    assert "128 nodes x 8" in p.stdout


def test_plan_json_is_consistent() -> None:
    p = ctl(*BASE, "--gpus", "64", "--response-tokens", "2048", "--prompts-per-step", "256", "--json")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert [s["model_stage"] for s in d["stages"]] and {s["model_stage"] for s in d["stages"]} == set(PPO_STAGES)
    for s in d["stages"]:
        assert s["num_gpus"] == s["dp"] * s["tp"] * s["pp"] <= 64
        assert s["dp"] * s["micro_batch_size"] * s["grad_accum"] == 256  # global batch (1 mini-batch)
        assert 0 < s["peak_memory_bytes"] <= d["memory_capacity_bytes"]
        assert sum(s["breakdown_s"].values()) == pytest.approx(s["seconds"], rel=1e-6)
    assert d["step_latency_s"] == pytest.approx(sum(d["kind_seconds"].values()), rel=1e-9)
    assert d["max_peak_memory_bytes"] <= d["memory_capacity_bytes"]


def test_infeasible_exits_1_and_says_why() -> None:
    p = ctl("--model", "llama-3.3-70b", "--gpus", "8", "--response-tokens", "4096")
    assert p.returncode == 1
    assert "infeasible" in p.stderr and "bytes) over" in p.stderr
    assert "actor-train" in p.stderr or "critic-train" in p.stderr


@pytest.mark.parametrize("args,field", [
    (("--model", "llama-9b", "--gpus", "8", "--response-tokens", "10"), "model"),
    (("--model", "llama-3.1-8b", "--gpus", "0", "--response-tokens", "10"), "gpus"),
    (("--model", "llama-3.1-8b", "--algo", "dpo", "--gpus", "8", "--response-tokens", "10"), "algo"),
])
def test_bad_input_exits_2_naming_the_field(args: tuple[str, ...], field: str) -> None:
    p = ctl(*args)
    assert p.returncode == 2
    assert f"error: {field}:" in p.stderr
    if field != "gpus":  # presets list what would be accepted
        assert "allowed" in p.stderr


def test_demo_shows_plans_while_responses_grow() -> None:
    p = subprocess.run([sys.executable, "-m", "nereusd.demo"], cwd=ROOT, text=True, capture_output=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    rows = [line for line in p.stdout.splitlines() if line.strip()[:4].isdigit()]
    assert [int(r.split()[0]) for r in rows] == [1024, 2048, 3072, 4096, 6144, 8192]
    latencies = [float(r.split()[1]) for r in rows]
    assert latencies == sorted(latencies)  # longer responses, longer steps
    assert "OOM" in p.stdout  # the plan chosen at 1k tokens does not survive 8k
