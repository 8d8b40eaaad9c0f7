"""A user's own model under the daemon: a job file whose ``[model] path`` is a Hugging Face directory
(a tiny Qwen2: q/k/v biases, its own BPE tokenizer) runs through ``python -m nereusd.live --acts none``.
The daemon plans the directory's architecture (read from its config.json, no preset), the driver
trains it on the workers, and the state the job checkpoints is that architecture, started from the
directory's weights (the frozen reference equals the safetensors file bit for bit)."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from agent.engine.hf_io import save_hf_dir
from agent.engine.model import build_decoder, load_safetensors
from planner.models import ModelSpec
from tests.engine.test_tokenizer import make_tokenizer_dir

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(600),
              pytest.mark.xdist_group("hf-model-job"),
              # dcp.load without a process group reads every shard in this process: what is meant here
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")]
ROOT = Path(__file__).resolve().parents[2]
SPEC = ModelSpec(name="m", num_layers=2, hidden_size=64, num_attention_heads=4, num_kv_heads=2, head_dim=16,
                 ffn_hidden_size=96, vocab_size=416, qkv_bias=True, rope_theta=1e6, rms_norm_eps=1e-6)
STEPS = 4


def _job(tmp_path: Path) -> Path:
    model_dir = make_tokenizer_dir(tmp_path / "qwen2-tiny", chat_template=False)
    save_hf_dir(tmp_path / "staging", SPEC, build_decoder(SPEC, seed=9).state_dict())
    for f in (tmp_path / "staging").iterdir():
        f.rename(model_dir / f.name)  # the weights beside the tokenizer, as on the Hub
    text = (ROOT / "etc" / "jobs" / "live.toml").read_text()
    assert 'preset = "tiny-byte"' in text and "steps = 20" in text
    job = tmp_path / "job.toml"
    job.write_text(text.replace('preset = "tiny-byte"', 'path = "qwen2-tiny"').replace("steps = 20", f"steps = {STEPS}"))
    return job


def _ref_tensor(ckpt: Path, name: str, like: torch.Tensor) -> torch.Tensor:
    import torch.distributed.checkpoint as dcp

    out = {f"ref-inf/{name}/param": torch.empty_like(like)}
    dcp.load(out, checkpoint_id=str(ckpt))  # no process group: one reader takes every shard
    return out[f"ref-inf/{name}/param"]


def test_a_hf_directory_job_is_planned_trained_and_checkpointed(tmp_path: Path) -> None:
    job, out = _job(tmp_path), tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "nereusd.live", "--job-file", str(job), "--steps", str(STEPS),
                           "--acts", "none", "--out", str(out), "--timeout-s", "400"],
                          cwd=ROOT, capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    report = json.loads((out / "report.json").read_text())
    assert [s["step"] for s in report["steps"]] == list(range(STEPS))  # --acts none: the job's own steps
    assert report["acts"] == []
    # the daemon stored and planned the directory's architecture, not a preset
    db = sqlite3.connect(next((out / "state").glob("*.db")))
    spec = json.loads(db.execute("SELECT spec FROM jobs WHERE job_id = 'live'").fetchone()[0])
    assert spec["model"]["qkv_bias"] is True and spec["model"]["vocab_size"] == 416, spec["model"]
    assert {s["model_stage"] for s in report["plan"]["stages"]} >= {"actor-train", "actor-gen"}
    # the checkpointed state is that architecture, started from the directory's weights
    ckpts = sorted(p for p in (out / "checkpoints").iterdir() if (p / "COMMITTED").exists())
    assert ckpts, list((out / "checkpoints").iterdir())
    files = [str(p) for p in (tmp_path / "qwen2-tiny").glob("*.safetensors")]
    for name in ("model.layers.1.self_attn.v_proj.bias", "model.embed_tokens.weight"):
        want = load_safetensors(files, [name])[name]
        assert torch.equal(_ref_tensor(ckpts[-1], name, want), want), name
