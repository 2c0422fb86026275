"""Test-only meters for memory and communication of a real training step (CPU, gloo).

- :class:`CommMeter`: a ``TorchDispatchMode`` that sees every ``c10d`` collective and
  point-to-point op (however megatron-core or torch calls it) and adds the payload to
  ``bytes["<group>/<kind>"]``. Payload: the tensor handed to the collective on this rank
  (all-reduce tensor, reduce-scatter input, all-gather output, all-to-all input, send and
  receive buffers). Ops on one-rank groups and one-element tensors (loss scalars, grad norm,
  found-inf) are not counted.
- :class:`SavedTensorMeter`: ``saved_tensors_hooks`` that track every storage autograd saves
  for backward (parameters and one-element tensors excluded), per forward pass (``forward``)
  and as a time-resolved peak of the storages alive (``peak``).
- :class:`WholeCopiesMeter`: a ``TorchDispatchMode`` that, after every operator, adds up the whole
  (unsharded) parameters and gradients torch FSDP2 holds (``peak``: their largest sum, with
  each ``fully_shard`` unit's part then in ``parts``).
- :func:`state_bytes`: weights, gradient buffers and optimizer state read from the real
  model chunks and optimizer.

Nothing here is imported by the ``megatron_flops`` package.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections import defaultdict
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

# c10d op name -> (kind, which argument(s) hold the payload)
_OPS: Dict[str, Tuple[str, Callable[[tuple], Iterable[torch.Tensor]]]] = {
    "allreduce_": ("all_reduce", lambda a: a[0]),
    "allreduce_coalesced_": ("all_reduce", lambda a: a[0]),
    "_allgather_base_": ("all_gather", lambda a: [a[0]]),
    "allgather_": ("all_gather", lambda a: [t for ts in a[0] for t in ts]),
    "allgather_into_tensor_coalesced_": ("all_gather", lambda a: a[0]),
    "_reduce_scatter_base_": ("reduce_scatter", lambda a: [a[1]]),
    "reduce_scatter_": ("reduce_scatter", lambda a: [t for ts in a[1] for t in ts]),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", lambda a: a[1]),
    "alltoall_base_": ("all_to_all", lambda a: [a[1]]),
    "alltoall_": ("all_to_all", lambda a: a[1]),
    "broadcast_": ("broadcast", lambda a: a[0]),
    "send": ("send_recv", lambda a: a[0]),
    "recv_": ("send_recv", lambda a: a[0]),
}


def _process_group(args: tuple) -> Optional[dist.ProcessGroup]:
    for a in args:
        if isinstance(a, torch.ScriptObject):
            try:
                return dist.ProcessGroup.unbox(a)
            except RuntimeError:
                continue
    return None


def megatron_groups() -> List[Tuple[str, Any]]:
    """(name, group) for megatron-core's process groups, in matching precedence."""
    from megatron.core import parallel_state as ps

    getters = [
        ("tp", ps.get_tensor_model_parallel_group),
        # Expert TP: the alltoall dispatcher's gathers of the routed tokens ("etp" when its ranks
        # are not the TP group's).
        (_expert_tp_name(), ps.get_expert_tensor_parallel_group),
        ("pp", ps.get_pipeline_model_parallel_group),
        ("embd", ps.get_embedding_group),
        ("dp", lambda: ps.get_data_parallel_group(with_context_parallel=True)),
        ("dp", ps.get_data_parallel_group),
        ("ep", ps.get_expert_model_parallel_group),
        ("expt_dp", ps.get_expert_data_parallel_group),
        # The expert TP x EP group: the token counts (alltoall) or the tokens (allgather) gathered.
        ("tp_ep", ps.get_expert_tensor_and_model_parallel_group),
        ("mp", ps.get_model_parallel_group),
    ]
    out = []
    for name, get in getters:
        try:
            group = get()
        except (AssertionError, RuntimeError, AttributeError):
            continue
        if group is not None:
            out.append((name, group))
    return out


def _expert_tp_name() -> str:
    from megatron.core import parallel_state as ps

    ranks = [dist.get_process_group_ranks(g) for g in (ps.get_tensor_model_parallel_group(),
                                                       ps.get_expert_tensor_parallel_group())]
    return "tp" if ranks[0] == ranks[1] else "etp"


