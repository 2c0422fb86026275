"""Kimi Delta Attention as GPU training runs it: transformers calls fla's ``chunk_kda`` and
causal-conv1d's ``causal_conv1d_fn`` when those packages are installed (before its torch path),
and keeps its own torch forget gate and gated output norm (hub kernels are not used unless
requested). Neither kernel runs on CPU: the figure is a formula read from their source, printed
under ``unmeasured`` beside the report's KDA figure, which follows the torch path (measured:
:func:`.ssm.kda_saved`). Stdlib only."""

from __future__ import annotations

from megatron_flops.memory.layout import FP32_BYTES, Training
from megatron_flops.memory.ssm import kda_saved
from megatron_flops.model.spec import ModelSpec

FLA_KDA_CHUNK = 64  # chunk_kda's default chunk_size: Aqk and Akk are [T, heads, 64]


def kda_fla_saved(spec: ModelSpec, *, s: int, b: int, act: int) -> int:
    """Bytes one KDA mixer keeps for backward beside its input, with fla and causal-conv1d:

    - causal-conv1d's ``CausalConv1dFn``: its input, q, k, v concatenated [b, 3 dim, s] (a
      transposed view: no copy), not its output (SiLU is re-run in backward);
    - the torch forget gate, ``beta`` and the ``f_a_proj``/``g_a_proj`` outputs as on the torch path
      (fp32 ``exp`` output, ``1 + exp``, the softplus [T, dim], the bool mask, ``exp(A_log)`` and
      its negation [H]; [T, d] x 2 and [T, H] in the activation dtype);
    - ``ChunkKDAFunction`` (fla, ``disable_recompute`` False, gate not in the kernel): the
      L2-normalised q and k [T, dim] and their fp32 rstd [T, H], v made contiguous [T, dim], the
      fp32 chunk-cumulated gate and the gate it was handed (fp32 [T, dim] each), ``beta`` (the
      sigmoid's output, counted above), ``Aqk`` and ``Akk`` [T, H, 64] in the activation dtype;
    - the gated output norm and ``o_proj``'s input as on the torch path.
    """
    k = spec.kda
    assert k is not None
    heads, d, f, t = k.num_heads, k.head_dim, FP32_BYTES, s * b
    dim = heads * d
    conv = b * 3 * dim * s * act
    gates = 2 * t * d * act + t * heads * act + 2 * heads * f + t * dim * (3 * f + 1)
    chunk = 3 * t * dim * act + 2 * t * heads * f + 2 * t * dim * f + 2 * t * heads * FLA_KDA_CHUNK * act
    out = t * dim * (4 * f + act) + t * heads * f + (d * f if act < f else 0)
    return conv + gates + chunk + out


def kda_fla_unmeasured(spec: ModelSpec, training: Training) -> tuple[str, ...]:
    """The fla figure, per KDA layer and micro-batch, beside the torch path's that the report counts."""
    if not any(m == "kda" for (m, _), _ in spec.layer_runs):
        return ()
    s, b, act = training.seq_length, training.micro_batch_size, training.param_bytes
    fla, torch = kda_fla_saved(spec, s=s, b=b, act=act), kda_saved(spec, s=s, b=b, act=act)
    return (f"Kimi Delta Attention with fla's chunk_kda and causal-conv1d installed (what GPU training runs; "
            f"transformers calls them before its torch path): {fla:,} bytes per KDA layer and micro-batch beside its "
            f"input, in place of the torch path's {torch:,} that the figures count; a formula from fla's "
            f"ChunkKDAFunction and causal-conv1d's saved tensors (neither runs on CPU)",)
