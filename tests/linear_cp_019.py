"""Test-only worker, run in megatron-core 0.19.0's Python 3.12 venv (tests/frameworks/envs.py):
megatron-core 0.19.0's ``GatedDeltaNet`` (one, or ``layers`` in a row) in gloo processes under
context parallelism, with stand-ins for fla's CUDA/Triton kernels that save what those kernels
save (the sizes :func:`megatron_flops.memory.ssm.gdn_saved` names). Measured: every storage saved
for backward (megatron-core's own: the all-to-all output's copies, the CP-sliced conv weight,
``exp(A_log)``, the head permutation's index, one cached tensor for every layer; the stand-ins'
of the kernels' sizes) and the ``cp/*`` payloads forward and backward.

NB: megatron-core decorates ``_prepare_input_for_gated_delta_rule``, ``_compute_g_and_beta`` and
``_apply_gated_norm`` with ``torch.compile`` (``jit_fuser``); here the fuser is off (eager), and
``_apply_gated_norm`` is a stand-in saving what the fused norm and gate keep.

Run: ``python -c 'import linear_cp_019; linear_cp_019.main()' JSON`` with tests/ on sys.path;
prints one JSON line: per case, per rank ``{"saved", "forward", "step"}``."""

from __future__ import annotations

import json
import sys
from typing import Any

import torch

import mcore_dist

FLA_CHUNK = 64


