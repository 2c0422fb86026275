"""Bytes saved for backward by one micro-batch of a megatron-core GPT model chunk, and the
micro-batches in flight at the pipeline schedule's peak (stdlib only).

Counted: the distinct storages autograd keeps for backward (``saved_tensors_hooks`` sees them),
as megatron-core 0.16's local layer spec saves them on CUDA. Not counted: parameters, gradients,
one-element tensors (loss scalars), temporaries freed inside an op, the pipeline's output tensors
(Megatron-LM sets ``deallocate_pipeline_outputs``), allocator caching and workspaces.

Per micro-batch of ``b`` sequences of ``s`` tokens (``T = s x b``), per tensor-parallel rank
(heads, ffn and vocabulary divided by TP), ``a`` bytes per activation element (the parameter
dtype). Sequence parallelism splits the [s, b, h] activations between layers over TP: what the
norms, dropouts and the column-parallel layers' inputs (``linear_qkv``, ``linear_fc1``,
``output_layer``: each saves its slice and all-gathers it again in backward) keep is divided by
TP; the rest is not.

- embedding (first stage): token ids (and position ids with learned absolute positions), int64;
  with TP > 1 the vocab-parallel lookup's shifted ids and a bool mask of the ids it does not hold.
- each norm: its input, and fp32 statistics per token (LayerNorm mean and rstd, RMSNorm rstd).
  NB: CUDA's kernels keep the statistics in fp32; torch's CPU LayerNorm keeps them in the input
  dtype and its CPU RMSNorm is composite (it also saves ``x * rstd``).
- attention, ``unfused`` (megatron-core's ``DotProductAttention``): q and k after RoPE (RoPE's
  cos and sin [s, rot] in the activation dtype, twice each), the qkv projection's output where
  q/k/v are views of it, GQA's repeated k and v, the mask handed in (bool [b, 1, s, s], as
  Megatron-LM's GPT dataset builds it, once per model chunk), the softmax output [b, heads, s, s]
  (fp32 with ``attention_softmax_in_fp32`` and 16-bit activations, which also keeps the 16-bit
  probabilities the context GEMM reads), and ``linear_proj``'s input.
  ``flash`` (FlashAttention/cuDNN-style kernels; not measured here: no Transformer Engine on
  CPU): q, k, v as handed to the kernel, its output (``linear_proj``'s input) and an fp32
  log-sum-exp per query and head.
- dropout (p > 0): a bool mask per site (CUDA's ``native_dropout``; torch's CPU dropout keeps an
  activation-dtype mask), and attention dropout's output.
- MLP: ``linear_fc1``'s input and output and ``linear_fc2``'s input; unfused SwiGLU also keeps
  ``silu(x1)`` and ``x2 + glu_linear_offset``. Attention and the MLP in parallel (Hugging Face
  cohere, gpt_neox, stablelm, falcon: :mod:`.hf_parallel`): one norm, whose output both keep, or
  two norms keeping the layer's input once.
- output (last stage): the final norm, ``output_layer``'s input, vocab-parallel cross-entropy's
  fp32 softmax [T, V/TP], target mask (bool) and masked targets (int64), and the loss mask
  (fp32) that Megatron-LM's ``loss_func`` multiplies by.

LoRA and frozen bases (:class:`~megatron_flops.flops.passes.PeftSpec`): autograd saves only for
ops whose inputs require grad. With a frozen base nothing does before the first adapter of the
first pipeline stage (a later stage's received hidden states do); a frozen linear layer keeps no
input (megatron-core's frozen-weight path saves only the weight), a frozen embedding no ids; a
LoRA adapter (Megatron-Bridge's ``linear_in``, ``linear_out``, no adapter dropout) keeps the
projection's input and the [T, r] intermediate. MoE and MLA layers (TP 1): frozen experts and MLA
projections keep no input (the router's gating function keeps its own); every routed and shared
expert's ``linear_fc1``/``linear_fc2`` is a target (:func:`.moe.expert_lora_activations`).

Recompute: a checkpointed region keeps its inputs (megatron-core's ``CheckpointFunction``) and
re-saves its activations while its backward runs. Full recompute checkpoints groups of layers
(hidden states, mask and the cached RoPE frequencies, fp32 [s, rot], shared by the micro-batches
of a model chunk); selective ``core_attn`` checkpoints the core attention (q, k, the qkv output
behind v, the mask), selective ``mlp`` each dense layer's MLP (its input), ``moe`` each MoE layer
(its input), ``shared_experts`` the shared experts (their input is the router's). ``layernorm``
and ``mla_up_proj`` run under ``CheckpointWithoutOutput``: the norm (MLA's up projections and
RoPE) runs under no_grad, its checkpoint keeps its inputs, and the output the next layers save
(the norm's output; MLA's q, k, v) is freed after their forward and restored in backward, with
what the re-run saves (the norm's statistics; RoPE's cos and sin), once their output gradient
is computed. Measured on CPU (tests/test_memory_recompute_modules.py, with a meter that sees
the freed storages); ``moe_act`` (grouped-GEMM experts only) is a formula (:mod:`.moe_grouped`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field

from megatron_flops.memory.decoder import DecoderOptions, experts_take_adapters, padded_vocab
from megatron_flops.memory.hf_parallel import ONE_NORM, SEQUENTIAL, TWO_NORMS
from megatron_flops.memory.hf_qk_norms import qk_norm_saved_bytes
from megatron_flops.memory.lora import lora_activation_reason, mla_targets
from megatron_flops.memory.linear_cp import dsa_cp_recompute_held, dsa_cp_saved, gdn_cp_saved
from megatron_flops.memory.ssm import dsa_saved, kda_saved, mamba_saved, ssm_activation_reason
from megatron_flops.memory.mtp_layers import mtp_kinds
from megatron_flops.memory.hybrid_pipeline import is_hybrid
from megatron_flops.memory.layout import FP32_BYTES, INDEX_BYTES, NORM_STATS_BYTES, Parallelism, Training
from megatron_flops.memory.mla_mtp import mtp_recomputed
from megatron_flops.memory.recompute import selective_reason
from megatron_flops.memory.moe_grouped import expert_adapter_targets, frozen_experts_keep_inputs, grouped_lora_saved
from megatron_flops.memory.moe_lora_start import first_adapter_moe_reason, first_adapter_moe_saved
from megatron_flops.memory.grouped_start import first_adapter_moe_act_freed
from megatron_flops.memory.moe import (expert_lora_activations, moe_act_freed, moe_activation_reason,
                                       moe_activations, shared_gate_activations)
from megatron_flops.flops.passes import PeftSpec, RecomputeSpec, check_checkpointed_regions
from megatron_flops.model.spec import ModelSpec



@dataclass(frozen=True)
class _Dims:
    """Per-rank sizes of one micro-batch."""

    s: int
    b: int
    h: int
    d: int
    heads: int
    groups: int
    ffn: int
    vocab: int
    act: int
    rot: int
    sp: int = 1  # TP with sequence parallelism (the [s, b, h] activations between layers are split), else 1
    received: int | None = None  # routed tokens reaching this rank's experts (None: balanced, T x topk)
    tp: int = 1
    gate: bool = False  # attention_output_gate: linear_qkv also projects a sigmoid gate per query channel
    ep: int = 1
    etp: int = 1  # the routed experts' tensor-parallel size
    cp: int = 1  # context parallelism: s is this rank's s/CP tokens of each sequence

    @property
    def tokens(self) -> int:
        return self.s * self.b

    @property
    def local_tokens(self) -> int:
        """Tokens of this rank's slice of the [s, b, h] activations between layers."""
        return self.tokens // self.sp

    @property
    def expert_tokens(self) -> int:
        """Tokens the routed experts' TP group holds: ETP ranks' slices (T with ETP = TP)."""
        return self.local_tokens * self.etp