_ACTIVE_METERS: List["CommMeter"] = []


class CommMeter(TorchDispatchMode):
    """Payload bytes per ``group/kind`` of every collective run under it (see module doc)."""

    def __init__(self, groups: List[Tuple[str, Any]]) -> None:
        super().__init__()
        self.groups = groups
        self.bytes: Dict[str, int] = defaultdict(int)
        self.calls: Dict[str, int] = defaultdict(int)

    def __enter__(self):
        _ACTIVE_METERS.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _ACTIVE_METERS.remove(self)
        return super().__exit__(*exc)

    def record(self, group: Optional[dist.ProcessGroup], kind: str, tensors: Iterable[torch.Tensor]) -> None:
        """Count a collective run outside the dispatcher (see :func:`patch_uneven_collectives`)."""
        key = f"{self._name(group, kind)}/{kind}"
        self.bytes[key] += sum(t.numel() * t.element_size() for t in tensors)
        self.calls[key] += 1

    def _name(self, group: Optional[dist.ProcessGroup], kind: str) -> str:
        if kind == "send_recv":
            # megatron-core's point-to-point traffic is the pipeline's; with two pipeline ranks it
            # sends half of it on the world group (p2p_communication._p2p_ops).
            return "pp"
        for name, g in self.groups:
            if g is group:
                return name
        if group is None or group is dist.group.WORLD:
            return "world"
        return "other" + str(dist.get_process_group_ranks(group))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            op = func._schema.name.split("::")[-1]
            if op in _OPS:
                kind, payload = _OPS[op]
                group = _process_group(args)
                tensors = [t for t in payload(args) if isinstance(t, torch.Tensor)]
                size = group.size() if group is not None else dist.get_world_size()
                if size > 1 and sum(t.numel() for t in tensors) > 1:
                    key = f"{self._name(group, kind)}/{kind}"
                    self.bytes[key] += sum(t.numel() * t.element_size() for t in tensors)
                    self.calls[key] += 1
        return func(*args, **(kwargs or {}))


class WholeCopiesMeter(TorchDispatchMode):
    """Bytes of the whole (unsharded) parameters and gradients of ``model``'s FSDP2 units, sampled
    after every operator run under it (distinct storages: FSDP2 frees a resharded unit's by
    resizing them to 0): ``peak`` their largest sum, ``parts`` then ``(unit, weights, gradients)``."""

    def __init__(self, model: torch.nn.Module) -> None:
        from torch.distributed.fsdp import FSDPModule

        super().__init__()
        self.units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        self.peak = 0
        self.parts: List[Tuple[str, int, int]] = []

    def _sample(self) -> None:
        parts, whole = [], []
        for unit in self.units:
            group = unit._get_fsdp_state()._fsdp_param_group
            params = [getattr(fp, "_unsharded_param", None) for fp in (group.fsdp_params if group else ())]
            weights = [p for p in params if p is not None]
            grads = [p.grad for p in weights if p.grad is not None]
            parts.append((type(unit).__name__, unique_bytes(weights), unique_bytes(grads)))
            whole += weights + grads
        total = unique_bytes(whole)
        if total > self.peak:
            self.peak, self.parts = total, parts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._sample()
        return out


class _Handle:
    """What the pack hook stores in the graph; its release marks the saved storage released."""

    __slots__ = ("tensor", "key", "__weakref__")

    def __init__(self, tensor: torch.Tensor, key: int) -> None:
        self.tensor = tensor
        self.key = key


