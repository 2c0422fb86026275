"""States and traffic per GPU of a megatron-core GPT under Megatron-FSDP (Megatron-LM's
``--use-megatron-fsdp``, megatron-core 0.16.1's ``distributed/fsdp``), by sharding strategy
(stdlib only).

NB: as megatron-core 0.16.1's ``ParamAndGradBuffer`` allocates and ``MegatronFSDP`` communicates
(measured on CPU with gloo, its CUDA streams stubbed: tests/test_memory_megatron_fsdp.py):

- parameter groups (``_get_parameter_groups``): parameters with the same expert-ness (``.experts.``
  in the name), ``requires_grad`` and FSDP unit (``optim_grads_params``: each ``TransformerLayer``;
  otherwise none) share a group wherever they sit; a group outside units is cut into buckets of
  the DDP bucket size, the shared embedding/output weight of a pipeline alone; each bucket gets a
  ``chunk_size_factor`` (the lcm of the row sizes it needs: :func:`chunk_size_factor`);
- each bucket's layout (``build_data_parallel_buffer_index``): parameters in order of decreasing
  row size, each starting on a chunk boundary unless its remainder fits beside another's, small
  ones in the gaps; the bucket padded to a multiple of ``DP x chunk_size_factor``, each rank
  owning ``1 / DP`` of it (expert buckets: over the expert DP group);
- buffers per bucket: model weights (params dtype), main weights (fp32, ``preserve_fp32_weights``,
  for trainable buckets, even of fp32 models), main gradients (fp32 with ``grad_reduce_in_fp32``);
  ``optim`` shards the main weights, ``optim_grads`` also the gradients, ``optim_grads_params``
  also the model weights; optimizer moments over the real elements of this rank's shard;
- collectives: see :func:`megatron_fsdp_rank`.

A frozen base (``requires_grad=False`` parameters: LoRA on a frozen model) follows megatron-core
0.19.2 (Megatron-Bridge 0.6.2's): 0.16.1's ``MegatronFSDP`` registers a gradient hook on every
parameter and raises on a frozen one. As 0.19.2 runs it (measured on CPU with gloo:
tests/test_memory_megatron_fsdp_frozen.py): frozen parameters in groups of their own, bucketed and
sharded as above but with no gradient or main-weight buffer and no optimizer state; main gradients
in the parameters' dtype (``--megatron-fsdp-main-grads-dtype auto``, its default); the trainable
buckets reduce-scattered every micro-batch; every bucket, frozen ones too, all-gathered once after
the optimizer step, and under ``optim_grads_params`` each ``TransformerLayer``'s (its frozen and its
adapter bucket) in every forward and again after every micro-batch's backward but the last, the
chunk's last layer not (it stays gathered): ``2m`` gathers per layer, ``m + 1`` for the last.
``optim`` fails at 0.19.2's first ``finish_grad_sync`` (``reduce_scatter_gradients`` reads the
gradient buffer a frozen group lacks): refused.

``no_shard`` (Megatron-LM's default strategy) is refused: megatron-core 0.16.1 fails at its first
optimizer step. ``megatron_fsdp/unsharded_working_copies`` (the gathered units and unsharded
gradient buckets alive at once) is a formula: gloo on CPU runs each collective to completion.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from megatron_flops.flops.passes import PeftSpec
from megatron_flops.memory.decoder import DecoderOptions, Param, chunk_parameters
from megatron_flops.memory.dp_ranks import Step, most_loaded_rank, span_steps
from megatron_flops.memory.fsdp_transients import unsharded_working_copies
from megatron_flops.memory.layout import FP32_BYTES, FSDP_STRATEGIES as STRATEGIES, Parallelism, Training
from megatron_flops.memory.states import optimizer_keys
from megatron_flops.model.spec import ModelSpec

_UNIT = re.compile(r"^(decoder\.layers\.\d+\.|mtp\.layers\.\d+\.(?:transformer_layer|mtp_model_layer\.layers\.\d+)\.)")


@dataclass(frozen=True)
class FsdpBucket:
    """One Megatron-FSDP parameter group after bucketing: its parameters (in buffer order), the
    group it reduces over (``dp`` or ``expt_dp``), whether they train, their FSDP unit."""

    params: tuple[Param, ...]
    group: str
    trainable: bool
    unit: str | None
    chunk: int


def _row(p: Param) -> int:
    return p.numel // (p.rows or p.numel) if p.rows else 1


def chunk_size_factor(params: Sequence[Param]) -> tuple[tuple[Param, ...], int]:
    """Step 3 of ``_get_parameter_groups``: the parameters by decreasing row size and the chunk
    size factor, grown to the lcm with each row size the current factor does not fit."""
    ordered = sorted(params, key=_row, reverse=True)  # (stable, as Python's sorted)
    chunk = _row(ordered[0])
    for p in ordered:
        row = _row(p)
        if not (row == chunk or (chunk % row == 0 and p.numel % chunk == 0) or p.numel < chunk):
            chunk = math.lcm(chunk, row)
    return tuple(ordered), chunk


def fsdp_buckets(params: Sequence[Param], *, strategy: str, bucket_size: int | None,
                 unit: re.Pattern[str] = _UNIT) -> list[FsdpBucket]:
    """The buckets of one model chunk (``params`` in ``named_parameters()`` order); ``unit``
    matches the name prefix of an FSDP unit's parameters (a GPT's ``TransformerLayer``)."""
    groups: dict[tuple[bool, bool, str | None], list[Param]] = {}
    for p in params:
        match = unit.match(p.name) if strategy == "optim_grads_params" else None
        groups.setdefault((".experts." in p.name, p.trainable, match.group(1) if match else None), []).append(p)
    out = []
    for (expert, trainable, unit_name), members in groups.items():
        cut: list[list[Param]] = [[]]
        for p in members:
            if p.shared_embedding:  # (a bucket of its own)
                cut += [[p], []]
                continue
            cut[-1].append(p)
            if unit_name is None and bucket_size and sum(q.numel for q in cut[-1]) >= bucket_size:
                cut.append([])
        for bucket in (b for b in cut if b):
            ordered, chunk = chunk_size_factor(bucket)
            out.append(FsdpBucket(ordered, "expt_dp" if expert else "dp", trainable, unit_name, chunk))
    return out


def bucket_layout(bucket: FsdpBucket, dp: int) -> tuple[int, list[tuple[int, int]]]:
    """``build_data_parallel_buffer_index``: the bucket's size, padding included, and each
    parameter's ``[start, end)`` in it (in ``bucket.params`` order)."""
    chunk = bucket.chunk
    numel = [p.numel for p in bucket.params]
    regular = [i for i, n in enumerate(numel) if n >= chunk]
    fragments = [i for i, n in enumerate(numel) if n < chunk]
    starts: dict[int, int] = {}
    index = 0
    while regular:
        i = regular.pop(0)
        starts[i] = index
        if numel[i] % chunk == 0:
            index += numel[i]
            continue
        gap = index + numel[i]
        index += (numel[i] // chunk + 1) * chunk
        remain = numel[i] % chunk
        space = chunk - remain
        partner = next((j for j in regular if numel[j] % chunk and remain + numel[j] % chunk <= chunk), None)
        if partner is not None:  # (its remainder ends where this one's chunk ends)
            regular.remove(partner)
            starts[partner] = index - numel[partner] % chunk
            space -= numel[partner] % chunk
            index += numel[partner] // chunk * chunk
        for j in list(fragments):  # small parameters into the gap after this one
            if numel[j] <= space:
                starts[j] = gap
                space -= numel[j]
                gap += numel[j]
                fragments.remove(j)
    for j in fragments:
        starts[j] = index
        index += numel[j]
    size = -(-index // (dp * chunk)) * dp * chunk
    return size, [(starts[i], starts[i] + numel[i]) for i in range(len(numel))]


def _all_gathers(bucket: FsdpBucket, *, m: int, last: bool, frozen: bool) -> int:
    """Times per step of ``m`` micro-batches a bucket's weights are all-gathered: once after the
    optimizer step, and a TransformerLayer ``unit``'s (optim_grads_params) also in every forward
    and after every backward but the last (2m); with a frozen base (0.19.2) the chunk's ``last``
    layer stays gathered into backward (m + 1)."""
    if bucket.unit is None:
        return 1
    return m + 1 if frozen and last else 2 * m


def megatron_fsdp_rank(params: Sequence[Param], training: Training, *, strategy: str, sizes: dict[str, int],
                       ranks: dict[str, int], bucket_size: int | None,
                       unit: re.Pattern[str] = _UNIT) -> tuple[dict[str, int], dict[str, int]]:
    """(state bytes, step payload per ``group/kind``) of one model chunk on the rank with
    data-parallel ranks ``ranks`` (``dp``, ``expt_dp``) in groups of ``sizes`` (see the module NB).
    ``bucket_size``: the DDP bucket size (None: ``overlap_grad_reduce`` off); ``unit``: as
    :func:`fsdp_buckets`."""
    if strategy not in STRATEGIES[1:]:
        raise ValueError(f"Megatron-FSDP is modelled with {', '.join(STRATEGIES[1:])}, not {strategy!r}: "
                         "megatron-core 0.16.1's no_shard fails at the first optimizer step (start_param_sync "
                         "all-gathers a model-weight buffer no_shard does not allocate)")
    frozen = any(not p.trainable for p in params)
    if frozen and strategy == "optim":
        raise ValueError("Megatron-FSDP's optim strategy cannot train a frozen base: megatron-core 0.16.1 cannot "
                         "wrap a frozen parameter (a gradient hook on each) and 0.19.2 fails at its first "
                         "finish_grad_sync (reduce_scatter_gradients reads the gradient buffer a frozen group lacks); "
                         "use optim_grads or optim_grads_params")
    shard_w, shard_g = strategy == "optim_grads_params", strategy != "optim"
    a, m = training.param_bytes, training.num_microbatches
    g = a if frozen else training.grad_bytes  # (0.19.2: main gradients in the params dtype by default)
    states = dict.fromkeys(("weights", "gradients", "optimizer/main_params", *optimizer_keys(training)), 0)
    moments = [k for k in states if k.startswith("optimizer/") and k != "optimizer/main_params"]
    comm: dict[str, int] = {}
    gathered: list[int] = []
    grads: list[int] = []
    buckets = fsdp_buckets(params, strategy=strategy, bucket_size=bucket_size, unit=unit)
    last_unit = [b.unit for b in buckets if b.unit is not None][-1:]
    for bucket in buckets:
        n, rank = sizes[bucket.group], ranks[bucket.group]
        size, spans = bucket_layout(bucket, n)
        part = size // n
        states["weights"] += (part if shard_w else size) * a
        gathered.append(size * a if shard_w and n > 1 else 0)
        if not bucket.trainable:
            grads.append(0)
            if n > 1:  # (0.19.2: gathered as the trainable buckets are)
                ag = _all_gathers(bucket, m=m, last=[bucket.unit] == last_unit, frozen=True)
                comm[f"{bucket.group}/all_gather"] = comm.get(f"{bucket.group}/all_gather", 0) + ag * size * a
            continue
        # NB: fp32 main weights for every trainable bucket (preserve_fp32_weights), even of fp32 models.
        states["optimizer/main_params"] += part * FP32_BYTES
        states["gradients"] += (part if shard_g else size) * g
        grads.append(size * g if shard_g and n > 1 else 0)
        real = sum(max(0, min((rank + 1) * part, end) - max(rank * part, start)) for start, end in spans)
        for key in moments:
            states[key] += real * FP32_BYTES
        if n > 1:
            # Gradients: optim reduce-scatters in the last micro-batch's backward and, without
            # overlap_grad_reduce, again in finish_grad_sync; optim_grads(_params) every backward.
            rs = (1 if bucket_size else 2) if strategy == "optim" else m
            ag = _all_gathers(bucket, m=m, last=[bucket.unit] == last_unit, frozen=frozen)
            for kind, value in (("reduce_scatter", rs * size * g), ("all_gather", ag * size * a)):
                comm[f"{bucket.group}/{kind}"] = comm.get(f"{bucket.group}/{kind}", 0) + value
    states["megatron_fsdp/unsharded_working_copies"] = unsharded_working_copies(gathered, grads)
    return {k: v for k, v in states.items() if v or k in ("weights", "gradients")}, comm


def megatron_fsdp_stage(spec: ModelSpec, options: DecoderOptions, par: Parallelism, training: Training, *,
                        pp_rank: int, peft: PeftSpec | None) -> tuple[dict[str, int], dict[str, int]]:
    """(states, ``dp``/``expt_dp`` payloads) of pipeline rank ``pp_rank``'s most loaded
    data-parallel rank (the lowest on a tie): one Megatron-FSDP wrapper per model chunk (bucketed:
    chunk 0 only)."""
    assert par.megatron_fsdp is not None
    strategy, sizes = par.megatron_fsdp, {"dp": par.dp * par.cp, "expt_dp": par.expert_dp}
    chunks = [(chunk_parameters(spec, options, par, pp_rank=pp_rank, chunk=chunk, seq_length=training.seq_length,
                                peft=peft), training.bucket_size if chunk == 0 else None)
              for chunk in range(par.num_chunks)]
    steps: dict[str, list[Step]] = {"dp": [], "expt_dp": []}
    for params, bucket_size in chunks:
        for group, found in shard_steps(params, strategy=strategy, sizes=sizes, bucket_size=bucket_size).items():
            steps[group] += found
    dp_rank = most_loaded_rank(steps["dp"], ranks=sizes["dp"], expert=steps["expt_dp"], expert_rank=par.expert_dp_rank)
    states: dict[str, int] = {}
    comm: dict[str, int] = {}
    for params, bucket_size in chunks:
        more = megatron_fsdp_rank(params, training, strategy=strategy, sizes=sizes,
                                  ranks={"dp": dp_rank, "expt_dp": par.expert_dp_rank(dp_rank)},
                                  bucket_size=bucket_size)
        for into, extra in zip((states, comm), more):
            for key, value in extra.items():
                into[key] = into.get(key, 0) + value
    return states, comm


def shard_steps(params: Sequence[Param], *, strategy: str, sizes: dict[str, int], bucket_size: int | None,
                unit: re.Pattern[str] = _UNIT) -> dict[str, list[Step]]:
    """Per group (``dp``, ``expt_dp``), the steps over the rank of the real trainable elements in
    each rank's shards of one model chunk's buckets: what its optimizer moments cover."""
    out: dict[str, list[Step]] = {"dp": [], "expt_dp": []}
    for bucket in fsdp_buckets(params, strategy=strategy, bucket_size=bucket_size, unit=unit):
        if bucket.trainable:
            size, spans = bucket_layout(bucket, sizes[bucket.group])
            out[bucket.group] += span_steps(spans, origin=0, part=size // sizes[bucket.group])
    return out


def megatron_fsdp_notes(par: Parallelism, peft: PeftSpec | None = None) -> tuple[list[str], list[str]]:
    """(assumptions, unmeasured) that Megatron-FSDP adds to a decoder's report."""
    assumptions = [f"Megatron-FSDP (--use-megatron-fsdp, --data-parallel-sharding-strategy {par.megatron_fsdp}) as "
                   "megatron-core 0.16.1 allocates it: fp32 main weights (preserve_fp32_weights), no FSDP double "
                   "buffer, no hybrid (outer) sharding, no FP8; activations as without it"]
    if peft is not None and peft.frozen:
        assumptions.append("Megatron-FSDP with a frozen base as megatron-core 0.19.2 (Megatron-Bridge 0.6.2's) runs it "
                           "(0.16.1 cannot train this layout: a gradient hook on every parameter): frozen parameters "
                           "in buckets of their own, sharded, without gradients, main weights or optimizer state; "
                           "main gradients and their reduce-scatter in the params dtype (--megatron-fsdp-main-grads-"
                           "dtype auto); the frozen buckets all-gathered as the trainable ones")
    unmeasured = ["megatron_fsdp/unsharded_working_copies: two neighbouring buckets' gathered weights and one "
                  "unsharded gradient bucket alive at once (gloo on CPU runs each collective to completion, so "
                  "the CUDA-stream overlap cannot be measured here)"]
    other = [f"{name} {size}" for name, size in (("TP", par.tp), ("PP", par.pp), ("EP", par.ep), ("CP", par.cp))
             if size > 1]
    if other:
        unmeasured.append(f"Megatron-FSDP with {', '.join(other)}: its buffers and dp/expt_dp collectives as over "
                          "data parallelism alone (measured: DP only), the other groups' traffic as without it")
    return assumptions, unmeasured
