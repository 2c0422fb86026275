"""Context parallelism of Gated DeltaNet and DeepSeek sparse attention layers, as megatron-core
0.19.0 runs them (stdlib only; ints in, ints out). megatron-core 0.16.1, whose layers the report
lists otherwise, refuses CP for both; 0.19.0 rewrote them:

- ``GatedDeltaNet`` all-to-alls ``in_proj``'s output from sequence to head shards (each CP rank
  then runs the conv and the chunked delta rule on the whole sequence with 1/CP of this TP rank's
  heads) and the gated norm's output back before ``out_proj``.
- DSA is an absorbed-MLA self-attention (``AbsorbedMLASelfAttention``) around ``DSAttention``,
  which all-gathers the latent key (and the indexer's key) over CP (``cp_comm_type`` allgather
  only) and attends from this rank's s/CP queries to every key, through the torch path
  (``dsa_kernel_backend`` ``none``, the default). A layer that reuses an earlier layer's top-k
  (``dsa_indexer_topk_freq``) runs no indexer; under TP the layer needs sequence parallelism
  (``AbsorbedMLASelfAttention`` asserts it).

Measured on CPU (``tests/test_memory_linear_cp.py``): the real 0.19.0 layers in 2 gloo processes
at CP 1 and CP 2 (TP 1; GDN with stand-ins for fla's kernels that save what those keep, DSA with a
stand-in for fast_hadamard_transform, which saves nothing), and DSA (a computing and a reusing
layer) in 4 at TP 2 x CP 2 with sequence parallelism: every saved storage and every ``cp/*`` (and
DSA's ``tp/*``) payload equals these formulas.
"""

from __future__ import annotations

from megatron_flops.memory.layout import BOOL_BYTES, FP32_BYTES, INDEX_BYTES, Parallelism
from megatron_flops.memory.mtp_layers import last_stage_mtp_kinds
from megatron_flops.memory.ssm import gdn_saved
from megatron_flops.model.spec import ModelSpec

CP_MIXERS = ("gdn", "dsa", "dsa_shared")  # mixers whose CP traffic is their own (no attention ring)


def gdn_cp_saved(spec: ModelSpec, *, tokens: int, tp: int, cp: int, act: int, param: int) -> int:
    """Bytes one Gated DeltaNet mixer keeps for backward after ``in_proj`` on a rank holding
    ``tokens`` tokens (s/CP of each sequence): :func:`.ssm.gdn_saved` of the whole sequence
    (``tokens x CP``) and 1/CP of this TP rank's heads (every term there is tokens x heads, so
    only ``exp(A_log)`` [heads/TP/CP] shrinks), plus under CP the conv weight sliced for this rank
    and concatenated (a new [(2qk + v)/TP/CP, K] in the parameter dtype, handed to the conv).
    The head permutation its ``index_select`` keeps is one storage per rank:
    :func:`gdn_cp_head_permutation`."""
    if cp == 1:
        return gdn_saved(spec, tokens=tokens, tp=tp, act=act, param=param)
    g = spec.gdn
    assert g is not None
    qk, v = g.num_key_heads * g.key_head_dim, g.num_value_heads * g.value_head_dim
    conv = (2 * qk + v) // tp // cp * g.conv_kernel_dim * param
    return gdn_saved(spec, tokens=tokens * cp, tp=tp * cp, act=act, param=param) + conv