class SavedTensorMeter:
    """Storages saved for backward: ``forward`` (bytes of distinct storages saved while inside
    :meth:`forward`, one entry per call) and ``peak`` (largest total of distinct live saved
    storages at any time). Parameters (their storages) and one-element tensors are skipped."""

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        self.param_storages = {p.untyped_storage().data_ptr() for p in params}
        self.live: Dict[int, List[int]] = {}  # storage ptr -> [refcount, nbytes]
        self.current = 0
        self.peak = 0
        self._forwards: List[Dict[int, int]] = []
        self.forward_chunks: List[int] = []
        self._in_forward: Optional[Dict[int, int]] = None

    def _release(self, key: int) -> None:
        entry = self.live[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.current -= entry[1]
            del self.live[key]

    def _pack(self, t: torch.Tensor) -> Any:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self.param_storages or t.numel() <= 1:
            return t
        if self._in_forward is not None:
            self._in_forward.setdefault(key, storage.nbytes())
        if key in self.live:
            self.live[key][0] += 1
        else:
            self.live[key] = [1, storage.nbytes()]
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
        handle = _Handle(t, key)
        weakref.finalize(handle, self._release, key)
        return handle

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Handle) else packed

    @contextlib.contextmanager
    def tracking(self) -> Iterator["SavedTensorMeter"]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield self

    @property
    def forward(self) -> List[int]:
        """Bytes of the distinct storages saved in each :meth:`one_forward` block."""
        return [sum(f.values()) for f in self._forwards]

    @contextlib.contextmanager
    def one_forward(self, extend: bool = False) -> Iterator[None]:
        """Count the distinct storages saved inside this block as one forward (``extend``: as
        part of the previous one, e.g. the loss function the schedule calls after it)."""
        if not extend:
            self._forwards.append({})
        outer, self._in_forward = self._in_forward, self._forwards[-1]
        try:
            yield
        finally:
            self._in_forward = outer


class LiveStorageMeter(SavedTensorMeter):
    """:class:`SavedTensorMeter` that also sees storages resized in place: megatron-core's
    ``CheckpointWithoutOutput`` frees the storage of an output other ops saved
    (``untyped_storage().resize_(0)``) and restores it in backward. Storages are keyed by their
    identity (``_cdata``, which a resize keeps; a freed pointer can be reused) and sized when
    read: ``forward`` is the bytes of the storages saved in each :meth:`one_forward` block as
    they are at its end, ``peak`` the most bytes the live saved storages hold at any pack or
    unpack (a restored storage is read by the backward op that unpacks it)."""

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        super().__init__(params)
        self._tensors: Dict[int, torch.Tensor] = {}  # storage id -> a tensor on it (while live)
        self._block: Optional[Dict[int, torch.Tensor]] = None

    def _now(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self._tensors.values())

    def _release(self, key: int) -> None:
        entry = self.live[key]
        entry[0] -= 1
        if entry[0] == 0:
            del self.live[key]
            del self._tensors[key]

    def _pack(self, t: torch.Tensor) -> Any:
        storage = t.untyped_storage()
        if storage.data_ptr() in self.param_storages or t.numel() <= 1:
            return t
        key = storage._cdata
        if self._block is not None:
            self._block.setdefault(key, t)
        if key in self.live:
            self.live[key][0] += 1
        else:
            self.live[key] = [1, 0]
            self._tensors[key] = t
        self.peak = max(self.peak, self._now())
        handle = _Handle(t, key)
        weakref.finalize(handle, self._release, key)
        return handle

    def _unpack(self, packed: Any) -> torch.Tensor:  # type: ignore[override]
        self.peak = max(self.peak, self._now())
        return packed.tensor if isinstance(packed, _Handle) else packed

    @contextlib.contextmanager
    def one_forward(self, extend: bool = False) -> Iterator[None]:
        if not extend:
            self._forwards.append({})
        outer, self._block = self._block, {}
        try:
            yield
        finally:
            block, self._block = self._block, outer
            sizes = self._forwards[-1]
            for key, t in block.items():
                sizes[key] = t.untyped_storage().nbytes()
            if outer is not None:
                outer.update(block)


def unique_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    seen: Dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def patch_alltoall_dispatcher() -> None:
    """Test-only: on CPU, give megatron-core's alltoall token dispatcher its split sizes as numpy
    arrays, as its device-to-host step does on GPU (tests/mcore_cpu.py only skips that step)."""
    from megatron.core.transformer.moe import token_dispatcher

    cls = token_dispatcher.MoEAlltoAllTokenDispatcher

    def to_host(self, point, tokens_per_expert=None):
        if not self.drop_and_pad and point == self.cuda_dtoh_point:
            for name in ("input_splits", "output_splits", "output_splits_tp"):
                value = getattr(self, name, None)
                if isinstance(value, torch.Tensor):
                    setattr(self, name, value.numpy())
        return tokens_per_expert

    cls._maybe_dtoh_and_synchronize = to_host


