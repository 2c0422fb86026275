"""LoRA adapters under tensor parallelism layer by layer: dense, MoE, MLA and multi-token
prediction layers, the ``tp/*`` payload per step they add on one pipeline rank (stdlib only).

As Megatron-Bridge 0.3.1's LoRA wraps megatron-core's local layers (``ParallelLinearAdapter``,
:mod:`megatron_flops.memory.lora` for one dense layer's adapters), measured on CPU with gloo:

- MLA layers: ``linear_proj`` (row parallel) and the MLP's ``linear_fc1``/``linear_fc2`` are
  adapted as a dense layer's; there is no ``linear_qkv`` (that target adapts nothing there, as in
  Bridge, whose module matcher goes by name). MLA's own projections are column-parallel targets
  (:mod:`megatron_flops.memory.lora`): the down projections' and ``linear_q_proj``'s adapters read
  the hidden states [T, h], the up projections' the latents [T, q_lora], [T, kv_lora]. In a frozen
  model's first layer an adapter's input requires no grad where no adapter runs before it on its
  branch: it runs no input-gradient reduce-scatter under sequence parallelism (it still
  all-reduces its input gradient without), nor do the base projections there.
- MoE layers: the shared experts' ``linear_fc1``/``linear_fc2`` as a dense MLP's (tensor
  parallel, sequence-parallel gathers of their own); a MoE layer without shared experts has no
  dense MLP to adapt. Every routed expert's ``linear_fc1``/``linear_fc2`` (``SequentialMLP``,
  Bridge's ``is_expert_linear``) gets an adapter split over expert TP as its layer:
  ``linear_fc1``'s ``linear_in`` [r/TP, h], ``linear_fc2``'s ``linear_out`` [h/TP, r]. They run
  megatron-core's explicit expert communication (no input-gradient reduction, no sequence
  parallelism; the dispatcher reduces): per routed token, forward only, ``linear_fc1``'s adapter
  all-gathers its [n, r] intermediate and ``linear_fc2``'s its output [n, h] over expert TP
  (grouped-GEMM experts: :mod:`megatron_flops.memory.moe_grouped`).
  NB: with an expert TP other than TP (``--etp``) a formula: Bridge 0.6.2 splits an expert
  linear's adapter over the expert TP group (``get_adapter_attributes_from_linear(is_expert=True)``
  reads ``expert_tensor_parallel_size``), so its gathers are ``etp/all_gather``; measured with
  expert TP = TP only (:func:`expert_lora_unmeasured`).
- MTP layers (last stage): their decoder layer's adapters as a main layer's (``eh_proj`` is no
  target); under sequence parallelism a frozen MTP layer skips the embedding gradient's, eh_proj's
  input's and the output layer's re-gathers, and its column-parallel layers' weight-gradient ones.

NB: Bridge pads an expert's tokens to a multiple of expert TP under ``torch.no_grad`` (its
``pad_seq_to_mult``): with an odd count the adapter's output is detached (no gradient, nothing
kept). Counted here: every expert's tokens divide (an assumption the report prints).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_flops.flops.passes import PeftSpec, RecomputeSpec
from megatron_flops.memory.layout import Parallelism, Training
from megatron_flops.memory.lora import (COLUMN_PARALLEL, LAYER_ORDER, adapter_backward_payload,
                                        adapter_forward_payload, input_widths, mla_targets)
from megatron_flops.memory.mla_mtp import mtp_recomputed
from megatron_flops.memory.moe import expert_tp_group
from megatron_flops.memory.moe_lora_start import first_adapter_dispatcher_skip, starts_in_experts
from megatron_flops.model.spec import ModelSpec


@dataclass(frozen=True)
class AdaptedLayer:
    """One decoder layer as LoRA sees it: ``mla`` attention, a ``dense`` MLP (an MLP or shared
    experts), routed ``experts``, ``rerun`` by full recompute, ``mtp`` a prediction layer."""

    mla: bool
    dense: bool
    experts: bool
    rerun: bool
    mtp: bool = False
    mla_names: tuple[str, ...] = ()  # MLA's projections (:func:`~megatron_flops.memory.lora.mla_targets`)

    def targets(self, peft: PeftSpec) -> tuple[str, ...]:
        """The tensor-parallel linears of this layer that ``peft`` adapts, in forward order."""
        absent = {"linear_qkv"} if self.mla else set()
        if not self.dense:
            absent |= {"linear_fc1", "linear_fc2"}
        order = self.mla_names + LAYER_ORDER[1:] if self.mla else LAYER_ORDER
        return tuple(t for t in order if t in peft.lora_targets and t not in absent)


def adapted_layers(spec: ModelSpec, par: Parallelism, recompute: RecomputeSpec | None, *,
                   pp_rank: int) -> list[AdaptedLayer]:
    """Every layer of pipeline rank ``pp_rank`` in forward order (its model chunks in turn), MTP
    layers after the last stage's decoder."""
    full = recompute is not None and recompute.granularity == "full"
    block = recompute.num_layers or 0 if recompute is not None and recompute.method == "block" else None
    shared = spec.moe is not None and bool(spec.moe.shared_expert_ffn_hidden_size)
    kinds, mla = spec.layers, spec.mla is not None
    out: list[AdaptedLayer] = []
    for chunk in range(par.num_chunks):
        layers = par.chunk_layers(spec.num_layers, pp_rank, chunk)
        for i, layer in enumerate(layers):
            rerun = full and (block is None or i < block)
            moe = kinds[layer][1] == "moe"
            out.append(AdaptedLayer(mla=mla, dense=not moe or shared, experts=moe, rerun=rerun,
                                    mla_names=mla_targets(spec)))
        if par.holds_mtp(pp_rank, chunk):
            moe, rerun = spec.mtp_ffn == "moe", mtp_recomputed(spec, recompute)
            out += [AdaptedLayer(mla=mla, dense=not moe or shared, experts=moe, rerun=rerun, mtp=True,
                                 mla_names=mla_targets(spec))
                    for _ in range(spec.mtp_num_layers)]
    return out


