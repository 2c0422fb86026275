"""GEMM FLOPs of a training step with frozen weights, LoRA adapters and activation recompute
(stdlib only: ints in, ints out).

Every forward GEMM of :func:`megatron_flops.flops.formulas.forward_runs` runs once forward. Its
backward runs one GEMM of the forward's size per operand that gets a gradient: the input
gradient (dgrad) when its activation operand needs one, the weight gradient (wgrad) when its
weight is trainable. Core attention multiplies two activations (Q and K, then P and V): one
dgrad GEMM per operand that needs a gradient. A fully trainable model runs all TRAIN_PASSES.

An activation needs a gradient when a trainable parameter lies upstream of it. With a frozen base
(embedding, norms, every linear, router and output layer) that is only true downstream of the
first LoRA adapter: the GEMMs before it run forward only, and the first adapted projection runs
no input gradient.

Model FLOPs (MFU), two conventions:

- ``"needed"`` (default): forward + every input gradient a gradient must flow through + the
  weight gradients of trainable weights. Equal to ``formulas.training_flops`` for a fully
  trainable model; a frozen base layer costs forward + dgrad.
- ``"train_passes"``: TRAIN_PASSES x every forward GEMM, adapters included: the stock "6N"
  count, as if every weight trained.

Executed FLOPs (HFU) = the ``"needed"`` passes + the GEMMs megatron-core runs that nothing needs
(``unneeded``) + recomputed forward GEMMs (``recompute``). Unneeded, as measured on
megatron-core 0.16.1:

- megatron's linear autograd Function always computes the input gradient of a trainable weight's
  layer. Adapters are megatron linears (Megatron-Bridge's ``ParallelLinearAdapter``), so an
  adapter whose input needs no gradient still runs its first GEMM's dgrad.
- ``RouterGatingLinearFunction`` always computes both gradients: a frozen router's wgrad.
- Full recompute with a frozen base: megatron's reentrant checkpoint calls backward only when
  its input requires grad, so Megatron-Bridge makes the decoder input require grad
  (``maybe_enable_recompute_inputs_grad``). We model that: every decoder GEMM then runs its dgrad.
- A pipeline whose first stage holds no decoder layer (``decoder_input_grad``, e.g. the layout
  ``E|ttttL``): that stage's output, the frozen embedding's, needs no gradient, so megatron-core
  0.16.1's ``backward_step`` skips its backward, but the next stage receives the decoder input with
  ``requires_grad=True`` (``recv_forward``): layer 0 runs its dgrad as every later layer does.

Recompute (megatron-core's ``recompute_granularity``/``recompute_method``/``recompute_num_layers``/
``recompute_modules``) re-runs the forward GEMMs of each checkpointed region whose backward runs:

- ``full``: every GEMM of the recomputed layers (``uniform``: all; ``block``: the first
  ``recompute_num_layers`` of every pipeline model chunk), LoRA adapters included; MTP layers
  (eh_proj + transformer layer) with ``uniform`` only. Never the output layer.
- ``selective``: ``core_attn`` the two core-attention GEMMs; ``mla_up_proj`` the MLA
  up-projections (``linear_q_up_proj`` or ``linear_q_proj``, and ``linear_kv_up_proj``);
  ``mlp`` the dense MLP; ``moe`` the whole MoE layer (router, latent projections, routed and
  shared experts); ``shared_experts`` the shared experts and their gate (twice with ``moe``: the
  inner checkpoint re-runs inside the outer one's recompute); ``layernorm``, ``moe_act`` no GEMM.

Not modelled (ValueError): hybrid, Mamba, Gated DeltaNet, KDA and DSA layers; a checkpointed region that holds trainable
weights but whose input needs no gradient (megatron's reentrant checkpoint would leave them
untrained); uneven pipeline splits with ``block``; FP8/FP4 ``block`` recompute, which skips
layers whose input needs no gradient.
"""

from __future__ import annotations

import bisect
import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from megatron_flops.flops.formulas import (
    TRAIN_PASSES,
    FlopsBreakdown,
    Gemm,
    LayerRun,
    SeqStats,
    forward_runs,
    gemm,
    training_flops,
)
from megatron_flops.flops.pipeline_split import PipelineSplit, split_stages
from megatron_flops.model.spec import ModelSpec

