"""Memory of a Qwen-VL (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-Omni) vision tower trained with a
megatron-core decoder, as Megatron-Bridge builds it (stdlib only).

Where it lives: Megatron-Bridge's ``Qwen25VLModel`` builds the Hugging Face tower
(``Qwen2_5_VisionTransformerPretrainedModel``) as ``visual`` on the first pipeline stage only
(``pre_process``: model chunk 0 of pipeline rank 0), registered before ``language_model``, so its
parameters come first in ``named_parameters()`` and join that chunk's DDP buffers. Every
tensor-parallel rank holds it whole and runs it on the whole micro-batch's images; its gradients
are averaged over TP once per step by ``finalize_model_grads`` (``average_gradients_across_tp_domain``):
one coalesced ``tp/all_reduce`` of the trainable tower's gradients. ``freeze_vision_model``
freezes the patch embedding and the blocks, ``freeze_vision_projection`` the merger; a PEFT
(``--frozen``) run freezes the whole tower (Bridge's LoRA targets, ``linear_qkv`` ..., name no
module of the Hugging Face tower).

Activations (saved for backward, one micro-batch; ``P`` patches, ``M = P / m^2`` merged tokens,
``D`` width, ``F`` MLP width, ``d`` head width, ``K = C x tp x p^2`` pixels per patch, ``a`` bytes
of the compute dtype), as the Hugging Face tower's eager attention saves them (measured on CPU):

- ``vit/patch_embed``: the Conv3d's input ``a P K`` (Qwen2.5-VL: and the int64 window order, ``8 M``);
- ``vit/rope``: the fp32 ``cos``/``sin`` ``[P, d]`` every block reads (once): ``8 P d``;
- ``vit/norm`` per RMSNorm (Qwen2.5-VL): an fp32 copy of its input, fp32 ``rstd`` and its output
  in ``a``: ``4 P D + 4 P + a P D``; per LayerNorm: its input and two statistics ``a P D + 2 s P``;
- ``vit/attn`` per block: qkv's input and output (``v`` is a view of it), the rotated ``q`` and
  ``k``, proj's input: ``7 a P D``; the softmax output ``[heads, n, n]`` per attention segment in fp32
  and, below fp32, its cast to ``a``;
- ``vit/mlp`` per block: its input, then ``[P, F]`` tensors: the activation's input (and
  QuickGELU's sigmoid), the activation's output, and for a gated MLP the up projection and the
  product;
- ``vit/merger``: its input norm, the two linear layers' inputs and the GELU's input
  (``3 a P D``), and (Qwen2.5-VL) the inverse window order (``8 M``);
- Qwen3-VL / Qwen3-Omni: ``vit/pos_embed``, the learned grid resampled per patch (int64 indices and
  fp32 weights of 4 bilinear taps: ``48 P``); ``vit/deepstack_merger`` per deep-stack merger, as
  the merger but normed over ``M`` rows of ``m^2 D`` after the shuffle (its input, a block's
  output, is saved already unless the blocks are frozen and it follows a block other than the last);
- ``vit/placeholder_mask``: the bool ``[b, s, 1]`` mask of each ``masked_scatter`` of image (``t = 1``
  rows) or video embeddings into the decoder's input.

A frozen linear layer keeps no input; a frozen tower keeps nothing (pixels need no gradient); with
the blocks frozen the merger keeps what its weights' gradients read.

Attention (``attn_implementation``; Megatron-Bridge leaves transformers' default, ``sdpa``):
``eager`` as above; ``sdpa`` saves no softmax: q, k, v (saved already), the kernel's output per
segment before the tower transposes it (``a P D``) and an fp32 log-sum-exp per patch and head
(``4 P heads``), measured with torch's CPU kernel; ``flash_attention_2`` the log-sum-exp only
(a formula: no such kernel on CPU).
NB: norm statistics in fp32 (``s = 4``), as CUDA's LayerNorm keeps them (CPU: the input dtype).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from megatron_flops.flops.vision import (
    VisionSpec,
    VisionStats,
    hf_vision_sections,
    vision_spec_from_model_mapping,
)
from megatron_flops.memory.decoder import Param
from megatron_flops.memory.layout import FP32_BYTES, INDEX_BYTES, NORM_STATS_BYTES

@dataclass(frozen=True, kw_only=True)
class VisionTower:
    """A Qwen-VL tower: ``family`` (``qwen2_vl``, ``qwen2_5_vl``, ``qwen3_vl``) and its shapes;
    ``hidden_act`` the blocks' MLP activation; ``num_position_embeddings`` Qwen3-VL's learned grid;
    ``omni``: Qwen3-Omni's encoder (Qwen3-VL's, its mergers named and registered otherwise)."""

    family: str
    spec: VisionSpec
    hidden_act: str
    num_position_embeddings: int = 0
    omni: bool = False

    @property
    def rms_norm(self) -> bool:
        return self.family == "qwen2_5_vl"


def vision_tower(raw: Mapping[str, Any]) -> VisionTower | None:
    """The tower of a Hugging Face model mapping, or None when it has none."""
    sections = hf_vision_sections(raw)
    if sections is None:
        return None
    spec = vision_spec_from_model_mapping(raw)
    kind = str(sections["model_type"]).removesuffix("_vision_encoder").removesuffix("_vision")
    family = "qwen3_vl" if kind in ("qwen3_vl", "qwen3_vl_moe", "qwen3_omni_moe") else kind
    config = sections["vision_config"]
    default_act = {"qwen2_vl": "quick_gelu", "qwen2_5_vl": "silu"}.get(family, "gelu_pytorch_tanh")
    return VisionTower(family=family, spec=spec, hidden_act=str(config.get("hidden_act", default_act)),
                       num_position_embeddings=int(config.get("num_position_embeddings", 2304)),
                       omni=kind == "qwen3_omni_moe")


def default_attention(raw: Mapping[str, Any]) -> str:
    """The tower's ``attn_implementation`` from the model file (its ``vision_config``, then the top
    level), else transformers' default ``sdpa``, which Megatron-Bridge's ``_from_config`` keeps."""
    sections = hf_vision_sections(raw) or {}
    for where in (sections.get("vision_config") or {}, raw):
        for key in ("_attn_implementation", "attn_implementation"):
            value = where.get(key) if isinstance(where, Mapping) else None
            if value is not None:
                if value not in VISION_ATTENTION:
                    raise ValueError(f"model file: {key}={value!r}: the vision tower's memory is modelled for "
                                     f"{VISION_ATTENTION}")
                return str(value)
    return "sdpa"


def _linear(name: str, n_in: int, n_out: int, trains: bool) -> list[Param]:
    return [Param(f"{name}.weight", n_in * n_out, trains, rows=n_out), Param(f"{name}.bias", n_out, trains)]


def _norm(tower: VisionTower, name: str, width: int, trains: bool) -> list[Param]:
    weight = [Param(f"{name}.weight", width, trains)]
    return weight if tower.rms_norm else weight + [Param(f"{name}.bias", width, trains)]


def vision_parameters(tower: VisionTower, *, model_trains: bool = True,
                      projection_trains: bool = True) -> tuple[Param, ...]:
    """The tower's parameters in ``named_parameters()`` order (prefix ``visual.``): ``model_trains``
    for the patch embedding, position embedding and blocks, ``projection_trains`` for the mergers."""
    s, t = tower.spec, model_trains
    d, f, m2 = s.hidden_size, s.intermediate_size, s.spatial_merge_size**2
    qwen3 = tower.family == "qwen3_vl"
    pixels = s.in_channels * s.temporal_patch_size * s.patch_size**2
    main, deepstack = _mergers(tower, projection_trains)
    out = deepstack if tower.omni else []  # (Qwen3-Omni registers its deep-stack mergers first)
    out += [Param("visual.patch_embed.proj.weight", pixels * d, t, rows=d)]  # (Conv3d: [D, C, t, p, p])
    if qwen3:
        out += [Param("visual.patch_embed.proj.bias", d, t),
                Param("visual.pos_embed.weight", tower.num_position_embeddings * d, t,
                      rows=tower.num_position_embeddings)]
    mlp = {"qwen2_vl": ("fc1", "fc2"), "qwen3_vl": ("linear_fc1", "linear_fc2")}.get(tower.family)
    for i in range(s.depth):
        block = f"visual.blocks.{i}."
        out += _norm(tower, block + "norm1", d, t) + _norm(tower, block + "norm2", d, t)
        out += _linear(block + "attn.qkv", d, 3 * d, t) + _linear(block + "attn.proj", d, d, t)
        if mlp is None:  # Qwen2.5-VL's gated MLP
            for name in ("gate_proj", "up_proj"):
                out += _linear(block + "mlp." + name, d, f, t)
            out += _linear(block + "mlp.down_proj", f, d, t)
        else:
            out += _linear(block + "mlp." + mlp[0], d, f, t) + _linear(block + "mlp." + mlp[1], f, d, t)
    out += main if tower.omni else main + deepstack
    return tuple(out)


def _mergers(tower: VisionTower, trains: bool) -> tuple[list[Param], list[Param]]:
    """The patch merger, and Qwen3-VL's deep-stack mergers (normed after the 2x2 shuffle)."""
    s = tower.spec
    wide = s.hidden_size * s.spatial_merge_size**2
    names = ("ln_q", "mlp.0", "mlp.2") if tower.family != "qwen3_vl" or tower.omni else ("norm", "linear_fc1",
                                                                                         "linear_fc2")
    deepstack = "visual.merger_list." if tower.omni else "visual.deepstack_merger_list."

    def merger(prefix: str, norm_width: int) -> list[Param]:
        return (_norm(tower, prefix + names[0], norm_width, trains) + _linear(prefix + names[1], wide, wide, trains)
                + _linear(prefix + names[2], wide, s.out_hidden_size, trains))

    extra = s.deepstack_visual_indexes if tower.family == "qwen3_vl" else ()
    return merger("visual.merger.", s.hidden_size), [p for i in range(len(extra))
                                                      for p in merger(f"{deepstack}{i}.", wide)]