@dataclass
class ChunkActivations:
    """One micro-batch of one model chunk: ``components`` kept after its forward (bytes by
    key), ``shared`` bytes kept once per chunk however many micro-batches are in flight (the
    cached RoPE frequencies a checkpoint saves), and ``backward_peak``: the most held while a
    recompute region re-runs in backward (0 without recompute)."""

    components: dict[str, int] = field(default_factory=dict)
    shared: int = 0
    backward_peak: int = 0

    @property
    def forward(self) -> int:
        return sum(self.components.values())


@dataclass
class _Grad:
    """What autograd records under PEFT. ``base``: the base weights train (every linear layer
    saves its input for the weight gradient); ``adapted``: LoRA targets of rank ``rank``;
    ``started``: the hidden states require grad (past the first adapter of a frozen model, or
    on a chunk fed by an earlier pipeline stage, whose received tensor requires grad);
    ``mask_saved``: the attention mask is saved already (once per chunk)."""

    base: bool = True
    adapted: tuple[str, ...] = ()
    rank: int = 0
    started: bool = True
    mask_saved: bool = False
    grouped_lora: int = 0  # bytes per MoE layer of grouped-expert adapters beyond shared ones (:mod:`.grouped_lora`)
    grouped_lora_first: int = 0  # the same in a frozen first MoE layer whose gradient starts in them


class _Walk:
    """Forward-order accumulation of kept bytes, and recompute regions' peaks."""

    def __init__(self, grad: _Grad | None = None, *, selective: tuple[str, ...] = ()) -> None:
        self.out = ChunkActivations()
        self.kept = 0
        self.grad = grad or _Grad()
        self.selective = selective  # selective recompute's modules
        self.restored = 0  # re-saved by a CheckpointWithoutOutput restored earlier in backward (see discard)

    def keep(self, key: str, nbytes: int) -> None:
        if nbytes:
            self.out.components[key] = self.out.components.get(key, 0) + nbytes
            self.kept += nbytes

    def act(self, key: str, nbytes: int) -> None:
        """Saved by an op on the hidden states: only once they require grad."""
        if self.grad.started:
            self.keep(key, nbytes)

    def linear(self, key: str, name: str, input_bytes: int, tokens: int, act: int,
               gathered: int | None = None) -> None:
        """A linear layer ``name`` reading ``input_bytes``: a trainable weight saves its input
        (megatron-core's frozen-weight path saves only the weight); a LoRA adapter's
        ``linear_in`` saves the same input, or under sequence parallelism the ``gathered``
        input it all-gathers itself (a column-parallel target), and its ``linear_out`` the
        [T, r] intermediate, after which the hidden states require grad."""
        g = self.grad
        adapted = name in g.adapted
        if gathered is not None and adapted:
            self.keep(key, gathered + (input_bytes if g.base else 0))
        elif g.base or adapted:
            self.keep(key, input_bytes)
        if adapted:
            self.keep("lora", tokens * g.rank * act)
            g.started = True

    def discard(self, key: str, nbytes: int) -> None:
        """An output ``key`` kept, which megatron-core's ``CheckpointWithoutOutput`` frees after
        its last forward use (``resize_(0)``) and restores in backward: no longer kept."""
        self.out.components[key] -= nbytes
        self.kept -= nbytes

    def region(self, transient: int) -> None:
        # NB: when a region's backward runs, everything saved before it (in forward order) is
        # still held, everything after it is already freed, and what a CheckpointWithoutOutput
        # restored before it is held again (``restored``). A region whose inputs require no
        # grad (before a frozen model's first adapter) saves nothing and never re-runs.
        if not self.grad.started:
            return
        self.out.backward_peak = max(self.out.backward_peak, self.kept + self.restored + transient)


def check_activations_supported(spec: ModelSpec, options: DecoderOptions, par: Parallelism,
                                recompute: RecomputeSpec | None, peft: PeftSpec | None = None) -> str | None:
    """Why activations are not modelled for this setup (None: they are); ValueError where no
    adapter of a checkpointed region would train (as ``estimate`` refuses it)."""
    check_checkpointed_regions(spec, peft, recompute, modules=("mlp", "moe", "shared_experts"))
    selective = recompute is not None and recompute.granularity == "selective" and "mla_up_proj" in recompute.modules
    reason = (lora_activation_reason(spec, peft, selective=selective) or ssm_activation_reason(spec, recompute, cp=par.cp)
              or first_adapter_moe_reason(spec, options, par, recompute, peft))
    if reason is not None:
        return reason
    if spec.moe is not None:
        reason = moe_activation_reason(options)
        if reason is not None:
            return reason
    if recompute is not None and recompute.granularity == "selective":
        reason = selective_reason(spec, par, recompute.modules, peft)
        if reason is not None:
            return reason
        if "mlp" in recompute.modules and (options.add_bias_linear or options.mlp_bias):
            # (fc2's bias, returned through the checkpoint, gets the checkpoint as its grad_fn: its
            # backward re-enters itself without end; seen on CPU, not a CPU effect.)
            return ("activations under selective mlp recompute with linear biases: megatron-core 0.16.1's and 0.19.0's "
                    "backward never ends (fc2's bias, returned through tensor_parallel.checkpoint, gets the checkpoint "
                    "as its grad_fn); seen here with both releases: set add_bias_linear false or recompute other "
                    "modules")
    return None


def _dims(spec: ModelSpec, options: DecoderOptions, par: Parallelism, training: Training) -> _Dims:
    rot = 0
    if options.position_embedding_type == "rope":
        rot = spec.kv_channels if options.rotary_percent >= 1 else int(spec.kv_channels * options.rotary_percent)
    sp = par.tp if par.sequence_parallel else 1
    if training.seq_length % sp:
        raise ValueError(f"--sequence-parallel splits the sequence over TP: --seq-length {training.seq_length} "
                         f"is not divisible by --tp {par.tp}")
    return _Dims(s=training.seq_length, b=training.micro_batch_size, h=spec.hidden_size, d=spec.kv_channels,
                 heads=spec.num_attention_heads // par.tp, groups=spec.num_query_groups // par.tp,
                 ffn=spec.ffn_hidden_size // par.tp, vocab=padded_vocab(spec, options, par.tp) // par.tp,
                 act=training.param_bytes, rot=rot, sp=sp, tp=par.tp, ep=par.ep, gate=spec.attention_output_gate,
                 etp=par.expert_tp, cp=par.cp)


def _gathered(x: _Dims) -> int | None:
    """Under sequence parallelism, the [T, h] input a column-parallel target's LoRA adapter
    all-gathers and keeps (Bridge's ``gather_from_sequence_parallel_region``); else None."""
    return x.tokens * x.h * x.act if x.sp > 1 else None


