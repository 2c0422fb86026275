"""Tensor-parallel traffic of one WAN-style DiT block per micro-batch, with and without sequence
parallelism, fully trained or LoRA on a frozen base, as Megatron-Bridge 0.6.2 builds ``WanModel``
(Transformer Engine layers; a formula: they do not run on CPU) (stdlib only).

The base layers (Bridge's layer spec): ``TEColumnParallelLinear`` for q/k/v (fused), the
cross-attention's q and k/v (fused; k_img/v_img), ``ffn.0``; ``TERowParallelLinear`` for o, the cross
o, ``ffn.2``; q/k RMSNorms across heads (``layernorm_across_heads``: q and k all-gathered over TP in
forward, their gradients in backward). Without sequence parallelism a row-parallel layer all-reduces
its output (forward) and a column-parallel one its input gradient (backward). Under sequence
parallelism a column-parallel layer all-gathers its input along the tokens in forward, again for the
weight gradient and reduce-scatters the input gradient in backward; a row-parallel one
reduce-scatters its output in forward and all-gathers its output gradient in backward. NB: the text
(CLIP) embeddings are whole on every TP rank, yet the cross-attention's k/v layer gathers them as if
each rank held a slice: ``TP x C`` rows.

A collective of the backward runs only where autograd reaches it
(:func:`~megatron_flops.memory.dit_activations.dit_block_input_grads`): an input gradient where the
input requires grad, a frozen layer's backward only where its input does (the first block of a
frozen base before its first adapter; the text embeddings of a frozen base everywhere), and a weight
gradient's all-gather only where the weight trains (NB: Transformer Engine skips both for a frozen
weight, as megatron-core's ``LinearWithFrozenWeight`` does where measured).

LoRA adapters: Bridge's ``ParallelLinearAdapter`` around ``TEColumnParallelLinear`` and
``TERowParallelLinear`` (``disable_sequence_parallel_comm`` off under sequence parallelism: no
Transformer Engine norm + linear fusion in WAN), one per adapted module of the example
(:func:`~megatron_flops.flops.dit.dit_block_parameters`), whose payloads are those measured for a GPT
(:func:`~megatron_flops.memory.lora.adapter_forward_payload` and
:func:`~megatron_flops.memory.lora.adapter_backward_payload`) over the module's rows; under sequence
parallelism an adapter whose input needs no gradient runs no input-gradient reduce-scatter.
"""

from __future__ import annotations

from megatron_flops.flops.dit import DiTSpec, dit_block_parameters
from megatron_flops.flops.passes import PeftSpec
from megatron_flops.memory.dit_activations import dit_block_input_grads
from megatron_flops.memory.lora import adapter_backward_payload, adapter_forward_payload

ROW_PARALLEL = ("self_attn.o", "cross_attn.o", "ffn.2")
# Bridge's column-parallel layers by the example module whose input they read (q/k/v and the cross
# k/v fused), and the q/k RMSNorms.
_COLUMN = ("self_attn.q", "cross_attn.q", "cross_attn.k", "cross_attn.k_img", "ffn.0")
_NORMS = ("self_attn.norm_q", "self_attn.norm_k", "cross_attn.norm_q", "cross_attn.norm_k", "cross_attn.norm_k_img")
# GPT target names of lora.py's payloads: a column- and a row-parallel target.
_GPT_LORA = ("linear_qkv", "linear_proj")


def _rows(module: str, tokens: tuple[int, int, int]) -> int:
    """Tokens a block module runs over: (video, text, CLIP) ``tokens`` as its input holds them."""
    T, C, M = tokens
    if module.startswith(("cross_attn.k_img", "cross_attn.v_img", "cross_attn.norm_k_img")):
        return M
    if module.startswith(("cross_attn.k", "cross_attn.v", "cross_attn.norm_k")):
        return C
    return T


def block_collectives(spec: DiTSpec, tokens: tuple[int, int, int], *, tp: int, sp: bool, peft: PeftSpec | None,
                      input_grad: bool = True) -> dict[str, tuple[int, int]]:
    """Elements one block hands to the TP group per micro-batch, by ``tp/<kind>``: (forward,
    backward), for ``tokens`` (video, text, CLIP) tokens of the micro-batch; ``input_grad``: whether
    the block's input requires grad (not: the first block of a frozen base). See the module NB."""
    T, C, M = tokens
    h, g, trains = spec.hidden_size, tp if sp else 1, not (peft is not None and peft.frozen)
    rows = (T, g * C, g * M)  # the text (CLIP) tokens gathered TP times over under SP
    grads = dit_block_input_grads(spec, peft, input_grad=input_grad)
    column = [(_rows(m, rows), grads[m]) for m in _COLUMN if m in grads]
    norms = [(_rows(m, rows), grads[m]) for m in _NORMS if m in grads and spec.qk_norm]
    row = [(T, grads[m] or trains) for m in ROW_PARALLEL]  # (tokens, whether its backward runs)
    norm_f, norm_b = sum(n for n, _ in norms), sum(n for n, grad in norms if grad)
    column_grads = sum(n for n, grad in column if grad)
    if sp:
        out = {"tp/all_gather": [sum(n for n, _ in column) + norm_f,
                                 sum(n for n, _ in column) * trains + sum(n for n, run in row if run) + norm_b],
               "tp/reduce_scatter": [3 * T, column_grads], "tp/all_reduce": [0, 0]}
    else:
        out = {"tp/all_reduce": [3 * T, column_grads], "tp/all_gather": [norm_f, norm_b]}
    out = {k: [v * h for v in pair] for k, pair in out.items()}
    _add_adapters(out, spec, rows, grads, peft, sp=sp)
    return {k: (fwd, bwd) for k, (fwd, bwd) in out.items() if fwd or bwd}


def _add_adapters(out: dict[str, list[int]], spec: DiTSpec, rows: tuple[int, int, int], grads: dict[str, bool],
                  peft: PeftSpec | None, *, sp: bool) -> None:
    """Each adapter's payloads (elements) into ``out`` (see the module NB)."""
    if peft is None or peft.lora_rank is None:
        return
    gpt = PeftSpec(lora_rank=peft.lora_rank, lora_targets=_GPT_LORA)
    h = spec.hidden_size
    for p in dit_block_parameters(spec, peft):
        if not p.name.endswith(".lora_A.weight"):
            continue
        module = p.name[: -len(".lora_A.weight")]
        n = _rows(module, rows)
        target = (_GPT_LORA[1] if module in ROW_PARALLEL else _GPT_LORA[0],)
        for i, payload in enumerate((adapter_forward_payload(gpt, target, n, h, 1, sp=sp),
                                     adapter_backward_payload(gpt, target, n, h, 1, sp=sp))):
            for key, value in payload.items():
                out.setdefault(key, [0, 0])[i] += value
        if sp and module not in ROW_PARALLEL and not grads[module]:  # the gather's backward: not reached
            out["tp/reduce_scatter"][1] -= n * h
