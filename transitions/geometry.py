"""EMU geometry: which exact slice of which tensor, in which state kind, a unit-local rank holds.

Every shard is computed from the ModelSpec's per-tensor rules, never stored by hand, and the same
functions are what the RL engine's DTensor / pipelining layouts hold:

- PP: decoder layers are spread over stages in balanced contiguous runs (``layer_stages``); the
  embedding sits on the first stage, the final norm and the head on the last (a tied embedding is held
  by both the first and the last stage).
- TP: COLUMN splits dim 0, ROW dim 1, VOCAB dim 0, as DTensor's ``Shard(0)`` / ``Shard(1)`` do
  (``torch.chunk`` semantics: chunks of ceil(n / tp), the last ones shorter or empty, so uneven sizes
  are allowed); REPLICATED tensors are held whole. k/v projections are GQA-aware: split by kv heads
  when tp <= kv heads (equal to ``Shard(0)``), and when kv heads divide tp each rank holds the whole
  kv head of its query-head group (``tp // kv_heads`` consecutive ranks share one head).

A unit's ranks are ``pp_rank * tp + tp_rank`` (planner.plan.Layout). Pure: no torch, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from functools import lru_cache
from math import prod

from planner.errors import SpecError
from planner.models import Head, ModelSpec, Parallel, TensorSpec
from planner.plan import Layout
from planner.workflow import StageKind

FP32_BYTES = 4


class StateKind(str, Enum):
    """One kind of per-tensor state a unit holds (mixed-precision Adam, ZeRO-0 inside a unit)."""

    PARAM = "param"  # bf16 weights (model.bytes_per_param)
    MASTER = "master"  # fp32 master weights
    EXP_AVG = "exp_avg"  # fp32 Adam first moment
    EXP_AVG_SQ = "exp_avg_sq"  # fp32 Adam second moment
    GRAD = "grad"  # bf16 gradients, only where a stage keeps them across the transition

    def bytes_per_element(self, model: ModelSpec) -> int:
        return model.bytes_per_param if self in (StateKind.PARAM, StateKind.GRAD) else FP32_BYTES


INFERENCE_KINDS: tuple[StateKind, ...] = (StateKind.PARAM,)
TRAINING_KINDS: tuple[StateKind, ...] = (
    StateKind.PARAM, StateKind.MASTER, StateKind.EXP_AVG, StateKind.EXP_AVG_SQ,
)


def state_kinds(stage_kind: StageKind, keep_grads: bool = False) -> tuple[StateKind, ...]:
    """State kinds a unit of a model-stage of this kind holds: generation/inference hold parameters
    only; training also holds fp32 master weights and Adam moments (and gradients if asked)."""
    if stage_kind is not StageKind.TRAINING:
        return INFERENCE_KINDS
    return TRAINING_KINDS + ((StateKind.GRAD,) if keep_grads else ())


@dataclass(frozen=True, kw_only=True, slots=True)
class Shard:
    """The box ``offsets .. offsets+lengths`` of one tensor's state kind, stored row-major contiguous."""

    tensor: str
    kind: StateKind
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    bytes_per_element: int

    def __post_init__(self) -> None:
        if not (len(self.global_shape) == len(self.offsets) == len(self.lengths)):
            raise SpecError("shard.offsets", f"rank mismatch for {self.tensor}: shape {self.global_shape}, "
                            f"offsets {self.offsets}, lengths {self.lengths}")
        for dim, (n, o, k) in enumerate(zip(self.global_shape, self.offsets, self.lengths)):
            if o < 0 or k < 0 or o + k > n:
                raise SpecError("shard.lengths", f"{self.tensor} dim {dim}: [{o}, {o + k}) outside [0, {n})")

    @property
    def numel(self) -> int:
        n = 1
        for k in self.lengths:
            n *= k
        return n

    @property
    def num_bytes(self) -> int:
        return self.numel * self.bytes_per_element

    @property
    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + k) for o, k in zip(self.offsets, self.lengths))

    @property
    def key(self) -> tuple[str, StateKind]:
        return (self.tensor, self.kind)


# --- pipeline parallelism -------------------------------------------------------------------------


@lru_cache(maxsize=1024)
def layer_stages(num_layers: int, pp: int) -> tuple[int, ...]:
    """PP stage of each decoder layer: contiguous runs, the first ``num_layers % pp`` stages one longer."""
    if pp < 1 or pp > num_layers:
        raise SpecError("pp", f"{pp} must be between 1 and num_layers={num_layers}")
    base, extra = divmod(num_layers, pp)
    out: list[int] = []
    for stage in range(pp):
        out += [stage] * (base + (1 if stage < extra else 0))
    return tuple(out)