def gdn_cp_head_permutation(spec: ModelSpec, par: Parallelism, *, pp_rank: int) -> int:
    """Bytes of the int64 head permutation [(2qk + 2v + 2 nv)/TP] pipeline rank ``pp_rank`` holds
    under CP when any of its layers (the last stage's MTP layers included) is a GDN mixer; else 0.

    NB: megatron-core 0.19.0 builds it in ``_build_head_perm_for_split_sections``, an
    ``lru_cache`` keyed by the TP-local ``in_proj`` sections, the CP size and the device: one
    tensor per process, which every GDN layer's ``index_select`` keeps for backward on every
    micro-batch, and which the cache keeps alive from the first forward on. It is counted once in
    the rank's activation peak, never per layer or per micro-batch."""
    if par.cp == 1 or spec.gdn is None:
        return 0
    mixers = {spec.layers[i][0] for c in range(par.num_chunks) for i in par.chunk_layers(spec.num_layers, pp_rank, c)}
    mixers |= {mixer for c in range(par.num_chunks) for mixer, _ in last_stage_mtp_kinds(spec, par.holds_mtp(pp_rank, c))}
    if "gdn" not in mixers:
        return 0
    g = spec.gdn
    return (2 * g.num_key_heads * g.key_head_dim + 2 * g.num_value_heads * g.value_head_dim
            + 2 * g.num_value_heads) // par.tp * INDEX_BYTES


def gdn_cp_all_to_all(spec: ModelSpec, *, tokens: int, tp: int, cp: int, act: int) -> int:
    """``cp/all_to_all`` bytes one GDN layer's forward hands over (backward: the same, reversed):
    ``in_proj``'s output [T, (2qk + 2v + 2 nv)/TP] to head shards, the gated norm's output
    [CP x T, v/TP/CP] back. CP 1: none."""
    if cp == 1:
        return 0
    g = spec.gdn
    assert g is not None
    qk, v, nv = g.num_key_heads * g.key_head_dim, g.num_value_heads * g.value_head_dim, g.num_value_heads
    return tokens * (2 * qk + 3 * v + 2 * nv) // tp * act