def _norm_stats(x: _Dims, options: DecoderOptions) -> int:
    """fp32 statistics per token of a norm over [T/sp, h] (LayerNorm: mean and rstd; RMSNorm: rstd)."""
    return x.local_tokens * NORM_STATS_BYTES * (2 if options.normalization == "LayerNorm" else 1)


def _norm(w: _Walk, key: str, x: _Dims, options: DecoderOptions, *, recomputed: bool = False,
          shared_input: bool = False) -> None:
    # Input [T/sp, h] (``shared_input``: kept by another norm already) and its statistics; selective
    # ``layernorm`` runs it under no_grad and its checkpoint keeps the input only.
    if not shared_input:
        w.act(key, x.local_tokens * x.h * x.act)
    if not recomputed:
        w.act(key, _norm_stats(x, options))


def _attention(w: _Walk, x: _Dims, options: DecoderOptions, *, checkpointed: bool) -> None:
    """Self-attention after the input norm: qkv input, q/k/v, core attention, proj input."""
    T, a, d = x.tokens, x.act, x.d
    gqa = x.heads > x.groups
    # linear_qkv input (the norm's output; under sequence parallelism this rank's slice: the
    # layer saves it and all-gathers it again in backward).
    w.linear("attention", "linear_qkv", x.local_tokens * x.h * a, T, a, _gathered(x))
    qkv_out = T * (x.heads + 2 * x.groups + (x.heads if x.gate else 0)) * d * a
    # NB: the output gate (megatron-core's fused ``_apply_output_gate``) keeps the core output and
    # the gate (a view of the qkv output; with GQA the reshape into heads copies it) and hands
    # linear_proj a new [T, heads*d] tensor.
    gated = T * x.heads * d * a * (2 if gqa else 1) if x.gate else 0
    # q and k are storages of their own after RoPE or the q/k norms, else views of the qkv output.
    fresh = bool(x.rot) or options.qk_layernorm
    # (transformers' modules, :mod:`.hf_qk_norms`; None: saved as megatron-core's)
    hf_saved = qk_norm_saved_bytes(options.hf_qk_norm, tokens=T, heads=x.heads, groups=x.groups, head_dim=d, act=a,
                                   trainable=w.grad.base) if options.qk_layernorm and options.hf_qk_norm else None
    if hf_saved is not None:
        w.act("attention", hf_saved)
    elif options.qk_layernorm:
        _qk_norms(w, x, options, qkv_out if gqa and options.attention_backend == "unfused" and not checkpointed else 0)
    if x.rot:
        w.act("attention", 4 * x.s * x.rot * a)  # cos and sin, for q and for k
    if options.attention_backend == "flash":
        # q, k (after RoPE or the q/k norms when used; views of the qkv output otherwise) and v
        # (a view of it).
        w.act("attention", qkv_out if not fresh else T * (x.heads + x.groups) * d * a + qkv_out)
        lse = x.b * x.heads * x.s * 4  # fp32 log-sum-exp [b, heads, s]
        out = T * x.heads * d * a  # the kernel's output = linear_proj's input
        if checkpointed:
            w.region(out + lse)  # re-run in backward: a second output and the log-sum-exp
        else:
            w.act("attention", lse)
        w.act("attention", out + gated)
        w.linear("attention", "linear_proj", 0, T, a)  # (its input is the kernel's output, kept above)
        return
    # Unfused: storages behind q, k, v as the local DotProductAttention reads them.
    q = T * x.heads * d * a  # q after RoPE, or GQA's reshaped copy
    if checkpointed:
        # The checkpoint keeps q, k (before GQA's repeat) and the qkv output behind v.
        kept = (q + T * x.groups * d * a + qkv_out) if fresh else (qkv_out + (q if gqa else 0))
        transient = 2 * T * x.heads * d * a if gqa else 0
    else:
        kept = 3 * q if gqa else (2 * q + qkv_out if fresh else qkv_out)
        transient = 0
    w.act("attention", kept)
    _softmax(w, x, options, checkpointed=checkpointed, transient=transient)
    w.act("attention", gated)
    w.linear("attention", "linear_proj", T * x.heads * d * a, T, a)


def _qk_norms(w: _Walk, x: _Dims, options: DecoderOptions, qkv_out: int) -> None:
    """``qk_layernorm`` (non-MLA): per head, the q norm's and the k norm's input and fp32
    statistics per token and head. k's input is a view of the qkv output (``qkv_out``: its bytes
    where nothing else keeps it), and so is q's but with GQA, whose query is a reshaped copy."""
    q_copy = x.tokens * x.heads * x.d * x.act if x.heads > x.groups else 0
    stats = x.tokens * (x.heads + x.groups) * NORM_STATS_BYTES * (2 if options.normalization == "LayerNorm" else 1)
    w.act("attention", q_copy + qkv_out + stats)


def _softmax(w: _Walk, x: _Dims, options: DecoderOptions, *, checkpointed: bool, transient: int = 0) -> None:
    """The local attention's mask (once per chunk), softmax output and dropout."""
    a = x.act
    if w.grad.started and not w.grad.mask_saved:
        w.keep("attention", x.b * x.s * x.s)  # bool [b, 1, s, s], once per model chunk
        w.grad.mask_saved = True
    scores = x.b * x.heads * x.s * x.s
    fp32_softmax = options.attention_softmax_in_fp32 and a < 4
    core = scores * (4 if fp32_softmax else a)  # softmax output
    if options.attn_logit_softcapping:
        core += scores * a  # tanh(scores / cap), saved by tanh (Bridge's Gemma2DotProductAttention)
    if options.attention_dropout > 0:
        core += scores + scores * a  # dropout mask (bool) and dropout output
    elif fp32_softmax:
        core += scores * a  # the 16-bit probabilities the context GEMM reads
    if checkpointed:
        w.region(transient + core)
    else:
        w.act("attention", core)


def _mla_attention(w: _Walk, x: _Dims, spec: ModelSpec, options: DecoderOptions, *, checkpointed: bool,
                   dsa: str = "") -> None:
    """Multi-latent attention (heads per TP rank; the latents whole) after the input norm: the
    norm's output (read by the query and the kv down projections), the latents (with
    ``qk_layernorm``: their norms' inputs and fp32 statistics, and outputs), RoPE's cos and sin,
    the concatenated query and key [T, heads, qk + rope] and a contiguous value [T, heads, v], the
    core attention, ``linear_proj``'s input. Under sequence parallelism the norm's output, the
    latent norms and the up projections' inputs are this rank's [T/TP] slices. A frozen base
    (``w.grad.base`` False): no projection keeps its input (the latents only as their norms'
    inputs); nothing before the hidden states require grad."""
    mla = spec.mla
    assert mla is not None
    if dsa in ("dsa", "dsa_shared") and x.cp > 1:  # megatron-core 0.19.0's absorbed-MLA DSA layer (:mod:`.linear_cp`)
        w.keep("attention", x.local_tokens * x.h * x.act)
        w.act("attention", dsa_cp_saved(spec, s=x.s, b=x.b, cp=x.cp, act=x.act, latent_norms=options.qk_layernorm,
                                        norm_stats=_mla_norm_stats(x, options) // x.local_tokens, tp=x.sp,
                                        indexer=dsa == "dsa"))
        return
    ad, started = _MlaAdapters.of(w.grad, spec, sp=x.sp > 1), w.grad.started
    moved, kv_rope = _mla_latents(w, x, spec, options, ad)
    # The up projections' adapters: under selective mla_up_proj inside its checkpoint, saved when it re-runs.
    up = _mla_up_adapters(ad, x, mla.q_lora_rank, mla.kv_lora_rank, norm=options.qk_layernorm, rank=w.grad.rank)
    moved += up if "mla_up_proj" in w.selective else 0
    w.keep("lora", 0 if "mla_up_proj" in w.selective else up)
    w.grad.started = started or ad.any
    # (a frozen first layer adapted on one branch: the other's q, or k and v, require no grad)
    grads = (started or ad.q_down or ad.q_up or ad.q_proj, started or ad.kv_down or ad.kv_up)
    _mla_core(w, x, spec, options, checkpointed=checkpointed, dsa=dsa, moved=moved, kv_rope=kv_rope, grads=grads)


