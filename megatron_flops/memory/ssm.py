"""Parameters and saved-for-backward bytes of the mixers beside softmax attention: Mamba-2, Gated
DeltaNet, Kimi Delta Attention and DeepSeek sparse attention (stdlib only).

Parameters come as ``(name, numel, tp_replicated)`` in ``named_parameters()`` order on one
tensor-parallel rank (:mod:`.decoder` turns them into its ``Param``): megatron-core 0.16's
``MambaMixer``, ``GatedDeltaNet`` and ``DSAIndexer``, and transformers' ``KimiLinearDeltaAttention``
(megatron-core has no KDA). ``tests/test_memory_ssm.py`` builds each of those modules on CPU and
compares names and shapes.

NB: megatron-core builds hybrid and GDN layers with Transformer Engine only: the layer's input norm
is fused into ``in_proj``/``linear_qkv``/``linear_fc1`` (``layer_norm_weight``); it is listed here
as the local spec's separate norm (the same elements; see :mod:`.decoder`).

Activations of Mamba and GDN are formulas from what the CUDA kernels keep for backward (mamba_ssm's
``mamba_split_conv1d_scan_combined`` and gated RMSNorm, causal-conv1d, fla's
``chunk_gated_delta_rule`` and ``l2norm``), read from their source: none of them runs on CPU, so
none is measured (the report lists them under ``unmeasured``). Kimi Delta Attention's are what
transformers' torch path keeps (it runs on CPU: measured), and DeepSeek sparse attention's what
megatron-core's torch ``DSAttention`` keeps (measured, TP 1 and TP 2 with and without sequence
parallelism).
"""

from __future__ import annotations

from megatron_flops.flops.passes import PeftSpec, RecomputeSpec
from megatron_flops.memory.hybrid_pipeline import hybrid_pipeline_notes, is_hybrid
from megatron_flops.memory.layout import FP32_BYTES, INDEX_BYTES, Parallelism
from megatron_flops.memory.mtp_layers import hybrid_mtp, hybrid_mtp_notes, mtp_kinds
from megatron_flops.model.spec import ModelSpec

Tensor = tuple[str, int, bool]  # (name, elements on one TP rank, whole on every TP rank)
# megatron-core's MambaMixer defaults (not TransformerConfig fields): conv width 4, conv bias.
MAMBA_CONV_WIDTH = 4
FLA_CHUNK = 64  # fla's chunk size: the solved [chunk, chunk] WY matrix per chunk and head
KDA_CHUNK = 64  # transformers' chunk_kimi_delta_attention's default chunk_size
MIXERS_WITH_PARAMETERS = ("mamba", "gdn", "kda")


def model_kinds(spec: ModelSpec) -> set[tuple[str, str]]:
    """Every (mixer, feed-forward) kind of the decoder's and the MTP depths' layers."""
    return {kind for kind, _ in spec.layer_runs} | (set(mtp_kinds(spec)) if spec.mtp_num_layers else set())


def mtp_mixer(spec: ModelSpec) -> str:
    """The mixer of a GPT's MTP layer: its last decoder layer's kind (attention unwindowed), as
    Megatron-LM 0.19's gpt_builders builds it (the last layer of the experimental-variant spec).
    NB: 0.16.1's builds a plain GPT layer there, which fails for DSA (see :func:`ssm_notes`)."""
    (mixer, _), _ = spec.mtp_layer_runs[0]
    return mixer


def mamba_inner(spec: ModelSpec) -> int:
    """Mamba's inner width: heads x head dim (``expand x hidden`` by default)."""
    m = spec.mamba
    assert m is not None
    return m.num_heads * m.head_dim