# [P, F] tensors an MLP activation saves of its own: QuickGELU (x * sigmoid(1.702 x)) keeps x and
# the sigmoid; the others (torch's GELU, SiLU) their input.
_ACT_SAVES = {"quick_gelu": 2}
MEASURED_ACTIVATIONS = ("silu", "gelu", "quick_gelu", "gelu_pytorch_tanh")
VISION_ATTENTION = ("eager", "sdpa", "flash_attention_2")  # Hugging Face attn_implementation


def _norm_bytes(tower: VisionTower, rows: int, width: int, a: int, stats: int, *, weight_trains: bool,
                input_grad: bool) -> int:
    """One norm over ``rows`` x ``width``: RMSNorm (composite: an fp32 copy of its input and fp32
    rstd when its input needs a gradient, its output in ``a`` when its weight trains); LayerNorm
    (its input and two statistics when anything needs a gradient)."""
    if tower.rms_norm:
        return (4 * rows * width + 4 * rows) * input_grad + a * rows * width * weight_trains
    return (a * rows * width + 2 * stats * rows) * (input_grad or weight_trains)


def _block_bytes(tower: VisionTower, stats: VisionStats, a: int, s: int, attention: str) -> dict[str, int]:
    """One micro-batch's blocks, all training (see the module docstring)."""
    spec, p = tower.spec, stats.num_patches
    d, f = spec.hidden_size, spec.intermediate_size
    pairs = (spec.num_full_attention_blocks * stats.sum_frame_patches_squared
             + spec.num_window_attention_blocks * stats.window_pairs)
    if attention != "eager":
        # NB: q, k, v and the output are saved already; the kernel adds an fp32 log-sum-exp per patch and
        # head, and sdpa's output per segment before the tower transposes it.
        core = spec.depth * (4 * p * spec.num_heads + (a * p * d if attention == "sdpa" else 0))
    else:
        # NB: softmax(dtype=float32) saves its fp32 output; below fp32 its cast to ``a`` is matmul's input too.
        core = spec.num_heads * pairs * (4 + (a if a < 4 else 0))
    per_mlp = _ACT_SAVES.get(tower.hidden_act, 1) + (3 if spec.gated_mlp else 1)
    return {
        "vit/norm": 2 * spec.depth * _norm_bytes(tower, p, d, a, s, weight_trains=True, input_grad=True),
        "vit/attn": spec.depth * 7 * a * p * d + core,
        "vit/mlp": spec.depth * (a * p * d + per_mlp * a * p * f),
    }