def patch_uneven_collectives() -> None:
    """Test-only: gloo has no all-gather of uneven sizes nor a list reduce-scatter, which
    megatron-core's alltoall dispatcher runs over expert TP (``output_split_sizes``). Run them as
    gloo's uneven all-to-all (each rank receives exactly what the all-gather would give it; the
    reduce-scatter's chunks are summed where they land), out of the meters' sight, and count for
    every active :class:`CommMeter` the payload NCCL's collective is handed: the all-gather's
    output list, the reduce-scatter's input list."""
    from torch.utils._python_dispatch import _disable_current_modes

    if getattr(dist, "_uneven_patched", False):
        return
    all_gather = dist.all_gather

    def gather(tensor_list, tensor, group=None, async_op=False):
        sizes = [t.shape[0] for t in tensor_list]
        if len(set(sizes)) == 1:
            return all_gather(tensor_list, tensor, group=group, async_op=async_op)
        world = len(tensor_list)
        with _disable_current_modes():
            received = torch.empty((sum(sizes), *tensor.shape[1:]), dtype=tensor.dtype)
            dist.all_to_all_single(received, torch.cat([tensor] * world), output_split_sizes=sizes,
                                   input_split_sizes=[tensor.shape[0]] * world, group=group)
            for out, part in zip(tensor_list, received.split(sizes)):
                out.copy_(part)
        for meter in _ACTIVE_METERS:
            meter.record(group, "all_gather", tensor_list)

    def scatter(output, input_list, op=dist.ReduceOp.SUM, group=None, async_op=False):
        assert op == dist.ReduceOp.SUM and not async_op
        sizes = [t.shape[0] for t in input_list]
        world, mine = len(input_list), output.shape[0]
        with _disable_current_modes():
            received = torch.empty((world * mine, *output.shape[1:]), dtype=output.dtype)
            dist.all_to_all_single(received, torch.cat(input_list), output_split_sizes=[mine] * world,
                                   input_split_sizes=sizes, group=group)
            output.copy_(received.view(world, *output.shape).sum(0))
        for meter in _ACTIVE_METERS:
            meter.record(group, "reduce_scatter", input_list)

    dist.all_gather, dist.reduce_scatter = gather, scatter
    dist._uneven_patched = True


def patch_sequence_parallel_norm() -> None:
    """Test-only: megatron-core's torch norm (the local spec's, without apex or TE) refuses
    ``sequence_parallel``; a norm is per token, so build it as without and mark its parameters
    ``sequence_parallel`` as TE's and apex's norms do (their gradients are all-reduced over TP)."""
    import copy

    from megatron.core.transformer import torch_norm

    cls = torch_norm.WrappedTorchNorm
    if getattr(cls, "_sequence_parallel_patched", False):
        return
    original = cls.__new__

    def new(klass, config, hidden_size, eps=1e-5, *args, **kwargs):
        sequence_parallel = config.sequence_parallel
        if sequence_parallel:
            config = copy.copy(config)
            config.sequence_parallel = False
        norm = original(klass, config, hidden_size, eps, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = sequence_parallel
        return norm

    cls.__new__ = staticmethod(new)
    cls._sequence_parallel_patched = True


def reinit_parallel(tp: int = 1, pp: int = 1, vpp: Optional[int] = None, ep: int = 1, seed: int = 1234,
                    etp: Optional[int] = None, embedding_ranks: Tuple[int, ...] = ()) -> None:
    """(Re)create megatron's parallel groups (expert parallelism and expert TP, None: TP, included)
    in one process group. ``embedding_ranks``: the pipeline ranks of the embedding group where not
    megatron-core's default first and last (Megatron-LM's pretrain_gpt get_embedding_ranks: the first,
    the last when tied, and the MTP layers' ranks)."""
    from megatron.core import parallel_state, tensor_parallel

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             virtual_pipeline_model_parallel_size=vpp,
                                             expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
                                             **({"get_embedding_ranks": functools.partial(_embedding_ranks, embedding_ranks)}
                                                if embedding_ranks else {}))
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)


