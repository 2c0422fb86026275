"""Training FLOPs of a WAN-style DiT with a frozen base, LoRA adapters and per-block activation
checkpointing (stdlib only: ints in, ints out).

Same conventions as the decoder's (:mod:`megatron_flops.flops.passes`): every forward GEMM of
:func:`~megatron_flops.flops.dit.dit_forward_gemms` runs once forward, then one backward GEMM of its
size per operand that gets a gradient; model FLOPs are ``"needed"`` (forward + the input
gradients a gradient flows through + the weight gradients of trainable weights) or
``"train_passes"`` (TRAIN_PASSES x every forward GEMM, adapters included); executed FLOPs add
what the hardware runs beyond them. Where a DiT differs from megatron-core's decoder:

- Inputs that never need a gradient: the latents, the T5 features and the sinusoid. With a
  frozen base the embeddings' outputs need none either, so the first block runs forward only up
  to its first adapter: ``cross_attn.k``/``v`` on the text tokens (and ``k_img``/``v_img``)
  without an adapter run no backward at all, in every block.
- Plain torch autograd (PEFT's LoRA ``Linear``, ``nn.Linear``): a GEMM computes an input
  gradient only where its input needs one, so no GEMM runs unneeded (``unneeded`` is zero).
- Checkpointing is per block, non-reentrant (``torch.utils.checkpoint.checkpoint(block, ...,
  use_reentrant=False)``, torch's ``checkpoint_wrapper``): the backward of a checkpointed block
  re-runs the block's forward GEMMs, adapters included, once. ``RecomputeSpec`` with
  ``granularity="full"``: ``method="block"`` checkpoints the first ``num_layers`` blocks,
  ``"uniform"`` every block (:func:`dit_recompute` builds one). Embeddings, the time projection
  and the head are never checkpointed.

Not modelled (ValueError): selective recompute; pipeline parallelism. NB: reentrant
checkpointing with a frozen base gives no block input a gradient (torch warns and the adapters do
not train); it is not modelled.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from megatron_flops.flops.dit import (
    DiTPeftSpec,
    DiTSpec,
    DiTStats,
    dit_adapted_modules,
    dit_forward_gemms,
    dit_parameter_counts,
)
from megatron_flops.flops.formulas import FlopsBreakdown, Gemm
from megatron_flops.flops.passes import (
    MODEL_FLOPS_CONVENTIONS,
    PeftSpec,
    PricedStep,
    RecomputeSpec,
    TrainingPasses,
    lora_passes,
    recomputed_counter,
)

# Activation operands of each GEMM, each given as the values it is computed from. ``data``: an input
# that needs no gradient; ``base``: a value behind trainable base weights only (a LayerNorm's, an
# adaLN table); ``x``: the block input; ``e``: the block's modulation (time_projection + its table);
# ``text``/``image``: the embedded context. Block GEMMs read the same block's values.
_SELF = ("self_attn.q", "self_attn.k", "self_attn.v")
_CROSS = ("cross_attn.q", "cross_attn.k", "cross_attn.v", "cross_attn.k_img", "cross_attn.v_img")
_OPERANDS: dict[str, tuple[tuple[str, ...], ...]] = {
    "patch_embedding": (("data",),),
    "text_embedding.0": (("data",),),
    "text_embedding.2": (("text_embedding.0",),),
    "time_embedding.0": (("data",),),
    "time_embedding.2": (("time_embedding.0",),),
    "time_projection.1": (("time_embedding.2",),),
    "img_emb.proj.1": (("base",),),
    "img_emb.proj.3": (("img_emb.proj.1",),),
    # norm1(x) * (1 + scale) + shift.
    "self_attn.q": (("x", "e"),),
    "self_attn.k": (("x", "e"),),
    "self_attn.v": (("x", "e"),),
    "self_attn.scores": (("self_attn.q",), ("self_attn.k",)),
    # softmax(scores) and V.
    "self_attn.context": (("self_attn.q", "self_attn.k"), ("self_attn.v",)),
    "self_attn.o": (_SELF,),
    # norm3(x + o * gate).
    "cross_attn.q": (("x", "e", "self_attn.o", "base"),),
    "cross_attn.k": (("text",),),
    "cross_attn.v": (("text",),),
    "cross_attn.scores": (("cross_attn.q",), ("cross_attn.k",)),
    "cross_attn.context": (("cross_attn.q", "cross_attn.k"), ("cross_attn.v",)),
    "cross_attn.k_img": (("image",),),
    "cross_attn.v_img": (("image",),),
    "cross_attn.image_scores": (("cross_attn.q",), ("cross_attn.k_img",)),
    "cross_attn.image_context": (("cross_attn.q", "cross_attn.k_img"), ("cross_attn.v_img",)),
    "cross_attn.o": (_CROSS,),
    # norm2(x) * (1 + scale) + shift.
    "ffn.0": (("x", "e", "self_attn.o", "cross_attn.o"),),
    "ffn.2": (("ffn.0",),),
    # norm(x) * (1 + scale) + shift, the head's adaLN from the time embedding and its table.
    "head.head": (("x", "time_embedding.2", "base"),),
}
# Values the residual stream adds up to a block's output (gates are ``e``).
_BLOCK_OUTPUTS = ("x", "e", "self_attn.o", "cross_attn.o", "ffn.2")


def dit_recompute(spec: DiTSpec, num_blocks: int | None = None) -> RecomputeSpec:
    """Checkpointing of the first ``num_blocks`` blocks (None: every block)."""
    recompute = RecomputeSpec(granularity="full", method="block",
                              num_layers=spec.num_layers if num_blocks is None else num_blocks)
    _checkpointed_blocks(spec, recompute)
    return recompute


def _full_only(granularity: str) -> None:
    if granularity != "full":
        raise ValueError(f"a DiT checkpoints whole blocks: use recompute granularity 'full', not {granularity!r} "
                         "(selective recompute is megatron-core's per-module scheme, not modelled for a DiT)")


def _checkpointed_blocks(spec: DiTSpec, recompute: RecomputeSpec | None) -> Callable[[int, int], int]:
    """``count(first, n)``: how many of the blocks ``first .. first + n - 1`` are checkpointed."""
    if recompute is None:
        return lambda first, n: 0
    _full_only(recompute.granularity)
    if recompute.pipeline_model_parallel_size != 1 or (recompute.virtual_pipeline_model_parallel_size or 1) != 1:
        raise ValueError("pipeline parallelism is not modelled for a DiT")
    if recompute.method == "block" and recompute.num_layers is not None and recompute.num_layers > spec.num_layers:
        raise ValueError(f"checkpointing {recompute.num_layers} blocks, but the DiT has {spec.num_layers}")
    return recomputed_counter(spec.num_layers, recompute)


def dit_training_passes(
    spec: DiTSpec,
    stats: DiTStats,
    *,
    peft: PeftSpec | None = None,
    recompute: RecomputeSpec | None = None,
) -> TrainingPasses:
    """Forward, input-gradient, weight-gradient and recompute FLOPs over ``stats``; keys are
    :func:`~megatron_flops.flops.dit.dit_forward_flops`'s plus ``dit/lora/<module>`` per adapted
    projection (``dit/lora/self_attn.q``, ...).

    Blocks are priced as runs, not one by one: the residual stream needs a gradient into the first
    block or not, and from the second block on it does whenever any block output does, so the
    first block and the rest each run one set of passes (the checkpointed ones add their forward).
    """
    peft = DiTPeftSpec.of(peft)
    checkpointed = _checkpointed_blocks(spec, recompute)
    forward = dit_forward_gemms(spec, stats)
    walker = _Walker(adapted=frozenset(dit_adapted_modules(spec, peft)), lora_rank=peft.lora_rank,
                     trainable=not peft.frozen)
    passes = _Passes()
    passes.add(walker.walk(forward.embeddings))
    walker.enter(first=True)
    passes.add(walker.walk(forward.block), recomputed=checkpointed(0, 1))
    walker.enter(first=False)
    rest = spec.num_layers - 1
    if rest:
        stream = walker.needs("x")
        passes.add(walker.walk(forward.block), times=rest, recomputed=checkpointed(1, rest))
        walker.enter(first=False)
        assert walker.needs("x") == stream, "every block after the first sees the same gradient flow"
    passes.add(walker.walk(forward.head))
    return passes.training_passes()


# Per GEMM of a walked list: (key, forward, input-gradient, weight-gradient FLOPs).
_Entries = list[tuple[str, int, int, int]]


class _Walker:
    """Which values need a gradient (named as in ``_OPERANDS``), as the forward GEMMs run in
    order, and the passes of each GEMM (and of its adapter) that this implies."""

    def __init__(self, *, adapted: frozenset[str], lora_rank: int | None, trainable: bool) -> None:
        self.adapted = adapted
        self.lora_rank = lora_rank
        self.trainable = trainable
        self._needs: dict[str, bool] = {"data": False, "base": trainable}

    def needs(self, name: str) -> bool:
        if name == "e":
            return self.trainable or self._needs["time_projection.1"]
        if name == "text":
            return self._needs["text_embedding.2"]
        if name == "image":
            return self.trainable or self._needs["img_emb.proj.3"]
        return self._needs.get(name, False)

    def enter(self, *, first: bool) -> None:
        """A block boundary: the residual stream ``x`` is the patch embedding's output before the
        first block, the previous block's output after one."""
        self._needs["x"] = self._needs["patch_embedding"] if first else any(self.needs(v) for v in _BLOCK_OUTPUTS)

    def walk(self, gemms: Sequence[Gemm]) -> _Entries:
        """The passes of ``gemms`` run in order (adapters after the GEMM they wrap)."""
        entries: _Entries = []
        for g in gemms:
            # Per activation operand: whether a gradient flows back through it.
            operands = [any(self.needs(v) for v in sources) for sources in _OPERANDS[g.name]]
            weight = g.has_weight and self.trainable
            entries.append((g.key, g.flops, g.flops * sum(operands), g.flops if weight else 0))
            lora = g.name in self.adapted
            if lora:
                assert g.shape is not None and self.lora_rank is not None
                entries.append((f"dit/lora/{g.name}", *lora_passes(g.shape, self.lora_rank, input_grad=operands[0])))
            # The output needs a gradient when an operand does, or trained weights produced it.
            self._needs[g.name] = any(operands) or weight or lora
        return entries