def vision_activations(tower: VisionTower, stats: VisionStats, *, act_bytes: int, attention: str = "eager",
                       model_trains: bool = True, projection_trains: bool = True,
                       norm_stats_bytes: int = NORM_STATS_BYTES) -> dict[str, int]:
    """Bytes the tower saves for backward over one micro-batch's grids (``stats``), by component.

    ``attention``: one of VISION_ATTENTION (see the module docstring). A frozen tower saves
    nothing: its input (pixels) needs no gradient; with the blocks frozen the merger saves only
    what its weights' gradients read."""
    if attention not in VISION_ATTENTION:
        raise ValueError(f"vision attention must be one of {VISION_ATTENTION}, got {attention!r}")
    spec, p, a = tower.spec, stats.num_patches, act_bytes
    d, merged = spec.hidden_size, p // spec.spatial_merge_size**2
    out: dict[str, int] = {}
    if model_trains:
        pixels = spec.in_channels * spec.temporal_patch_size * spec.patch_size**2
        out["vit/patch_embed"] = a * p * pixels
        out["vit/rope"] = 2 * FP32_BYTES * p * spec.head_dim  # fp32 cos and sin [P, d]
        out.update(_block_bytes(tower, stats, a, norm_stats_bytes, attention))
        if tower.family == "qwen3_vl":
            # NB: the learned grid resampled per patch: embedding(indices [P, 4] int64) x fp32 weights [P, 4].
            out["vit/pos_embed"] = (INDEX_BYTES + FP32_BYTES) * 4 * p
    if model_trains or projection_trains:
        # NB: a frozen linear layer keeps no input; the GELU keeps its input when it needs a gradient.
        linears = 2 * a * p * d if projection_trains else 0
        norm = _norm_bytes(tower, p, d, a, norm_stats_bytes, weight_trains=projection_trains, input_grad=model_trains)
        out["vit/merger"] = norm + linears + a * p * d
        if tower.family == "qwen3_vl":
            out["vit/deepstack_merger"] = _deepstack_bytes(tower, p, a, norm_stats_bytes, model_trains=model_trains,
                                                           projection_trains=projection_trains)
    if tower.family == "qwen2_5_vl":
        # NB: int64 indices of the window order (gathering the patch embeddings) and of its inverse
        # (gathering the merger's output), each saved when its gather's input needs a gradient.
        out["vit/patch_embed"] = out.get("vit/patch_embed", 0) + INDEX_BYTES * merged * model_trains
        out["vit/merger"] = out.get("vit/merger", 0) + INDEX_BYTES * merged * (model_trains or projection_trains)
    return {k: v for k, v in out.items() if v}