def _embedding_ranks(embedding_ranks: Tuple[int, ...], pp_ranks: List[int]) -> List[int]:
    """The global ranks of ``embedding_ranks`` (pipeline ranks) in this pipeline group."""
    return [pp_ranks[r] for r in embedding_ranks]


def _inner_optimizers(optimizer: Any) -> List[Any]:
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def state_bytes(chunks: List[Any], optimizer: Any) -> Dict[str, int]:
    """``weights`` (distinct parameter storages), ``gradients`` (DDP grad buffers),
    ``optimizer/main_params`` (fp32 main copies) and one key per optimizer state tensor name
    (``optimizer/exp_avg``, ...; one-element ``step`` tensors skipped)."""
    params = [p for c in chunks for p in c.parameters()]
    out = {"weights": unique_bytes(params)}
    buffers = [b for c in chunks for b in list(c.buffers) + list(c.expert_parallel_buffers)]
    out["gradients"] = sum(b.grad_data.numel() * b.grad_data.element_size() for b in buffers)
    main: List[torch.Tensor] = []
    for opt in _inner_optimizers(optimizer):
        for attr in ("shard_fp32_from_float16_groups", "fp32_from_float16_groups"):
            for group in getattr(opt, attr, None) or []:
                main += list(group)
        # (An optimizer over no parameters, e.g. the dense one when only experts train, has none.)
        for state in opt.optimizer.state.values() if opt.optimizer is not None else ():
            for name, value in state.items():
                if isinstance(value, torch.Tensor) and value.numel() > 1:
                    key = f"optimizer/{name}"
                    out[key] = out.get(key, 0) + value.numel() * value.element_size()
    if main:
        out["optimizer/main_params"] = unique_bytes(main)
    return out


# ---------------------------------------------------------------------------
# A real training step: megatron-core DDP (+ distributed optimizer) and its optimizer
# ---------------------------------------------------------------------------


BRIDGE_VENV = "megatron-bridge-0.3.1"


def bridge_peft(module: str = "utils") -> Optional[Any]:
    """Megatron-Bridge 0.3.1's ``peft/<module>.py`` (``utils``: ``ParallelLinearAdapter``,
    ``get_adapter_attributes_from_linear``; ``recompute``: ``maybe_enable_recompute_inputs_grad``)
    from its cached venv (tests/frameworks/envs.py), imported against this environment's
    megatron-core 0.16.1 (the version that venv pins): empty namespace packages stand in for
    ``megatron.bridge`` and its ``utils`` and ``peft`` (their ``__init__`` imports transformers).
    ``HAVE_TE`` set False: megatron-core's TE extension imports here but its classes are
    placeholders. None when that venv is absent."""
    import importlib
    import os
    import sys
    import types
    from pathlib import Path

    venvs = Path(os.environ.get("MEGATRON_FLOPS_TEST_VENVS") or Path.home() / ".cache" / "megatron-flops" / "venvs")
    root = venvs / BRIDGE_VENV / "lib" / "python3.11" / "site-packages" / "megatron" / "bridge"
    if not (root / "peft" / f"{module}.py").is_file():
        return None
    for name, sub in (("megatron.bridge", root), ("megatron.bridge.utils", root / "utils"),
                      ("megatron.bridge.peft", root / "peft")):
        if name not in sys.modules:
            package = types.ModuleType(name)
            package.__path__ = [str(sub)]
            sys.modules[name] = package
    loaded = importlib.import_module(f"megatron.bridge.peft.{module}")
    if module == "utils":
        loaded.HAVE_TE = False
    return loaded