def _mla_norm_stats(x: _Dims, options: DecoderOptions) -> int:
    """Bytes of one latent norm's statistics on this rank's tokens (LayerNorm: mean and rstd)."""
    return x.local_tokens * NORM_STATS_BYTES * (2 if options.normalization == "LayerNorm" else 1)


def _mla_latents(w: _Walk, x: _Dims, spec: ModelSpec, options: DecoderOptions, ad: _MlaAdapters) -> tuple[int, bool]:
    """:func:`_mla_attention` up to its up projections: the input norm's output, the down
    projections' adapters, the q and kv latents, the up-projection checkpoint's inputs, the latent
    norms. Returns (what the ``mla_up_proj`` re-run saves of the latent norms fused into it,
    whether k's RoPE input requires grad); leaves ``w.grad.started`` as the latter."""
    mla = spec.mla
    assert mla is not None
    T, a, base = x.tokens, x.act, w.grad.base
    norm, loc, stats = options.qk_layernorm, x.local_tokens, _mla_norm_stats(x, options)
    # NB: Transformer Engine's spec fuses the latent norms into the up projections, so selective
    # ``mla_up_proj`` re-runs them too: their statistics and outputs are saved in backward only.
    fused = "mla_up_proj" in w.selective and norm and options.transformer_impl == "transformer_engine"
    moved = 0
    # (an up projection's adapter keeps the latent it reads: without sequence parallelism the latent
    # itself, unless it runs inside the mla_up_proj checkpoint, which keeps its inputs)
    outside = x.sp == 1 and "mla_up_proj" not in w.selective
    if base or ad.downs and x.sp == 1:
        w.keep("attention", loc * x.h * a)  # (this rank's slice under sequence parallelism)
    w.keep("lora", ad.downs * (T * x.h * a * (x.sp > 1) + T * w.grad.rank * a))  # (gathered input, [T, r])
    started, w.grad.started = w.grad.started, w.grad.started or ad.q_down
    if mla.q_lora_rank is not None and (base or norm):
        # The all-gathered q latent [T, q_lora] (q_up's input, or the q norm's; under sequence
        # parallelism their [T/TP] slice is a view of it), the norm's statistics and output.
        q_norm = (stats + (loc * mla.q_lora_rank * a if base or ad.q_up and outside else 0)) if norm else 0
        moved += q_norm if fused else 0
        w.act("attention", T * mla.q_lora_rank * a + (0 if fused else q_norm))
    if mla.q_lora_rank is not None and not base and not norm and ad.q_up and outside:
        w.keep("attention", T * mla.q_lora_rank * a)  # (the q latent, the adapter's input)
    w.grad.started = started or ad.kv_down
    # kv_up's input (or the kv norm's): a view of the all-gathered kv_down output [T, kv_lora +
    # rope], which it keeps whole; under sequence parallelism a [T/TP, kv_lora] copy of its slice
    # (RoPE's product with cos/sin keeps only those), then the kv norm.
    if base or norm:
        w.act("attention", T * (mla.kv_lora_rank + mla.qk_pos_emb_head_dim) * a if x.sp == 1
              else loc * mla.kv_lora_rank * a)
    kv_rope = w.grad.started  # (k_pos_emb requires grad: RoPE keeps k's cos and sin)
    w.grad.started = started or ad.q_down or ad.kv_down  # (the up-projection checkpoint's inputs)
    if "mla_up_proj" in w.selective and w.grad.started:
        _mla_up_proj_inputs(w, x, spec, options)
    w.grad.started = kv_rope
    if norm:
        kv_norm = stats + (loc * mla.kv_lora_rank * a if base or ad.kv_up and outside else 0)
        moved += kv_norm if fused else 0
        w.act("attention", 0 if fused else kv_norm)
    return moved, kv_rope


def _mla_up_proj_inputs(w: _Walk, x: _Dims, spec: ModelSpec, options: DecoderOptions) -> None:
    """What selective ``mla_up_proj``'s checkpoint keeps beyond what the up projections keep of
    their inputs (a trained base's keep the latents already)."""
    mla = spec.mla
    assert mla is not None
    T, loc, norm = x.tokens, x.local_tokens, options.qk_layernorm
    if not w.grad.base:
        # A frozen base's up projections keep no input, but the up-projection checkpoint keeps its
        # inputs: the q latent (the q norm's output, or q_down's output [T, q_lora]; direct q: the
        # input norm's output [T, h]) and the kv latent (the kv norm's output, or kv_down's output
        # [T, kv_lora + rope], of which k_pos_emb is a view; under sequence parallelism the kv
        # latent is a [T/TP, kv_lora] copy and k_pos_emb a view of the all-gathered kv_down output).
        q = (loc if norm else T) * mla.q_lora_rank if mla.q_lora_rank is not None else loc * x.h
        kv = (loc * mla.kv_lora_rank if norm or x.sp > 1 else 0) + (T * (mla.kv_lora_rank + mla.qk_pos_emb_head_dim)
                                                                   if x.sp > 1 or not norm else 0)
        w.act("attention", (q + kv) * x.act)
    elif x.sp > 1:
        # The up-projection checkpoint keeps k_pos_emb, all-gathered [T, rope] under sequence
        # parallelism: a view of the all-gathered kv_down output [T, kv_lora + rope] (the local
        # spec's column-parallel down projections), its own storage under Transformer Engine's
        # (duplicated TELinear down projections; unmeasured: :func:`.recompute.selective_unmeasured`).
        local = options.transformer_impl != "transformer_engine"
        w.act("attention", T * ((mla.kv_lora_rank if local else 0) + mla.qk_pos_emb_head_dim) * x.act)