def stage_layers(num_layers: int, pp: int, pp_rank: int) -> range:
    """The decoder layers of one PP stage (what the engine's pipeline stage module holds)."""
    base, extra = divmod(num_layers, pp)
    start = pp_rank * base + min(pp_rank, extra)
    return range(start, start + base + (1 if pp_rank < extra else 0))


def tensor_stages(tensor: TensorSpec, model: ModelSpec, pp: int) -> tuple[int, ...]:
    """Every PP stage holding ``tensor``: one, except a tied embedding (first and last stage)."""
    model.check_pp(pp)
    if tensor.layer is not None:
        return (layer_stages(model.num_layers, pp)[tensor.layer],)
    if tensor.name == "model.embed_tokens.weight":
        return (0, pp - 1) if model.tie_word_embeddings and pp > 1 else (0,)
    return (pp - 1,)  # final norm and head


def tensor_stage(tensor: TensorSpec, model: ModelSpec, pp: int) -> int:
    """The PP stage owning ``tensor`` (for a tied embedding, the first; see ``tensor_stages``)."""
    return tensor_stages(tensor, model, pp)[0]


# --- tensor parallelism ---------------------------------------------------------------------------


def chunk_range(size: int, num_chunks: int, index: int) -> tuple[int, int]:
    """(offset, length) of chunk ``index`` of ``size`` split as torch.chunk / DTensor Shard do."""
    if size % num_chunks == 0:
        step = size // num_chunks
        return step * index, step
    step = -(-size // num_chunks)
    start = min(size, step * index)
    return start, max(0, min(size, step * (index + 1)) - start)


def tp_box(tensor: TensorSpec, model: ModelSpec, tp: int,
           tp_rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offsets, lengths) of the global box TP rank ``tp_rank`` of ``tp`` holds of ``tensor``."""
    if not 0 <= tp_rank < tp:
        raise SpecError("tp_rank", f"{tp_rank} outside [0, {tp})")
    shape = tensor.shape
    offsets = [0] * len(shape)
    lengths = list(shape)
    if tensor.parallel is Parallel.REPLICATED or tp == 1:
        return tuple(offsets), tuple(lengths)
    dim = 1 if tensor.parallel is Parallel.ROW else 0
    heads = tensor.num_heads
    if heads is not None and tensor.parallel is Parallel.COLUMN and tp > heads and tp % heads == 0:
        # GQA: fewer kv heads than ranks; each group of tp // heads ranks shares one whole head
        head = tp_rank // (tp // heads)
        per_head = shape[0] // heads
        offsets[0], lengths[0] = head * per_head, per_head
    else:
        offsets[dim], lengths[dim] = chunk_range(shape[dim], tp, tp_rank)
    return tuple(offsets), tuple(lengths)


def tp_slice(tensor: TensorSpec, model: ModelSpec, tp: int, tp_rank: int) -> tuple[slice, ...]:
    """The exact global slice TP rank ``tp_rank`` holds (equal to DTensor's local shard for Shard dims)."""
    offsets, lengths = tp_box(tensor, model, tp, tp_rank)
    return tuple(slice(o, o + k) for o, k in zip(offsets, lengths))


# --- unit shards ----------------------------------------------------------------------------------


def check_layout(model: ModelSpec, layout: Layout) -> None:
    model.check_tp(layout.tp)
    model.check_pp(layout.pp)


def unit_shards(
    model: ModelSpec,
    head: Head,
    layout: Layout,
    rank: int,
    kinds: tuple[StateKind, ...] = INFERENCE_KINDS,
) -> list[Shard]:
    """Every non-empty shard unit-local ``rank`` of a ``layout`` unit holds, tensor-major, kinds in order.

    Empty chunks of uneven splits (e.g. vocab 5 over tp 4) hold no bytes and are left out.
    """
    return list(rank_shard_tuple(model, head, layout, rank, kinds))


@lru_cache(maxsize=8192)
def rank_shard_tuple(model: ModelSpec, head: Head, layout: Layout, rank: int,
                     kinds: tuple[StateKind, ...] = INFERENCE_KINDS) -> tuple[Shard, ...]:
    """``unit_shards`` memoised by value (a pure function of frozen specs; bounded): the units' shards
    (transitions.emu) and their buffers' slots (transitions.layout) both read it."""
    check_layout(model, layout)
    if not 0 <= rank < layout.size:
        raise SpecError("rank", f"{rank} outside unit of {layout.size} GPUs ({layout})")
    tp_rank, pp_rank = layout.coords(rank)
    stages = layer_stages(model.num_layers, layout.pp)
    held = _tp_rank_shards(model, head, layout.tp, tp_rank, kinds)
    out: list[Shard] = []
    for tensor, shards in zip(_tensors(model, head), held):
        if tensor.layer is not None:
            if stages[tensor.layer] != pp_rank:
                continue
        elif pp_rank not in tensor_stages(tensor, model, layout.pp):
            continue
        out += shards
    return tuple(out)


_new = object.__new__
# the slots' own setters (what the frozen dataclass's ``__init__`` reaches through object.__setattr__)
_put_tensor, _put_kind, _put_shape, _put_offsets, _put_lengths, _put_bytes = (
    vars(Shard)[name].__set__ for name in ("tensor", "kind", "global_shape", "offsets", "lengths",
                                            "bytes_per_element"))


def make_shard(tensor: str, kind: StateKind, global_shape: tuple[int, ...], offsets: tuple[int, ...],
               lengths: tuple[int, ...], bytes_per_element: int) -> Shard:
    """``Shard(...)`` of these fields without the dataclass ``__init__`` and its checks (which cost
    ~4x this): the bulk constructor of ``_tp_rank_shards``, whose boxes come from ``tp_box`` and lie
    inside the tensor by construction (a cold 70B build makes ~60,000 shards).
    tests/transitions/test_fast_constructors.py checks it sets every field."""
    shard = _new(Shard)
    _put_tensor(shard, tensor)
    _put_kind(shard, kind)
    _put_shape(shard, global_shape)
    _put_offsets(shard, offsets)
    _put_lengths(shard, lengths)
    _put_bytes(shard, bytes_per_element)
    return shard


@lru_cache(maxsize=256)  # (model, head, TP degree, TP rank, kinds): a PPO job's models and kinds fill ~60
def _tp_rank_shards(model: ModelSpec, head: Head, tp: int, tp_rank: int, kinds: tuple[StateKind, ...]
                    ) -> tuple[tuple[Shard, ...], ...]:
    """Per tensor (model order), the shards TP rank ``tp_rank`` of ``tp`` holds of it, one per state kind
    (none where its chunk of an uneven split is empty): what any PP stage holding the tensor holds, so
    every layout of one TP degree (PP 1, 2, 4, ... and each of their stages) shares these objects, and
    every head shares those of the tensors all heads hold alike (``_common_shards``)."""
    common = _common_shards(model, tp, tp_rank, kinds)
    own = [t for t in _tensors(model, head) if t.name not in common]
    built = dict(zip((t.name for t in own), _shards_of(model, own, tp, tp_rank, kinds)))
    return tuple([common[t.name] if t.name in common else built[t.name] for t in _tensors(model, head)])


@lru_cache(maxsize=128)
def _common_shards(model: ModelSpec, tp: int, tp_rank: int, kinds: tuple[StateKind, ...]
                   ) -> dict[str, tuple[Shard, ...]]:
    """By name, the shards TP rank ``tp_rank`` holds of every tensor that each head's model holds alike
    (the decoder, the embedding, the final norm: all but the head's own weight)."""
    specs = [_tensors(model, h) for h in Head]
    others = [dict((t.name, t) for t in tensors) for tensors in specs[1:]]
    shared = [t for t in specs[0] if all(o.get(t.name) == t for o in others)]
    return dict(zip((t.name for t in shared), _shards_of(model, shared, tp, tp_rank, kinds)))


BoxRule = tuple[tuple[int, ...], int, int | None]


def _box_rule(tensor: TensorSpec) -> BoxRule:
    """What ``tp_box`` reads of a tensor: its shape, split (by identity: one enum member each) and
    heads; tensors of one rule get the same box on every TP rank (every layer repeats a few)."""
    return (tensor.shape, id(tensor.parallel), tensor.num_heads)


def _shards_of(model: ModelSpec, tensors: list[TensorSpec], tp: int, tp_rank: int,
               kinds: tuple[StateKind, ...]) -> list[tuple[Shard, ...]]:
    """Per tensor, its shards on TP rank ``tp_rank`` of ``tp`` (one per kind; none if its box is empty)."""
    per_kind = [(kind, kind.bytes_per_element(model)) for kind in kinds]
    out: list[tuple[Shard, ...]] = []
    boxes: dict[BoxRule, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    for tensor in tensors:
        # every layer's tensors repeat a few box rules
        spec = _box_rule(tensor)
        box = boxes.get(spec)
        if box is None:
            box = boxes[spec] = tp_box(tensor, model, tp, tp_rank)
        offsets, lengths = box
        if 0 in lengths:
            out.append(())
            continue
        name, shape = tensor.name, tensor.shape
        out.append(tuple([make_shard(name, kind, shape, offsets, lengths, nbytes) for kind, nbytes in per_kind]))
    return out


@lru_cache(maxsize=256)
def _tensors(model: ModelSpec, head: Head) -> tuple[TensorSpec, ...]:
    return model.tensors(head)


def unit_rank_bytes(model: ModelSpec, head: Head, layout: Layout, rank: int,
                    kinds: tuple[StateKind, ...] = INFERENCE_KINDS) -> int:
    """Bytes of state unit-local ``rank`` holds."""
    return sum(s.num_bytes for s in unit_shards(model, head, layout, rank, kinds))


@lru_cache(maxsize=1024)
def layout_rank_bytes(model: ModelSpec, head: Head, layout: Layout,
                      kinds: tuple[StateKind, ...] = INFERENCE_KINDS) -> tuple[int, ...]:
    """Bytes of state each unit-local rank of a ``layout`` unit holds (``unit_rank_bytes`` of every
    rank), summed from the TP boxes without building the shards: what a GPU's held memory needs (a
    cold 70B build asks it of training units it never moves, ~46,000 shards' worth)."""
    check_layout(model, layout)
    per_element = sum(kind.bytes_per_element(model) for kind in kinds)
    stages = layer_stages(model.num_layers, layout.pp)
    tensors = _tensors(model, head)
    holders = [(stages[t.layer],) if t.layer is not None else tensor_stages(t, model, layout.pp) for t in tensors]
    # tensors by box rule (shape, split, heads: every layer repeats a few), with how many of each
    # every PP stage holds
    rules: dict[BoxRule, tuple[TensorSpec, list[int]]] = {}
    for tensor, held in zip(tensors, holders):
        spec = _box_rule(tensor)
        rule = rules.get(spec)
        if rule is None:
            rule = rules[spec] = (tensor, [0] * layout.pp)
        for stage in held:
            rule[1][stage] += 1
    out = [0] * layout.size
    for tp_rank in range(layout.tp):
        per_stage = [0] * layout.pp
        for tensor, counts in rules.values():
            numel = prod(tp_box(tensor, model, layout.tp, tp_rank)[1])
            for stage, count in enumerate(counts):
                per_stage[stage] += numel * count
        for pp_rank in range(layout.pp):
            out[layout.rank_of(tp_rank, pp_rank)] = per_stage[pp_rank] * per_element
    return tuple(out)


@lru_cache(maxsize=1024)
def layouts_nest(model: ModelSpec, head: Head, sub: Layout, final: Layout) -> bool:
    """transitions.emu.parts_nest from the TP boxes and PP stages alone (no shard, box or rank map is
    built): whether every rank of a ``final`` unit holds a subset of what its strided ``sub`` part rank
    (TP rank // k_tp, PP rank // k_pp) holds, tensor by tensor; every state kind of a unit has the same
    box, so the kinds (never empty: a unit holds parameters) do not matter. A pair of boxes is compared
    once per shape, split, heads and TP rank."""
    if final.tp % sub.tp or final.pp % sub.pp:
        raise SpecError("layout", f"{final} does not split into {sub}")
    check_layout(model, sub)
    check_layout(model, final)
    k_tp, k_pp = final.tp // sub.tp, final.pp // sub.pp
    seen: dict[tuple[object, ...], tuple[bool, bool]] = {}  # (rule, TP rank) -> (empty, inside)
    for tensor in _tensors(model, head):
        held = tensor_stages(tensor, model, sub.pp)
        for stage in tensor_stages(tensor, model, final.pp):
            for tp_rank in range(final.tp):
                key = (*_box_rule(tensor), tp_rank)
                found = seen.get(key)
                if found is None:
                    offsets, lengths = tp_box(tensor, model, final.tp, tp_rank)
                    outer_offsets, outer_lengths = tp_box(tensor, model, sub.tp, tp_rank // k_tp)
                    found = seen[key] = (0 in lengths, 0 not in outer_lengths and all(
                        o1 <= o2 and o2 + n2 <= o1 + n1
                        for o1, n1, o2, n2 in zip(outer_offsets, outer_lengths, offsets, lengths)))
                empty, inside = found
                if not empty and (stage // k_pp not in held or not inside):
                    return False  # a shard the part's rank does not hold (whole, or that box of it)
    return True