MODEL_FLOPS_CONVENTIONS = ("needed", "train_passes")
# Projections an adapter can wrap, named as Megatron-Bridge's LoRA ``target_modules`` name them.
LORA_TARGETS = (
    "linear_qkv",
    "linear_proj",
    "linear_fc1",
    "linear_fc2",
    "linear_q_proj",
    "linear_q_down_proj",
    "linear_q_up_proj",
    "linear_kv_down_proj",
    "linear_kv_up_proj",
)
# Megatron-Bridge's LoRA default.
DEFAULT_LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
# Megatron-Bridge 0.6.2's adapters on grouped-GEMM experts (TEGroupedMLP): one shared by the local
# experts (``share_expert_adapters``, the default), one per local expert (it off), or shared-outer
# (``experts_shared_outer_loras``: fc1's A and fc2's B shared, the other side per expert).
GROUPED_EXPERT_ADAPTERS = ("shared", "per-expert", "shared-outer")
RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")
RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")


@dataclass(frozen=True, kw_only=True)
class PeftSpec:
    """Which weights train: ``frozen`` freezes every base parameter; ``lora_rank`` adds a rank-r
    adapter ``x @ A @ B`` (A: in x r, B: r x out, run on the projection's input rows) beside every
    projection named in ``lora_targets``, in every layer (MTP layers and routed/shared experts
    included, as Megatron-Bridge matches module names); ``expert_adapters=False``: the routed
    experts take none (megatron-core's legacy ``GroupedMLP`` keeps them in ``weight1``/``weight2``,
    no ``linear_fc1``/``linear_fc2`` for Megatron-Bridge to match); ``grouped_expert_adapters``:
    Megatron-Bridge 0.6.2's adapter layout on grouped-GEMM experts (:data:`GROUPED_EXPERT_ADAPTERS`;
    the same GEMM FLOPs each: every routed token runs one rank-r pair per adapted linear).
    Subclasses name another model's projections in ``KNOWN_TARGETS`` (``dit.DiTPeftSpec``)."""

    KNOWN_TARGETS: ClassVar[tuple[str, ...]] = LORA_TARGETS

    frozen: bool = False
    lora_rank: int | None = None
    lora_targets: tuple[str, ...] = DEFAULT_LORA_TARGETS
    expert_adapters: bool = True
    grouped_expert_adapters: str = "shared"

    def __post_init__(self) -> None:
        if self.grouped_expert_adapters not in GROUPED_EXPERT_ADAPTERS:
            raise ValueError(f"grouped expert adapters must be one of {', '.join(GROUPED_EXPERT_ADAPTERS)}, "
                             f"got {self.grouped_expert_adapters!r}")
        if self.lora_rank is not None and (
            isinstance(self.lora_rank, bool) or not isinstance(self.lora_rank, int) or self.lora_rank < 1
        ):
            raise ValueError(f"lora rank must be a positive integer, got {self.lora_rank!r}")
        if not isinstance(self.lora_targets, tuple) or not self.lora_targets:
            raise ValueError(f"lora targets must be a non-empty tuple of names, got {self.lora_targets!r}")
        known = self.KNOWN_TARGETS
        for target in self.lora_targets:
            if target not in known:
                close = difflib.get_close_matches(str(target), known, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ValueError(f"unknown lora target {target!r}{hint}; known: {', '.join(known)}")
        if self.frozen and self.lora_rank is None:
            raise ValueError("a frozen base without LoRA adapters has nothing to train; give a lora rank")

    def adapted(self, gemm: str) -> bool:
        """Whether the GEMM of module ``gemm`` (``linear_qkv``, ``experts.linear_fc1``, ...) gets an adapter."""
        if self.lora_rank is None or (not self.expert_adapters and gemm.startswith("experts.")):
            return False
        return gemm.rsplit(".", 1)[-1] in self.lora_targets

    @classmethod
    def from_lora_mapping(cls, section: Mapping[str, Any], *, source: str = "model file") -> PeftSpec:
        """A model file's ``"lora"`` section in Megatron-Bridge's field names: ``dim`` (rank),
        optional ``target_modules``, and 0.6.2's ``share_expert_adapters`` (default true) and
        ``experts_shared_outer_loras`` (default false; it wins over the other, as in Bridge).
        LoRA freezes the base, as Megatron-Bridge's PEFT does."""
        if not isinstance(section, Mapping):
            raise ValueError(f"{source}: 'lora' must be a mapping with 'dim' and 'target_modules'")
        known = ("dim", "target_modules", "share_expert_adapters", "experts_shared_outer_loras")
        unknown = set(section) - set(known)
        if unknown:
            raise ValueError(f"{source}: unknown key(s) {sorted(unknown)} in 'lora' (known: {', '.join(known)})")
        if "dim" not in section:
            raise ValueError(f"{source}: 'lora' needs 'dim' (the adapter rank)")
        targets = section.get("target_modules")
        if targets is not None and (isinstance(targets, str) or not isinstance(targets, (list, tuple))):
            raise ValueError(f"{source}: lora 'target_modules' must be a list of names, got {targets!r}")
        switches = {k: section.get(k, k == "share_expert_adapters") for k in known[2:]}
        for key, value in switches.items():
            if not isinstance(value, bool):
                raise ValueError(f"{source}: lora {key!r} must be true or false, got {value!r}")
        grouped = "shared-outer" if switches["experts_shared_outer_loras"] else \
            "shared" if switches["share_expert_adapters"] else "per-expert"
        try:
            extra: dict[str, Any] = {} if targets is None else {"lora_targets": tuple(targets)}
            return cls(frozen=True, lora_rank=section["dim"], grouped_expert_adapters=grouped, **extra)
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from None


@dataclass(frozen=True, kw_only=True)
class RecomputeSpec:
    """Activation recompute as megatron-core's ``TransformerConfig`` sets it (same validation)."""

    granularity: str
    method: str | None = None
    num_layers: int | None = None
    modules: tuple[str, ...] = ("core_attn",)
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    pipeline_split: PipelineSplit | None = None  # an uneven split (None: even)

    def __post_init__(self) -> None:
        if self.granularity not in RECOMPUTE_GRANULARITIES:
            raise ValueError(
                f"recompute_granularity must be one of {RECOMPUTE_GRANULARITIES}, got {self.granularity!r}"
            )
        if self.granularity == "full":
            if self.method not in RECOMPUTE_METHODS:
                raise ValueError(
                    f"recompute_granularity='full' needs recompute_method in {RECOMPUTE_METHODS}, "
                    f"got {self.method!r}"
                )
            if isinstance(self.num_layers, bool) or not isinstance(self.num_layers, int) or self.num_layers < 1:
                raise ValueError(
                    f"recompute_granularity='full' needs recompute_num_layers >= 1, got {self.num_layers!r}"
                )
        elif self.num_layers is not None:
            raise ValueError("recompute_num_layers must be None with recompute_granularity='selective'")
        if not isinstance(self.modules, tuple):
            raise ValueError(f"recompute_modules must be a tuple of names, got {self.modules!r}")
        for module in self.modules:
            if module not in RECOMPUTE_MODULES:
                raise ValueError(f"unknown recompute module {module!r}; known: {', '.join(RECOMPUTE_MODULES)}")
        for name in ("pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    @classmethod
    def from_mapping(cls, fields: Mapping[str, Any], *, source: str = "model file") -> RecomputeSpec | None:
        """From ``TransformerConfig`` field names (a model file, or a config's ``vars``); None when
        ``recompute_granularity`` is unset."""
        granularity = fields.get("recompute_granularity")
        if granularity is None:
            return None
        modules = fields.get("recompute_modules")
        if modules is None:
            modules = ("core_attn",)
        elif isinstance(modules, str) or not isinstance(modules, (list, tuple)):
            raise ValueError(f"{source}: recompute_modules must be a list of names, got {modules!r}")
        split = PipelineSplit.from_mapping(fields, source=source)
        pp = fields.get("pipeline_model_parallel_size")
        try:
            return cls(
                granularity=granularity,
                method=fields.get("recompute_method"),
                num_layers=fields.get("recompute_num_layers"),
                modules=tuple(modules),
                pipeline_model_parallel_size=1 if pp is None else pp,
                virtual_pipeline_model_parallel_size=fields.get("virtual_pipeline_model_parallel_size"),
                pipeline_split=split if split.uneven else None,
            )
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from None


@dataclass(frozen=True, kw_only=True)
class TrainingPasses:
    """FLOPs of one training step per component, split by pass. Every mapping has the keys of
    ``forward`` (formulas' keys plus ``lora/<target>`` per adapted projection)."""

    forward: Mapping[str, int]
    input_grad: Mapping[str, int]
    weight_grad: Mapping[str, int]
    unneeded: Mapping[str, int]
    recompute: Mapping[str, int]
    attention: str = "causal"
    include_padding: bool = False

    def model(self, convention: str = "needed") -> FlopsBreakdown:
        """Model FLOPs per component under ``convention`` (see the module docstring)."""
        if convention == "needed":
            components = {k: v + self.input_grad[k] + self.weight_grad[k] for k, v in self.forward.items()}
        elif convention == "train_passes":
            components = {k: TRAIN_PASSES * v for k, v in self.forward.items()}
        else:
            raise ValueError(
                f"unknown model FLOPs convention {convention!r}; use one of {MODEL_FLOPS_CONVENTIONS}"
            )
        return FlopsBreakdown(components=components, attention=self.attention, include_padding=self.include_padding)

    def executed(self) -> FlopsBreakdown:
        """What the hardware runs: the needed passes + unneeded GEMMs + recompute."""
        needed = self.model("needed").components
        components = {k: v + self.unneeded[k] + self.recompute[k] for k, v in needed.items()}
        return FlopsBreakdown(components=components, attention=self.attention, include_padding=self.include_padding)


def training_passes(
    spec: ModelSpec,
    stats: SeqStats,
    *,
    peft: PeftSpec | None = None,
    recompute: RecomputeSpec | None = None,
    attention: str = "causal",
    include_padding: bool = False,
    decoder_input_grad: bool = False,
) -> TrainingPasses:
    """Forward, input-gradient, weight-gradient, unneeded and recompute FLOPs over ``stats``;
    ``decoder_input_grad``: megatron-core runs the decoder input with ``requires_grad=True``
    whatever trains (a first pipeline stage without decoder layers: :func:`~megatron_flops.flops.pipeline_split.first_stage_without_decoder`)."""
    peft = peft or PeftSpec()
    if not gpt_decoder(spec):
        raise ValueError(
            "frozen weights, LoRA and recompute are modelled for GPT decoders only (no hybrid, Mamba, "
            "Gated DeltaNet, KDA or DSA layers)"
        )
    runs = forward_runs(spec, stats, attention=attention, include_padding=include_padding)
    check_lora_targets(spec, peft, runs)
    needed = _walk(spec, runs, peft, None, executed=False)
    done = _walk(spec, runs, peft, recompute, executed=True, decoder_input_grad=decoder_input_grad)
    unneeded = {}
    for k in needed.forward:
        unneeded[k] = done.input_grad[k] + done.weight_grad[k] - needed.input_grad[k] - needed.weight_grad[k]
        assert unneeded[k] >= 0, k
    return TrainingPasses(
        forward=needed.forward,
        input_grad=needed.input_grad,
        weight_grad=needed.weight_grad,
        unneeded=unneeded,
        recompute=done.recompute,
        attention=attention,
        include_padding=include_padding,
    )


def check_lora_targets(spec: ModelSpec, peft: PeftSpec | None, runs: tuple[LayerRun, ...] | None = None) -> None:
    """ValueError for a LoRA target that matches no projection of ``spec`` (Megatron-Bridge would
    put no adapter there; with legacy ``GroupedMLP`` experts, ``expert_adapters=False``, none on
    them): the one rule ``estimate`` and ``memory`` share. ``runs``: ``spec``'s forward runs, if
    built already (only the GEMM names are read)."""
    if peft is None or peft.lora_rank is None:
        return
    if runs is None:
        runs = forward_runs(spec, SeqStats.full_length(1, 1, window=spec.pair_window))
    present = {g.name.rsplit(".", 1)[-1] for run in runs for g in run.gemms if peft.adapted(g.name)}
    for target in peft.lora_targets:
        if target not in present:
            legacy = "" if peft.expert_adapters else " (its routed experts, legacy GroupedMLP, take no adapter)"
            raise ValueError(f"lora target {target!r} matches no projection of this model{legacy}")


def check_recompute_modules(spec: ModelSpec, recompute: RecomputeSpec | None, *, grouped_gemm: bool) -> None:
    """ValueError, with megatron-core's ``TransformerConfig`` reason, for selective modules the model
    cannot recompute: ``moe_act`` without grouped-GEMM experts (``moe_grouped_gemm``), ``mla_up_proj``
    without multi-latent attention. The one rule ``estimate`` and ``memory`` share."""
    modules = recompute.modules if recompute is not None and recompute.granularity == "selective" else ()
    if "moe_act" in modules and not grouped_gemm:
        raise ValueError("megatron-core refuses selective recompute of moe_act without grouped-GEMM experts "
                         "(TransformerConfig: 'moe_act in recompute_modules is only supported with "
                         "moe_grouped_gemm'): set moe_grouped_gemm")
    if "mla_up_proj" in modules and spec.mla is None:
        raise ValueError("megatron-core refuses selective recompute of mla_up_proj without multi-latent attention "
                         "(TransformerConfig: 'mla_up_proj in recompute_modules is only supported with "
                         "multi_latent_attention')")


def gpt_decoder(spec: ModelSpec) -> bool:
    """Whether the walk models this decoder (no hybrid, Mamba, Gated DeltaNet, KDA or DSA layers)."""
    return all(m is None for m in (spec.mamba, spec.gdn, spec.kda, spec.dsa)) and not any(
        "none" in kind for kind, _ in spec.layer_runs)


def check_checkpointed_regions(
    spec: ModelSpec, peft: PeftSpec | None, recompute: RecomputeSpec | None, *, modules: tuple[str, ...]
) -> None:
    """The ValueError :func:`training_passes` raises where a selective region among ``modules``
    holds trainable weights or adapters but its input needs no gradient (megatron-core's reentrant
    checkpoint would leave them untrained), for callers that price no FLOPs (the memory report).
    Nothing for a decoder the walk does not model (training_passes refuses it on its own)."""
    if peft is None or recompute is None or recompute.granularity != "selective" or not gpt_decoder(spec):
        return
    regions = tuple(m for m in recompute.modules if m in modules)
    if regions:  # (the region's decision reads no size: one token will do)
        _walk(spec, forward_runs(spec, SeqStats.full_length(1, 1)), peft, replace(recompute, modules=regions),
              executed=True)


# ---- the walk: which operands need a gradient -------------------------------------------------

_Q = ("linear_qkv", "linear_q_proj", "linear_q_up_proj")
_K = ("linear_qkv", "linear_kv_down_proj", "linear_kv_up_proj")
_V = ("linear_qkv", "linear_kv_up_proj")
# Activation operands of each GEMM, each given as the values it is computed from; ``attn_in`` and
# ``ffn_in`` are the (normed) inputs of the attention and MLP sub-layers.
_OPERANDS: dict[str, tuple[tuple[str, ...], ...]] = {
    "linear_qkv": (("attn_in",),),
    "linear_q_proj": (("attn_in",),),
    "linear_q_down_proj": (("attn_in",),),
    "linear_kv_down_proj": (("attn_in",),),
    "linear_q_up_proj": (("linear_q_down_proj",),),
    "linear_kv_up_proj": (("linear_kv_down_proj",),),
    "core_attention.scores": (_Q, _K),
    # softmax(scores) and V.
    "core_attention.context": (_Q + _K, _V),
    "linear_proj": (_Q + _K + _V,),
    "linear_fc1": (("ffn_in",),),
    "linear_fc2": (("linear_fc1",),),
    "router": (("ffn_in",),),
    "fc1_latent_proj": (("ffn_in",),),
    "experts.linear_fc1": (("ffn_in", "fc1_latent_proj"),),
    "experts.linear_fc2": (("experts.linear_fc1",),),
    # The combine weighs expert outputs by router probabilities.
    "fc2_latent_proj": (("experts.linear_fc2", "router"),),
    "shared_experts.linear_fc1": (("ffn_in",),),
    "shared_experts.linear_fc2": (("shared_experts.linear_fc1",),),
    "shared_experts.gate_weight": (("ffn_in",),),
    "eh_proj": (("attn_in",),),
    "output_layer": (("attn_in",),),
}
# Values the residual stream adds after a layer's MLP sub-layer.
_SHARED = ("shared_experts.linear_fc1", "shared_experts.linear_fc2", "shared_experts.gate_weight")
_LAYER_OUTPUTS = ("ffn_in", "linear_fc2", "experts.linear_fc2", "router", "fc2_latent_proj") + _SHARED
_MOE = ("router", "fc1_latent_proj", "experts.linear_fc1", "experts.linear_fc2", "fc2_latent_proj") + _SHARED
# Selective recompute: module -> (GEMMs it re-runs, values its checkpoint takes as input).
_REGIONS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "core_attn": (("core_attention.scores", "core_attention.context"), _Q + _K + _V),
    "mla_up_proj": (("linear_q_proj", "linear_q_up_proj", "linear_kv_up_proj"),
                    ("attn_in", "linear_q_down_proj", "linear_kv_down_proj")),
    "mlp": (("linear_fc1", "linear_fc2"), ("ffn_in",)),
    "moe": (_MOE, ("ffn_in",)),
    "shared_experts": (_SHARED, ("ffn_in",)),
}


@dataclass(frozen=True, kw_only=True)
class _Walk:
    forward: dict[str, int]
    input_grad: dict[str, int]
    weight_grad: dict[str, int]
    recompute: dict[str, int]


def lora_passes(shape: tuple[int, int, int], rank: int, *, input_grad: bool) -> tuple[int, int, int]:
    """(forward, input-gradient, weight-gradient) FLOPs of a rank-``rank`` adapter beside a
    projection of ``shape`` (rows, in, out); ``input_grad``: whether A's dgrad runs."""
    rows, d_in, d_out = shape
    # A: [rows, in] @ [in, r]; B: [rows, r] @ [r, out]. Both train; B's input (A's output) always
    # needs a gradient, A's when the projection's input does.
    a, b = gemm(rows, d_in, rank), gemm(rows, rank, d_out)
    return a + b, (a if input_grad else 0) + b, a + b


def recomputed_counter(
    num_layers: int, recompute: RecomputeSpec | None, *, mtp_num_layers: int = 0
) -> Callable[[int | None, int], int]:
    """``count(first, n)``: how many of the layers ``first .. first + n - 1`` (decoder layers, then
    MTP depths; ``None`` is the output layer, never recomputed) full recompute re-runs, without a
    loop over them."""
    if recompute is None or recompute.granularity != "full":
        return lambda first, n: 0
    layers = num_layers
    if recompute.method == "uniform":
        if mtp_num_layers and recompute.num_layers != 1:
            raise ValueError(
                "megatron-core's MTP recompute needs recompute_num_layers=1 with recompute_method='uniform'"
            )
        return lambda first, n: 0 if first is None else n
    starts = _chunk_starts(layers, recompute, mtp_num_layers)
    # NB: block recompute re-runs the first recompute_num_layers layers of every model chunk (each
    # virtual stage's, as megatron-core splits them, uneven splits included) and skips MTP layers
    # (megatron-core warns and runs them plainly).
    assert recompute.num_layers is not None, "RecomputeSpec requires num_layers for full recompute"
    block = recompute.num_layers

    done = [0]  # recomputed layers before each chunk
    for a, b in zip(starts, starts[1:]):
        done.append(done[-1] + min(block, b - a))

    def below(i: int) -> int:  # recomputed layers among 0 .. i - 1 (i <= layers)
        chunk = bisect.bisect_right(starts, i) - 1
        return done[chunk] + min(i - starts[chunk], block)

    def count(first: int | None, n: int) -> int:
        if first is None or first >= layers:
            return 0
        return below(min(first + n, layers)) - below(first)

    return count


def _chunk_starts(layers: int, recompute: RecomputeSpec, mtp_num_layers: int) -> list[int]:
    """The first layer of each model chunk in layer order, then ``layers``."""
    pp, vpp = recompute.pipeline_model_parallel_size, recompute.virtual_pipeline_model_parallel_size
    if recompute.pipeline_split is not None:
        sizes, _ = split_stages(recompute.pipeline_split, num_layers=layers, pp=pp, vpp=vpp,
                                mtp_num_layers=mtp_num_layers)
    else:
        chunks = pp * (vpp or 1)
        if layers % chunks:
            raise ValueError(f"num_layers={layers} does not split evenly into {chunks} pipeline model chunks")
        sizes = (layers // chunks,) * chunks
    return [sum(sizes[:i]) for i in range(len(sizes))] + [layers]


# One layer's contribution: (key, forward, input grad, weight grad, recompute) per GEMM.
_Contribution = tuple[tuple[str, int, int, int, int], ...]


def _walk(
    spec: ModelSpec,
    runs: tuple[LayerRun, ...],
    peft: PeftSpec,
    recompute: RecomputeSpec | None,
    *,
    executed: bool,
    decoder_input_grad: bool = False,
) -> _Walk:
    """One pass over the layers: the needed passes (``executed=False``, no recompute) or what
    megatron-core runs (``executed=True``). A run of identical layers is walked once per distinct
    (input needs a gradient, recomputed) case and multiplied, so the cost does not grow with the
    number of layers."""
    acc: tuple[dict[str, int], ...] = ({}, {}, {}, {})
    recomputed = recomputed_counter(spec.num_layers, recompute, mtp_num_layers=spec.mtp_num_layers)
    walker = _LayerWalker(peft, recompute, executed=executed)
    # The decoder input (embedding output) needs a gradient when the embedding trains, and in the
    # executed walk when Megatron-Bridge forces it for full recompute or when the first pipeline
    # stage holds no decoder layer (the next stage receives it with requires_grad=True); nothing
    # needs that gradient, so it is unneeded.
    stream = walker.trainable or (executed and (
        decoder_input_grad or recomputed(0, spec.num_layers + spec.mtp_num_layers) > 0))
    for run in runs:
        redo = recomputed(run.first, run.count)
        _, out = walker.layer(run.gemms, stream, False, run.first)
        groups = [(stream, run.first, run.count, redo)]
        if out != stream:
            # Only the first layer sees an input that needs no gradient; every later one does.
            first_redo = recomputed(run.first, 1)
            nxt = None if run.first is None else run.first + 1
            groups = [(stream, run.first, 1, first_redo), (out, nxt, run.count - 1, redo - first_redo)]
        for grad_in, index, count, redone in groups:
            for times, n in ((True, redone), (False, count - redone)):
                if n:
                    contribution, _ = walker.layer(run.gemms, grad_in, times, index)
                    for key, *values in contribution:
                        for into, value in zip(acc, values):
                            into[key] = into.get(key, 0) + n * value
        stream = out
    return _Walk(forward=acc[0], input_grad=acc[1], weight_grad=acc[2], recompute=acc[3])


class _LayerWalker:
    """Which operands of one layer's GEMMs need a gradient, given whether its input does; memoised
    per (layer GEMMs, input needs a gradient, fully recomputed)."""

    def __init__(self, peft: PeftSpec, recompute: RecomputeSpec | None, *, executed: bool) -> None:
        self.peft = peft
        self.executed = executed
        self.trainable = not peft.frozen
        self.selective = recompute.modules if recompute is not None and recompute.granularity == "selective" else ()
        self._memo: dict[tuple[tuple[Gemm, ...], bool, bool], tuple[_Contribution, bool]] = {}

    def layer(
        self, gemms: tuple[Gemm, ...], grad_in: bool, recomputed: bool, index: int | None
    ) -> tuple[_Contribution, bool]:
        """The layer's contribution and whether its output needs a gradient."""
        key = (gemms, grad_in, recomputed)
        if key not in self._memo:
            self._memo[key] = self._walk_layer(gemms, grad_in, recomputed, index)
        return self._memo[key]

    def _walk_layer(
        self, gemms: tuple[Gemm, ...], grad_in: bool, recomputed: bool, index: int | None
    ) -> tuple[_Contribution, bool]:
        peft = self.peft
        values: dict[str, bool] = {"attn_in": grad_in}

        def value(name: str) -> bool:
            if name == "ffn_in":
                return values["attn_in"] or values.get("linear_proj", False)
            return values.get(name, False)

        out: list[tuple[str, int, int, int, int]] = []
        for g in gemms:
            operands = [any(value(v) for v in sources) for sources in _OPERANDS[g.name]]
            adapted = peft.adapted(g.name)
            weight = g.has_weight and self.trainable
            # Backward: one GEMM of the forward's size per operand that gets a gradient.
            d = g.flops * sum(operands)
            w = g.flops if weight else 0
            if self.executed and g.name == "router" and any(operands):
                # RouterGatingLinearFunction computes dgrad and wgrad whenever it runs backward.
                w = g.flops
            times = int(recomputed)
            for module in self.selective:
                names, inputs = _REGIONS.get(module, ((), ()))
                if g.name not in names:
                    continue
                if any(value(v) for v in inputs):
                    times += 1
                elif weight or adapted:
                    raise ValueError(
                        f"selective recompute of {module!r} with a frozen base: megatron-core's reentrant "
                        f"checkpoint gives the trainable weights of {g.name} (layer {index}) no gradient, "
                        "because nothing upstream of it trains"
                    )
            out.append((g.key, g.flops, d, w, times * g.flops))
            if adapted:
                assert g.shape is not None and peft.lora_rank is not None
                # A trainable megatron linear computes its dgrad even when its input needs none (executed).
                f, d, w = lora_passes(g.shape, peft.lora_rank, input_grad=operands[0] or self.executed)
                prefix = "mtp/" if g.key.startswith("mtp/") else ""
                out.append((f"{prefix}lora/{g.name}", f, d, w, times * f))
            values[g.name] = any(operands) or weight or adapted
            if g.name == "eh_proj":
                values["attn_in"] = values["eh_proj"]
        return tuple(out), any(value(v) for v in _LAYER_OUTPUTS)


@dataclass(frozen=True, kw_only=True)
class PricedStep:
    """Model FLOPs (real tokens, the model-FLOPs convention) and executed FLOPs (padding,
    unneeded GEMMs, recompute) of one set of statistics."""

    model: FlopsBreakdown
    executed: FlopsBreakdown
    recompute_flops: int = 0
    unneeded_flops: int = 0


def price(
    spec: ModelSpec,
    stats: SeqStats,
    *,
    attention: str = "causal",
    peft: PeftSpec | None = None,
    recompute: RecomputeSpec | None = None,
    convention: str = "needed",
    decoder_input_grad: bool = False,
) -> PricedStep:
    """The one pricing path of the CLI and the tracker: plain TRAIN_PASSES when nothing is frozen
    or recomputed, else :func:`training_passes` (``decoder_input_grad``: see there)."""
    if peft is None and recompute is None:
        model = training_flops(spec, stats, attention=attention)
        if (stats.num_padded_tokens, stats.sum_padded_seqlen_squared, stats.padded_window_pairs) == (
                stats.num_tokens, stats.sum_seqlen_squared, stats.window_pairs):
            # No padding: the padded GEMMs are the real ones (what forward_runs reads of the stats).
            executed = replace(model, components=dict(model.components), include_padding=True)
        else:
            executed = training_flops(spec, stats, attention=attention, include_padding=True)
        return PricedStep(model=model, executed=executed)
    model = training_passes(spec, stats, peft=peft, recompute=recompute, attention=attention).model(convention)
    padded = training_passes(spec, stats, peft=peft, recompute=recompute, attention=attention, include_padding=True,
                             decoder_input_grad=decoder_input_grad)
    return PricedStep(
        model=model,
        executed=padded.executed(),
        recompute_flops=sum(padded.recompute.values()),
        unneeded_flops=sum(padded.unneeded.values()),
    )