def dsa_cp_saved(spec: ModelSpec, *, s: int, b: int, cp: int, act: int, latent_norms: bool, norm_stats: int,
                 tp: int = 1, indexer: bool = True) -> int:
    """Bytes megatron-core 0.19.0's DSA attention (absorbed MLA around ``DSAttention``) keeps
    for backward after the layer's input (which the caller counts) up to ``linear_proj``'s input
    (included), on a rank holding ``s`` tokens of each of ``b`` sequences (s/CP; S = CP x s keys)
    and H/TP of the H heads; ``tp``: the TP size under sequence parallelism (else 1: 0.19.0
    asserts sequence parallelism under TP), whose ranks each norm T/TP of the latents; ``norm_stats``:
    bytes per normed token of one latent norm's statistics. T = s x b; latents q [Q], kv [L], RoPE
    width R; indexer nh heads of d. ``indexer`` False: a layer reusing an earlier layer's top-k
    (``dsa_shared``), which runs no indexer.

    - MLA: the q latent [T, Q] (``q_up``'s input; under sequence parallelism a slice of the
      gathered latent, which it keeps whole), the query [T, H/TP, qk + R] (its no-RoPE part read by
      the absorption into the latent), RoPE's cos and sin for q and k [s, R] each; with latent
      norms, their inputs (the q latent [T, Q]; the kv norm's, a view of the kv down projection's
      gathered output [T, L + R]), the q norm's output [T/TP, Q] when TP > 1 (``q_up``'s input; at
      TP 1 the q latent above) and their statistics [T/TP];
    - under CP, the int64 order [S] that undoes the zigzag after the key all-gather;
    - the indexer, only when it trains (``dsa_indexer_loss_coeff > 0``; else it runs without
      grad): RoPE's cos and sin [s, R] for its q and k, ``k_norm``'s (LayerNorm) input [T, d] and
      fp32 mean and rstd, under sequence parallelism its linears' all-gathered inputs (the norm
      output [T, h] and the q latent [T, Q], without one the norm output again), and what the loss
      function keeps of its inputs: q [T, nh, d], weights [T, nh], the gathered k [S x b, d], the
      detached query [T, H/TP, L + R] and gathered key [S x b, L + R], the int64 top-k
      [b, s, min(topk, S)];
    - with layers that reuse it (``dsa_shared``), the int64 top-k a computing layer leaves in the
      holder on the micro-batch (its attention mask; none saved when the indexer trains: the
      holder's is the loss's storage);
    - the sparse attention (torch path), h = H/TP heads: the fp32 query [T, h, L + R] and key
      (expanded to every head when b > 1: [b x h, L + R, S]; b = 1: the fp32 copy [S, L + R]); the
      masked softmax's three bool masks and two fp32 [b, h, s, S] (exp and the probabilities), its
      int64 arg-max, bool row flag and two fp32 row sums [b, h, s]; the probabilities in the
      activation dtype; the latent value [b x h, S, L] (b = 1: a view of the gathered key, already
      counted when the indexer trains); the latent output [T, h, L] and the up-projection weight
      [h, v, L] its einsum keeps; ``linear_proj``'s input [T, h x v].

    NB: bf16 activations: megatron-core 0.19.0's indexer accepts nothing else (``rotate_activation``
    asserts it), so the fp32 query and key are always copies.
    """
    mla, dsa = spec.mla, spec.dsa
    assert mla is not None and dsa is not None
    heads, a, big_s, t = spec.num_attention_heads // tp, act, s * cp, s * b
    q_lora, kv, rope, d, nh = mla.q_lora_rank, mla.kv_lora_rank, mla.qk_pos_emb_head_dim, dsa.head_dim, dsa.num_heads
    latent, normed = kv + rope, t // tp
    cos_sin = 4 * s * rope * a
    mla_part = t * (q_lora or 0) * a + t * heads * (mla.qk_head_dim + rope) * a + cos_sin
    if latent_norms:  # (megatron-core 0.19 refuses a q norm without q_lora)
        mla_part += (normed * q_lora * a + normed * norm_stats if q_lora else 0) + t * latent * a + normed * norm_stats
    order = big_s * INDEX_BYTES if cp > 1 else 0
    trains = dsa.trains_indexer and indexer
    topk = b * s * min(dsa.topk, big_s) * INDEX_BYTES
    gathered = t * (spec.hidden_size + (q_lora or spec.hidden_size)) * a if tp > 1 else 0
    indexer_part = (cos_sin + t * d * a + 2 * t * FP32_BYTES + t * nh * (d + 1) * a + big_s * b * d * a + gathered
                    + t * heads * latent * a + big_s * b * latent * a + topk) if trains else 0
    held = 0 if trains else dsa_cp_held_topk(spec, s=s, b=b, cp=cp, indexer=indexer)
    scores = b * heads * s * big_s
    key = (b * heads if b > 1 else 1) * big_s * latent * FP32_BYTES
    value = b * heads * big_s * kv * a if b > 1 else (0 if trains else big_s * latent * a)
    rows = b * heads * s * (INDEX_BYTES + BOOL_BYTES + 2 * FP32_BYTES)  # arg-max, row flag, two row sums
    softmax = 3 * scores * BOOL_BYTES + 2 * scores * FP32_BYTES + rows
    core = t * heads * latent * FP32_BYTES + key + softmax + scores * a + value
    out = heads * mla.v_head_dim * kv * a + t * heads * kv * a + t * heads * mla.v_head_dim * a
    return mla_part + order + indexer_part + held + core + out


def dsa_cp_held_topk(spec: ModelSpec, *, s: int, b: int, cp: int, indexer: bool = True) -> int:
    """Bytes of the int64 top-k [b, s, min(topk, S)] a computing DSA layer (``indexer``) leaves in
    megatron-core 0.19.0's top-k holder on the micro-batch's attention mask, when layers reuse it
    (``dsa_shared``); else 0."""
    dsa = spec.dsa
    assert dsa is not None
    if not indexer or not any(m == "dsa_shared" for (m, _), _ in spec.layer_runs):
        return 0
    return b * s * min(dsa.topk, s * cp) * INDEX_BYTES


def dsa_cp_recompute_held(spec: ModelSpec, mixer: str, *, s: int, b: int, cp: int) -> int:
    """Bytes a fully recomputed DSA layer under CP keeps beside its checkpoint's input until the
    micro-batch's backward: a computing layer's top-k that the first (no-grad) forward leaves in the
    holder (:func:`dsa_cp_held_topk`), whether or not its indexer trains (the no-grad forward builds
    no indexer loss to save it); its re-run in backward computes another, which replaces it once the
    layer's forward ends (both held meanwhile). Else 0.

    NB: measured (``tests/test_memory_linear_cp.py``): the checkpoint keeps only the layer's input
    [T/TP, h]; the re-run saves what the layer saves without recompute (:func:`dsa_cp_saved`)."""
    if cp == 1 or mixer != "dsa":
        return 0
    return dsa_cp_held_topk(spec, s=s, b=b, cp=cp)