def _mla_core(w: _Walk, x: _Dims, spec: ModelSpec, options: DecoderOptions, *, checkpointed: bool, dsa: str,
              moved: int, kv_rope: bool = True, grads: tuple[bool, bool] = (True, True)) -> None:
    """MLA after its latents: RoPE, q, k, v, the core attention and linear_proj's input.
    Selective ``mla_up_proj`` (CheckpointWithoutOutput around the up projections and RoPE,
    whose inputs the latents keep, and the layer's fp32 RoPE frequencies [s, rope]): no cos and
    sin, and q, k, v freed after the core attention; restored, with cos and sin (and ``moved``:
    what the re-run saves of the latent norms fused into it) saved again, once linear_proj's
    backward has run."""
    mla = spec.mla
    assert mla is not None
    T, a, heads = x.tokens, x.act, x.heads
    rope = (2 * grads[0] + 2 * kv_rope) * x.s * mla.qk_pos_emb_head_dim * a  # cos and sin, for q and for k
    v = T * heads * mla.v_head_dim * a
    if dsa in ("dsa", "dsa_shared"):  # DSAttention for the core attention (:func:`.ssm.dsa_saved`; v: MLA's view)
        core = dsa_saved(spec, s=x.s, b=x.b, heads=heads, act=a, sequence_parallel=x.sp > 1,
                         indexer=dsa == "dsa") - v
        restored = rope + v + moved if "mla_up_proj" in w.selective and w.grad.started else 0
        w.act("attention", (x.s * mla.qk_pos_emb_head_dim * FP32_BYTES if restored else rope + v) + core)
        if restored:
            w.region(restored)
        w.linear("attention", "linear_proj", v, T, a)
        return
    qk = T * heads * (mla.qk_head_dim + mla.qk_pos_emb_head_dim) * a
    # (q@k^T keeps q for k's gradient and k for q's; a fused kernel keeps q, k and v for any, and so
    # does selective core_attn's CheckpointFunction, which saves its inputs whether they require grad or not)
    kept = options.attention_backend == "flash" or checkpointed
    qkv = (2 * qk if kept else qk * (grads[0] + grads[1])) + v
    restored = rope + qkv + moved if "mla_up_proj" in w.selective and w.grad.started else 0
    w.act("attention", x.s * mla.qk_pos_emb_head_dim * FP32_BYTES if restored else rope + qkv)
    w.restored += restored
    if options.attention_backend == "flash":
        lse = x.b * heads * x.s * 4  # fp32 log-sum-exp
        if checkpointed:
            w.region(v + lse)  # re-run in backward: a second output and the log-sum-exp
        else:
            w.act("attention", lse)
    else:
        _softmax(w, x, options, checkpointed=checkpointed)  # (a checkpoint keeps q, k, v and the mask)
    w.restored -= restored
    if restored:
        w.region(restored)
    if options.attention_backend == "flash":
        w.act("attention", v)  # the output = linear_proj's input
        v = 0
    w.linear("attention", "linear_proj", v, T, a)


def _mlp(w: _Walk, x: _Dims, options: DecoderOptions, gated: bool, *, shared_input: bool = False) -> None:
    T, a = x.tokens, x.act
    # linear_fc1 input (this rank's slice under sequence parallelism; ``shared_input``: linear_qkv's).
    w.linear("mlp", "linear_fc1", 0 if shared_input else x.local_tokens * x.h * a, T, a, _gathered(x))
    if gated and not options.bias_activation_fusion:
        # fc1 output [T, 2 ffn] (silu's input is a view), silu(x1), x2 + offset.
        w.act("mlp", T * x.ffn * a * (2 + 2))
    else:
        # fc1 output (the activation's input).
        w.act("mlp", T * x.ffn * a * (2 if gated else 1))
    if options.xielu:
        # transformers' xIELU (its python path): alpha_p * x, expm1(min(x, eps)), expm1(...) - x and the
        # bool x > 0 that torch.where keeps, each [T, ffn].
        w.act("mlp", T * x.ffn * (3 * a + 1))
    w.linear("mlp", "linear_fc2", T * x.ffn * a, T, a)  # fc2's input (the activation's output)
    if options.post_layernorms:  # (Bridge's fc2 post-norm: inside the MLP, so inside its checkpoint)
        _norm(w, "mlp", x, options)


def _checkpointed_mlp(w: _Walk, x: _Dims, options: DecoderOptions, gated: bool, *, shared_input: bool = False) \
        -> None:
    """Selective ``mlp`` recompute (dense layers): megatron-core's ``CheckpointFunction`` keeps
    the MLP's input (the norm's output, this rank's slice; ``shared_input``: linear_qkv's) and
    re-runs the MLP in backward. An input that requires no grad (a frozen model before its first
    adapter): nothing saved or re-run."""
    if not w.grad.started:
        return
    inner = _Walk(dataclasses.replace(w.grad))
    _mlp(inner, x, options, gated, shared_input=shared_input)
    g, inp = w.grad, 0 if shared_input else x.local_tokens * x.h * x.act
    w.keep("recompute", inp)
    # (fc1's input is the checkpoint's, but the [T, h] a frozen fc1's adapter gathers itself under SP)
    w.region(inner.kept - (inp if g.base or ("linear_fc1" in g.adapted and x.sp == 1) else 0))


def _dropout_mask(w: _Walk, x: _Dims, options: DecoderOptions) -> None:
    if options.hidden_dropout > 0:
        w.act("dropout", x.local_tokens * x.h)  # bool [T/sp, h]


def _layer(w: _Walk, x: _Dims, spec: ModelSpec, options: DecoderOptions, *, core_attn: bool,
           moe: bool = False, mixer: str = "attention", ffn: bool = True) -> None:
    """One layer: its mixer (none: a hybrid MLP layer) and its MLP or MoE (``ffn=False``: a
    hybrid mixer layer), each after its norm and before its dropout; or attention and the MLP in
    parallel on the layer's input (:mod:`.hf_parallel`)."""
    parallel = options.parallel_layer_norms if mixer == "attention" and ffn and not moe and spec.mla is None \
        else SEQUENTIAL
    if parallel == ONE_NORM:
        _one_norm_parallel_layer(w, x, spec, options, core_attn=core_attn)
        return
    if mixer != "none":
        with _recomputed_norm(w, x, options, "attention", fused=options.transformer_impl == "transformer_engine"
                              and spec.mla is None):
            if mixer in ("mamba", "gdn", "kda"):
                _ssm_mixer(w, x, spec, mixer)
            elif spec.mla is not None:
                _mla_attention(w, x, spec, options, checkpointed=core_attn, dsa=mixer)
            else:
                _attention(w, x, options, checkpointed=core_attn)
                if options.post_layernorms:
                    _norm(w, "norm", x, options)  # (Bridge's linear_proj post-norm, on its [T/sp, h] output)
        _dropout_mask(w, x, options)
    if not ffn:
        return
    selective = w.selective
    reader = ("recompute" if "moe" in selective else "moe/router") if moe else \
        ("recompute" if "mlp" in selective else "mlp")
    with _recomputed_norm(w, x, options, reader, fused=options.transformer_impl == "transformer_engine" and not moe,
                          shared_input=parallel == TWO_NORMS):  # (the layer's input, the input norm's)
        if moe:
            _moe(w, x, spec, options)
        elif "mlp" in selective:
            _checkpointed_mlp(w, x, options, spec.gated_linear_unit)
        else:
            _mlp(w, x, options, spec.gated_linear_unit)
    _dropout_mask(w, x, options)


def _one_norm_parallel_layer(w: _Walk, x: _Dims, spec: ModelSpec, options: DecoderOptions, *,
                             core_attn: bool) -> None:
    """Attention and the MLP reading one norm's output: linear_fc1 (or the MLP's checkpoint) keeps
    no input of its own where linear_qkv keeps that output (this rank's slice: with the base
    trained, or a LoRA linear_qkv without sequence parallelism). NB: the norm's output is needed
    until both sublayers' backward ran: selective ``layernorm`` restores it before the MLP's."""
    g, checkpointed = w.grad, "mlp" in w.selective
    shared = g.base or ("linear_qkv" in g.adapted and x.sp == 1)
    reader = "attention" if shared else "recompute" if checkpointed else "mlp"
    with _recomputed_norm(w, x, options, reader, fused=options.transformer_impl == "transformer_engine"):
        _attention(w, x, options, checkpointed=core_attn)
        _dropout_mask(w, x, options)
        if checkpointed:
            _checkpointed_mlp(w, x, options, spec.gated_linear_unit, shared_input=shared)
        else:
            _mlp(w, x, options, spec.gated_linear_unit, shared_input=shared)
    _dropout_mask(w, x, options)


