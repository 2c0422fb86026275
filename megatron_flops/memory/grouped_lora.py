"""Megatron-Bridge 0.6.2's LoRA adapter layouts on grouped-GEMM experts (``TEGroupedMLP``):
parameters, what they keep for backward and what they add to collectives (stdlib only).

Bridge adapts a grouped expert linear (``is_grouped_expert_linear``: ``mlp.experts.linear_fc1``/
``linear_fc2``, not ``SequentialMLP``'s ``local_experts.N.``, which get their own adapter each
anyway; legacy ``GroupedMLP`` has no linear to match) in one of three ways (``LoRA`` fields):

- ``shared`` (``share_expert_adapters``, the default; 0.3.1's only layout): one
  ``ParallelLinearAdapter`` shared by the E/EP local experts (:mod:`.moe_grouped`).
- ``per-expert`` (``share_expert_adapters=False``): ``GroupedExpertLinearAdapter``, one packed
  parameter per side, ``linear_in`` [E/EP, r/ETP, h] and ``linear_out`` [E/EP, out/ETP, r] on
  ``linear_fc1``, [E/EP, r, ffn/ETP] and [E/EP, h/ETP, r] on ``linear_fc2``: each local expert
  ``SequentialMLP``'s adapter, reduced over expert DP when EP > 1 or ETP != TP (its
  ``allreduce``), the same expert-TP gathers as the shared adapter. What it keeps depends on its
  path: bf16 on a GPU of compute capability 8.0 or more with every local matrix dimension a
  multiple of 8 runs ``torch.nn.functional.grouped_mm`` over ``torch.cat`` of the experts' token
  slices, a copy of its input [n, in] (with more than one local expert) that the grouped GEMM
  keeps, its int32 offsets [E/EP], and the weights it indexes per call (``weight[active experts]``:
  copies, which it keeps where the GEMM's input requires grad, each index op keeping its int64
  indices [E/EP]); otherwise (fp32/fp16, other sizes) a loop of per-expert
  ``linear`` calls that keep views of the input and [n_e, r] each: the shared adapter's count.
  NB: FP8 (Transformer Engine's grouped kernel) is not modelled.
- ``shared-outer`` (``experts_shared_outer_loras``, SGLang's serving contract):
  ``SharedOuterGroupedExpertAdapter``: ``linear_fc1``'s A a ``ColumnParallelLinear`` [r, h]
  shared by the experts, its B packed per expert [E/EP, out, r]; ``linear_fc2``'s A packed per
  expert [E/EP, r, ffn] and its B a ``RowParallelLinear`` [h, r] shared. The packed sides are
  sized to the whole expert width (``get_adapter_attributes_from_linear`` undoes the base's
  split), so they match the base linear at expert TP 1 only: under ETP > 1 the adapter's output
  cannot be added to the base's (refused: Bridge's limit, read in its source). The packed sides
  are expert-DP parameters (``allreduce=False``); the shared ones are expert-DP when EP > 1 or
  TP > 1 (megatron-core 0.19's ``use_expert_pgs``), and ``_make_cross_ep_replicated`` hooks
  their gradient: every backward it is SUM all-reduced over the stage's TP x DP x CP ranks
  (``tp_dp_cp/all_reduce``, the gradient in the parameter dtype). Each packed side runs
  ``torch._grouped_mm``, which keeps its input (the shared side's [n, r] output or fc2's input,
  as the shared adapter's) and its int32 offsets [E/EP].

Every layout runs each routed token through one rank-r pair per adapted linear: the same GEMM
FLOPs (``estimate`` prices them alike).
"""

from __future__ import annotations

from collections.abc import Mapping

from megatron_flops.flops.passes import PeftSpec
from megatron_flops.memory.layout import INDEX_BYTES, Parallelism

OFFSET_BYTES = 4  # int32 group offsets of a grouped GEMM
ADAPTED = ("linear_fc1", "linear_fc2")