class _StandInAdapter(torch.nn.Module):
    """Bridge's ``ParallelLinearAdapter`` (identity activation, no dropout, local layers, no
    sequence parallelism) where its venv is absent: ``linear_in`` a ``RowParallelLinear`` for a
    row-parallel base, else a ``ColumnParallelLinear`` gathering its output; ``linear_out`` a
    ``ColumnParallelLinear`` gathering its output for a row-parallel base."""

    def __init__(self, base: torch.nn.Module, rank: int) -> None:
        super().__init__()
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        row = isinstance(base, RowParallelLinear)
        config, init = base.config, lambda w: torch.nn.init.normal_(w, std=0.02)  # noqa: E731
        if row:
            self.linear_in = RowParallelLinear(base.input_size, rank, config=config, init_method=init, bias=False,
                                               input_is_parallel=True, skip_bias_add=True)
        else:
            self.linear_in = ColumnParallelLinear(base.input_size, rank, config=config, init_method=init, bias=False,
                                                  gather_output=True)
        self.linear_out = ColumnParallelLinear(rank, base.output_size, config=config, init_method=init, bias=False,
                                               gather_output=row)

    def forward(self, x):
        return self.linear_out(self.linear_in(x)[0])[0]


class LoRALinear(torch.nn.Module):
    """Megatron-Bridge's ``LoRALinear`` forward (its module imports Transformer Engine):
    ``to_wrap`` (the frozen layer) + ``adapter`` applied to the same input."""

    def __init__(self, to_wrap: torch.nn.Module, adapter: torch.nn.Module) -> None:
        super().__init__()
        self.to_wrap = to_wrap
        self.adapter = adapter

    def forward(self, x, *args, **kwargs):
        out, bias = self.to_wrap(x, *args, **kwargs)
        return out + self.adapter(x.contiguous()).reshape(out.shape), bias


def _adapter(utils: Optional[Any], base: torch.nn.Module, full_name: str, rank: int) -> torch.nn.Module:
    """As Bridge's ``LoRA.transform`` builds it for a megatron-core local linear layer."""
    if utils is None:
        return _StandInAdapter(base, rank)
    expert = utils.is_expert_linear(full_name)
    attrs = utils.get_adapter_attributes_from_linear(base, is_expert=expert)
    return utils.ParallelLinearAdapter(
        attrs.in_features, attrs.out_features, rank, base_linear_name=full_name, activation="identity",
        norm_type=None, column_init_method="xavier", row_init_method="zero", gather_output=False,
        input_is_parallel=attrs.input_is_parallel, dropout=0.0, dropout_position="pre",
        model_parallel_config=base.config, alpha=rank, is_expert=expert, a2a_experimental=False,
        disable_tensor_parallel_comm=attrs.disable_tensor_parallel_comm,
        disable_sequence_parallel_comm=attrs.disable_sequence_parallel_comm,
        base_linear_is_parallel=attrs.base_linear_is_parallel)


def apply_lora(model: torch.nn.Module, targets: Tuple[str, ...], rank: int) -> bool:
    """Freeze every parameter, then wrap every module named in ``targets`` as Megatron-Bridge's
    LoRA does: where its venv exists (returns True), its real ``ParallelLinearAdapter`` and its
    recompute fix (``maybe_enable_recompute_inputs_grad``), else the stand-in and no fix."""
    for p in model.parameters():
        p.requires_grad_(False)
    utils = bridge_peft()
    for prefix, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if name in targets and not isinstance(parent, LoRALinear):
                full = f"{prefix}.{name}" if prefix else name
                setattr(parent, name, LoRALinear(child, _adapter(utils, child, full, rank)))
    if utils is not None:
        # As Bridge's PEFT.__call__: under full recompute the decoder's input requires grad. (A
        # registry of its own: Bridge's global one holds ids of models built before.)
        bridge_peft("recompute").maybe_enable_recompute_inputs_grad(model, {-1})
    return utils is not None


