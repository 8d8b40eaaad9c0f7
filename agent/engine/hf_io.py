"""Hugging Face model directories in and out of the engine (``config.json`` + safetensors).

``read_hf_dir`` maps a Llama, Qwen2/Qwen2.5 or Qwen3 directory onto a ``ModelSpec`` and its weight files (one
``model.safetensors`` or shards listed in ``model.safetensors.index.json``); the engine's parameter
names are already the HF names, so the weights load by name (``agent.engine.model.load_safetensors``).
``save_hf_dir`` writes the actor back as a directory that ``transformers`` loads and generates with;
the directory appears whole or not at all (written under a temporary name, then renamed), and
tokenizer files of the source directory travel with it. ``full_state`` gathers a sharded stage
(TP x PP) onto one rank for that.

Llama 3.1's rope scaling (``rope_type: llama3``) is read into ``ModelSpec.rope_scaling`` and written
back. Qwen2's q/k/v biases are ``ModelSpec.qkv_bias``. What the engine's architecture cannot express is
refused by name, never approximated: Llama's ``attention_bias`` (an o_proj bias too) or MLP biases, another rope scaling (linear, dynamic, yarn, ...), partial rotary embeddings,
sliding-window attention, an activation other than SiLU.

Run: ``python -m agent.engine.hf_io DIR`` prints the ModelSpec read from DIR.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from agent.engine.tokenizer import HFTokenizer
from planner.errors import SpecError
from planner.hf_config import (  # re-exported: pure, the daemon reads them
    hf_config,
    spec_from_hf_config,
)
from planner.models import ModelSpec

# files of a model directory that are not weights or config and belong with an exported actor
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "chat_template.jinja")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, kw_only=True, slots=True)
class ExportConfig:
    """Periodic export of the actor as a HF directory: ``<dir>/step-<N>`` after every ``every_steps``
    steps (N = steps done), the newest ``keep`` kept, ``<dir>/latest`` a symlink to the newest."""

    dir: str
    every_steps: int
    dtype: str = "bfloat16"
    keep: int = 2

    def __post_init__(self) -> None:
        if self.every_steps < 1:
            raise SpecError("export.every_steps", f"must be >= 1, got {self.every_steps}")
        if self.keep < 1:
            raise SpecError("export.keep", f"must be >= 1, got {self.keep}")
        if self.dtype not in DTYPES:
            raise SpecError("export.dtype", f"unknown {self.dtype!r}", ", ".join(DTYPES))


@dataclass(frozen=True, slots=True)
class HFModel:
    """What a HF directory holds for the engine: the spec, its weight files, and the directory."""

    spec: ModelSpec
    weight_files: tuple[str, ...]
    path: Path


def weight_files(path: Path) -> tuple[str, ...]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (path / s).exists()]
        if missing:
            raise SpecError(str(index), f"lists shards that are not there: {missing}")
        return tuple(str(path / s) for s in shards)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise SpecError(str(path), "holds no *.safetensors weights (a .bin-only checkpoint must be converted)")
    return tuple(str(f) for f in files)


def read_hf_dir(path: str | Path) -> HFModel:
    """Spec and weight files of a HF model directory (nothing is loaded yet)."""
    p = Path(path)
    cfg_file = p / "config.json"
    if not cfg_file.is_file():
        raise SpecError(str(p), "is not a Hugging Face model directory (no config.json)")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SpecError(str(cfg_file), f"is not valid JSON: {e}") from None
    spec = spec_from_hf_config(cfg, name=p.resolve().name, where=str(cfg_file))  # "latest" -> its step
    return HFModel(spec=spec, weight_files=weight_files(p), path=p)


def save_hf_dir(path: str | Path, spec: ModelSpec, state: Mapping[str, torch.Tensor], *, dtype: str = "float32",
                tokenizer_from: str | Path | None = None, token_ids: Mapping[str, int | None] | None = None,
                max_position_embeddings: int | None = None) -> Path:
    """Write ``state`` (full tensors by HF name, LM head) as a HF directory at ``path``, atomically.

    The files go to a hidden sibling first and are synced to disk, then the sibling is renamed onto
    ``path``, so a reader never sees a partial export, even after a crash. An existing directory at
    ``path`` is moved aside first (POSIX cannot rename over a non-empty directory), so for an instant
    ``path`` is absent; periodic exports never replace one (``export_step``: a new name per step, and
    ``latest`` a symlink replaced atomically).
    """
    from safetensors.torch import save_file

    if dtype not in DTYPES:
        raise SpecError("export.dtype", f"unknown {dtype!r}", ", ".join(DTYPES))
    out = Path(path)
    names = [t.name for t in spec.tensors()]
    missing = [n for n in names if n not in state]
    if missing:
        raise SpecError("export", f"state lacks {missing[:3]}{'...' if len(missing) > 3 else ''}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        tensors = {n: state[n].detach().to("cpu", DTYPES[dtype]).contiguous() for n in names}
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = hf_config(spec, dtype=dtype, max_position_embeddings=max_position_embeddings, token_ids=token_ids)
        (tmp / "config.json").write_text(json.dumps(config, indent=1) + "\n")
        if tokenizer_from is not None:
            for f in TOKENIZER_FILES:
                if (Path(tokenizer_from) / f).is_file():
                    shutil.copy2(Path(tokenizer_from) / f, tmp / f)
        _sync_tree(tmp)
        old = None
        if out.exists():
            old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(out, old)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return out


def _sync_tree(path: Path) -> None:
    """fsync every file of ``path`` and the directory itself, so a rename after it publishes data."""
    for f in path.iterdir():
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def export_step(cfg: ExportConfig, steps_done: int, spec: ModelSpec, state: Mapping[str, torch.Tensor], *,
                tokenizer_from: str | Path | None = None, token_ids: Mapping[str, int | None] | None = None) -> Path:
    """Write ``<dir>/step-<steps_done>`` atomically, point ``latest`` at it (symlink renamed into
    place), and remove exports older than the newest ``keep``."""
    root = Path(cfg.dir)
    out = save_hf_dir(root / f"step-{steps_done:06d}", spec, state, dtype=cfg.dtype, tokenizer_from=tokenizer_from,
                      token_ids=token_ids)
    link = root / f".latest.tmp-{uuid.uuid4().hex[:8]}"
    os.symlink(out.name, link)
    os.replace(link, root / "latest")
    for old in sorted(root.glob("step-*"))[:-cfg.keep]:
        shutil.rmtree(old, ignore_errors=True)
    return out


def export_actor(cfg: ExportConfig | None, step: int, spec: ModelSpec, engine: Any, tok: Any) -> None:
    """After RL step ``step``, every ``cfg.every_steps`` steps: the actor's full weights (``engine``:
    actor-train's StageEngine), gathered onto rank 0 and written as a HF directory with the
    tokenizer's special ids (a HF tokenizer's own files copied beside them). Collective over
    actor-train's first replica and rank 0, like full_state; a no-op between exports."""
    if cfg is None or (step + 1) % cfg.every_steps:
        return
    state = full_state(engine)
    if state is None:
        return
    if isinstance(tok, HFTokenizer):
        export_step(cfg, step + 1, spec, state, tokenizer_from=str(tok.dir),
                    token_ids={"eos_token_id": tok.stop_ids[0], "pad_token_id": tok.pad_id})
    else:
        export_step(cfg, step + 1, spec, state,
                    token_ids={"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id})


def full_state(engine: Any, dst: int = 0) -> dict[str, torch.Tensor] | None:
    """Every full tensor of ``engine``'s model-stage (a ``StageEngine``), float32, on world rank ``dst``.

    Collective over the ranks of replica 0 and ``dst`` (others return None at once): TP shards are
    gathered within their group (``DTensor.full_tensor``), then TP rank 0 of the pipeline stage that
    holds a tensor sends it to ``dst``. Every rank walks ``spec.tensors()`` in the same order.
    """
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from transitions.geometry import tensor_stage

    spec, lay = engine.spec, engine.plan.layout
    local: dict[str, torch.Tensor] = dict(engine.module.named_parameters()) if engine.module is not None else {}
    if not dist.is_initialized():
        return {n: t.detach().float().clone() for n, t in local.items()}
    rank, replica0 = dist.get_rank(), engine.plan.gpu_sets[0]
    if rank != dst and rank not in replica0:
        return None
    out: dict[str, torch.Tensor] = {}
    for ts in spec.tensors(engine.head):
        holder = _holder(replica0, lay, tensor_stage(ts, spec, lay.pp))
        t = local.get(ts.name) if rank in replica0 else None
        if t is not None:
            t = (t.full_tensor() if isinstance(t, DTensor) else t).detach().float()
        if rank == holder:
            assert t is not None, f"{ts.name} not held on rank {rank}"
            if rank == dst:
                out[ts.name] = t.clone()
            else:
                dist.send(t.contiguous(), dst)
        elif rank == dst:
            buf = torch.empty(ts.shape)
            dist.recv(buf, holder)
            out[ts.name] = buf
    return out if rank == dst else None


def _holder(gpus: tuple[int, ...], lay: Any, stage: int) -> int:
    for i, g in enumerate(gpus):
        tp_rank, pp_rank = lay.coords(i)
        if tp_rank == 0 and pp_rank == stage:
            return int(g)
    raise AssertionError(f"no TP rank 0 on pipeline stage {stage} of {gpus}")


if __name__ == "__main__":
    print(read_hf_dir(sys.argv[1]).spec)