def check_grouped_lora(par: Parallelism, peft: PeftSpec | None, *, grouped: bool) -> None:
    """ValueError for a layout Megatron-Bridge 0.6.2's grouped-expert adapters cannot train."""
    if grouped and peft is not None and peft.lora_rank is not None and \
            peft.grouped_expert_adapters == "shared-outer" and par.expert_tp > 1:
        raise ValueError(f"Megatron-Bridge 0.6.2's shared-outer grouped-expert LoRA (experts_shared_outer_loras) "
                         f"sizes its per-expert side to the whole expert width, which does not match linears split "
                         f"over expert TP {par.expert_tp}: it cannot train there (set --etp 1)")


def grouped_adapter_tensors(peft: PeftSpec, par: Parallelism, *, width: int, ffn: int, gate: int,
                            num_local: int) -> list[tuple[str, int, int, bool]]:
    """(name under the experts, numel, dim 0, expert-DP) of every adapter parameter of one
    ``TEGroupedMLP`` with ``per-expert`` or ``shared-outer`` adapters (see the module doc);
    ``width``: h (or the latent size), ``ffn``: the expert width on this expert-TP rank, ``gate``:
    2 for a gated fc1."""
    assert peft.lora_rank is not None and peft.grouped_expert_adapters != "shared"
    r, etp, e = peft.lora_rank, par.expert_tp, num_local
    out: list[tuple[str, int, int, bool]] = []
    if peft.grouped_expert_adapters == "per-expert":
        grouped = par.ep > 1 or etp != par.tp
        shapes = {"linear_fc1": ((r // etp, width), (gate * ffn, r)), "linear_fc2": ((r, ffn), (width // etp, r))}
        for name in ADAPTED:
            if name in peft.lora_targets:
                for side, (rows, cols) in zip(("linear_in", "linear_out"), shapes[name]):
                    out.append((f"{name}.adapter.{side}.weight", e * rows * cols, e, grouped))
        return out
    shared = par.ep > 1 or par.tp > 1  # (expert TP 1 here)
    if "linear_fc1" in peft.lora_targets:
        out += [("linear_fc1.adapter.linear_in.weight", r * width, r, shared),
                ("linear_fc1.adapter.linear_out.weight", e * gate * ffn * r, e, True)]
    if "linear_fc2" in peft.lora_targets:
        out += [("linear_fc2.adapter.linear_in.weight", e * r * ffn, e, True),
                ("linear_fc2.adapter.linear_out.weight", width * r, width, shared)]
    return out


def adapter_weight_numels(peft: PeftSpec, par: Parallelism, *, width: int, ffn: int, gate: int,
                          num_local: int) -> dict[str, tuple[int, int]]:
    """(``linear_in``, ``linear_out``) elements of each adapted expert linear's ``per-expert`` or
    ``shared-outer`` adapter ({} for the shared adapter; see :func:`grouped_adapter_tensors`)."""
    out: dict[str, tuple[int, int]] = {}
    if peft.lora_rank is None or peft.grouped_expert_adapters == "shared":
        return out
    for name, numel, _, _ in grouped_adapter_tensors(peft, par, width=width, ffn=ffn, gate=gate, num_local=num_local):
        linear, side = name.split(".")[0], name.split(".")[2]  # linear_fc1.adapter.linear_in.weight
        inn, outer = out.get(linear, (0, 0))
        out[linear] = (inn + numel, outer) if side == "linear_in" else (inn, outer + numel)
    return out


def uses_grouped_mm(peft: PeftSpec, par: Parallelism, *, bf16: bool, width: int, ffn: int, gate: int) -> bool:
    """Whether ``per-expert`` adapters take ``grouped_mm``'s path (bf16, every local matrix
    dimension a multiple of 8; a GPU of compute capability 8.0 or more assumed)."""
    assert peft.lora_rank is not None
    r, etp = peft.lora_rank, par.expert_tp
    dims = {"linear_fc1": (r // etp, width, gate * ffn, r), "linear_fc2": (r, ffn, width // etp, r)}
    return bf16 and all(d % 8 == 0 for t in ADAPTED if t in peft.lora_targets for d in dims[t])


def grouped_adapter_saved(peft: PeftSpec, *, grouped_mm: bool, got: int, num_local: int, width: int, ffn: int,
                          act: int, frozen: bool, moe_act: bool, weights: Mapping[str, tuple[int, int]],
                          started: bool = True) -> int:
    """Bytes one MoE layer's ``per-expert`` or ``shared-outer`` adapters keep per micro-batch
    beyond the shared adapter's (:func:`~megatron_flops.memory.moe.expert_lora_activations`), for
    ``got`` routed tokens on this rank: each grouped GEMM's int32 offsets [E/EP]; on
    ``grouped_mm``'s path the concatenated copy of each adapter's input [n, in] (more than one
    local expert), which stands in for the input a frozen base's adapter keeps otherwise (but
    fc2's under ``moe_act``, whose input the checkpoint frees: counted there), and the weights it
    indexes per call (``weight[active experts]``: a copy, ``weights``: the numels of each adapted
    linear's ``linear_in`` and ``linear_out``), whose index op keeps the int64 indices [E/EP]:
    ``grouped_mm`` keeps ``linear_out``'s copy (its input, the [n, r] intermediate, requires
    grad), and ``linear_in``'s where its input requires grad (``started``: the hidden states do
    before the experts; else only fc2's, and only when fc1 is adapted: a frozen first layer whose
    gradient starts in them). Measured (the adapter alone, Bridge 0.6.2 on CPU with torch 2.13:
    tests/test_memory_grouped_start.py)."""
    layout = peft.grouped_expert_adapters
    if peft.lora_rank is None or layout == "shared" or (layout == "per-expert" and not grouped_mm):
        return 0
    total = 0
    for name, inp in zip(ADAPTED, (width, ffn)):
        if name not in peft.lora_targets:
            continue
        total += num_local * OFFSET_BYTES
        if layout == "per-expert" and num_local > 1 and not (frozen and not (name == "linear_fc2" and moe_act)):
            total += got * inp * act
        if layout == "per-expert":
            in_numel, out_numel = weights[name]
            input_grad = started or (name == "linear_fc2" and "linear_fc1" in peft.lora_targets)
            total += 2 * num_local * INDEX_BYTES + (out_numel + (in_numel if input_grad else 0)) * act
    return total


def cross_ep_all_reduce(peft: PeftSpec | None, par: Parallelism, *, width: int, moe_layers: int,
                        param_bytes: int, num_microbatches: int) -> dict[str, int]:
    """``tp_dp_cp/all_reduce`` bytes per step of ``shared-outer`` adapters' shared sides on
    ``moe_layers`` MoE layers of one pipeline rank: each backward, fc1's A [r, h] and fc2's B
    [h, r] gradients over the stage's TP x DP x CP ranks ({} when that group is one rank)."""
    if peft is None or peft.lora_rank is None or peft.grouped_expert_adapters != "shared-outer" \
            or par.tp * par.dp * par.cp == 1:
        return {}
    shared = sum(name in peft.lora_targets for name in ADAPTED) * peft.lora_rank * width
    value = num_microbatches * moe_layers * shared * param_bytes
    return {"tp_dp_cp/all_reduce": value} if value else {}


def grouped_lora_note(peft: PeftSpec) -> str:
    """The ``unmeasured`` text of a ``TEGroupedMLP``'s adapters under ``peft``."""
    return {
        "shared": "one adapter per grouped linear shared by the local experts (share_expert_adapters), kept per "
                  "routed token as SequentialMLP's",
        "per-expert": "one adapter per local expert (share_expert_adapters off), packed [E/EP, ...]: bf16 with "
                      "every local dimension a multiple of 8 runs grouped_mm on a copy of its input (a GPU of "
                      "compute capability 8.0 or more assumed), else a per-expert loop kept as SequentialMLP's",
        "shared-outer": "shared-outer adapters (experts_shared_outer_loras): fc1's A and fc2's B shared, their "
                        "gradients all-reduced over TP x DP x CP each backward, the other sides per expert "
                        "through torch._grouped_mm",
    }[peft.grouped_expert_adapters]