def expert_adapter_payload(spec: ModelSpec, peft: PeftSpec, *, routed: int, act: int) -> int:
    """``tp/all_gather`` bytes of one MoE layer's routed-expert adapters in forward, for
    ``routed`` tokens reaching this rank's experts: ``linear_fc1``'s [n, r] and ``linear_fc2``'s
    output [n, h] per expert, over expert TP."""
    assert spec.moe is not None and peft.lora_rank is not None
    width = spec.moe.latent_size or spec.hidden_size
    return routed * act * (peft.lora_rank * ("linear_fc1" in peft.lora_targets)
                           + width * ("linear_fc2" in peft.lora_targets))


def lora_tp_communication(spec: ModelSpec, par: Parallelism, training: Training, *, pp_rank: int,
                          peft: PeftSpec | None, recompute: RecomputeSpec | None = None,
                          received: int | None = None, duplicated: bool = False, fused: tuple[str, ...] = (),
                          expert_adapters: bool = True, dispatcher: str = "alltoall") -> dict[str, int]:
    """``tp/*`` payload per step that LoRA adapters add on pipeline rank ``pp_rank`` (TP > 1):
    every layer's adapters (forward again where full recompute re-runs it), less what a frozen
    base does not run (:func:`_frozen_skips`); ``received``: routed tokens per MoE layer reaching
    this rank's experts (None: balanced, ``s/TP*b x ETP x topk``); ``duplicated``: Transformer Engine's MLA
    down projections, whole on every TP rank (a formula); ``fused``: the targets Transformer Engine builds
    with a norm fused in (under sequence parallelism their adapters read the norm output the base gathered:
    :func:`~megatron_flops.memory.lora.input_widths`); ``expert_adapters``: whether the routed
    experts have adapters (legacy ``GroupedMLP`` has none; ``TEGroupedMLP``'s shared one runs the
    same explicit expert communication over all routed tokens); ``dispatcher``: the MoE token
    dispatcher (a frozen MoE first layer whose gradient starts in its experts runs no dispatcher
    backward: :mod:`~megatron_flops.memory.moe_lora_start`). {} at TP 1 and expert TP 1."""
    if peft is None or peft.lora_rank is None or (par.tp == 1 and par.expert_tp == 1):
        return {}
    a, h, sp = training.param_bytes, spec.hidden_size, par.sequence_parallel
    tokens = training.seq_length * training.micro_batch_size
    routed = received if received is not None or spec.moe is None \
        else tokens // par.tp * par.expert_tp * spec.moe.router_topk
    out: dict[str, int] = {}

    def add(key: str, value: int) -> None:
        out[key] = out.get(key, 0) + value

    layers = adapted_layers(spec, par, recompute, pp_rank=pp_rank)
    outputs = _down_widths(spec) if duplicated else None
    for layer in layers:
        targets = layer.targets(peft) if par.tp > 1 else ()
        widths = input_widths(spec, fused=fused if sp else (), experts=layer.experts)
        for key, value in adapter_forward_payload(peft, targets, tokens, h, a, sp=sp, widths=widths,
                                                  duplicated=outputs).items():
            add(key, (1 + layer.rerun) * value)
        for key, value in adapter_backward_payload(peft, targets, tokens, h, a, sp=sp, widths=widths).items():
            add(key, value)
        if layer.experts and routed is not None and par.expert_tp > 1 and expert_adapters:
            add(f"{expert_tp_group(par)}/all_gather",
                (1 + layer.rerun) * expert_adapter_payload(spec, peft, routed=routed, act=a))
    full = recompute is not None and recompute.granularity == "full"
    # Legacy GroupedMLP without shared experts: the first stage's leading MoE layers have no adapter.
    leading = _leading_unadapted(spec, par, layers, pp_rank=pp_rank) if not expert_adapters else 0
    skips = _frozen_skips(spec, par, peft, layers, pp_rank=pp_rank, started=full, duplicated=duplicated,
                          fused=fused, leading=leading) if par.tp > 1 else {}
    for key, count in skips.items():
        add(key, -count * tokens * a)
    if not full and par.holds_frozen_first_layer(spec.num_layers, pp_rank) and starts_in_experts(spec, peft) and routed is not None:
        for key, value in first_adapter_dispatcher_skip(spec, par, training, dispatcher=dispatcher,
                                                        routed=routed).items():
            add(key, -max(leading, 1) * value)
    m = training.num_microbatches
    return {key: m * value for key, value in out.items() if value}


