"""Activations of a WAN-style DiT (``examples/wan_dit_fsdp2.py``'s ``WanLike``: its blocks,
``WanAttentionBlock``, then the embeddings, head and loss around them), fully trained or LoRA on a
frozen base, with and without per-block checkpointing (stdlib only).

The block's forward is walked op by op with torch's rule for what an op saves for backward (an
operand is saved when another operand, or the weight, needs a gradient), counting distinct
storages. Fully trained (``T`` video tokens, ``C`` text and ``M`` CLIP tokens of the micro-batch,
``h`` hidden, ``f`` FFN, ``a`` bytes of the compute dtype), one block saves:

- ``adaln``: the modulation sum ``[T, 6, h]`` (its chunks 2 and 5 gate the residuals), ``1 + scale``
  twice, the two modulated norms' outputs and the two gated outputs: ``12 T h a``;
- ``norm``: the three LayerNorms' inputs and statistics: ``3 (T h a + 2 T s)``;
- ``self_attn``: q/k/v's input, q and k RMSNorms, normalised q, k and v, ``o``'s input, core attention;
- ``cross_attn``: ``q``'s input (norm3's output), its RMSNorm and output, ``o``'s input; per key/value
  source (text, CLIP image) its ``k`` RMSNorm, normalised keys and values; core attention;
- ``ffn``: its input, the GELU's input and output ``[T, f]``.

A frozen linear layer saves nothing of its input; an adapter saves the input and its ``[N, rank]``
intermediate; with a frozen base the first block's input, the time modulation and the text/image
embeddings need no gradient, so the first block saves only from its first adapter on.

NB: an RMSNorm is torch's composite ``nn.RMSNorm``: an fp32 copy of its input (the input itself in
fp32) and fp32 ``rstd`` per token, the fp32 normalised product when its weight trains, then its
output in ``a``.
NB: LayerNorm statistics in fp32 (``s = 4``), as CUDA's kernel keeps them.
NB: the text and image embeddings every block reads (``C h a``, ``M h a``) are saved once per forward.
NB: core attention, ``local``: the example's explicit matmuls keep the softmax output per clip
``[heads, s_i, kv_i]``; ``flash``: the kernel keeps q, k, v, its output (``o``'s input already,
except for image-to-video, where ``o`` reads the sum of the text and image outputs) and fp32
log-sum-exp ``[heads, T]`` per call. ``flash`` is a convention: not measured on CPU.
NB: a checkpointed block keeps its inputs until its backward: the hidden states ``T h a`` each,
and once per forward the per-token modulation input ``[T, 6, h]`` and the text/image embeddings;
backward re-runs one block at a time, which saves a whole block again except its input.
Groups of N blocks under one checkpoint (megatron-core's ``uniform`` method, ``recompute_num_layers``
N > 1): each group keeps its first block's input and re-runs its N blocks together; when a group
re-runs, the later groups' backward has freed their inputs.
FSDP2 runs forward and backward of one micro-batch before the next: one micro-batch in flight.
NB: ``tp`` > 1 (a formula): the column-parallel outputs, heads and FFN split over TP, q and k
gathered whole for the norms; with ``sequence_parallel`` also the residual stream (and what the
adaLN ops, LayerNorms, checkpoints and head save) on ``T / TP`` tokens, each column-parallel
input saved as this rank's slice, and the text (CLIP) side of cross-attention ``TP`` times over
(Megatron-Bridge's ``linear_kv`` all-gathers the whole context as if it were a slice).

Outside the blocks (``WanLike.forward`` and the loss; ``B`` clips, ``freq``, ``text_dim`` and
``w = image_dim`` the embeddings' input widths, ``P = out_channels x prod(patch_size)``), the same
GEMM inputs the FLOPs side prices (:func:`megatron_flops.flops.dit.dit_forward_gemms`):

- ``patch_embed``: the Conv3d's input, each clip's latents, ``T x in_channels x prod(patch_size)``;
- ``time_embed``: the sinusoid ``[B, freq]``, SiLU's input and output ``[B, h]`` twice
  (``time_embedding``, ``time_projection``) and the int64 index ``[T]`` that repeats each clip's
  projection per token;
- ``text_embed``: the text ``[C, text_dim]``, GELU's input and output ``[C, h]``;
- ``image_embed`` (image-to-video): ``img_emb``'s two LayerNorms' inputs and statistics
  (``[M, w]``, ``[M, h]``), its Linear's input, GELU's input and output ``[M, w]``;
- ``head``: its LayerNorm's input (the last block's output) and statistics, ``1 + scale`` ``[T, h]``;
  trained, also the normalised ``x``, the head Linear's input and the int64 repeat index ``[T]``;
- ``loss``: MSE in fp32 (the prediction cast with ``.float()``): the prediction and the target,
  ``[T, P]`` each.

With a frozen base only the head (its input needs a gradient) and the loss save. Backward frees the
head's and the loss's saves first, then each block's: a checkpointed block re-runs after the blocks
behind it have freed theirs, so the peak is the embeddings', the shared embeddings' and the
checkpoints' storages plus the larger of (the un-checkpointed blocks, head and loss) and (one
block re-run).
NB: the sinusoid is cast to the compute dtype (the example's ``.to(x.dtype)``); WAN runs the time
embedding in fp32 under autocast: another implementation saves differently.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from megatron_flops.flops.dit import DiTPeftSpec, DiTSpec
from megatron_flops.flops.passes import PeftSpec
from megatron_flops.memory.layout import FP32_BYTES, INDEX_BYTES, NORM_STATS_BYTES

ATTENTION_CONVENTIONS = ("local", "flash")
# Megatron-Bridge's WanModel under tensor parallelism: column-parallel projections (output split over
# TP); o and ffn.2 are row-parallel (input split, output whole).
TP_COLUMN_PARALLEL = ("self_attn.q", "self_attn.k", "self_attn.v", "cross_attn.q", "cross_attn.k", "cross_attn.v",
                      "cross_attn.k_img", "cross_attn.v_img", "ffn.0")


@dataclass(frozen=True, kw_only=True)
class DiTBatch:
    """One micro-batch's clips: video, text and (image-to-video) CLIP tokens per clip."""

    video: tuple[int, ...]
    text: tuple[int, ...]
    image: tuple[int, ...] | None = None

    @classmethod
    def uniform(cls, spec: DiTSpec, *, video_tokens: int, num_clips: int) -> DiTBatch:
        """``num_clips`` clips of ``video_tokens`` tokens with WAN's padded ``text_len`` text tokens."""
        return cls(video=(video_tokens,) * num_clips, text=(spec.text_len,) * num_clips,
                   image=None if spec.image_dim is None else (spec.image_len,) * num_clips)