class _CudaTypeNames(torch.overrides.TorchFunctionMode):
    """``Tensor.type()`` answers ``torch.cuda.<X>Tensor`` for CPU tensors: megatron-core's
    optimizers accept parameters by those names only (test-only, CPU)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and out.startswith("torch.") \
                and not out.startswith("torch.cuda."):
            return "torch.cuda." + out[len("torch."):]
        return out


@contextlib.contextmanager
def on_cpu() -> Iterator[None]:
    """CUDA device arguments mapped to CPU and CUDA tensor type names (for the optimizer)."""
    try:
        from . import mcore_cpu
    except ImportError:
        import mcore_cpu  # type: ignore[no-redef]

    with mcore_cpu.cuda_to_cpu_mode(), _CudaTypeNames():
        yield


def build_training(
    config_kwargs: Dict[str, Any],
    *,
    vocab_size: int,
    seq_length: int,
    params_dtype: str = "bf16",
    distributed_optimizer: bool = False,
    optimizer: str = "adam",
    share_embeddings: bool = True,
    position_embedding_type: str = "rope",
    bucket_size: Optional[int] = None,
    lora: Optional[Tuple[Tuple[str, ...], int]] = None,
):
    """Model chunks for the current parallel groups, as Megatron-LM's ``get_model`` builds them
    (``Float16Module`` for bf16/fp16, megatron-core DDP with bucketing for chunk 0 only), and
    ``get_megatron_optimizer``. Returns ``(chunks, optimizer, config)``."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    try:
        from . import mcore_cpu, mcore_dist
    except ImportError:
        import mcore_cpu  # type: ignore[no-redef]
        import mcore_dist  # type: ignore[no-redef]

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[params_dtype]
    kwargs = dict(config_kwargs, params_dtype=dtype, pipeline_dtype=dtype,
                  bf16=params_dtype == "bf16", fp16=params_dtype == "fp16")
    chunks, config = mcore_dist.build_model_chunks(kwargs, vocab_size, seq_length, share_embeddings=share_embeddings,
                                                   position_embedding_type=position_embedding_type)
    if lora is not None:
        for chunk in chunks:
            apply_lora(chunk, *lora)
    if params_dtype != "fp32":
        chunks = [Float16Module(config, c) for c in chunks]
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=bucket_size is not None,
        use_distributed_optimizer=distributed_optimizer,
        bucket_size=bucket_size,
    )
    chunks = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=c, disable_bucketing=i > 0)
              for i, c in enumerate(chunks)]
    config.no_sync_func = [c.no_sync for c in chunks] if len(chunks) > 1 else chunks[0].no_sync
    if bucket_size is not None:
        config.grad_sync_func = [c.start_grad_sync for c in chunks] if len(chunks) > 1 else chunks[0].start_grad_sync
    config.finalize_model_grads_func = finalize_model_grads
    opt_config = OptimizerConfig(optimizer=optimizer, lr=1e-4, bf16=params_dtype == "bf16",
                                 fp16=params_dtype == "fp16", params_dtype=dtype,
                                 use_distributed_optimizer=distributed_optimizer, clip_grad=1.0)
    with on_cpu():
        opt = get_megatron_optimizer(opt_config, chunks)
    return chunks, opt, config


def batches(num_microbatches: int, micro_batch_size: int, seq_length: int, vocab_size: int,
            seed: int = 0) -> Iterator[Dict[str, torch.Tensor]]:
    """Micro-batches as Megatron-LM's GPT dataset collates them: a bool causal mask
    [b, 1, s, s] (True = masked), int64 tokens/labels/positions, an fp32 loss mask."""
    gen = torch.Generator().manual_seed(seed)
    b, s = micro_batch_size, seq_length
    for _ in range(num_microbatches):
        yield dict(
            input_ids=torch.randint(0, vocab_size, (b, s), generator=gen),
            labels=torch.randint(0, vocab_size, (b, s), generator=gen),
            position_ids=torch.arange(s).expand(b, s).contiguous(),
            attention_mask=torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1).expand(b, 1, s, s).contiguous(),
            loss_mask=torch.ones(b, s),
        )