@contextlib.contextmanager
def _recomputed_norm(w: _Walk, x: _Dims, options: DecoderOptions, reader: str, *, fused: bool,
                     shared_input: bool = False) -> Iterator[None]:
    """A layer's input or pre-MLP norm, then (the body) what reads its output. Selective
    ``layernorm`` (megatron-core's ``CheckpointWithoutOutput``): the norm runs under no_grad
    (its checkpoint keeps its input), and the output the reader keeps (under key ``reader``) is
    freed after the reader's forward; in backward, once the reader's output gradient is
    computed, the output is restored and the norm re-run, which saves its statistics again:
    both are held from then on, through the reader's own recompute regions. NB: a norm that
    Transformer Engine's spec fuses into the next linear layer (``fused``: the input norm but
    for MLA, the pre-MLP norm but for MoE layers) is an ``IdentityOp`` there, never recomputed."""
    if not options.pre_layernorms:  # (olmo2, olmo3: their norms are after the sublayers, never recomputed)
        yield
        return
    recomputed = "layernorm" in w.selective and w.grad.started and not fused
    _norm(w, "norm", x, options, recomputed=recomputed, shared_input=shared_input)
    if not recomputed:
        yield
        return
    out, stats = x.local_tokens * x.h * x.act, _norm_stats(x, options)
    w.restored += stats
    yield
    w.restored -= stats
    w.discard(reader, out)
    w.region(out + stats)


def _ssm_mixer(w: _Walk, x: _Dims, spec: ModelSpec, mixer: str) -> None:
    """A Mamba, Gated DeltaNet or Kimi Delta Attention mixer (:mod:`.ssm`): ``in_proj``'s input
    (KDA: the one input of its projections; this rank's slice under sequence parallelism), then
    what the kernels keep."""
    w.act(mixer, x.local_tokens * x.h * x.act)
    if mixer == "kda":
        w.act(mixer, kda_saved(spec, s=x.s, b=x.b, act=x.act))
    elif mixer == "mamba":
        w.act(mixer, mamba_saved(spec, tokens=x.tokens, tp=x.tp, act=x.act, cp=x.cp))
    else:  # NB: parameters in the activation dtype (Float16Module), so exp(A_log) too
        w.act(mixer, gdn_cp_saved(spec, tokens=x.tokens, tp=x.tp, cp=x.cp, act=x.act, param=x.act))