@dataclass(frozen=True, kw_only=True)
class DiTActivations:
    """Bytes per micro-batch: ``block`` (one block's own saved storages, by part), ``outside``
    (the embeddings', head's and loss's, by part), ``shared`` (the text/image embeddings all blocks
    save), ``kept`` (what the checkpointed blocks keep), ``recompute`` (the largest region re-run
    in backward, less the later checkpoints' freed inputs), ``total`` (the peak of saved storages),
    ``held`` (what it holds from the end of its forward until its backward starts)."""

    block: dict[str, int]
    outside: dict[str, int]
    shared: int
    kept: int
    recompute: int
    total: int
    held: int


@dataclass(frozen=True)
class _T:
    """A tensor of the walk: its storage's name, bytes, and whether it requires grad."""

    name: str
    nbytes: int
    grad: bool


class _Block:
    """One block's forward, op by op, with torch's rule of what each op saves for backward: an
    operand is saved when another operand (or the weight) needs a gradient."""

    def __init__(self, spec: DiTSpec, batch: DiTBatch, peft: DiTPeftSpec, a: int, stats: int, tp: int = 1,
                 sp: bool = False) -> None:
        self.spec, self.batch, self.peft, self.a, self.stats, self.tp = spec, batch, peft, a, stats, tp
        # Sequence parallelism: the residual stream holds this rank's 1/TP of the video tokens, and a
        # column-parallel layer all-gathers its input along the tokens: the text (CLIP) tokens, whole
        # on every rank, come out TP times over.
        self.sp = sp and tp > 1
        self.saved: dict[str, tuple[str, int]] = {}  # storage -> (part, bytes)
        self.input_grads: dict[str, bool] = {}  # module (linear or RMSNorm) -> whether its input requires grad
        self.part = ""

    def save(self, *tensors: _T) -> None:
        for t in tensors:
            self.saved.setdefault(t.name, (self.part, t.nbytes))

    def new(self, name: str, rows: int, grad: bool, width: int | None = None, size: int | None = None) -> _T:
        return _T(name, rows * (width or self.spec.hidden_size) * (size or self.a), grad)

    def linear(self, module: str, x: _T, rows: int, width: int | None = None) -> _T:
        base = not self.peft.frozen
        self.input_grads[module] = x.grad
        if base:
            self.save(x)  # the weight's gradient reads the input
        if self.peft.adapts(module):
            self.save(*self.adapter_saves(module, x, rows))
        width = width or self.spec.hidden_size
        return self.new(module, rows, x.grad or base or self.peft.adapts(module),
                        width // self.tp if module in TP_COLUMN_PARALLEL else width)

    def adapter_saves(self, module: str, x: _T, rows: int) -> tuple[_T, _T]:
        """What an adapter on ``module`` saves: linear_in's input and linear_out's [N, rank] input.
        NB: under sequence parallelism (Bridge's ``ParallelLinearAdapter`` around a
        ``TEColumnParallelLinear``) a column-parallel target's adapter all-gathers its input along
        the tokens itself and keeps that [rows, h] (its own storage); a row-parallel one's linear_in
        all-reduces its [T, rank] output over every video token, not this rank's 1/TP."""
        if self.sp and module in TP_COLUMN_PARALLEL:
            x = self.new(f"{module}.lora_in", rows, x.grad)
        elif self.sp:
            rows = sum(self.batch.video)
        return x, self.new(f"{module}.lora", rows, True, self.peft.lora_rank)

    def layer_norm(self, name: str, x: _T, rows: int, affine: bool) -> _T:
        trains = affine and not self.peft.frozen
        if x.grad or trains:
            self.save(x, _T(name + ".stats", 2 * rows * self.stats, False))
        return self.new(name, rows, x.grad or trains)

    def rms_norm(self, name: str, x: _T, rows: int) -> _T:
        # NB: torch's composite: an fp32 copy of the input (the input itself in fp32), fp32 rstd,
        # the fp32 normalised product (read by the weight's gradient), then the output in ``a``.
        # Under TP the norm spans the heads of every rank: its input all-gathered [rows, h], its output
        # split back ([rows, h/TP], a new storage).
        trains = not self.peft.frozen
        self.input_grads[name] = x.grad
        if self.tp > 1:
            x = self.new(x.name + ".gathered", rows, x.grad)
        copy = x if self.a == 4 else _T(x.name + ".f32", rows * self.spec.hidden_size * 4, x.grad)
        if x.grad:
            self.save(copy, _T(name + ".rstd", rows * 4, False))
        if trains:
            self.save(_T(name + ".normed", rows * self.spec.hidden_size * 4, True))
        return self.new(name, rows, x.grad or trains, self.spec.hidden_size // self.tp)

    def mul(self, name: str, x: _T, y: _T, rows: int) -> _T:
        if x.grad:
            self.save(y)
        if y.grad:
            self.save(x)
        return self.new(name, rows, x.grad or y.grad)

    def attention(self, name: str, q: _T, k: _T, v: _T, kv: Sequence[int], attention: str) -> _T:
        """Core attention of each clip's queries to its ``kv`` keys; returns the output [T, h/TP]."""
        T, heads, width = sum(self.batch.video), self.spec.num_heads // self.tp, self.spec.hidden_size // self.tp
        grad = q.grad or k.grad or v.grad
        if attention == "flash":  # NB: the kernel keeps q, k, v, its output and fp32 log-sum-exp
            out = self.new(name + ".out", T, grad, width)
            if grad:
                self.save(q, k, v, out, _T(name + ".lse", heads * T * 4, False))
            return out
        # The example's matmuls: q @ k^T, softmax (keeps its output), probs @ v, per clip.
        probs = _T(name + ".probs", heads * sum(s * c for s, c in zip(self.batch.video, kv)) * self.a, q.grad or k.grad)
        self.mul(name + ".scores", q, k, T)
        if probs.grad:
            self.save(probs)
        self.mul(name + ".out", probs, v, T)
        return self.new(name + ".out", T, probs.grad or v.grad, width)

    def forward(self, x: _T, e: _T, context: _T, image: _T | None, attention: str) -> _T:
        """The block's forward (``WanAttentionBlock.forward``); returns its output."""
        b, T = self.batch, sum(self.batch.video)
        L, g = (T // self.tp, self.tp) if self.sp else (T, 1)  # residual-stream tokens; text copies
        mod = self.new("mod", L, e.grad or not self.peft.frozen, 6 * self.spec.hidden_size)
        self.part = "norm"
        n1 = self.layer_norm("norm1", x, L, affine=False)
        self.part = "adaln"
        modulated = self.mul("mod1", n1, self.new("1+e1", L, mod.grad), L)
        m1 = self.new("m1", L, modulated.grad or mod.grad)
        self.part = "self_attn"
        q, k, v = (self.linear(f"self_attn.{n}", m1, T) for n in "qkv")
        out = self.attention("self", self.rms_norm("self_attn.norm_q", q, T), self.rms_norm("self_attn.norm_k", k, T),
                             v, b.video, attention)
        o = self.linear("self_attn.o", out, L)
        self.part = "adaln"
        gated = self.mul("gate1", o, mod, L)
        x1 = self.new("x1", L, x.grad or gated.grad)
        self.part = "norm"
        n3 = self.layer_norm("norm3", x1, L, affine=True)
        self.part = "cross_attn"
        q = self.rms_norm("cross_attn.norm_q", self.linear("cross_attn.q", n3, T), T)
        sources = [("text", "", context, b.text)] + ([] if image is None else [("image", "_img", image, b.image or ())])
        outs = [self.attention(name, q, self.rms_norm(f"cross_attn.norm_k{suffix}",
                                                      self.linear(f"cross_attn.k{suffix}", src, g * sum(lens)),
                                                      g * sum(lens)),
                               self.linear(f"cross_attn.v{suffix}", src, g * sum(lens)), [g * n for n in lens],
                               attention)
                for name, suffix, src, lens in sources]
        summed = outs[0] if len(outs) == 1 else self.new("cross.sum", T, any(t.grad for t in outs),
                                                         self.spec.hidden_size // self.tp)
        o = self.linear("cross_attn.o", summed, L)
        x2 = self.new("x2", L, x1.grad or o.grad)
        self.part = "norm"
        n2 = self.layer_norm("norm2", x2, L, affine=False)
        self.part = "adaln"
        modulated = self.mul("mod2", n2, self.new("1+e4", L, mod.grad), L)
        m2 = self.new("m2", L, modulated.grad or mod.grad)
        self.part = "ffn"
        f0 = self.linear("ffn.0", m2, T, self.spec.ffn_hidden_size)
        if f0.grad:
            self.save(f0)  # GELU's input
        gelu = self.new("gelu", T, f0.grad, self.spec.ffn_hidden_size // self.tp)
        f2 = self.linear("ffn.2", gelu, L)
        self.part = "adaln"
        gated = self.mul("gate2", f2, mod, L)
        return self.new("out", L, x2.grad or gated.grad)


SHARED = ("context", "image")  # storages every block reads: saved once per forward


def _walk(spec: DiTSpec, batch: DiTBatch, peft: DiTPeftSpec, a: int, stats: int, attention: str,
          x_grad: bool, tp: int = 1, sp: bool = False) -> tuple[_Block, bool]:
    """(one block's walk: its saved storages, its inputs' autograd flags; whether its output
    requires grad) for an input that does (or does not: the first block of a frozen base) require
    grad."""
    if attention not in ATTENTION_CONVENTIONS:
        raise ValueError(f"DiT attention must be one of {ATTENTION_CONVENTIONS}, got {attention!r}")
    walk = _Block(spec, batch, peft, a, stats, tp, sp)
    trains = not peft.frozen  # NB: the embeddings (patch, time, text, image) train with the base
    image = None if batch.image is None else walk.new("image", sum(batch.image), trains)
    local = sum(batch.video) // (tp if walk.sp else 1)
    out = walk.forward(walk.new("x", local, x_grad), walk.new("e", local, trains, 6 * spec.hidden_size),
                       walk.new("context", sum(batch.text), trains), image, attention)
    return walk, out.grad


def dit_block_input_grads(spec: DiTSpec, peft: PeftSpec | None, *, input_grad: bool) -> dict[str, bool]:
    """Whether each linear module's and q/k RMSNorm's input in one block requires grad (the
    walk's autograd flags; the block's input does or, the first of a frozen base, does not)."""
    batch = DiTBatch(video=(1,), text=(1,), image=None if spec.image_dim is None else (1,))
    walk, _ = _walk(spec, batch, DiTPeftSpec.of(peft), 2, NORM_STATS_BYTES, "flash", input_grad)
    return walk.input_grads


def dit_block_saved(spec: DiTSpec, batch: DiTBatch, *, act_bytes: int, attention: str = "flash",
                    peft: PeftSpec | None = None, input_grad: bool = True,
                    layer_norm_stats_bytes: int = NORM_STATS_BYTES, tp: int = 1,
                    sequence_parallel: bool = False) -> dict[str, int]:
    """One block's own saved bytes per part (see the module NB); the shared embeddings excluded."""
    walk, _ = _walk(spec, batch, DiTPeftSpec.of(peft), act_bytes, layer_norm_stats_bytes, attention, input_grad, tp,
                    sequence_parallel)
    parts: dict[str, int] = dict.fromkeys(("adaln", "norm", "self_attn", "cross_attn", "ffn"), 0)
    for name, (part, nbytes) in walk.saved.items():
        if name not in SHARED:
            parts[part] += nbytes
    return parts


def dit_outside_saved(spec: DiTSpec, batch: DiTBatch, *, act_bytes: int, trains: bool, head_grad: bool = True,
                      layer_norm_stats_bytes: int = NORM_STATS_BYTES, head_split: int = 1) -> dict[str, int]:
    """What the model saves outside its blocks, by part (see the module NB): the base ``trains``
    or is frozen; ``head_grad``: whether the last block's output needs a gradient; ``head_split``:
    the head runs on 1/``head_split`` of the video tokens (sequence parallelism: TP), the loss on all."""
    B, T, C, M = len(batch.video), sum(batch.video), sum(batch.text), sum(batch.image or ())
    H = T // head_split
    h, a, s, patch = spec.hidden_size, act_bytes, layer_norm_stats_bytes, math.prod(spec.patch_size)
    out = dict.fromkeys(("patch_embed", "time_embed", "text_embed", "image_embed", "head", "loss"), 0)
    if trains:
        out["patch_embed"] = T * spec.in_channels * patch * a  # Conv3d's input: [T, C_in * patch]
        # time_embedding.0's input [B, freq]; SiLU's input and output [B, h], twice; the repeat's index.
        out["time_embed"] = B * spec.freq_dim * a + 4 * B * h * a + T * INDEX_BYTES
        out["text_embed"] = C * spec.text_dim * a + 2 * C * h * a  # [C, text_dim]; GELU's in and out
        if spec.image_dim is not None:
            # LayerNorm(w): input and statistics; Linear(w, w)'s input; GELU's input and output;
            # LayerNorm(h): input and statistics.
            out["image_embed"] = 4 * M * spec.image_dim * a + M * h * a + 2 * 2 * M * s
    if head_grad or trains:
        # LayerNorm: the last block's output and statistics; (1 + scale), read by the norm's gradient.
        out["head"] = 2 * H * h * a + 2 * H * s
        if trains:  # the normalised x (scale's gradient), the head's input, e's repeat index
            out["head"] += 2 * H * h * a + H * INDEX_BYTES
        out["loss"] = 2 * T * spec.out_channels * patch * FP32_BYTES  # prediction and target, fp32
    return out


def _no_blocks_embeddings(spec: DiTSpec, batch: DiTBatch, a: int, *, trains: bool, last: bool) -> dict[str, int]:
    """A pipeline stage without blocks (a layout's ``E|...`` or ``...|L`` stage) computes the text,
    image and time embeddings all the same (``WanModel.forward``), but only the head reads any of
    them: the text (image) embeddings and the time projection feed nothing, so their graphs (and
    what they saved) are freed when the forward returns. The last stage keeps the time embedding's
    saves, which the head's modulation reads: its first linear's input [B, freq] and the SiLU's
    input and output [B, h]; a first stage keeps none."""
    B, h = len(batch.video), spec.hidden_size
    time = B * spec.freq_dim * a + 2 * B * h * a if trains and last else 0
    return {"time_embed": time, "text_embed": 0, "image_embed": 0}


def dit_activations(spec: DiTSpec, batch: DiTBatch, *, act_bytes: int, attention: str = "flash",
                    peft: PeftSpec | None = None, checkpointed_blocks: int = 0,
                    layer_norm_stats_bytes: int = NORM_STATS_BYTES, first: bool = True,
                    last: bool = True, tp: int = 1, sequence_parallel: bool = False,
                    checkpoint_group: int = 1, num_blocks: int | None = None) -> DiTActivations:
    """Peak saved bytes of the model and its loss for one micro-batch, the first
    ``checkpointed_blocks`` blocks checkpointed (see the module NB). ``block``: the parts of a
    block whose input needs a gradient (every block but a frozen base's first). A pipeline
    stage (``spec.num_layers`` its blocks): not ``first``, no patch embedding and an input that
    needs a gradient; not ``last``, no head and loss. ``tp``: one tensor-parallel rank's (a formula);
    ``sequence_parallel``: with the residual stream, the head and the checkpoints on 1/TP of the
    video tokens and the text (CLIP) side of cross-attention TP times over (a formula).
    ``checkpoint_group``: blocks per checkpoint (megatron-core's ``uniform`` method with
    ``recompute_num_layers`` N: each group of N keeps only its first block's input and re-runs whole).
    ``num_blocks``: the stage's blocks in place of ``spec.num_layers`` (a stage may have none)."""
    n = spec.num_layers if num_blocks is None else num_blocks
    if not 0 <= checkpointed_blocks <= n:
        raise ValueError(f"checkpointing {checkpointed_blocks} of {n} blocks")
    peft = DiTPeftSpec.of(peft)
    walks = {g: _walk(spec, batch, peft, act_bytes, layer_norm_stats_bytes, attention, g, tp, sequence_parallel)
             for g in (False, True)}
    # the patch embedding's output needs a grad if it trains; a received activation always does
    x_grad, blocks = not (peft.frozen and first), []
    for _ in range(n):
        walk, out_grad = walks[x_grad]
        blocks.append(walk.saved)
        x_grad = out_grad
    split = tp if sequence_parallel else 1
    T, h, a = sum(batch.video) // split, spec.hidden_size, act_bytes  # the residual stream's tokens
    sources = {"context": sum(batch.text) * h * a, "image": sum(batch.image or ()) * h * a}
    own = [sum(n for k, (_, n) in b.items() if k not in SHARED) for b in blocks]
    shared_names = {k for b in blocks[checkpointed_blocks:] for k in b if k in SHARED}
    kept = recompute = 0
    if checkpointed_blocks:
        # The checkpoints keep their inputs: each group's hidden states, and once the per-token
        # modulation input and the text/image embeddings; backward re-runs one group at a time, the
        # last first: group g re-runs while groups 0..g still keep their inputs (later ones freed).
        shared_names |= set(SHARED)
        starts = range(0, checkpointed_blocks, checkpoint_group)
        kept = len(starts) * T * h * a + 6 * T * h * a
        recompute = max(sum(own[i:min(i + checkpoint_group, checkpointed_blocks)])
                        - (T * h * a if "x" in blocks[i] else 0) - (len(starts) - 1 - g) * T * h * a
                        for g, i in enumerate(starts))
    shared = sum(sources[k] for k in shared_names)
    parts = dit_block_saved(spec, batch, act_bytes=a, attention=attention, peft=peft, input_grad=True,
                            layer_norm_stats_bytes=layer_norm_stats_bytes, tp=tp, sequence_parallel=sequence_parallel)
    outside = dit_outside_saved(spec, batch, act_bytes=a, trains=not peft.frozen, head_grad=x_grad,
                                layer_norm_stats_bytes=layer_norm_stats_bytes, head_split=split)
    outside.update({"patch_embed": outside["patch_embed"] * first, "head": outside["head"] * last,
                    "loss": outside["loss"] * last})
    if not n:
        outside.update(_no_blocks_embeddings(spec, batch, a, trains=not peft.frozen, last=last))
    # Backward frees the head's and loss's saves, then the later blocks', before a checkpoint re-runs.
    embeddings = sum(outside.values()) - outside["head"] - outside["loss"]
    after = sum(own[checkpointed_blocks:]) + outside["head"] + outside["loss"]
    total = embeddings + shared + kept + max(after, recompute)
    return DiTActivations(block=parts, outside=outside, shared=shared, kept=kept, recompute=recompute, total=total,
                          held=embeddings + shared + kept + after)