def _deepstack_bytes(tower: VisionTower, p: int, a: int, s: int, *, model_trains: bool,
                     projection_trains: bool) -> int:
    """Qwen3-VL's deep-stack mergers: each a LayerNorm over ``P / m^2`` rows of ``m^2 D`` (after the
    shuffle), its two linear layers' inputs and the GELU's input, as the main merger."""
    spec = tower.spec
    d, merged = spec.hidden_size, p // spec.spatial_merge_size**2
    total = 0
    for index in spec.deepstack_visual_indexes:
        # NB: the norm's input is the block's output, which the next block's norm1 (trained) or, after the
        # last block, the main merger's norm saves already; only behind frozen blocks is it kept anew.
        own_input = projection_trains and not model_trains and index < spec.depth - 1
        total += a * p * d * own_input + 2 * s * merged + (2 * a * p * d) * projection_trains + a * p * d
    return total


@dataclass(frozen=True, kw_only=True)
class NeededInput:
    """A figure left out of the report until the user gives ``flag``: ``excluded`` (what the total
    leaves out without it) needs ``give`` (what the flag says)."""

    flag: str
    excluded: str
    give: str


# The tower's activations depend on the images of a micro-batch, which no model file holds.
GRIDS_NEEDED = NeededInput(flag="--grid-thw", excluded="the vision tower's activations",
                           give="the [t, h, w] grids of one micro-batch")