class _Passes:
    """Forward, input-gradient, weight-gradient and recompute FLOPs by key."""

    def __init__(self) -> None:
        self.forward: dict[str, int] = {}
        self.input_grad: dict[str, int] = {}
        self.weight_grad: dict[str, int] = {}
        self.recompute: dict[str, int] = {}

    def add(self, entries: _Entries, *, times: int = 1, recomputed: int = 0) -> None:
        """``entries`` run ``times`` times; ``recomputed`` of those runs are checkpointed blocks, whose
        backward (when one runs) re-runs their forward GEMMs, adapters included, once."""
        backward = any(d or w for _, _, d, w in entries)
        redo = recomputed if backward else 0
        for key, f, d, w in entries:
            for totals, flops in ((self.forward, times * f), (self.input_grad, times * d),
                                  (self.weight_grad, times * w), (self.recompute, redo * f)):
                totals[key] = totals.get(key, 0) + flops

    def training_passes(self) -> TrainingPasses:
        return TrainingPasses(
            forward=self.forward,
            input_grad=self.input_grad,
            weight_grad=self.weight_grad,
            unneeded=dict.fromkeys(self.forward, 0),
            recompute=self.recompute,
            attention="full",
        )


def price_dit(
    spec: DiTSpec,
    stats: DiTStats,
    *,
    peft: PeftSpec | None = None,
    recompute: RecomputeSpec | None = None,
    convention: str = "needed",
) -> PricedStep:
    """Model FLOPs (``convention``) and executed FLOPs (needed passes + recompute) of ``stats``:
    the one pricing path of the CLI and the DiT tracker."""
    if convention not in MODEL_FLOPS_CONVENTIONS:
        raise ValueError(f"unknown model FLOPs convention {convention!r}; use one of {MODEL_FLOPS_CONVENTIONS}")
    passes = dit_training_passes(spec, stats, peft=peft, recompute=recompute)
    return PricedStep(model=passes.model(convention), executed=passes.executed(),
                      recompute_flops=sum(passes.recompute.values()))


