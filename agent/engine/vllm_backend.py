"""vLLM rollout backend (GPU only, optional extra ``nereus[vllm]``): same interface as the torch
backend (``generate(prompts, seeds, params) -> Rollout``), weights pushed from the actor after each
update, engine memory released between generation and training when colocated (sleep mode).

vLLM is imported lazily, so this module imports on machines without it; ``hf_config`` (the HF
``config.json`` a ModelSpec needs) is pure and tested everywhere. Weight names are the HF names of
``ModelSpec.tensors()``, which is what vLLM's ``load_weights`` expects.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from agent.engine import hf_io
from agent.engine.rollout import Rollout, SamplingParams, left_pad
from planner.errors import SpecError
from planner.models import ModelSpec


def hf_config(spec: ModelSpec, max_position_embeddings: int = 4096, dtype: str = "bfloat16") -> dict[str, Any]:
    """The Hugging Face ``config.json`` of ``spec`` (Llama, or Qwen3 when it normalises q/k): the
    engine's one writer of it, ``agent.engine.hf_io.hf_config``, in vLLM's default dtype."""
    return hf_io.hf_config(spec, dtype=dtype, max_position_embeddings=max_position_embeddings)


def write_model_dir(spec: ModelSpec, path: str | Path, weights: dict[str, torch.Tensor] | None = None) -> Path:
    """A directory vLLM can open: config.json, and model.safetensors when ``weights`` are given."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf_config(spec), indent=1))
    if weights is not None:
        from safetensors.torch import save_file

        save_file({k: v.detach().contiguous().cpu() for k, v in weights.items()}, str(out / "model.safetensors"))
    return out


def _load_weights_on_worker(worker: Any, weights: list[tuple[str, torch.Tensor]]) -> int:
    """Runs inside each vLLM worker (``collective_rpc`` passes the worker as the first argument)."""
    worker.model_runner.model.load_weights(weights=weights)
    return len(weights)


class VLLMBackend:
    """One vLLM engine per actor-gen replica; its TP degree is the replica's."""

    def __init__(self, spec: ModelSpec, model_dir: str | Path, *, tp: int = 1, seed: int = 0,
                 gpu_memory_utilization: float = 0.4, colocated: bool = True, dtype: str = "bfloat16") -> None:
        try:
            vllm = importlib.import_module("vllm")
        except ImportError as e:  # the optional extra is missing
            raise SpecError("rollout.backend", "vllm is not installed (pip install 'nereus[vllm]')",
                            "torch, vllm") from e
        self._vllm = vllm
        self.spec = spec
        load_format = "auto" if (Path(model_dir) / "model.safetensors").exists() else "dummy"
        self.llm = vllm.LLM(model=str(model_dir), skip_tokenizer_init=True, tensor_parallel_size=tp, seed=seed,
                            dtype=dtype, gpu_memory_utilization=gpu_memory_utilization,
                            enable_sleep_mode=colocated, load_format=load_format, enforce_eager=True)
        self.colocated = colocated
        self.asleep = False

    def push_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load the actor's current weights (full tensors, HF names) into the engine."""
        weights = [(n, t.detach()) for n, t in named]
        if self.asleep:
            self.wake()
        counts = self.llm.collective_rpc(_load_weights_on_worker, args=(weights,))
        return int(counts[0])

    def release(self) -> None:
        """Free the engine's GPU memory (weights offloaded, KV cache dropped) before training."""
        if self.colocated and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def generate(self, prompts: list[list[int]], seeds: list[int], params: SamplingParams, *,
                 prompt_tokens: int, pad_id: int) -> Rollout:
        self.wake()
        vllm = self._vllm
        requests = [{"prompt_token_ids": p} for p in prompts]
        sps = [vllm.SamplingParams(n=1, max_tokens=params.max_new_tokens, seed=s, logprobs=0,
                                   temperature=0.0 if params.greedy else params.temperature,
                                   top_p=params.top_p, stop_token_ids=list(params.stop_ids),
                                   detokenize=False) for s in seeds]
        outs = self.llm.generate(requests, sps, use_tqdm=False)
        ids, mask = left_pad(prompts, prompt_tokens, pad_id)
        b, r = len(prompts), params.max_new_tokens
        tokens = torch.cat([ids, torch.full((b, r), pad_id, dtype=torch.long)], dim=1)
        attn = torch.cat([mask, torch.zeros((b, r), dtype=torch.long)], dim=1)
        logprobs = torch.zeros(b, prompt_tokens + r)
        for i, out in enumerate(outs):
            comp = out.outputs[0]
            toks = list(comp.token_ids)[:r]
            tokens[i, prompt_tokens:prompt_tokens + len(toks)] = torch.tensor(toks, dtype=torch.long)
            attn[i, prompt_tokens:prompt_tokens + len(toks)] = 1
            for j, (tok, lp) in enumerate(zip(toks, comp.logprobs or [])):
                logprobs[i, prompt_tokens - 1 + j] = float(lp[tok].logprob)
        action = torch.zeros(b, prompt_tokens + r)
        action[:, prompt_tokens - 1:-1] = attn[:, prompt_tokens:].float()
        return Rollout(tokens=tokens, attention_mask=attn, action_mask=action, logprobs=logprobs,
                       prompt_tokens=prompt_tokens)