def _down_widths(spec: ModelSpec) -> dict[str, int]:
    """The output widths of MLA's down projections, by target name."""
    if spec.mla is None:
        return {}
    return {"linear_q_down_proj": spec.mla.q_lora_rank or 0,
            "linear_kv_down_proj": spec.mla.kv_lora_rank + spec.mla.qk_pos_emb_head_dim}


def _leading_unadapted(spec: ModelSpec, par: Parallelism, layers: list[AdaptedLayer], *, pp_rank: int) -> int:
    """How many of the first stage's first layers are MoE layers with no adapter (no dense MLP, and
    experts without adapters): they run no backward at all under a frozen base."""
    if not par.holds_frozen_first_layer(spec.num_layers, pp_rank):
        return 0
    count = 0
    for layer in layers[: len(par.chunk_layers(spec.num_layers, pp_rank, 0))]:
        if layer.dense or not layer.experts:
            break
        count += 1
    return count


def _frozen_skips(spec: ModelSpec, par: Parallelism, peft: PeftSpec, layers: list[AdaptedLayer], *,
                  pp_rank: int, started: bool, duplicated: bool, fused: tuple[str, ...] = (),
                  leading: int = 0) -> dict[str, int]:
    """Elements per token of the collectives :mod:`megatron_flops.memory.comm` prices for a
    trained base that a frozen one does not run. Under sequence parallelism: every layer's
    column-parallel weight-gradient all-gathers (``linear_qkv`` or MLA's, ``linear_fc1``), the
    output layer's, the embedding's gradient; an MTP layer's embedding gradient and ``eh_proj``
    input [T, 2h]. On the rank running layer 0 after the embedding (not where a layout leaves the
    first stage no layer), unless its decoder input requires grad (``started``), the
    backward collectives of the first layer's base linears up to its first adapter (see
    :func:`_before_first_adapter`; ``fused``: as :func:`lora_tp_communication`), and before them those of
    the ``leading`` layers with no adapter (all of their base linears')."""
    if not peft.frozen:
        return {}
    h, sp = spec.hidden_size, par.sequence_parallel
    first = par.holds_frozen_first_layer(spec.num_layers, pp_rank) and not started
    out: dict[str, int] = {}
    for layer in layers[: min(leading + 1, len(par.chunk_layers(spec.num_layers, pp_rank, 0)))] if first else []:
        for key, value in _before_first_adapter(spec, peft, layer, sp=sp, duplicated=duplicated, fused=fused).items():
            out[key] = out.get(key, 0) + value
    if not sp:
        return out
    gathers = 0
    for layer in layers:
        gathers += h * (1 + layer.dense) + _mla_weight_gathers(spec, layer, duplicated) + (4 * h if layer.mtp else 0)
    gathers += h * (par.is_last_stage(pp_rank, par.num_chunks - 1) + par.is_first_stage(pp_rank, 0))
    out["tp/all_gather"] = out.get("tp/all_gather", 0) + gathers
    return out