def dsa_cp_traffic(spec: ModelSpec, *, s: int, b: int, cp: int, act: int, tp: int = 1,
                   indexer: bool = True) -> tuple[dict[str, int], dict[str, int]]:
    """(bytes every forward of one DSA layer moves, bytes once per micro-batch) under CP, as
    megatron-core 0.19.0 runs the layer (``tp``: the TP size under sequence parallelism, else 1;
    ``indexer`` False: a layer reusing an earlier layer's top-k runs no indexer).

    Every forward: ``cp/all_gather`` of the latent key [S x b, L + R] and, with the indexer, its
    key [S x b, d] (all-gather outputs), and the int64 sequence lengths each rank checks
    (``_validate_nonpacked_cp_uniform_length``: CP x 8 bytes); under sequence parallelism the
    indexer's ``tp/all_gather`` of its detached inputs [T, h] and [T, Q] (no q latent: [T, h]),
    with or without grad.

    Once: ``cp/reduce_scatter`` of the key's gradient (the indexer key's too when the indexer
    trains); under sequence parallelism, when the indexer trains, the KL loss's ``tp/all_reduce``
    of its target, fp32 [b, s, S], in forward (built with grad only: a full recompute's first
    forward skips it) and in backward; and one ``tp/all_gather`` fewer than
    :func:`.mla_mtp.mla_mtp_tensor_parallel` counts for an MLA layer, as a negative delta: the kv
    latent [T, L] is gathered by an explicit all-gather (backward: a reduce-scatter), not by
    ``linear_kv_up_proj``, which gathers its input again in backward."""
    mla, dsa = spec.mla, spec.dsa
    assert mla is not None and dsa is not None
    rows, t = s * cp * b, s * b
    key, index_key = rows * (mla.kv_lora_rank + mla.qk_pos_emb_head_dim) * act, rows * dsa.head_dim * act
    trains = indexer and dsa.trains_indexer
    forward = {"cp/all_gather": key + (index_key if indexer else 0) + cp * INDEX_BYTES}
    once = {"cp/reduce_scatter": key + (index_key if trains else 0)}
    if tp > 1:
        inputs = t * (spec.hidden_size + (mla.q_lora_rank or spec.hidden_size)) * act
        forward["tp/all_gather"] = inputs if indexer else 0
        once["tp/all_gather"] = -t * mla.kv_lora_rank * act
        once["tp/all_reduce"] = 2 * s * rows * FP32_BYTES if trains else 0  # [b, s, S], twice
    return forward, once


def dsa_cp_communication(spec: ModelSpec, *, s: int, b: int, cp: int, act: int, tp: int = 1,
                         indexer: bool = True) -> dict[str, int]:
    """The bytes one DSA layer moves per micro-batch under CP, forward and backward
    (:func:`dsa_cp_traffic`, one forward); CP 1: none."""
    if cp == 1:
        return {}
    forward, once = dsa_cp_traffic(spec, s=s, b=b, cp=cp, act=act, tp=tp, indexer=indexer)
    return {k: forward.get(k, 0) + once.get(k, 0) for k in {**forward, **once} if forward.get(k, 0) + once.get(k, 0)}