def dit_training_flops(
    spec: DiTSpec,
    video_seqlens: Sequence[int],
    text_seqlens: Sequence[int] | None = None,
    image_seqlens: Sequence[int] | None = None,
    *,
    convention: str = "needed",
    peft: PeftSpec | None = None,
    recompute: RecomputeSpec | None = None,
) -> FlopsBreakdown:
    """Model FLOPs per component over per-sample lengths (see :meth:`DiTStats.from_seqlens`).

    NB (``"needed"``, fully trainable): the GEMMs fed by data (latents into the patch embedding,
    T5 features into ``text_embedding.0``, the sinusoid into ``time_embedding.0``) run forward +
    weight gradient only; every other GEMM all TRAIN_PASSES (``img_emb.proj.1`` follows a
    LayerNorm with trainable weights, so it needs its input gradient).
    """
    stats = DiTStats.from_seqlens(spec, video_seqlens, text_seqlens, image_seqlens)
    return price_dit(spec, stats, peft=peft, recompute=recompute, convention=convention).model


# ---- model files --------------------------------------------------------------------------------

_RECOMPUTE_KEYS = ("recompute_granularity", "recompute_method", "recompute_num_layers")


@dataclass(frozen=True, kw_only=True)
class DiTSetup:
    """A DiT model file's model and training setup."""

    spec: DiTSpec
    peft: DiTPeftSpec | None = None
    recompute: RecomputeSpec | None = None