class _Conv(torch.autograd.Function):
    """fla's ``causal_conv1d`` stand-in: saves its contiguous input and the weight handed to it."""

    @staticmethod
    def forward(ctx, x, weight):
        x = x.contiguous()
        ctx.save_for_backward(x, weight)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _L2Norm(torch.autograd.Function):
    """fla's ``l2norm`` stand-in: saves its output and fp32 rstd per row."""

    @staticmethod
    def forward(ctx, x):
        y = x.clone()
        ctx.save_for_backward(y, torch.empty(x.numel() // x.shape[-1], dtype=torch.float32))
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad


class _Rule(torch.autograd.Function):
    """fla's ``chunk_gated_delta_rule`` stand-in: saves q, k, v, beta, the chunk-cumulated fp32 g
    and the solved WY matrix [b, s, heads, 64] in the activation dtype; returns [b, s, heads, dv]."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta):
        a = torch.empty(*v.shape[:3], FLA_CHUNK, dtype=v.dtype)
        ctx.save_for_backward(q, k, v, g.clone(), beta, a)
        return v.clone()

    @staticmethod
    def backward(ctx, grad):
        return None, None, grad, None, None


class _GatedNorm(torch.autograd.Function):
    """The fused gated norm's stand-in: saves its input, fp32 rstd per row, its output and the gate."""

    @staticmethod
    def forward(ctx, x, gate):
        y = x.clone()
        ctx.save_for_backward(x, torch.empty(x.shape[0], dtype=torch.float32), y, gate)
        return y * 1

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _patch_gdn() -> Any:
    from megatron.core import jit

    jit.disable_jit_fuser()
    from megatron.core.ssm.gated_delta_net import common, gdn

    common.HAVE_FLA = True
    common.l2norm = _L2Norm.apply
    gdn.causal_conv1d = lambda x, weight, bias=None, **_: (_Conv.apply(x, weight), None)
    gdn.chunk_gated_delta_rule = lambda q, k, v, g, beta, **_: (_Rule.apply(q, k, v, g, beta), None)

    def gated_norm(self, x, gate):
        return _GatedNorm.apply(x.reshape(-1, x.shape[-1]), gate.reshape(-1, gate.shape[-1]))

    common._GDNBase._apply_gated_norm = gated_norm
    return gdn, common


def _gdn_worker(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    import mcore_cpu
    import mcore_memory

    mcore_dist.init_worker()
    gdn, common = _patch_gdn()
    out = []
    for case in cases:
        cp = case["cp"]
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(context_parallel_size=cp)
        config = mcore_cpu.make_config(dict(case["model"], num_layers=1, context_parallel_size=cp,
                                            activation_func=torch.nn.functional.silu, normalization="RMSNorm",
                                            add_bias_linear=False, bf16=True, params_dtype=torch.bfloat16))
        with mcore_cpu.cuda_to_cpu_mode():
            layers = torch.nn.ModuleList(gdn.GatedDeltaNet(config, common.GatedDeltaNetSubmodules(
                in_proj=ColumnParallelLinear, out_norm=WrappedTorchNorm, out_proj=RowParallelLinear),
                layer_number=n + 1, pg_collection=ProcessGroupCollection.use_mpu_process_groups())
                for n in range(case.get("layers", 1)))
        meter = mcore_memory.SavedTensorMeter(layers.parameters())
        comm = mcore_memory.CommMeter([("cp", ps.get_context_parallel_group())])
        y = torch.randn(case["seq"] // cp, case["mbs"], case["model"]["hidden_size"], dtype=torch.bfloat16,
                        requires_grad=True)
        with comm, meter.tracking(), meter.one_forward(), mcore_cpu.cuda_to_cpu_mode():
            for layer in layers:  # (each layer's output is the next one's input)
                y, _ = layer(y, None)
        forward_comm = dict(comm.bytes)
        with comm, mcore_cpu.cuda_to_cpu_mode():
            y.float().sum().backward()
        params = [(name, p.numel()) for name, p in layers[0].named_parameters()]
        out.append(dict(saved=meter.forward[0], forward=forward_comm, step=dict(comm.bytes), params=params))
    dist.barrier()
    return out


class _Hadamard(torch.autograd.Function):
    """fast_hadamard_transform's stand-in (saves nothing, as the CUDA kernel)."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return _Hadamard.rotate(x, scale)

    @staticmethod
    def backward(ctx, grad):
        return _Hadamard.rotate(grad, ctx.scale), None

    @staticmethod
    def rotate(x, scale):
        h = torch.ones(1, 1)
        while h.size(0) < x.size(-1):
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
        return (x.float() @ h * scale).to(x.dtype)


def _cpu_mode() -> Any:
    """:func:`mcore_cpu.cuda_to_cpu_mode`, and no pinned memory (0.19's RoPE pins its CP index)."""
    import mcore_cpu

    class Mode(type(mcore_cpu.cuda_to_cpu_mode())):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = {k: v for k, v in (kwargs or {}).items() if k != "pin_memory"}
            return super().__torch_function__(func, types, args, kwargs)

    return Mode()


def _dsa_attentions(model: dict, loss_coeff: float, dtype: torch.dtype, num_layers: int = 1) -> list[Any]:
    """megatron-core 0.19.0's DSA attention (``get_dsa_module_spec_for_backend``: the absorbed MLA
    self-attention around ``DSAttention``) from the local backend's layers, the indexer's
    duplicated linears as torch linears, bf16, on this process's TP and CP groups: layers 1 to
    ``num_layers`` on one config (which carries the shared top-k when ``attention_mask`` is None)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.models.gpt import experimental_attention_variant_module_specs as specs
    from megatron.core.transformer.experimental_attention_variant import dsa
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    class Duplicated(torch.nn.Linear):  # TELinear(parallel_mode="duplicated"): (output, bias)
        def __init__(self, d_in, d_out, *, bias=False, **_):
            super().__init__(d_in, d_out, bias=bias)

        def forward(self, x):
            return super().forward(x), None

    class Norm:  # WrappedTorchNorm, which refuses sequence parallelism
        def __new__(cls, config, hidden_size, eps=1e-5, **kw):
            sequence_parallel, config.sequence_parallel = config.sequence_parallel, False
            try:
                return WrappedTorchNorm(config, hidden_size, eps, **kw)
            finally:
                config.sequence_parallel = sequence_parallel

    class Backend(LocalSpecProvider):
        def linear(self):
            return Duplicated

        def layer_norm(self, rms_norm=False, for_qk=False, has_residual=False):  # (Apex's absent: the same)
            return Norm

    dsa.hadamard_transform = _Hadamard.apply
    config = MLATransformerConfig(**model, experimental_attention_variant="dsa", dsa_indexer_loss_coeff=loss_coeff,
                                  normalization="RMSNorm", add_bias_linear=False, use_cpu_initialization=True,
                                  rope_type="rope", bf16=dtype == torch.bfloat16, params_dtype=dtype,
                                  context_parallel_size=ps.get_context_parallel_world_size(),
                                  tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
                                  cp_comm_type="allgather")
    spec = specs.get_dsa_module_spec_for_backend(config, backend=Backend())
    # The down projections as the local MLA spec builds them (ColumnParallelLinear, not gathered).
    spec.submodules.linear_q_down_proj = spec.submodules.linear_kv_down_proj = ColumnParallelLinear
    with _cpu_mode():
        return [build_module(spec, config=config, layer_number=n, cp_comm_type="allgather").to(dtype)
                for n in range(1, num_layers + 1)]


def _run(attention: Any, x: torch.Tensor, recompute: bool) -> torch.Tensor:
    """One DSA attention's output; ``recompute``: inside megatron-core's full-recompute checkpoint
    (``tensor_parallel.checkpoint``, as ``TransformerBlock._checkpointed_forward`` wraps a layer)."""
    if not recompute:
        return attention(x, attention_mask=None)[0]
    from megatron.core import tensor_parallel

    return tensor_parallel.checkpoint(lambda inp: attention(inp, attention_mask=None)[0], False, x)


def _dsa_worker(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    """Per case: ``layers`` DSA attentions (default 1; with ``dsa_indexer_topk_freq`` 2 the second
    reuses the first's top-k) on TP ``tp`` (default 1; ``sp``: sequence parallelism) x CP ``cp``,
    their forwards in turn (``recompute``: each in a full-recompute checkpoint), then one backward.
    ``saved``/``forward``: the first layer's; ``layers``: each one's saved bytes and forward
    payloads; ``held``: bytes of the shared top-k holder's storages that no layer saved;
    ``forward_peak``/``peak``: the most saved bytes live after the forwards / at any time (the
    backward's re-runs); ``error``: an AssertionError's message instead."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    import mcore_memory

    mcore_dist.init_worker()
    out: list[dict] = []
    for case in cases:
        tp, cp, seq, mbs, sp = case.get("tp", 1), case["cp"], case["seq"], case["mbs"], case.get("sp", False)
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
        dtype = getattr(torch, case["dtype"])
        try:
            attentions = _dsa_attentions(dict(case["model"], sequence_parallel=sp), case["loss_coeff"], dtype,
                                         case.get("layers", 1))
        except AssertionError as exc:
            out.append(dict(error=str(exc)))
            continue
        meter = mcore_memory.SavedTensorMeter([p for a in attentions for p in a.parameters()])
        comm = mcore_memory.CommMeter([("cp", ps.get_context_parallel_group()),
                                       ("tp", ps.get_tensor_model_parallel_group())])
        torch.manual_seed(0)
        ys, layers, before = [], [], {}
        try:
            for attention in attentions:
                x = torch.randn(seq // cp // (tp if sp else 1), mbs, case["model"]["hidden_size"], dtype=dtype,
                                requires_grad=True)
                with comm, meter.tracking(), meter.one_forward(), _cpu_mode():
                    ys.append(_run(attention, x, case.get("recompute", False)))
                now = dict(comm.bytes)
                layers.append(dict(saved=meter.forward[-1], forward={k: v - before.get(k, 0) for k, v in now.items()
                                                                     if v != before.get(k, 0)}))
                before = now
        except AssertionError as exc:
            out.append(dict(error=str(exc)))
            continue
        holder = getattr(attentions[0].core_attention.config, "_dsa_index_share_topk_holder", {})
        held = sum(t.untyped_storage().nbytes() for t in holder.values() if t.untyped_storage().data_ptr()
                   not in meter.live)
        forward_peak = meter.peak
        with comm, meter.tracking(), _cpu_mode():
            sum(y.float().sum() for y in ys).backward()
        params = [(name, p.numel()) for name, p in attentions[0].named_parameters()]
        out.append(dict(saved=layers[0]["saved"], forward=layers[0]["forward"], layers=layers, held=held,
                        step=dict(comm.bytes), params=params, forward_peak=forward_peak, peak=meter.peak))
    dist.barrier()
    return out


def _worker(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    """Each case in turn (its ``layer``: ``dsa`` first, then ``gdn``, whose patches turn the
    jit fuser off for modules imported after them), one process group for all."""
    out = _dsa_worker(rank, world_size, [c for c in cases if c["layer"] == "dsa"])
    return out + _gdn_worker(rank, world_size, [c for c in cases if c["layer"] == "gdn"])


def main() -> None:
    """The cases in ``sys.argv[1]`` on 2 processes, or on TP x CP when a case names ``tp`` (one run per
    process count)."""
    cases = json.loads(sys.argv[1])
    by_case: dict[str, list] = {}
    for world in sorted({c.get("tp", 1) * c["cp"] if "tp" in c else 2 for c in cases}):
        mine = [c for c in cases if (c.get("tp", 1) * c["cp"] if "tp" in c else 2) == world]
        ordered = [c for c in mine if c["layer"] == "dsa"] + [c for c in mine if c["layer"] == "gdn"]
        ranks = mcore_dist.run_distributed(_worker, world, ordered, timeout=900)
        by_case.update({json.dumps(c, sort_keys=True): list(r) for c, r in zip(ordered, zip(*ranks))})
    print(json.dumps([by_case[json.dumps(c, sort_keys=True)] for c in cases]))