def linear_cp_communication(spec: ModelSpec, mixers: list[str], *, tokens: int, s: int, b: int, par: Parallelism,
                            act: int, reruns: int) -> dict[str, int]:
    """``cp/*`` bytes per micro-batch of the GDN and DSA layers among ``mixers`` (one per layer of
    this chunk; the first ``reruns`` re-run their forward under full recompute): the GDN
    all-to-alls forward and backward (:func:`gdn_cp_all_to_all`), DSA's all-gathers and
    reduce-scatters and, under TP with sequence parallelism, its ``tp/*`` terms
    (:func:`dsa_cp_traffic`)."""
    out: dict[str, int] = {}
    if par.cp == 1:
        return out
    gdn = gdn_cp_all_to_all(spec, tokens=tokens, tp=par.tp, cp=par.cp, act=act) if spec.gdn is not None else 0
    for i, mixer in enumerate(mixers):
        forwards = 2 if i < reruns else 1
        if mixer == "gdn":
            out["cp/all_to_all"] = out.get("cp/all_to_all", 0) + (forwards + 1) * gdn
        elif mixer in ("dsa", "dsa_shared"):
            forward, once = dsa_cp_traffic(spec, s=s, b=b, cp=par.cp, act=act, tp=par.tp, indexer=mixer == "dsa")
            for key in {**forward, **once}:
                out[key] = out.get(key, 0) + forwards * forward.get(key, 0) + once.get(key, 0)
    return out


def linear_cp_reason(spec: ModelSpec, par: Parallelism) -> str | None:
    """Why ``--cp`` is not modelled for these GDN or DSA sizes (None: it is, or no CP)."""
    mixers = {mixer for (mixer, _), _ in spec.layer_runs}
    if par.cp == 1:
        return None
    g = spec.gdn
    if "gdn" in mixers and g is not None:
        for name, heads in (("linear_num_key_heads", g.num_key_heads), ("linear_num_value_heads", g.num_value_heads)):
            if heads // par.tp % par.cp:
                return (f"{name} / TP = {heads // par.tp} is not divisible by --cp {par.cp} (megatron-core 0.19.0's "
                        "GatedDeltaNet splits every head section over CP ranks)")
    if mixers & {"dsa", "dsa_shared"} and par.tp > 1 and not par.sequence_parallel:
        return ("megatron-core 0.19.0's absorbed-MLA DeepSeek sparse attention layer, which context parallelism "
                "needs, requires sequence parallelism under TP (AbsorbedMLASelfAttention asserts it): add "
                "--sequence-parallel")
    return None


def linear_cp_notes(spec: ModelSpec, par: Parallelism) -> tuple[list[str], list[str]]:
    """(assumptions, unmeasured) to print for GDN and DSA layers under CP."""
    mixers = {mixer for (mixer, _), _ in spec.layer_runs}
    out: list[str] = []
    unmeasured = [f"cp/all_to_all of Gated DeltaNet layers under TP {par.tp} x CP {par.cp} (measured at TP 1)"
                  ] if par.cp > 1 and par.tp > 1 and "gdn" in mixers else []
    if par.cp > 1 and "gdn" in mixers:
        out.append(f"Gated DeltaNet under context parallelism (CP {par.cp}) as megatron-core 0.19.0 runs it (0.16.1 "
                   "refuses it): in_proj's output all-to-all'd to 1/CP of the heads on the whole sequence, the gated "
                   "norm's output back; its int64 head permutation, one cached tensor for every GDN layer and "
                   "micro-batch, counted once per rank; parameters as 0.16.1 lists them (the same tensors)")
    if par.cp > 1 and mixers & {"dsa", "dsa_shared"}:
        out.append(f"DeepSeek sparse attention under context parallelism (CP {par.cp}) as megatron-core 0.19.0 runs it "
                   "(0.16.1 refuses it): an absorbed-MLA layer, cp_comm_type allgather (the latent and indexer keys "
                   "all-gathered), the torch sparse attention (dsa_kernel_backend none), the indexer's graph only when "
                   "dsa_indexer_loss_coeff > 0, bf16 (its indexer asserts it); without CP the report follows 0.16.1's "
                   "DSAttention")
    if par.cp > 1 and "dsa_shared" in mixers:
        out.append("DeepSeek sparse attention layers that reuse an earlier layer's top-k (dsa_indexer_topk_freq) as "
                   "megatron-core 0.19.0 runs them under context parallelism: no indexer (its key is not gathered), "
                   "each computing layer's int64 top-k held on the micro-batch's attention mask until it goes")
    return out, unmeasured