def _mla_weight_gathers(spec: ModelSpec, layer: AdaptedLayer, duplicated: bool) -> int:
    """An MLA layer's column-parallel weight-gradient all-gathers beyond a dense layer's
    ``linear_qkv``: the up projections' latents and the second down projection's input [T, h]
    (duplicated down projections: none, nor the first's, unless ``linear_q_proj`` reads it)."""
    mla = spec.mla
    if not layer.mla or mla is None:
        return 0
    hidden = (-spec.hidden_size if mla.q_lora_rank else 0) if duplicated else spec.hidden_size
    return hidden + (mla.q_lora_rank or 0) + mla.kv_lora_rank


def _before_first_adapter(spec: ModelSpec, peft: PeftSpec, layer: AdaptedLayer, *, sp: bool,
                          duplicated: bool, fused: tuple[str, ...] = ()) -> dict[str, int]:
    """The first layer's base linears up to its first adapter run no backward (their input
    requires no grad): per column-parallel one its input gradient's all-reduce (reduce-scatter
    under sequence parallelism), per row-parallel one under sequence parallelism its output
    gradient's all-gather; under sequence parallelism a first column-parallel adapter's
    input-gradient reduce-scatter too (none around a ``fused`` norm + linear: it runs none of its
    own). An MLA layer's projections before ``linear_proj``: see :func:`_mla_before_proj`."""
    targets = layer.targets(peft)
    # (A MoE layer without shared experts has no dense fc1/fc2: moe_communication takes theirs out.)
    order = [t for t in LAYER_ORDER if (t != "linear_qkv" or not layer.mla)
             and (layer.dense or t not in ("linear_fc1", "linear_fc2"))]
    in_mla = bool(targets) and targets[0] in layer.mla_names
    index = order.index(targets[0]) if targets and not in_mla else -1 if in_mla else len(order) - 1
    before = order[: index + 1]
    h = spec.hidden_size
    column = h * sum(n in COLUMN_PARALLEL for n in before)
    out = _mla_before_proj(spec, targets, sp=sp, duplicated=duplicated, fused=fused) if layer.mla else {}
    if not sp:
        out["tp/all_reduce"] = out.get("tp/all_reduce", 0) + column
        return out
    row = h * (len(before) - sum(n in COLUMN_PARALLEL for n in before))
    first = order[index] if before and targets else ""
    first_adapter = input_widths(spec, fused=fused, experts=layer.experts).get(first, h) \
        if first in COLUMN_PARALLEL else 0
    out["tp/reduce_scatter"] = out.get("tp/reduce_scatter", 0) + column + first_adapter
    out["tp/all_gather"] = out.get("tp/all_gather", 0) + row
    return out