def metered_forward_step(meter: SavedTensorMeter, chunks: List[torch.nn.Module]) -> Callable:
    """A ``forward_step_func`` that runs each chunk's forward (and, on the last stage, the loss
    function the schedule calls next) as one :meth:`SavedTensorMeter.one_forward`; the index of
    the chunk of each forward is appended to ``meter.forward_chunks``."""

    def loss_func(loss_mask: torch.Tensor, output: torch.Tensor):
        with meter.one_forward(extend=True):
            losses = output.float().view(-1)
            loss = torch.sum(losses * loss_mask.view(-1))
        num_tokens = loss_mask.sum().to(torch.int)
        return loss, num_tokens, {"lm loss": torch.cat([loss.detach().view(1), num_tokens.float().view(1)])}

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        meter.forward_chunks.append(next(i for i, c in enumerate(chunks) if c is model))
        with meter.one_forward():
            # (As Megatron-LM's forward_step: the loss mask too, which multi-token prediction reads.)
            output = model(batch["input_ids"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"],
                           loss_mask=batch["loss_mask"])
        return output, lambda out: loss_func(batch["loss_mask"], out)

    return forward_step


class _NoStream:
    """Test-only stand-in for ``torch.cuda.Stream``/``Event`` on CPU: work runs in order."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, *args: Any) -> None:
        pass

    def wait_event(self, *args: Any) -> None:
        pass

    def record_event(self, *args: Any) -> "_NoStream":
        return _NoStream()

    def record(self, *args: Any) -> None:
        pass

    def wait(self, *args: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


def patch_megatron_fsdp_on_cpu() -> None:
    """Test-only: Megatron-FSDP runs its buffers' copies and collectives on CUDA streams; on CPU
    with gloo every op runs in order, so streams and events become no-ops (``record_stream``
    too)."""
    torch.cuda.Stream = _NoStream  # type: ignore[misc,assignment]
    torch.cuda.Event = _NoStream  # type: ignore[misc,assignment]
    torch.cuda.current_stream = lambda *args: _NoStream()  # type: ignore[assignment]
    torch.cuda.stream = lambda stream: contextlib.nullcontext()  # type: ignore[assignment]
    torch.Tensor.record_stream = lambda self, stream: None  # type: ignore[method-assign,assignment]


def wrap_megatron_fsdp(config: Any, module: torch.nn.Module, strategy: str,
                       unit_modules: Optional[List[type]] = None) -> Any:
    """megatron-core's ``FullyShardedDataParallel`` around ``module`` on CPU, with Megatron-LM's
    DDP config for ``--use-megatron-fsdp`` (fp32 gradient reduction; gloo has no PREMUL_SUM:
    the scaling runs before the sum, ``gradient_reduce_div_fusion`` off); ``unit_modules``: its
    ``fsdp_unit_modules`` (None: megatron-core's default, ``TransformerLayer`` under
    ``optim_grads_params``)."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

    try:
        from . import mcore_cpu
    except ImportError:
        import mcore_cpu  # type: ignore[no-redef]

    ddp_config = DistributedDataParallelConfig(data_parallel_sharding_strategy=strategy, grad_reduce_in_fp32=True,
                                               use_megatron_fsdp=True, use_distributed_optimizer=True,
                                               gradient_reduce_div_fusion=False)
    current_device = torch.cuda.current_device
    torch.cuda.current_device = lambda: 0  # (its device check builds "cuda:<current device>")
    try:
        with mcore_cpu.cuda_to_cpu_mode():
            return FullyShardedDataParallel(config=config, ddp_config=ddp_config, module=module,
                                            fsdp_unit_modules=unit_modules, device=torch.device("cpu"))
    finally:
        torch.cuda.current_device = current_device  # type: ignore[assignment]


def megatron_fsdp_state_bytes(model: Any, optimizer: Any) -> Dict[str, int]:
    """``weights``, ``gradients`` and ``optimizer/main_params``: Megatron-FSDP's model-weight,
    main-gradient and main-weight buffers on this rank; ``optimizer/<state>`` the local shards of
    the optimizer's DTensor states."""
    out = {"weights": 0, "gradients": 0, "optimizer/main_params": 0}
    for group in model.param_and_grad_buffer.parameter_groups:
        for key, buffer in (("weights", group.model_weight_buffer), ("gradients", group.main_grad_buffer),
                            ("optimizer/main_params", group.main_weight_buffer)):
            if buffer is not None and buffer.data is not None:
                out[key] += buffer.data.numel() * buffer.data.element_size()
    for opt in _inner_optimizers(optimizer):
        # (An optimizer over no parameters, e.g. the dense one when only experts train, has none.)
        for state in opt.optimizer.state.values() if opt.optimizer is not None else ():
            for name, value in state.items():
                value = value.to_local() if hasattr(value, "to_local") else value
                if isinstance(value, torch.Tensor) and value.numel() > 1:
                    out[f"optimizer/{name}"] = out.get(f"optimizer/{name}", 0) + value.numel() * value.element_size()
    return out