def _moe(w: _Walk, x: _Dims, spec: ModelSpec, options: DecoderOptions) -> None:
    """A MoE layer after its norm (:mod:`megatron_flops.memory.moe`); shared experts as a dense
    MLP. Under a frozen base nothing before the hidden states require grad, then no expert linear
    keeps its input but for its LoRA adapter (routed and shared experts' ``linear_fc1``/``fc2``)."""
    moe = spec.moe
    assert moe is not None
    if not w.grad.started:
        if w.grad.adapted and {"linear_fc1", "linear_fc2"} & set(w.grad.adapted):  # the experts' adapters start it
            _first_adapter_moe(w, x, spec, options)
        return
    g, moe_act = w.grad, "moe_act" in w.selective
    frozen = not g.base and not frozen_experts_keep_inputs(options)
    routed = moe_activations(spec, options, tokens=x.expert_tokens, local_tokens=x.local_tokens, act=x.act,
                             tp=x.etp, ep=x.ep, received=x.received, frozen=frozen, moe_act=moe_act)
    adapted = expert_adapter_targets(options, g.adapted)
    routed["lora"] = expert_lora_activations(spec, adapted=adapted, rank=g.rank, frozen=frozen, moe_act=moe_act,
                                             tokens=x.expert_tokens, act=x.act, tp=x.etp, received=x.received)
    routed["lora"] += g.grouped_lora
    shared = moe.shared_expert_ffn_hidden_size
    if shared:
        sub = _Walk(_Grad(base=g.base, adapted=g.adapted, rank=g.rank))
        _mlp(sub, dataclasses.replace(x, ffn=shared // x.tp), options, spec.gated_linear_unit)
        lora = sub.out.components.pop("lora", 0)
        # fc1's input is the router's (but the [T, h] an adapter gathers itself under sequence parallelism).
        fc1_input = x.local_tokens * x.h * x.act if g.base or ("linear_fc1" in g.adapted and x.sp == 1) else 0
        routed["moe/shared_experts"] = (sub.kept - lora - fc1_input
                                        + shared_gate_activations(spec, local_tokens=x.local_tokens, act=x.act))
        # (Selective shared_experts: their adapters' intermediates are re-saved inside the checkpoint.)
        routed["moe/shared_experts" if "shared_experts" in w.selective else "lora"] += lora
    freed = moe_act_freed(spec, options, tokens=x.expert_tokens, act=x.act, tp=x.etp, received=x.received) \
        if moe_act else 0
    _selective_moe(w, routed, x.local_tokens * x.h * x.act, freed)


def _first_adapter_moe(w: _Walk, x: _Dims, spec: ModelSpec, options: DecoderOptions) -> None:
    """A frozen MoE first layer whose first adapters are its experts' (:mod:`.moe_lora_start`):
    the shared experts (they run first) as a frozen dense MLP whose adapter starts the gradient,
    their gate keeping only its output [T_l, 1] for the product; then the routed experts."""
    moe, g = spec.moe, w.grad
    assert moe is not None
    if not moe.shared_expert_ffn_hidden_size and not experts_take_adapters(options):
        return  # (legacy GroupedMLP: no adapter of this layer trains; the gradient starts in a later dense layer)
    if moe.shared_expert_ffn_hidden_size:
        sub = _Walk(_Grad(base=False, adapted=g.adapted, rank=g.rank, started=False))
        _mlp(sub, dataclasses.replace(x, ffn=moe.shared_expert_ffn_hidden_size // x.tp), options,
             spec.gated_linear_unit)
        lora = sub.out.components.pop("lora", 0)
        w.keep("moe/shared_experts", sub.kept - lora + (x.local_tokens * x.act if moe.shared_expert_gate else 0))
        w.keep("lora", lora)
    peft, moe_act = PeftSpec(frozen=True, lora_rank=g.rank, lora_targets=g.adapted), "moe_act" in w.selective
    for key, nbytes in first_adapter_moe_saved(spec, options, peft, tokens=x.expert_tokens,
                                               local_tokens=x.local_tokens, act=x.act, tp=x.etp, ep=x.ep,
                                               received=x.received, moe_act=moe_act).items():
        w.keep(key, nbytes)
    g.started = True
    w.keep("lora", g.grouped_lora_first)  # (per-expert, shared-outer adapters: :mod:`.grouped_start`)
    freed = first_adapter_moe_act_freed(
        spec, options, tokens=x.expert_tokens, act=x.act, tp=x.etp, received=x.received,
        freed=moe_act_freed(spec, options, tokens=x.expert_tokens, act=x.act, tp=x.etp, received=x.received)) \
        if moe_act else 0
    if freed:
        w.region(freed)


def _selective_moe(w: _Walk, kept: dict[str, int], inp: int, freed: int = 0) -> None:
    """Keep a MoE layer's ``kept`` bytes (the router's input ``inp`` among them), or under
    selective recompute: ``moe`` (``CheckpointFunction`` around the layer) keeps its input and
    re-saves the rest while its backward runs; ``shared_experts`` (around the shared experts, whose
    input is the router's) keeps nothing of them, and re-saves them in backward once the routed
    experts, router and dispatcher have run theirs (autograd runs the later-created nodes first),
    with only the input left of the layer. Both: the shared experts re-run inside the outer
    checkpoint's backward. ``moe_act`` (:mod:`.moe_grouped`): the ``freed`` bytes its
    CheckpointWithoutOutput holds again while the routed experts' backward runs (the layer's
    router, dispatcher and shared experts still held: they ran first)."""
    shared = kept.pop("moe/shared_experts", 0) if "shared_experts" in w.selective else 0
    if "moe" in w.selective:
        w.keep("recompute", inp)
        w.region(sum(kept.values()) - inp + freed)
    elif shared:
        w.region(inp + shared)
    if "moe" in w.selective:
        if shared:
            w.region(shared)
        return
    for key, nbytes in kept.items():
        w.keep(key, nbytes)
    if freed:
        w.region(freed)


@dataclass(frozen=True)
class _MlaAdapters:
    """LoRA adapters on one MLA layer's projections: ``downs`` on the down projections (and
    direct q's ``linear_q_proj``, which reads the hidden states too), whether the q and kv down
    projections and the up projections are adapted."""

    downs: int
    q_down: bool
    kv_down: bool
    q_up: bool
    kv_up: bool
    sp: bool
    q_proj: bool = False

    @property
    def any(self) -> bool:
        return bool(self.downs) or self.q_up or self.kv_up

    @classmethod
    def of(cls, grad: _Grad, spec: ModelSpec, *, sp: bool) -> _MlaAdapters:
        names = set(grad.adapted) & set(mla_targets(spec))
        q_down, kv_down = "linear_q_down_proj" in names, "linear_kv_down_proj" in names
        return cls(downs=q_down + kv_down + ("linear_q_proj" in names), q_down=q_down, kv_down=kv_down,
                   q_up="linear_q_up_proj" in names, kv_up="linear_kv_up_proj" in names, sp=sp,
                   q_proj="linear_q_proj" in names)


def _mla_up_adapters(ad: _MlaAdapters, x: _Dims, q_lora: int | None, kv_lora: int, *, norm: bool, rank: int) -> int:
    """What the up projections' adapters keep beyond the latents counted already: [T, r] each;
    under sequence parallelism the latent each all-gathers [T, width]; else, without the kv
    norm, kv_up's adapter's contiguous copy of its latent [T, kv_lora] (a view of kv_down's
    output)."""
    T, a, r = x.tokens, x.act, rank
    out = (ad.q_up + ad.kv_up) * T * r * a
    if ad.q_up and ad.sp:
        out += T * (q_lora or 0) * a
    if ad.kv_up and (ad.sp or not norm):
        out += T * kv_lora * a
    return out


def chunk_activations(
    spec: ModelSpec,
    options: DecoderOptions,
    par: Parallelism,
    training: Training,
    *,
    pp_rank: int,
    chunk: int,
    recompute: RecomputeSpec | None = None,
    peft: PeftSpec | None = None,
    received: int | None = None,
) -> ChunkActivations:
    """Saved-for-backward bytes of one micro-batch of one model chunk (see the module doc);
    ``received``: routed tokens per MoE layer reaching this rank's experts (None: balanced)."""
    reason = check_activations_supported(spec, options, par, recompute, peft)
    if reason is not None:
        raise ValueError(reason)
    x = dataclasses.replace(_dims(spec, options, par, training), received=received)
    first = par.is_first_stage(pp_rank, chunk)
    selective = recompute.modules if recompute is not None and recompute.granularity == "selective" else ()
    w = _Walk(_peft_grad(peft, first_stage=first), selective=selective)
    w.grad.grouped_lora, w.grad.grouped_lora_first = (
        grouped_lora_saved(spec, options, par, training, peft, tokens=x.expert_tokens, received=received,
                           moe_act="moe_act" in selective, first=start) for start in (False, True))
    layers = par.chunk_layers(spec.num_layers, pp_rank, chunk)
    if first:
        positions = options.position_embedding_type == "learned_absolute"
        if w.grad.base:  # the lookup saves the ids for the embedding's weight gradient
            w.keep("embedding", x.tokens * INDEX_BYTES * (2 if positions else 1))
        if par.tp > 1 and w.grad.base:  # (a frozen lookup's output requires no grad: its masking saves nothing)
            w.keep("embedding", x.tokens)  # vocab-parallel lookup: bool mask of ids outside this rank's rows
        _dropout_mask(w, x, options)
    full = recompute is not None and recompute.granularity == "full"
    core_attn = recompute is not None and recompute.granularity == "selective" and "core_attn" in recompute.modules
    if full:
        assert recompute is not None
        # NB: with a frozen base, Megatron-Bridge makes the decoder's input require grad under
        # full recompute (maybe_enable_recompute_inputs_grad), or no checkpoint would run backward.
        w.grad.started = True
        _full_recompute_layers(w, x, spec, options, recompute, [spec.layers[i] for i in layers])
    else:
        kinds = spec.layers
        for i, layer in enumerate(layers):
            mixer, ffn = kinds[layer]
            _layer(w, x, spec, options, core_attn=core_attn, moe=ffn == "moe", mixer=mixer, ffn=ffn != "none")
    if par.holds_final_norm(spec.num_layers, pp_rank, chunk, mtp=bool(spec.mtp_num_layers) and not is_hybrid(spec)):
        _norm(w, "output", x, options)
    if par.holds_mtp(pp_rank, chunk):
        _mtp_layers(w, x, spec, options, vocab_parallel=par.tp > 1, core_attn=core_attn,
                    recomputed=mtp_recomputed(spec, recompute))
    if par.is_last_stage(pp_rank, chunk):
        # The MTP losses, on the last stage wherever the MTP layers are: cross-entropy, the rolled fp32
        # loss mask and the scaled per-token loss MTPLossAutoScaler keeps.
        w.keep("mtp", spec.mtp_num_layers * (x.tokens * (x.vocab * 4 + 1 + INDEX_BYTES) + x.tokens * 4 * 2))
        # output_layer input (a slice under sequence parallelism): with MTP, one storage holding
        # the main and every MTP layer's hidden states, which megatron-core chunks.
        w.linear("output", "output_layer", (1 + spec.mtp_num_layers) * x.local_tokens * x.h * x.act, x.tokens,
                 x.act)
        # Cross-entropy: fp32 softmax [T, V/TP], target mask (bool), masked targets (int64);
        # loss_func's fp32 loss mask.
        w.act("output", x.tokens * (x.vocab * 4 + 1 + INDEX_BYTES + 4))
        if options.final_logit_softcapping:  # tanh(logits / cap) [T, V/TP] (Bridge's Gemma2OutputLayer)
            w.act("output", x.tokens * x.vocab * x.act)
    return w.out


def _mtp_layers(w: _Walk, x: _Dims, spec: ModelSpec, options: DecoderOptions, *, vocab_parallel: bool,
                core_attn: bool, recomputed: bool) -> None:
    """The multi-token-prediction layers (their losses: on the last stage). Each layer: the embedding's ids
    (the rolled ids; with TP > 1 the vocab-parallel lookup's shifted ids and bool mask), its
    ``enorm`` and ``hnorm`` (of the previous hidden states), ``eh_proj``'s input [T, 2h], a
    decoder layer of the last layer's kind (a hybrid MTP part: its layers) and its final norm.
    Full recompute (``recomputed``) checkpoints all but the embedding: the checkpoint keeps the previous hidden states, the
    embedding's output, the mask and the cached RoPE frequencies (shared; none for MLA, which
    makes its own)."""
    T, a, base = x.tokens, x.act, w.grad.base
    positions = options.position_embedding_type == "learned_absolute"
    for _ in range(spec.mtp_num_layers):
        if base:  # (a frozen embedding's output requires no grad: no ids, mask, dropout or enorm input)
            w.keep("mtp", T * INDEX_BYTES * (2 if positions else 1) + (T if vocab_parallel else 0))
            _dropout_mask(w, x, options)
        body = _Walk(dataclasses.replace(w.grad, mask_saved=True)) if recomputed else w
        if base:
            _norm(body, "mtp", x, options)
        _norm(body, "mtp", x, options)
        body.linear("mtp", "eh_proj", x.local_tokens * 2 * x.h * a, T, a)
        # NB: under sequence parallelism eh_proj's output is all-gathered and sliced again: the
        # layer's input is a view of the whole [T, h] storage, which its first norm keeps alive.
        body.keep("mtp", (T - x.local_tokens) * x.h * a)
        for mixer, ffn in mtp_kinds(spec):  # (a hybrid MTP part: its layers, :mod:`.mtp_layers`)
            _layer(body, x, spec, options, core_attn=core_attn, moe=ffn == "moe", mixer=mixer, ffn=ffn != "none")
        _norm(body, "mtp", x, options)
        if recomputed:
            inputs = 2 * x.local_tokens * x.h * a  # the norms' inputs (the checkpoint keeps them)
            w.keep("recompute", inputs)
            w.region(body.kept - inputs // (1 if base else 2))  # (of which the norms keep their own)
            if x.rot and spec.mla is None:
                w.out.shared = x.s * x.rot * 4


def _peft_grad(peft: PeftSpec | None, *, first_stage: bool) -> _Grad:
    """Full training, or a LoRA/frozen model: a frozen base saves nothing before the first
    adapter of the first stage (no input requires grad there)."""
    if peft is None or (not peft.frozen and peft.lora_rank is None):
        return _Grad()
    base = not peft.frozen
    return _Grad(base=base, adapted=peft.lora_targets if peft.lora_rank else (), rank=peft.lora_rank or 0,
                 started=base or not first_stage)


def _full_recompute_layers(w: _Walk, x: _Dims, spec: ModelSpec, options: DecoderOptions,
                           recompute: RecomputeSpec, kinds: list[tuple[str, str]]) -> None:
    """Full recompute: checkpointed groups keep their input (hidden states, the mask, the cached
    RoPE frequencies); ``block`` checkpoints the first ``recompute_num_layers`` layers one by
    one and runs the rest plainly. ``kinds``: each layer's (mixer, feed-forward) of the chunk."""
    num_layers = len(kinds)
    group = recompute.num_layers or 1
    if recompute.method == "block":
        starts = list(range(min(group, num_layers)))
        sizes = [1] * len(starts)
    else:
        starts = list(range(0, num_layers, group))
        sizes = [min(group, num_layers - s) for s in starts]
    hidden = x.local_tokens * x.h * x.act
    for i, (start, size) in enumerate(zip(starts, sizes)):
        w.keep("recompute", hidden)
        if i == 0:
            w.keep("recompute", x.b * x.s * x.s if options.attention_backend == "unfused" else 0)
            w.grad.mask_saved = True
        inner = _Walk(dataclasses.replace(w.grad, mask_saved=True))
        for j in range(start, start + size):
            _layer(inner, x, spec, options, core_attn=False, moe=kinds[j][1] == "moe", mixer=kinds[j][0])
            w.keep("attention", dsa_cp_recompute_held(spec, kinds[j][0], s=x.s, b=x.b, cp=x.cp))
        w.region(inner.kept - hidden)  # the group input is the first norm's input
    plain = num_layers - sum(sizes)
    for j in range(num_layers - plain, num_layers):
        _layer(w, x, spec, options, core_attn=False, moe=kinds[j][1] == "moe", mixer=kinds[j][0])
    if x.rot and spec.mla is None:  # (MLA computes its RoPE inside the attention: no checkpoint input)
        w.out.shared = x.s * x.rot * 4


def received_bounds(spec: ModelSpec, par: Parallelism, training: Training) -> tuple[int, int]:
    """The fewest and the most routed tokens per MoE layer and micro-batch that one rank's
    experts can receive under EP (no token dropped): none, or every token of the EP group that
    picks one of its ``E / EP`` experts (each token picks ``topk`` distinct experts)."""
    moe = spec.moe
    assert moe is not None
    tokens = training.seq_length * training.micro_batch_size // par.tp * par.expert_tp  # the expert TP group's
    return 0, par.ep * tokens * min(moe.router_topk, moe.num_experts // par.ep)


def in_flight(par: Parallelism, num_microbatches: int, pp_rank: int) -> list[tuple[str, int]]:
    """The order in which pipeline rank ``pp_rank`` runs forward (``F``) and backward (``B``)
    passes of its model chunks in megatron-core's schedules (1F1B; interleaved 1F1B with
    ``microbatch_group_size_per_vp_stage = PP``; one micro-batch at a time without PP)."""
    m, p = num_microbatches, par.pp
    if p == 1:
        return [e for _ in range(m) for e in (("F", 0), ("B", 0))]
    chunks = par.num_chunks
    if par.vpp is None:
        warmup = min(p - pp_rank - 1, m)
        table = [0] * m
    else:
        table = []
        for lo in range(0, m, p):
            hi = m if lo + p >= m else lo + p
            table += [c for c in range(chunks) for _ in range(lo, hi)]
        warmup = min((p - pp_rank - 1) * 2 + (chunks - 1) * p, m * chunks)
    total = m * chunks
    events = [("F", table[k]) for k in range(warmup)]
    for k in range(total - warmup):
        events += [("F", table[warmup + k]), ("B", chunks - 1 - table[k])]
    events += [("B", chunks - 1 - table[k]) for k in range(total - warmup, total)]
    return events


def schedule_peak(per_chunk: list[ChunkActivations], events: list[tuple[str, int]]) -> tuple[int, int]:
    """The most saved-for-backward bytes held at once over ``events``, and the most
    micro-batches in flight then."""
    live = [0] * len(per_chunk)

    def held() -> int:
        return sum(n * c.forward + (c.shared if n else 0) for n, c in zip(live, per_chunk))

    peak = count = 0
    for kind, chunk in events:
        if kind == "F":
            live[chunk] += 1
            now = held()
        else:
            c = per_chunk[chunk]
            live[chunk] -= 1
            now = held() + (c.backward_peak + (c.shared if not live[chunk] else 0) if c.backward_peak else 0)
        if now > peak:
            peak, count = now, sum(live) + (kind == "B")
    return peak, count