@dataclass(frozen=True, kw_only=True)
class VisionMemory:
    """The tower as a memory report places it: ``params`` on model chunk 0 of pipeline rank 0
    (before the decoder's, in ``named_parameters()`` order), ``activations`` one micro-batch's
    saved bytes there (None: no grids given, ``needs_input`` says so), and the notes it adds to
    the report."""

    params: tuple[Param, ...]
    activations: dict[str, int] | None
    needs_input: tuple[NeededInput, ...] = ()
    unmeasured: tuple[str, ...] = ()
    assumptions: tuple[str, ...] = ()

    def chunk_params(self, first_stage: bool) -> tuple[Param, ...]:
        return self.params if first_stage else ()

    def chunk_activations(self, first_stage: bool) -> dict[str, int]:
        return dict(self.activations or {}) if first_stage else {}

    def communication(self, tp: int, grad_bytes: int, first_stage: bool) -> dict[str, int]:
        """``finalize_model_grads``' coalesced TP all-reduce of the trainable tower's gradients."""
        numel = sum(p.numel for p in self.params if p.trainable)
        return {"tp/all_reduce": numel * grad_bytes} if tp > 1 and first_stage and numel else {}

    def parameter_counts(self) -> dict[str, int]:
        return {"total": sum(p.numel for p in self.params),
                "trainable": sum(p.numel for p in self.params if p.trainable)}


def _placeholder_masks(grids: Any) -> int:
    """masked_scatter calls: one for the images (``t = 1`` rows), one for the videos (``t > 1``)."""
    return int(any(row[0] == 1 for row in grids)) + int(any(row[0] > 1 for row in grids))


def vision_memory(tower: VisionTower, grids: Any, *, act_bytes: int, attention: str, tokens: int = 0,
                  model_trains: bool = True, projection_trains: bool = True, embedding_trains: bool = True,
                  cp: int = 1) -> VisionMemory:
    """The tower's memory for ``grids`` (the ``[t, h, w]`` rows of one micro-batch of ``tokens``
    decoder tokens; None: activations left out, ``needs_input`` naming --grid-thw) under ``attention`` (one of VISION_ATTENTION);
    ``embedding_trains``: the decoder's word embeddings train."""
    params = vision_parameters(tower, model_trains=model_trains, projection_trains=projection_trains)
    unmeasured: list[str] = []
    assumptions = [f"the {tower.family} vision tower whole on every TP rank of the first pipeline stage, as "
                   "Megatron-Bridge's Hugging Face Qwen2.5-VL tower (its gradients averaged over TP once per step)"
                   + (" (Megatron-Bridge has no Qwen2-VL model)" if tower.family == "qwen2_vl" else "")]
    activations = None
    stats = None if grids is None else VisionStats.from_grids(tower.spec, grids)  # (validates the grids)
    if tower.family == "qwen3_vl":
        name = "Qwen3-Omni" if tower.omni else "Qwen3-VL"
        unmeasured.append(f"the {name} vision tower as the Hugging Face module (its parameters and saved activations "
                          "measured on it), whole on each TP rank: Megatron-Bridge builds it from megatron-core "
                          "Transformer Engine layers split over TP (not measured: no CPU run)")
    if stats is not None:
        activations = vision_activations(tower, stats, act_bytes=act_bytes, attention=attention,
                                         model_trains=model_trains, projection_trains=projection_trains)
        if (model_trains or projection_trains or embedding_trains) and tokens * _placeholder_masks(grids):
            activations["vit/placeholder_mask"] = tokens * _placeholder_masks(grids)
            assumptions.append("vit/placeholder_mask: the bool [b, s, 1] mask each masked_scatter of image (t = 1 "
                               "grids) or video (t > 1) embeddings into the decoder's input keeps, as "
                               "Megatron-Bridge's Qwen25VLModel.forward (measured on a forward that mirrors it)")
        if tower.hidden_act not in MEASURED_ACTIVATIONS:
            unmeasured.append(f"the vision MLP's {tower.hidden_act!r} counted as keeping its input (measured: "
                              f"{', '.join(MEASURED_ACTIVATIONS)})")
        if attention == "sdpa" and model_trains:
            assumptions.append("the vision tower's sdpa kernel keeps q, k, v, its output and an fp32 log-sum-exp per "
                               "patch and head, as torch's CPU kernel does (measured; GPU kernels may pad the "
                               "log-sum-exp)")
        if attention == "flash_attention_2" and model_trains:
            unmeasured.append("activations of the vision tower's flash_attention_2 (q, k, v, output and an fp32 "
                              "log-sum-exp per patch and head, no softmax; no such kernel on CPU; eager and sdpa are "
                              "measured: --vision-attention)")
    if cp > 1:
        unmeasured.append("the vision tower under context parallelism: whole on every CP rank")
    return VisionMemory(params=params, activations=activations, needs_input=(GRIDS_NEEDED,) if stats is None else (),
                        unmeasured=tuple(unmeasured), assumptions=tuple(assumptions))