def dit_setup(
    raw: Mapping[str, Any],
    *,
    frozen: bool = False,
    lora_rank: int | None = None,
    lora_targets: Sequence[str] | None = None,
    recompute: str | None = None,
    recompute_method: str | None = None,
    recompute_num_layers: int | None = None,
    source: str = "model file",
) -> DiTSetup:
    """From a model file's mapping: ``"dit"`` (DiTSpec fields), optional ``"lora"`` (``dim``,
    ``target_modules``: LoRA on a frozen base) and ``recompute_granularity`` (``"full"``),
    ``recompute_method`` (default ``"block"``), ``recompute_num_layers`` (blocks; default all);
    the keyword arguments (the CLI's flags) override the file."""
    other = [k for k in raw if k not in ("dit", "lora", *_RECOMPUTE_KEYS)]
    if other:
        raise ValueError(f"{source}: a DiT model file holds 'dit', 'lora' and {', '.join(_RECOMPUTE_KEYS)}; "
                         f"decoder-style key(s) {', '.join(map(repr, other))} do not apply")
    spec = DiTSpec.from_mapping(raw["dit"], source=source)
    peft = None
    if raw.get("lora") is not None:
        peft = DiTPeftSpec.of(DiTPeftSpec.from_lora_mapping(raw["lora"], source=source))
    if lora_targets is not None and lora_rank is None and peft is None:
        raise ValueError("lora targets need a lora rank")
    if frozen or lora_rank is not None or lora_targets is not None:
        base = peft or DiTPeftSpec()
        peft = DiTPeftSpec(
            frozen=frozen or base.frozen,
            lora_rank=base.lora_rank if lora_rank is None else lora_rank,
            lora_targets=base.lora_targets if lora_targets is None else tuple(lora_targets),
        )
    if peft is not None:
        dit_adapted_modules(spec, peft)
    fields = {k: raw.get(k) for k in _RECOMPUTE_KEYS}
    flags = dict(zip(_RECOMPUTE_KEYS, (recompute, recompute_method, recompute_num_layers)))
    fields.update({k: v for k, v in flags.items() if v is not None})
    if fields["recompute_granularity"] is None:
        if any(v is not None for v in fields.values()):
            raise ValueError(f"{source}: recompute_method/recompute_num_layers need recompute_granularity 'full'")
        return DiTSetup(spec=spec, peft=peft)
    _full_only(fields["recompute_granularity"])
    fields["recompute_method"] = fields["recompute_method"] or "block"
    if fields["recompute_num_layers"] is None:
        fields["recompute_num_layers"] = spec.num_layers
    spec_recompute = RecomputeSpec.from_mapping(fields, source=source)
    _checkpointed_blocks(spec, spec_recompute)
    return DiTSetup(spec=spec, peft=peft, recompute=spec_recompute)


