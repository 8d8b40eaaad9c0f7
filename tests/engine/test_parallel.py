"""TP=2, PP=2 and TP=2 x PP=2 (gloo, real processes) give the single-process loss, gradients,
inference outputs and greedy tokens; DTensor local shards equal transitions.geometry.tp_slice."""

from __future__ import annotations

import pytest
import torch
from engine_dist import run_workers

from agent.engine.losses import ActorLoss, CriticLoss, pack, token_logprobs
from agent.engine.model import build_decoder
from agent.engine.parallel import PipelineRunner, StageEngine
from agent.engine.rollout import SamplingParams, generate
from planner.models import Head, ModelSpec
from planner.plan import Layout, StagePlan
from transitions.geometry import tp_slice

SPEC = ModelSpec(name="t", num_layers=4, hidden_size=64, num_attention_heads=4, num_kv_heads=2, head_dim=16,
                 ffn_hidden_size=128, vocab_size=272, rope_theta=10_000.0)
# Qwen2's shape: q/k/v biases, split over TP with their projections' rows
SPEC_BIAS = ModelSpec(name="t-bias", num_layers=4, hidden_size=64, num_attention_heads=4, num_kv_heads=2, head_dim=16,
                      ffn_hidden_size=128, vocab_size=272, rope_theta=10_000.0, qkv_bias=True)
B, T, MBS, ACCUM = 8, 12, 2, 4


def batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 256, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, :3] = 0
    mask[5, :1] = 0
    action = torch.zeros(B, T)
    action[:, 5:-1] = 1.0
    weight = action / action.sum()
    nxt = torch.cat([tokens[:, 1:], tokens[:, :1] * 0], 1)
    actor_target = pack(nxt, torch.randn(B, T, generator=g) * 0.1 - 5.5, torch.randn(B, T, generator=g),
                        torch.randn(B, T, generator=g) * 0.1 - 5.5, weight)
    critic_target = pack(torch.randn(B, T, generator=g) * 0.1, torch.randn(B, T, generator=g), weight)
    return {"tokens": tokens, "mask": mask, "nxt": nxt, "actor": actor_target, "critic": critic_target}


def run_layout(rank: int, world: int, tp: int, pp: int, bias: bool = False) -> dict[str, object]:
    spec = SPEC_BIAS if bias else SPEC
    lay = Layout(tp, pp)
    plan = StagePlan(model_stage="actor-train", layout=lay, gpu_sets=(tuple(range(lay.size)),),
                     micro_batch_size=MBS, grad_accum=ACCUM)
    d = batch()
    out: dict[str, object] = {}
    for head in (Head.LM, Head.VALUE):
        eng = StageEngine("s", spec, head, plan, seed=3, lr=1e-3)
        loss_fn = ActorLoss(clip=0.2, kl_coef=0.1) if head is Head.LM else CriticLoss(clip=0.2)
        target = d["actor"] if head is Head.LM else d["critic"]

        def out_fn(y: torch.Tensor, e: torch.Tensor, head: Head = head) -> torch.Tensor:
            return token_logprobs(y, e) if head is Head.LM else y

        fwd = eng.forward(d["tokens"], d["mask"], d["nxt"], out_fn)
        loss = eng.backward(d["tokens"], d["mask"], target, loss_fn)
        grads, shards_ok = {}, True
        assert eng.module is not None
        full = build_decoder(spec, head, seed=3).state_dict()
        specs = {t.name: t for t in spec.tensors(head)}
        for n, p in eng.module.named_parameters():
            g = p.grad
            grads[n] = (g.full_tensor() if hasattr(g, "full_tensor") else g).clone()  # clone waits: clipping writes next
        for n, local in eng.local_tensors():
            assert eng.coord is not None
            want = full[n][tp_slice(specs[n], spec, tp, eng.coord.tp_rank)]
            shards_ok &= bool(torch.equal(local, want))
        # global-norm clipping over DTensor shards (TP) and plain replicated parameters (norms, heads)
        eng.max_grad_norm = 1e-3
        norm = eng.clip_grads()
        clipped = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                   for n, p in eng.module.named_parameters()}
        assert eng.optimizer is not None
        eng.optimizer.step()  # AdamW on sharded DTensor and plain parameters alike
        updated = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                   for n, p in eng.module.named_parameters()}
        out[head.value] = {"fwd": fwd, "loss": loss, "grads": grads, "shards_ok": shards_ok, "norm": norm,
                           "clipped": clipped, "updated": updated}
        if head is Head.LM:
            prompts = [[257, 50 + i, 51, 52 + i][: 2 + i % 3] for i in range(4)]
            roll = generate(PipelineRunner(eng), prompts, [0] * 4, SamplingParams(max_new_tokens=6, greedy=True),
                            prompt_tokens=4, pad_id=256)
            out["greedy"] = roll.tokens
            out["greedy_logprobs"] = roll.logprobs
    return out


def reference(bias: bool = False) -> dict[str, object]:
    return run_layout(0, 1, 1, 1, bias)


def merged(results: list[dict[str, object]], key: str) -> dict[str, torch.Tensor]:
    grads: dict[str, torch.Tensor] = {}
    for r in results:
        grads.update(r[key]["grads"])  # type: ignore[index]
    return grads


@pytest.mark.multiprocess
@pytest.mark.parametrize(("tp", "pp", "bias"), [(2, 1, False), (1, 2, False), (2, 2, False), (2, 2, True)],
                         ids=["tp2", "pp2", "tp2xpp2", "tp2xpp2-qkv-bias"])
def test_layout_matches_single_process(tp: int, pp: int, bias: bool) -> None:
    ref = reference(bias)
    if bias:  # the biases are parameters that train
        assert any(n.endswith("q_proj.bias") for n in ref["lm"]["grads"])  # type: ignore[index]
    results = run_workers(run_layout, tp * pp, tp, pp, bias)
    for head in ("lm", "value"):
        want = ref[head]
        loss = sum(r[head]["loss"] for r in results) / tp  # each TP rank of the last stage reports it
        assert loss == pytest.approx(want["loss"], rel=1e-5, abs=1e-6)
        got = merged(results, head)
        assert set(got) == set(want["grads"])
        for n, g in got.items():
            torch.testing.assert_close(g, want["grads"][n], rtol=1e-4, atol=1e-6, msg=n)
        clipped, updated = {}, {}
        for r in results:
            torch.testing.assert_close(r[head]["fwd"], want["fwd"], rtol=1e-5, atol=1e-5)
            assert r[head]["shards_ok"]
            assert r[head]["norm"] == pytest.approx(want["norm"], rel=1e-5)
            clipped.update(r[head]["clipped"])
            updated.update(r[head]["updated"])
        assert want["norm"] > 1e-3  # so clipping really scaled the gradients
        for n, g in clipped.items():
            torch.testing.assert_close(g, want["clipped"][n], rtol=1e-4, atol=1e-9, msg=n)
        for n, w in updated.items():
            torch.testing.assert_close(w, want["updated"][n], rtol=1e-5, atol=1e-6, msg=n)
    for r in results:
        assert torch.equal(r["greedy"], ref["greedy"])
        # the sampled tokens' log-probs too: every stage samples from the last stage's real logits
        torch.testing.assert_close(r["greedy_logprobs"], ref["greedy_logprobs"], rtol=1e-5, atol=1e-5)