def mixer_tensors(spec: ModelSpec, mixer: str, prefix: str, tp: int, layer_norm: bool) -> list[Tensor]:
    """The mixer's own parameters (no input norm) of a ``mamba``/``gdn``/``kda`` layer, under
    ``prefix`` (``decoder.layers.N.``); ``layer_norm``: GDN's per-head output norm is a LayerNorm."""
    if mixer == "mamba":
        return _mamba(spec, prefix + "mixer.", tp)
    if mixer == "gdn":
        return _gdn(spec, prefix + "self_attention.", tp, layer_norm)
    if mixer == "kda":
        return _kda(spec, prefix + "self_attention.")
    raise ValueError(f"no parameter list for mixer {mixer!r}")


def _mamba(spec: ModelSpec, p: str, tp: int) -> list[Tensor]:
    m = spec.mamba
    assert m is not None
    h, inner = spec.hidden_size, mamba_inner(spec)
    heads, conv = m.num_heads // tp, (inner + 2 * m.num_groups * m.state_dim) // tp
    # NB: the mixer's own parameters (dt_bias, A_log, D: [heads/tp]) come before its submodules'.
    return [
        (p + "dt_bias", heads, False), (p + "A_log", heads, False), (p + "D", heads, False),
        # in_proj: [(2*inner + 2*groups*state + heads)/tp, h] (z, x, B, C, dt; column parallel, no bias).
        (p + "in_proj.weight", (2 * inner + 2 * m.num_groups * m.state_dim + m.num_heads) // tp * h, False),
        # Depthwise conv over x, B, C: weight [conv, 1, 4], bias [conv].
        (p + "conv1d.weight", conv * MAMBA_CONV_WIDTH, False),
        (p + "conv1d.bias", conv, False),
        # Gated RMSNorm over this rank's inner channels, then out_proj [h, inner/tp] (row parallel).
        (p + "norm.weight", inner // tp, False),
        (p + "out_proj.weight", h * (inner // tp), False),
    ]


def _gdn(spec: ModelSpec, p: str, tp: int, layer_norm: bool) -> list[Tensor]:
    g = spec.gdn
    assert g is not None
    h = spec.hidden_size
    qk, v, nv = g.num_key_heads * g.key_head_dim, g.num_value_heads * g.value_head_dim, g.num_value_heads
    out = [
        # The module's own dt_bias and A_log [nv/tp] first, then its submodules'.
        (p + "dt_bias", nv // tp, False), (p + "A_log", nv // tp, False),
        # in_proj: [(2*qk + 2*v + 2*nv)/tp, h] (q, k, v, gate z, beta, alpha; column parallel, no bias).
        (p + "in_proj.weight", (2 * qk + 2 * v + 2 * nv) // tp * h, False),
        # Depthwise causal conv over q, k, v: [(2*qk + v)/tp, 1, K], no bias (megatron-core's default).
        (p + "conv1d.weight", (2 * qk + v) // tp * g.conv_kernel_dim, False),
        # The output norm is per value head: [value_head_dim], whole on every TP rank.
        (p + "out_norm.weight", g.value_head_dim, True),
    ]
    if layer_norm:
        out.append((p + "out_norm.bias", g.value_head_dim, True))
    return out + [(p + "out_proj.weight", h * (v // tp), False)]


def _kda(spec: ModelSpec, p: str) -> list[Tensor]:
    """transformers' ``KimiLinearDeltaAttention`` (TP 1)."""
    k = spec.kda
    assert k is not None
    h, d, dim = spec.hidden_size, k.head_dim, k.num_heads * k.head_dim
    return [
        (p + "q_proj.weight", dim * h, False), (p + "k_proj.weight", dim * h, False), (p + "v_proj.weight", dim * h, False),
        (p + "conv1d.weight", 3 * dim * k.conv_kernel_dim, False),  # one depthwise conv over q, k, v
        (p + "forget_gate.dt_bias", dim, False), (p + "forget_gate.A_log", k.num_heads, False),
        (p + "forget_gate.f_a_proj.weight", d * h, False), (p + "forget_gate.f_b_proj.weight", dim * d, False),
        (p + "b_proj.weight", k.num_heads * h, False),
        (p + "g_a_proj.weight", d * h, False), (p + "g_b_proj.weight", dim * d, False),
        (p + "o_norm.weight", d, False),
        (p + "o_proj.weight", h * dim, False),
    ]


def dsa_indexer_tensors(spec: ModelSpec, prefix: str) -> list[Tensor]:
    """megatron-core's ``DSAIndexer`` (``self_attention.core_attention.indexer.``, registered before
    ``linear_proj``): duplicated (not TP-split) linears and a LayerNorm of the key."""
    mla, dsa = spec.mla, spec.dsa
    assert mla is not None and dsa is not None
    h, p = spec.hidden_size, prefix + "self_attention.core_attention.indexer."
    return [
        (p + "linear_wq_b.weight", dsa.num_heads * dsa.head_dim * (mla.q_lora_rank or h), False),
        (p + "linear_wk.weight", dsa.head_dim * h, False),
        (p + "k_norm.weight", dsa.head_dim, True), (p + "k_norm.bias", dsa.head_dim, True),
        (p + "linear_weights_proj.weight", dsa.num_heads * h, False),
    ]


def mamba_saved(spec: ModelSpec, *, tokens: int, tp: int, act: int, cp: int = 1) -> int:
    """Bytes one Mamba mixer keeps for backward after ``in_proj`` (whose input the caller counts),
    ``tokens`` per rank: the combined kernel's contiguous ``zxBCdt`` [T, in/tp] and ``out_x`` (the
    scan output before the z gate) [T, inner/tp], ``A = -exp(A_log)`` and ``exp``'s output (fp32
    [heads] each) and ``dt_bias.float()`` (a copy for 16-bit parameters); the gated RMSNorm's input
    [T, inner/tp] and fp32 rstd per token and group; ``out_proj``'s input [T, inner/tp]. The conv
    output, dt and the chunk states are recomputed in backward.

    Under context parallelism (megatron-core's ``MambaContextParallel``) the kernel runs on the
    whole sequence (CP x ``tokens``) with the widths of :func:`mamba_cp_widths`, and keeps the
    conv weight [conv/CP, 4] and bias sliced and concatenated for this CP rank (new storages, in
    the parameter dtype); the norm and ``out_proj`` run after the all-to-all back, on ``tokens``.
    """
    m = spec.mamba
    assert m is not None
    inner, groups = mamba_inner(spec) // tp, m.num_groups // tp
    scan_inner, scan_groups, scan_heads = mamba_cp_widths(spec, tp=tp, cp=cp)
    scan_tokens = tokens * cp
    in_dim = 2 * scan_inner + 2 * scan_groups * m.state_dim + scan_heads
    kernel = (scan_tokens * in_dim * act + scan_tokens * scan_inner * act + 2 * scan_heads * FP32_BYTES
              + (scan_heads * FP32_BYTES if act < FP32_BYTES else 0))
    conv = scan_inner + 2 * scan_groups * m.state_dim
    sliced = conv * (MAMBA_CONV_WIDTH + 1) * act if cp > 1 else 0
    return kernel + sliced + tokens * inner * act + tokens * groups * FP32_BYTES + tokens * inner * act


def mamba_cp_widths(spec: ModelSpec, *, tp: int, cp: int) -> tuple[int, int, int]:
    """(inner channels, groups, heads) one CP rank's scan runs: 1/CP of this TP rank's heads and
    channels; groups split over CP, or (fewer groups than CP ranks) one group's state each,
    repeated (``group_repeat_count``)."""
    m = spec.mamba
    assert m is not None
    groups = m.num_groups // tp
    return mamba_inner(spec) // tp // cp, max(groups // cp, 1), m.num_heads // tp // cp


def mamba_cp_all_to_all(spec: ModelSpec, *, tokens: int, tp: int, cp: int, act: int) -> int:
    """``cp/all_to_all`` bytes one Mamba layer's forward hands over on a rank with ``tokens``
    tokens (backward: the same, reversed). ``MambaContextParallel.pre_conv_ssm`` sends z and x
    [T, inner/tp], B and C [T, groups/tp x repeat x state] (groups repeated to CP ranks when fewer)
    and dt [T, heads/tp] from sequence to head shards; ``post_conv_ssm`` the scan output
    [CP x T, inner/tp/CP] back. CP 1: none."""
    if cp == 1:
        return 0
    m = spec.mamba
    assert m is not None
    inner, groups, heads = mamba_inner(spec) // tp, m.num_groups // tp, m.num_heads // tp
    repeat = cp // groups if groups < cp else 1
    return tokens * (3 * inner + 2 * groups * repeat * m.state_dim + heads) * act


def gdn_saved(spec: ModelSpec, *, tokens: int, tp: int, act: int, param: int) -> int:
    """Bytes one Gated DeltaNet mixer keeps for backward after ``in_proj`` (production path:
    causal-conv1d and fla kernels, q/k L2-normalised):

    - causal-conv1d: its input, the transposed contiguous q, k, v [T, (2qk + v)/tp];
    - fla's ``l2norm`` of q and of k: output [T, qk/tp] and fp32 rstd per token and key head;
      GQA's ``repeat_interleave`` (value heads > key heads) makes new q and k of [T, nv/tp x dk];
    - the decay ``g = -exp(A_log) * softplus(alpha + dt_bias)``: softplus's fp32 input and output
      [T, nv/tp], ``exp``'s output and its negation [nv/tp] (parameter dtype); ``beta = sigmoid(b)``
      [T, nv/tp];
    - ``chunk_gated_delta_rule``: q, k, the contiguous v [T, v/tp], the chunk-cumulated fp32 g,
      beta, the solved WY matrix ``A`` [T, nv/tp, 64] in the activation dtype;
    - the gated output norm: the norm's input [T, v/tp] and fp32 rstd per token and value head,
      its output and the contiguous gate z [T, v/tp] (the fused ``y * silu(z)``); ``out_proj``'s
      input [T, v/tp].
    """
    g = spec.gdn
    assert g is not None
    nk, nv = g.num_key_heads // tp, g.num_value_heads // tp
    qk, v = nk * g.key_head_dim, nv * g.value_head_dim
    t = tokens
    conv = t * (2 * qk + v) * act
    l2 = 2 * (t * qk * act + t * nk * FP32_BYTES)
    repeated = 2 * t * nv * g.key_head_dim * act if nv > nk else 0
    decay = 2 * t * nv * FP32_BYTES + 2 * nv * param + t * nv * act
    core = t * v * act + t * nv * FP32_BYTES + t * nv * FLA_CHUNK * act
    norm = 3 * t * v * act + t * nv * FP32_BYTES
    return conv + l2 + repeated + decay + core + norm + t * v * act


def kda_saved(spec: ModelSpec, *, s: int, b: int, act: int) -> int:
    """Bytes one Kimi Delta Attention mixer keeps for backward beside its input (which the caller
    counts), as transformers 5.24's ``KimiLinearDeltaAttention`` runs without fla and causal-conv1d
    (its torch path, the one that runs on CPU: measured in ``tests/test_memory_ssm.py``). Per head
    and head dim ``d``, ``n`` chunks of C = 64 over the sequence padded to ``n x C``:

    - the depthwise conv: its input, q, k, v concatenated [b, 3 dim, s], and its output (SiLU's
      input) [b, 3 dim, s + K - 1] before the causal slice; ``f_a_proj``'s and ``g_a_proj``'s
      outputs [T, d]; ``beta = sigmoid(b_proj)`` [T, H];
    - the forget gate (fp32): ``exp(A_log)`` and its negation [H], the softplus's ``exp`` output,
      ``log``'s input and its output [T, dim], the bool ``g > 20`` mask [T, dim];
    - the chunked delta rule (fp32): q and k before their L2 norms [T, dim] and the norms [T, H];
      padded beta [b, H, nC]; seven padded [b, H, nC, d] tensors (value, key, ``k * beta``,
      ``v * beta``, ``exp(g)``, ``k * beta * exp(g)``, the scaled query; with two chunks or more
      the cumulative decay ``k_cumdecay`` too); the decay mask and the product it scales
      [b, H, n, C, C, d] each; the solved [C, C] matrix, and the clones its row loop saves
      (row i: [i] and [i, i], for i < C); three bool [C, C] masks; per chunk: ``exp(g)``, the
      new values [C, d], the state [d, d], the intra-chunk product [C, C, d] and scores [C, C];
      per chunk but the last (whose state is dropped), the state update's ``exp`` outputs [C, d]
      and [d] and its [C, d] product, and the query term the state's matmul keeps [C, d];
    - the gated output norm (fp32): its input, the normalised input, the gate's sigmoid and the
      weighted input [T, dim], rstd [T, H], a fp32 copy of its weight [d] (16-bit weights);
      ``o_proj``'s input [T, dim].

    NB: ``layer(x)`` as a training step runs it (no cache); with fla and causal-conv1d installed
    transformers calls their kernels instead, which keep far less (:mod:`.kda_fla`: a formula,
    printed under ``unmeasured``).
    """
    k = spec.kda
    assert k is not None
    heads, d, c, f, t = k.num_heads, k.head_dim, KDA_CHUNK, FP32_BYTES, s * b
    dim, n, bh = heads * d, -(-s // c), b * heads
    conv = b * 3 * dim * (2 * s + k.conv_kernel_dim - 1) * act
    gates = 2 * t * d * act + t * heads * act + 2 * heads * f + t * dim * (3 * f + 1)
    l2 = 2 * t * (dim + heads) * f
    rows = (c - 1) * c // 2 + (c - 1) * c * (2 * c - 1) // 6  # sum of i + i^2 for i < C
    padded = bh * n * c * (1 + (7 + (n > 1)) * d) * f
    chunks = bh * n * (2 * c * c * d + c * c + rows) * f + 3 * c * c
    per_chunk = bh * (n * (2 * c * d + d * d + c * c * d + c * c) + (n - 1) * (3 * c * d + d)) * f
    out = t * dim * (4 * f + act) + t * heads * f + (d * f if act < f else 0)
    return conv + gates + l2 + padded + chunks + per_chunk + out


def dsa_saved(spec: ModelSpec, *, s: int, b: int, heads: int, act: int, sequence_parallel: bool = False,
              indexer: bool = True) -> int:
    """Bytes megatron-core 0.16.1's ``DSAttention`` (its torch implementation) keeps for backward,
    in place of MLA's core attention, with ``heads`` attention heads on this TP rank: measured on
    CPU (``tests/test_memory_ssm.py``: TP 1, and TP 2 with and without sequence parallelism in
    2 gloo processes).

    The indexer (its inputs, the detached norm output and q latent, are MLA's own): RoPE's cos and
    sin for its q and k [s, rope]; ``k_norm``'s input [T, d] and fp32 mean and rstd per token; the
    fp32 q [T, nh, d] and k [T, d] of the score einsum, ReLU's fp32 output [b, nh, s, s], the
    weights [T, nh]. (top-k saves its int64 indices [b, s, min(topk, s)], but only its indices are
    used: its backward node and what it saved go before the forward ends.) The KL indexer loss: the index
    softmax's output, ``log``'s input and the normalised attention target (fp32 [b, s, s] each).
    The unfused sparse attention: fp32 q and k [b x heads, s, qk + rope], the fp32 softmax
    [b, heads, s, s] and its copy in the activation dtype (none in fp32), a contiguous v [T, heads, v].

    Under TP the indexer is whole on every rank (its linears duplicated) and sees every token: its
    figures and the KL loss's [b, s, s] do not shrink; the loss's head sum over this rank's heads is
    all-reduced over TP in place (nothing more saved). Under sequence parallelism the indexer
    all-gathers its detached inputs and its linears keep the gathered copies: the norm output
    [T, h] and the q latent [T, q_lora] (without q_lora, the norm output again: [T, h]).

    A layer that reuses an earlier layer's top-k (``indexer`` False: megatron-core 0.19's
    ``dsa_indexer_topk_freq``; 0.16.1 has none) runs no indexer and no KL loss: the sparse attention
    only. With such layers in the model, 0.19 keeps every computing layer's int64 top-k
    [b, s, min(topk, s)] in a holder on the micro-batch's attention mask, alive until the mask goes
    (after the backward): counted with the layer that computes it. (A formula: 0.19's DSAttention is
    not run here.)

    NB: the graph is the same whatever ``dsa_indexer_loss_coeff`` (a zero coefficient still builds it).
    NB: fast_hadamard_transform saves nothing for backward (the test's stand-in neither).
    """
    mla, dsa = spec.mla, spec.dsa
    assert mla is not None and dsa is not None
    t, nh, d, rope = s * b, dsa.num_heads, dsa.head_dim, mla.qk_pos_emb_head_dim
    indexer_bytes = (4 * s * rope * act + t * d * act + 2 * t * FP32_BYTES + t * nh * d * FP32_BYTES + t * d * FP32_BYTES
               + b * nh * s * s * FP32_BYTES + t * nh * act)
    loss = 3 * b * s * s * FP32_BYTES
    scores = b * heads * s * s
    sparse = (2 * t * heads * (mla.qk_head_dim + rope) * FP32_BYTES + scores * FP32_BYTES + (scores * act if act < FP32_BYTES else 0)
              + t * heads * mla.v_head_dim * act)
    if not indexer:
        return sparse
    held = b * s * min(dsa.topk, s) * INDEX_BYTES if any(m == "dsa_shared" for (m, _), _ in spec.layer_runs) else 0
    gathered = t * (spec.hidden_size + (mla.q_lora_rank or spec.hidden_size)) * act if sequence_parallel else 0
    return indexer_bytes + loss + sparse + gathered + held


def ssm_reason(spec: ModelSpec, par: Parallelism, peft: PeftSpec | None) -> str | None:
    """Why the parameters of this model are not modelled on ``par`` (None: they are)."""
    kinds = model_kinds(spec)
    mixers = {mixer for mixer, _ in kinds}
    if spec.mtp_num_layers and not hybrid_mtp(spec) and mtp_mixer(spec) == "kda":
        return ("multi-token prediction after a Kimi Delta Attention layer: no framework trains it (Megatron-LM builds "
                "an MTP layer of the last decoder layer's kind, and neither megatron-core (0.16.1 to 0.19.2) nor "
                "Megatron-Bridge 0.6.2 has a KDA layer; transformers' Kimi Linear has no MTP layers)")
    if spec.mtp_num_layers and not hybrid_mtp(spec) and mtp_mixer(spec) not in ("attention", "dsa", "gdn"):
        return "multi-token prediction is modelled with MTP layers of one attention, DSA or GDN layer"
    if peft is not None and peft.lora_rank is not None and (mixers - {"attention", "window"}
                                                            or any(f == "none" for _, f in kinds)):
        return "LoRA adapters are modelled on attention + MLP layers (not Mamba, GDN, KDA, DSA or hybrid layers)"
    if par.cp > 1 and "kda" in mixers:  # (GDN and DSA: :mod:`.linear_cp`)
        return "Kimi Delta Attention is transformers' KimiLinearDeltaAttention, which has no context parallelism"
    if "kda" in mixers and par.tp > 1:
        return ("Kimi Delta Attention is modelled with --tp 1: neither megatron-core (0.16.1 to 0.19.2) nor "
                "Megatron-Bridge 0.6.2 has a KDA layer, and transformers' KimiLinearDeltaAttention has no tensor "
                "parallelism (Kimi Linear's TP plan splits only its MLPs and experts)")
    sizes = []
    if spec.mamba is not None:
        sizes += [("mamba_num_heads", spec.mamba.num_heads), ("mamba_num_groups", spec.mamba.num_groups)]
    if spec.gdn is not None:
        sizes += [("linear_num_key_heads", spec.gdn.num_key_heads), ("linear_num_value_heads", spec.gdn.num_value_heads)]
    for name, value in sizes:
        if value % par.tp:
            return f"{name}={value} is not divisible by --tp {par.tp}"
    return _mamba_cp_reason(spec, par) if "mamba" in mixers else None


def _mamba_cp_reason(spec: ModelSpec, par: Parallelism) -> str | None:
    """Why megatron-core's ``MambaContextParallel`` refuses ``--cp`` for these Mamba sizes."""
    m = spec.mamba
    assert m is not None
    heads, groups, cp = m.num_heads // par.tp, m.num_groups // par.tp, par.cp
    if heads % cp:
        return f"mamba_num_heads / TP = {heads} is not divisible by --cp {cp} (megatron-core's MambaContextParallel)"
    if (cp % groups if groups < cp else groups % cp):
        return (f"mamba_num_groups / TP = {groups} and --cp {cp}: one must divide the other (megatron-core's "
                "MambaContextParallel)")
    return None


def ssm_activation_reason(spec: ModelSpec, recompute: RecomputeSpec | None, *, cp: int = 1) -> str | None:
    """Why activations are not modelled for these layers (None: they are, or there are none)."""
    kinds = model_kinds(spec)
    mixers = {mixer for mixer, _ in kinds}
    attention_modules = {"core_attn", "mla_up_proj", "layernorm"}
    if mixers & {"dsa", "dsa_shared"} and recompute is not None and cp > 1 and recompute.granularity == "selective" \
            and attention_modules & set(recompute.modules):
        return ("activations of DeepSeek sparse attention layers under context parallelism (megatron-core 0.19.0's "
                "absorbed-MLA layer) are modelled with full recompute or selective recompute of modules outside the "
                "attention (mlp, moe, moe_act, shared_experts), not of core_attn, mla_up_proj or layernorm")
    if mixers & {"dsa", "dsa_shared"} and recompute is not None and recompute.granularity == "selective" \
            and "core_attn" in recompute.modules:
        return ("activations under selective recompute of core_attn with DeepSeek sparse attention: megatron-core "
                "0.16.1's checkpointed core attention calls DSAttention without its x and qr arguments (a TypeError "
                "in the first forward; seen here)")
    plain = mixers <= {"attention", "window", "dsa", "dsa_shared"} and all(f != "none" for _, f in kinds)
    if recompute is not None and recompute.granularity == "full" and not plain:
        return ("activations of Mamba, Gated DeltaNet, Kimi Delta Attention and hybrid layers are modelled "
                "without full recompute")
    return None


def ssm_notes(spec: ModelSpec, par: Parallelism, *, activations: bool) -> tuple[list[str], list[str]]:
    """(assumptions, unmeasured) for these layers: every activation formula here is unmeasured."""
    mixers = {mixer for mixer, _ in model_kinds(spec)}
    assumptions: list[str] = []
    if "gdn" in mixers or is_hybrid(spec):
        assumptions.append("Mamba, GDN and hybrid layers as megatron-core builds them (Transformer Engine specs: a "
                           "layer's norm fused into its first linear layer, listed as a separate norm: same bytes)")
    if is_hybrid(spec) and spec.mla is not None:
        assumptions.append("hybrid multi-latent attention layers without latent norms (megatron-core's hybrid specs "
                           "build q_layernorm and kv_layernorm as IdentityOp, whatever qk_layernorm says)")
    assumptions += hybrid_pipeline_notes(spec, par)
    mtp_assumptions, unmeasured = hybrid_mtp_notes(spec, par)
    assumptions += mtp_assumptions
    if activations and "mamba" in mixers:
        unmeasured.append("activations of Mamba layers: a formula from what mamba_ssm's fused conv1d + chunked scan "
                          "and gated RMSNorm save for backward (CUDA/Triton kernels: they do not run on CPU)")
    if par.cp > 1 and "mamba" in mixers:
        unmeasured.append(f"context parallelism of Mamba layers (CP {par.cp}): the scan's saved bytes on the whole "
                          "sequence and 1/CP of the heads; megatron-core's MambaContextParallel around it (cp/all_to_all "
                          "and the storages it hands the kernels) is measured on gloo at TP 1, what mamba_ssm's CUDA "
                          "kernels keep of their own (out_x, the norm's rstd) is a formula")
    if activations and "gdn" in mixers:
        unmeasured.append("activations of Gated DeltaNet layers: a formula from what causal-conv1d and fla's "
                          "l2norm and chunk_gated_delta_rule save for backward (CUDA/Triton kernels: they do not run "
                          "on CPU)")
    if par.tp > 1 and mixers & {"mamba", "gdn"}:
        unmeasured.append("tp/* traffic of Mamba and GDN layers: in_proj and out_proj priced as an attention block's "
                          "column- and row-parallel pair (the layers do not run on CPU)")
    if "kda" in mixers:
        assumptions.append("Kimi Delta Attention layers as transformers' KimiLinearDeltaAttention (TP 1)")
    if activations and "kda" in mixers:
        assumptions.append("Kimi Delta Attention's activations as transformers' torch path keeps them (no fla or "
                           "causal-conv1d installed; measured on CPU): fp32 [chunk, chunk, head dim] decay products "
                           "per 64-token chunk; with fla and causal-conv1d installed transformers runs their kernels, "
                           "which keep far less: that figure is under unmeasured)")
    if activations and "dsa" in mixers and par.cp == 1:  # (under CP: megatron-core 0.19.0's, :mod:`.linear_cp`)
        assumptions.append("DeepSeek sparse attention as megatron-core 0.16.1's DSAttention runs it (torch, unfused: "
                           "fp32 [b, heads, s, s] scores, the indexer's KL loss graph, the indexer whole on every TP "
                           "rank); measured on CPU (TP 1, TP 2 with and without sequence parallelism; whole GPT steps "
                           "with full and selective recompute and an MTP layer) with a stand-in for "
                           "fast_hadamard_transform, which saves nothing for backward")
    if spec.mtp_num_layers and not hybrid_mtp(spec) and mtp_mixer(spec) in ("dsa", "gdn"):
        assumptions.append("MTP layers of the last decoder layer's kind (DSA or GDN), as Megatron-LM 0.19's gpt_builders "
                           "builds them; 0.16.1's builds a plain GPT layer there (for DSA, MLA then hands the plain core "
                           "attention x and qr: a TypeError), and 0.16.1's DSAttention in an MTP layer logs its indexer "
                           "loss out of range unless dsa_indexer_loss_coeff is 0 (measured so: the same graph)")
    if activations and "dsa_shared" in mixers and par.cp == 1:  # (under CP: measured, :mod:`.linear_cp`)
        unmeasured.append("activations of DeepSeek sparse attention layers that reuse an earlier top-k (megatron-core "
                          "0.19's dsa_indexer_topk_freq; 0.16.1 has none): 0.16.1's sparse attention without the indexer "
                          "and its KL loss, and each computing layer's int64 top-k held for the micro-batch (0.19's "
                          "holder on the attention mask); a formula")
    return assumptions, unmeasured


def missing_blocks(kinds: tuple[tuple[str, str], ...], layers: range | list[int]) -> int:
    """Sub-blocks (a mixer or a feed-forward part, each with one TP collective pair) that the
    hybrid layers among ``layers`` lack: :mod:`.comm` prices two per layer."""
    return sum((kinds[i][0] == "none") + (kinds[i][1] == "none") for i in layers)
