"""One model-stage on this process under its ``planner.plan.StagePlan`` (TP x PP per unit, DP units).

- TP: ``torch.distributed.tensor.parallel.parallelize_module`` with column-wise q/k/v/gate/up and the
  LM head, row-wise o/down, and a vocabulary-parallel (row-wise) embedding; norms and the value head
  stay plain replicated parameters. Shards equal ``transitions.geometry.tp_slice``.
- PP: ``torch.distributed.pipelining`` stages holding ``transitions.geometry.stage_layers``; 1F1B
  for training, a forward-only GPipe schedule for inference and generation.
- DP: replicas hold whole units (ZeRO-0); gradients are summed over DP in one flat buffer.

GPU ids in the plans are world ranks (one worker per GPU). Every rank of the world constructs every
``StageEngine`` and calls every collective method
(process groups are created collectively); ranks outside the stage take part only in the final
all-reduce that hands each result to every rank, so the driver loop is plain SPMD. Per-token losses
are pre-weighted by the global token count (``agent.engine.losses``), so micro-batch losses sum, and
the loss and gradients do not depend on DP, micro-batch size or the pipeline schedule.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)
from torch.profiler import record_function

from agent.engine.measure import DP_ALLREDUCE_RANGE, GATHER_RANGE
from agent.engine.model import Decoder, KVCache, build_decoder
from planner.errors import SpecError
from planner.models import Head, ModelSpec
from planner.plan import StagePlan
from transitions.geometry import stage_layers

OutFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (stage output, per-row extra) -> [B, T]


@dataclass(frozen=True, slots=True)
class Coord:
    replica: int
    tp_rank: int
    pp_rank: int


def tp_plan(model: Decoder) -> dict[str, ParallelStyle]:
    """The DTensor plan of one (stage) decoder: Megatron-style column/row pairs, vocab-parallel ends."""
    plan: dict[str, ParallelStyle] = {}
    if model.is_first:
        plan["model.embed_tokens"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    for i in model.model.layers:
        p = f"model.layers.{i}."
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[p + name] = ColwiseParallel()
        plan[p + "self_attn.o_proj"] = RowwiseParallel()
        plan[p + "mlp.down_proj"] = RowwiseParallel()
    if model.lm_head is not None and not model.spec.tie_word_embeddings:
        plan["lm_head"] = ColwiseParallel(output_layouts=Replicate())
    return plan


def check_tp_supported(spec: ModelSpec, tp: int) -> None:
    spec.check_tp(tp)
    if spec.num_kv_heads % tp:
        raise SpecError("tp", f"the engine splits kv heads evenly: {tp} must divide num_kv_heads="
                        f"{spec.num_kv_heads}")
    if tp > 1 and spec.tie_word_embeddings:
        raise SpecError("tp", "a tied head under tensor parallelism is not supported; use tp=1")


class StageEngine:
    """This process's part of one model-stage: module, optimizer, groups and pipeline schedules."""

    def __init__(self, name: str, spec: ModelSpec, head: Head, plan: StagePlan, *, seed: int = 0,
                 weights: Mapping[str, torch.Tensor] | None = None, lr: float | None = None,
                 weight_decay: float = 0.0, max_grad_norm: float | None = 1.0) -> None:
        self.name, self.spec, self.head, self.plan = name, spec, head, plan
        self.max_grad_norm = max_grad_norm
        lay = plan.layout
        check_tp_supported(spec, lay.tp)
        spec.check_pp(lay.pp)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.coord: Coord | None = None
        for d, gpus in enumerate(plan.gpu_sets):
            if self.rank in gpus:
                tp_rank, pp_rank = lay.coords(gpus.index(self.rank))
                self.coord = Coord(d, tp_rank, pp_rank)
        self.mesh: DeviceMesh | None = None
        if dist.is_initialized():
            ranks = torch.tensor(plan.gpu_sets).view(plan.dp, lay.pp, lay.tp)
            # collective over the whole world: every rank builds every stage's mesh in the same order
            self.mesh = DeviceMesh("cpu", ranks, mesh_dim_names=("dp", "pp", "tp"))
        # one group per replica (all its tp*pp ranks): sampled logits are broadcast over it
        self.replica_groups: list[dist.ProcessGroup | None] = [
            dist.new_group(list(g)) if dist.is_initialized() and len(g) > 1 else None for g in plan.gpu_sets
        ]
        self.module: Decoder | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self._schedules: dict[tuple[object, ...], object] = {}
        self._loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        if self.coord is not None:
            layers = stage_layers(spec.num_layers, lay.pp, self.coord.pp_rank)
            self.module = build_decoder(spec, head, layers, seed=seed, weights=weights)
            if lay.tp > 1:
                assert self.mesh is not None
                parallelize_module(self.module, self.mesh["tp"], tp_plan(self.module))
            if lr is not None:
                # foreach kernels group tensors by type; a mix of DTensor and plain parameters is
                # safest on the per-tensor path
                self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=lr, weight_decay=weight_decay,
                                                   foreach=False)

    # --- layout helpers ---------------------------------------------------------------------------
    @property
    def is_member(self) -> bool:
        return self.coord is not None

    @property
    def is_owner(self) -> bool:
        """The rank whose outputs stand for its replica (last PP stage, TP rank 0)."""
        c = self.coord
        return c is not None and c.tp_rank == 0 and c.pp_rank == self.plan.layout.pp - 1

    def replica_rows(self, batch: int, replica: int) -> slice:
        if batch % self.plan.dp:
            raise SpecError(f"{self.name}.dp", f"{self.plan.dp} replicas do not divide a batch of {batch}")
        n = batch // self.plan.dp
        return slice(replica * n, (replica + 1) * n)

    def _group(self, dim: str) -> dist.ProcessGroup | None:
        return self.mesh.get_group(dim) if self.mesh is not None else None

    def local_tensors(self, kind: str = "param") -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, this rank's local shard) of every parameter held here, or of one optimizer state
        (``exp_avg``, ``exp_avg_sq``); writable in place."""
        assert self.module is not None
        for n, p in self.module.named_parameters():
            t = p if kind == "param" else self.optimizer_state(p)[kind]
            yield n, (t.to_local() if isinstance(t, DTensor) else t).data

    def optimizer_state(self, p: torch.nn.Parameter) -> dict[str, torch.Tensor]:
        """AdamW's state of ``p``, created (zeros, step 0) if the optimizer has not stepped yet, so
        that a new replica can receive the state of a running one before its first step."""
        if self.optimizer is None:
            raise SpecError(f"{self.name}.lr", "optimizer state exists only on a training model-stage")
        st = self.optimizer.state[p]
        if not st:
            st["step"] = torch.tensor(0.0)
            st["exp_avg"] = torch.zeros_like(p)
            st["exp_avg_sq"] = torch.zeros_like(p)
        return st

    def set_optimizer_steps(self, steps: int) -> None:
        assert self.module is not None
        for p in self.module.parameters():
            self.optimizer_state(p)["step"].fill_(float(steps))

    # --- forward-only --------------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, attention_mask: torch.Tensor, extra: torch.Tensor,
                out_fn: OutFn) -> torch.Tensor:
        """Per-token outputs ``[B, T]`` of the whole batch on every rank of the world.

        Each replica runs its rows in micro-batches of ``plan.micro_batch_size``; ``out_fn`` turns the
        model output of a micro-batch (logits or values) into one float per token, with ``extra``
        (e.g. next tokens) rows alongside.
        """
        b, t = tokens.shape
        out = torch.zeros(b, t)
        c = self.coord
        if c is not None:
            assert self.module is not None
            rows = self.replica_rows(b, c.replica)
            x, m, e = tokens[rows], attention_mask[rows], extra[rows]
            mbs = self.plan.micro_batch_size
            n_mb = x.shape[0] // mbs
            if n_mb * mbs != x.shape[0]:
                raise SpecError(f"{self.name}.micro_batch_size",
                                f"{mbs} does not divide {x.shape[0]} rows per replica")
            self.module.eval()
            res: torch.Tensor | None
            if self.plan.layout.pp == 1:
                res = torch.cat([out_fn(self.module(x[i * mbs:(i + 1) * mbs], m[i * mbs:(i + 1) * mbs]),
                                        e[i * mbs:(i + 1) * mbs]) for i in range(n_mb)])
            else:
                sched = self._schedule("eval", n_mb, (mbs, t))
                y = sched.step(*([x] if self.module.is_first else []), attention_mask=m)  # type: ignore[attr-defined]
                res = out_fn(y, e) if self.module.is_last else None
            if self.is_owner:
                assert res is not None
                out[rows] = res.float()
        return self.gather(out)

    def gather(self, out: torch.Tensor) -> torch.Tensor:
        """Rows written by each replica's owner (zeros elsewhere) summed over the world."""
        if dist.is_initialized() and self.world > 1:
            with record_function(GATHER_RANGE):
                dist.all_reduce(out)
        return out

    # --- training -------------------------------------------------------------------------------
    def train_step(self, tokens: torch.Tensor, attention_mask: torch.Tensor, target: torch.Tensor,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> dict[str, float]:
        """One optimizer step on the whole mini-batch; returns the global loss and grad norm."""
        loss = self.backward(tokens, attention_mask, target, loss_fn)
        stats = torch.zeros(2)
        if self.is_member:
            norm = self.clip_grads()
            assert self.optimizer is not None
            self.optimizer.step()
            if self.is_owner:
                stats[0] = loss  # each replica's share of the globally normalised loss
                if self.coord is not None and self.coord.replica == 0:
                    stats[1] = norm  # identical on every replica after the DP all-reduce
        stats = self.gather(stats)
        return {"loss": float(stats[0]), "grad_norm": float(stats[1])}

    def backward(self, tokens: torch.Tensor, attention_mask: torch.Tensor, target: torch.Tensor,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> float:
        """Accumulate this replica's gradients (summed over DP); returns this replica's loss sum."""
        c = self.coord
        if c is None:
            return 0.0
        assert self.module is not None
        b, t = tokens.shape
        rows = self.replica_rows(b, c.replica)
        mbs, accum = self.plan.micro_batch_size, self.plan.grad_accum
        if rows.stop - rows.start != mbs * accum:
            raise SpecError(f"{self.name}.grad_accum", f"dp*micro_batch_size*grad_accum="
                            f"{self.plan.sequences_per_batch} but the mini-batch has {b} sequences")
        x, m, y = tokens[rows], attention_mask[rows], target[rows]
        self.module.train()
        for p in self.module.parameters():
            p.grad = None
        total = 0.0
        if self.plan.layout.pp == 1:
            for i in range(accum):
                s = slice(i * mbs, (i + 1) * mbs)
                loss = loss_fn(self.module(x[s], m[s]), y[s])
                loss.backward()
                total += float(loss.detach())
        else:
            self._loss_fn = loss_fn
            sched = self._schedule("train", accum, (mbs, t))
            losses: list[torch.Tensor] = []
            sched.step(*([x] if self.module.is_first else []),  # type: ignore[attr-defined]
                       target=y if self.module.is_last else None, losses=losses, attention_mask=m)
            total = float(sum(float(v.detach()) for v in losses))
        if self.plan.dp > 1:
            self._allreduce_grads()
        return total

    def _allreduce_grads(self) -> None:
        assert self.module is not None
        grads = [(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad)
                 for p in self.module.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])  # one bucket: gloo is slow on many small tensors
        with record_function(DP_ALLREDUCE_RANGE):  # lets measure.classify tell DP from TP collectives
            dist.all_reduce(flat, group=self._group("dp"))
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    def clip_grads(self) -> float:
        """Global grad-norm clipping over DTensor shards and plain (replicated) parameters.

        ``clip_grad_norm_`` rejects a mix of DTensor and plain tensors, so each group's squared norm
        is summed separately: shards over the TP group, then everything over the PP group.
        """
        assert self.module is not None
        sharded = torch.zeros(())
        plain = torch.zeros(())
        params = [p for p in self.module.parameters() if p.grad is not None]
        for p in params:
            # a grad may come back with other placements than its parameter (the vocab-parallel
            # embedding's is Replicate): bring it to the parameter's, so local shards partition it
            if isinstance(p, DTensor) and isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
                p.grad = p.grad.redistribute(p.device_mesh, p.placements)
        for p in params:
            g = p.grad
            if isinstance(g, DTensor):
                sharded += g.to_local().float().pow(2).sum()
            else:
                plain += g.float().pow(2).sum()  # type: ignore[union-attr]
        if self.plan.layout.tp > 1:
            dist.all_reduce(sharded, group=self._group("tp"))
        total = sharded + plain
        if self.plan.layout.pp > 1:
            dist.all_reduce(total, group=self._group("pp"))
        norm = float(total.sqrt())
        if self.max_grad_norm is not None and norm > self.max_grad_norm:
            scale = self.max_grad_norm / (norm + 1e-6)
            for p in params:
                g = p.grad
                (g.to_local() if isinstance(g, DTensor) else g).mul_(scale)  # type: ignore[union-attr]
        return norm

    # --- pipelining ---------------------------------------------------------------------------------
    def _schedule(self, kind: str, n_microbatches: int, mb_shape: tuple[int, int]) -> object:
        """A cached schedule per (kind, shape); stages get explicit example shapes (no meta forward,
        which would touch a KV cache held by the module)."""
        key = (kind, n_microbatches, mb_shape)
        if key not in self._schedules:
            assert self.module is not None and self.coord is not None
            mbs, t = mb_shape
            h = self.spec.hidden_size
            x_in = torch.zeros(mbs, t, dtype=torch.long) if self.module.is_first else torch.zeros(mbs, t, h)
            if not self.module.is_last:
                x_out = torch.zeros(mbs, t, h)
            elif self.head is Head.LM:
                x_out = torch.zeros(mbs, t, self.spec.vocab_size)
            else:
                x_out = torch.zeros(mbs, t)
            if kind == "train":
                # static stage metadata: requires_grad on the examples is what makes grads flow back
                if not self.module.is_first:
                    x_in.requires_grad_(True)
                x_out.requires_grad_(True)
            group = self._group("pp")
            stage = PipelineStage(self.module, self.coord.pp_rank, self.plan.layout.pp, torch.device("cpu"),
                                  input_args=x_in, output_args=x_out, group=group)
            # single-stage schedules assume pipeline stage i is group rank i; a group's ranks follow the
            # world's order, and a replica's GPUs need not (stage 0 on rank 3, stage 1 on rank 1)
            lay, gpus = self.plan.layout, self.plan.gpu_sets[self.coord.replica]
            stage.stage_index_to_group_rank = {
                i: dist.get_group_rank(group, gpus[lay.rank_of(self.coord.tp_rank, i)]) if group is not None else i
                for i in range(lay.pp)}
            if kind == "train":
                # 1F1B needs at least one micro-batch per stage; a plan may give fewer (a small batch on a
                # deep pipeline, which the planner prices as bubbles): GPipe runs any number
                sched_cls = Schedule1F1B if n_microbatches >= lay.pp else ScheduleGPipe
                self._schedules[key] = sched_cls(stage, n_microbatches, loss_fn=self._call_loss, scale_grads=False)
            else:
                self._schedules[key] = ScheduleGPipe(stage, n_microbatches)
        return self._schedules[key]

    def _call_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        assert self._loss_fn is not None
        return self._loss_fn(output, target)


class PipelineRunner:
    """``rollout.LMRunner`` over a pipeline (and TP) replica: forward-only schedule per decode step,
    each stage keeping the KV cache of its own layers; the last stage's logits are broadcast to the
    replica so every rank samples the same token."""

    def __init__(self, engine: StageEngine) -> None:
        assert engine.module is not None and engine.coord is not None
        self.engine = engine
        self.module = engine.module
        lay = engine.plan.layout
        gpus = engine.plan.gpu_sets[engine.coord.replica]
        self.src = gpus[lay.rank_of(0, lay.pp - 1)]
        self.group = engine.replica_groups[engine.coord.replica]

    def begin(self, batch: int, max_tokens: int) -> None:
        self.module.eval()
        self.module.cache = KVCache(batch, max_tokens)

    def last_logits(self, ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        b, t = ids.shape
        eng = self.engine
        if eng.plan.layout.pp == 1:
            logits = self.module(ids, attention_mask)[:, -1].contiguous()
        else:
            sched = eng._schedule("gen", 1, (b, t))
            y = sched.step(*([ids] if self.module.is_first else []), attention_mask=attention_mask)  # type: ignore[attr-defined]
            logits = y[:, -1].contiguous() if self.module.is_last else torch.zeros(b, eng.spec.vocab_size)
            dist.broadcast(logits, src=self.src, group=self.group)
        return logits

    def end(self) -> None:
        self.module.cache = None