def dit_report(
    setup: DiTSetup,
    video_seqlens: Sequence[int],
    text_seqlens: Sequence[int] | None = None,
    image_seqlens: Sequence[int] | None = None,
    *,
    convention: str = "needed",
) -> dict[str, Any]:
    """What ``estimate --json`` prints for a DiT model file: model FLOPs under ``convention``,
    executed FLOPs (needed passes + recompute), statistics, parameter counts, and the static
    number."""
    spec = setup.spec
    stats = DiTStats.from_seqlens(spec, video_seqlens, text_seqlens, image_seqlens)
    priced = price_dit(spec, stats, peft=setup.peft, recompute=setup.recompute, convention=convention)
    # NB: the static number prices every sample at the longest clip with the full text (and image)
    # context, every weight trained, nothing recomputed: what a fixed-shape formula reports.
    longest, n = max(video_seqlens), stats.num_samples
    static_stats = DiTStats.full_context(spec, num_samples=n, num_video_tokens=n * longest,
                                         sum_video_seqlen_squared=n * longest * longest)
    static = price_dit(spec, static_stats, convention=convention).model.total
    params = dit_parameter_counts(spec, setup.peft)
    checkpointed = _checkpointed_blocks(spec, setup.recompute)(0, spec.num_layers)
    return {
        "total_flops": priced.model.total,
        "components": dict(priced.model.components),
        "executed_flops": priced.executed.total,
        "executed_components": dict(priced.executed.components),
        "recompute_flops": priced.recompute_flops,
        "unneeded_flops": priced.unneeded_flops,
        "model_flops_convention": convention,
        "static_flops": static,
        "static_seq_length": max(video_seqlens),
        "over_report_factor": static / priced.model.total,
        "attention": "full",
        "num_samples": stats.num_samples,
        "num_video_tokens": stats.num_video_tokens,
        "num_text_tokens": stats.num_text_tokens,
        "num_image_tokens": stats.num_image_tokens,
        "sum_video_seqlen_squared": stats.sum_video_seqlen_squared,
        "sum_cross_pairs": stats.sum_text_pairs,
        "sum_image_pairs": stats.sum_image_pairs,
        "frozen": bool(setup.peft and setup.peft.frozen),
        "lora_rank": setup.peft.lora_rank if setup.peft else None,
        "lora_targets": list(setup.peft.lora_targets) if setup.peft and setup.peft.lora_rank else [],
        "lora_modules": list(dit_adapted_modules(spec, setup.peft)),
        "checkpointed_blocks": checkpointed,
        "num_params": params.num_params,
        "num_trainable_params": params.num_trainable_params,
        "num_block_params": params.num_block_params,
        "num_adapters": params.num_adapters,
        "num_adapter_params": params.num_adapter_params,
    }