def _mla_before_proj(spec: ModelSpec, targets: tuple[str, ...], *, sp: bool, duplicated: bool,
                     fused: tuple[str, ...] = ()) -> dict[str, int]:
    """An MLA layer's frozen projections before ``linear_proj`` (no backward): without sequence
    parallelism the input-gradient all-reduces of both down projections [T, h] (duplicated:
    none but ``linear_q_proj``'s) and both up projections' latents; under sequence parallelism
    their reduce-scatters and the latents' gradient all-gathers (duplicated: no latent
    gathers, the reduce-scatter of the kv latent's RoPE part). With adapters on MLA's own
    projections (``targets``): see :func:`_mla_adapted_before_proj`."""
    mla = spec.mla
    assert mla is not None
    h, latents = spec.hidden_size, (mla.q_lora_rank or 0) + mla.kv_lora_rank
    if any(t.startswith(("linear_q_", "linear_kv_")) for t in targets):
        return _mla_adapted_before_proj(spec, targets, sp=sp, duplicated=duplicated, fused=fused)
    if duplicated:
        hidden = 0 if mla.q_lora_rank else h
        if not sp:
            return {"tp/all_reduce": hidden + latents}
        return {"tp/reduce_scatter": hidden + latents + mla.qk_pos_emb_head_dim}
    if not sp:
        return {"tp/all_reduce": 2 * h + latents}
    return {"tp/reduce_scatter": 2 * h + latents, "tp/all_gather": latents}


def expert_lora_unmeasured(spec: ModelSpec, par: Parallelism, peft: PeftSpec | None) -> list[str]:
    """The label of LoRA adapters on routed experts whose TP is not TP (a formula, see the NB)."""
    adapted = peft is not None and peft.lora_rank is not None and {"linear_fc1", "linear_fc2"} & set(peft.lora_targets)
    if spec.moe is None or not adapted or par.expert_tp == par.tp:
        return []
    return [f"LoRA adapters on the routed experts with expert TP {par.expert_tp} other than TP {par.tp}: split over "
            "the expert TP group as Megatron-Bridge 0.6.2 splits them (is_expert: expert_tensor_parallel_size), "
            "their parameters, activations and etp/all_gather payloads a formula (measured with expert TP = TP)"]


def _mla_adapted_before_proj(spec: ModelSpec, targets: tuple[str, ...], *, sp: bool,
                             duplicated: bool = False, fused: tuple[str, ...] = ()) -> dict[str, int]:
    """As :func:`_mla_before_proj` with adapters on MLA's projections (local spec): the base
    down projections (or ``linear_q_proj``) never reduce their input gradient [T, h]; an up
    projection's latent requires grad once its branch's down projection is adapted (then its
    input gradient is reduced, and under sequence parallelism its slice's gradient all-gathered).
    Under sequence parallelism an adapter whose input requires no grad skips its input's
    gradient reduce-scatter (the hidden states', or a latent's). ``duplicated`` (Transformer
    Engine's spec, a formula): the base down projections reduce no input gradient anyway, so
    only ``linear_q_proj``'s [T, h] and the latents' are skipped; under sequence parallelism
    (up-projection adapters only) no latent gathers, and the kv latent's RoPE part's
    reduce-scatter [T, rope] is skipped too; ``fused``: adapters on the up projections there
    run no reduce-scatter of their own (:func:`~megatron_flops.memory.lora.input_widths`)."""
    mla = spec.mla
    assert mla is not None
    h, q, kv = spec.hidden_size, mla.q_lora_rank, mla.kv_lora_rank
    q_on, kv_on = "linear_q_down_proj" in targets, "linear_kv_down_proj" in targets
    hidden = (0 if q else h) if duplicated else 2 * h
    skipped = hidden + (q or 0) * (not q_on) + kv * (not kv_on)  # base input gradients
    if not sp:
        return {"tp/all_reduce": skipped}
    gathers = 0 if duplicated else (q or 0) * (not q_on) + kv * (not kv_on)
    rope = mla.qk_pos_emb_head_dim * (duplicated and not kv_on)
    adapters = h * sum(t in ("linear_q_down_proj", "linear_kv_down_proj", "linear_q_proj") for t in targets)
    widths = input_widths(spec, fused=fused)
    adapters += widths["linear_q_up_proj"] * ("linear_q_up_proj" in targets and not q_on) \
        + widths["linear_kv_up_proj"] * ("linear_kv_up_proj" in targets and not kv_on)
    return {"tp/reduce_scatter": skipped + rope + adapters, "tp/all_gather": gathers}
