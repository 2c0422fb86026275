"""Parallel layout and training settings that memory and traffic depend on (stdlib only).

Sizes follow megatron-core's ``initialize_model_parallel``: world = TP x PP x CP x DP; the
experts have their own grid over each pipeline stage's TP x CP x DP ranks: expert tensor
parallelism (ETP, TP unless given) x expert parallelism (EP) x expert data parallelism, so the
expert data-parallel size is ``TP x CP x DP / (ETP x EP)`` (``DP x CP / EP`` with ETP = TP).
Pipeline stages hold ``num_layers / (PP x VPP)`` layers per model chunk (or ``stage_layers``: a
hybrid pattern's ``|`` segments); virtual stage ``v x PP + r`` is chunk ``v`` of pipeline rank ``r``.
"""

from __future__ import annotations

from dataclasses import dataclass

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
FP32_BYTES = DTYPE_BYTES["fp32"]
NORM_STATS_BYTES = FP32_BYTES  # a norm's mean/rstd per token, in fp32 as CUDA kernels keep them
INDEX_BYTES = 8  # int64 token ids, positions, targets, top-k and gather indices
BOOL_BYTES = 1  # torch.bool masks and flags
OPTIMIZERS = ("adam", "sgd")
# Megatron-FSDP's data_parallel_sharding_strategy values, from nothing sharded to everything.
FSDP_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class Parallelism:
    """Parallel sizes. ``vpp`` is the number of model chunks per pipeline rank (None: no
    interleaving); ``distributed_optimizer`` shards optimizer state over DP (megatron-core's
    ``DistributedOptimizer``); ``fsdp`` shards parameters, gradients and optimizer state over DP
    (torch FSDP2, DiT models); ``megatron_fsdp`` Megatron-FSDP's sharding strategy (None: not
    Megatron-FSDP); ``etp`` the routed experts' tensor-parallel size (None: TP); ``stage_layers``:
    the decoder layers of each virtual stage in the order ``v x PP + r`` (a hybrid pattern's ``|``
    segments; None: an even split); ``mtp_stage``: the virtual stage of the MTP layers when a layout
    puts them apart from the loss's (megatron-core's ``mtp_standalone``; None: the last stage's)."""

    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    cp: int = 1
    ep: int = 1
    dp: int = 1
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    fsdp: bool = False
    etp: int | None = None
    megatron_fsdp: str | None = None
    stage_layers: tuple[int, ...] | None = None
    mtp_stage: int | None = None

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "cp", "ep", "dp"):
            _positive(f"--{name}", getattr(self, name))
        if self.vpp is not None:
            _positive("--vpp", self.vpp)
            if self.pp == 1:
                raise ValueError("--vpp needs --pp > 1 (interleaving splits each pipeline rank's layers)")
        if self.distributed_optimizer and self.fsdp:
            raise ValueError("--distributed-optimizer and --fsdp are two ways to shard over DP: choose one")
        if self.megatron_fsdp is not None:
            if self.megatron_fsdp not in FSDP_STRATEGIES:
                raise ValueError(f"--megatron-fsdp takes one of {FSDP_STRATEGIES}, got {self.megatron_fsdp!r}")
            if self.distributed_optimizer or self.fsdp:
                raise ValueError("Megatron-FSDP shards over DP itself: not with --distributed-optimizer or --fsdp")
        if self.etp is not None:
            _positive("--etp", self.etp)
        if (self.tp * self.dp * self.cp) % (self.expert_tp * self.ep):
            what = "DP x CP" if self.expert_tp == self.tp else "TP x DP x CP"
            size = self.dp * self.cp if self.expert_tp == self.tp else self.tp * self.dp * self.cp
            raise ValueError(f"--ep {self.ep}" + (f" x --etp {self.expert_tp}" if self.expert_tp != self.tp else "")
                             + f" does not divide {what} = {size}")
        if self.stage_layers is not None and len(self.stage_layers) != self.pp * self.num_chunks:
            raise ValueError(f"{len(self.stage_layers)} pipeline segments for PP x VPP = {self.pp * self.num_chunks} "
                             "virtual stages")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def num_chunks(self) -> int:
        return self.vpp or 1

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def expert_dp(self) -> int:
        return self.tp * self.dp * self.cp // (self.expert_tp * self.ep)

    def expert_dp_rank(self, dp_rank: int) -> int:
        """The expert data-parallel rank of TP rank 0 of data-parallel rank ``dp_rank`` (megatron's
        expert grid orders ETP, then EP, then expert DP)."""
        return dp_rank * self.tp // (self.expert_tp * self.ep)

    def chunk_layers(self, num_layers: int, pp_rank: int, chunk: int) -> range:
        """Decoder layers of model chunk ``chunk`` on pipeline rank ``pp_rank``."""
        stage = chunk * self.pp + pp_rank
        if self.stage_layers is not None:
            first = sum(self.stage_layers[:stage])
            return range(first, first + self.stage_layers[stage])
        per_chunk = num_layers // (self.pp * self.num_chunks)
        return range(stage * per_chunk, (stage + 1) * per_chunk)

    def is_first_stage(self, pp_rank: int, chunk: int) -> bool:
        return pp_rank == 0 and chunk == 0

    def holds_frozen_first_layer(self, num_layers: int, pp_rank: int) -> bool:
        """Whether pipeline rank ``pp_rank`` runs decoder layer 0 after the embedding on the first
        virtual stage: of a frozen model, the one layer whose input requires no grad. Where a layout
        leaves the first stage no layer, layer 0's input is received from it and requires grad
        (megatron-core skips a stage's backward whose output needs none): no layer is frozen-input."""
        return pp_rank == 0 and len(self.chunk_layers(num_layers, 0, 0)) > 0

    def is_last_stage(self, pp_rank: int, chunk: int) -> bool:
        return pp_rank == self.pp - 1 and chunk == self.num_chunks - 1

    def holds_mtp(self, pp_rank: int, chunk: int) -> bool:
        """Whether this model chunk builds the MTP layers (and an embedding copy for them)."""
        if self.mtp_stage is None:
            return self.is_last_stage(pp_rank, chunk)
        return chunk * self.pp + pp_rank == self.mtp_stage

    def sends_mtp(self, pp_rank: int, chunk: int) -> bool:
        """Whether this model chunk's forward output carries the MTP layers' hidden states too,
        ``[(1 + k) s, b, h]`` (a standalone MTP stage and the stages after it)."""
        return self.mtp_stage is not None and chunk * self.pp + pp_rank >= self.mtp_stage

    def holds_final_norm(self, num_layers: int, pp_rank: int, chunk: int, *, mtp: bool) -> bool:
        """Whether this model chunk builds the decoder's final norm (megatron-core's
        ``has_final_layernorm_in_this_stage``): the last stage, or with MTP layers the stage of the
        last decoder layer (a layout can leave the last stage none); ``mtp`` False for a hybrid
        stack, whose final norm is always the last stage's."""
        if not mtp:
            return self.is_last_stage(pp_rank, chunk)
        return num_layers - 1 in self.chunk_layers(num_layers, pp_rank, chunk)


@dataclass(frozen=True, kw_only=True)
class Training:
    """What one training step runs: ``num_microbatches`` micro-batches of ``micro_batch_size``
    sequences of ``seq_length`` tokens per data-parallel rank, ``params_dtype`` weights (bf16 and
    fp16 keep fp32 main copies in the optimizer), gradients reduced in fp32 when
    ``grad_reduce_in_fp32`` (Megatron-LM's default for bf16), ``optimizer`` Adam or SGD with
    momentum. ``bucket_size``: megatron-core DDP's bucket size in parameters (None: one bucket
    per buffer, as when ``overlap_grad_reduce`` is off)."""

    seq_length: int
    micro_batch_size: int
    num_microbatches: int = 1
    params_dtype: str = "bf16"
    grad_reduce_in_fp32: bool = True
    optimizer: str = "adam"
    bucket_size: int | None = None

    def __post_init__(self) -> None:
        for name in ("seq_length", "micro_batch_size", "num_microbatches"):
            _positive(f"--{name.replace('_', '-')}", getattr(self, name))
        if self.params_dtype not in DTYPE_BYTES:
            raise ValueError(f"--params-dtype must be one of {sorted(DTYPE_BYTES)}, got {self.params_dtype!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"--optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if self.bucket_size is not None:
            _positive("bucket size", self.bucket_size)

    @property
    def param_bytes(self) -> int:
        return DTYPE_BYTES[self.params_dtype]

    @property
    def grad_bytes(self) -> int:
        # NB: megatron-core DDP accumulates and reduces gradients in fp32 with grad_reduce_in_fp32.
        return 4 if self.grad_reduce_in_fp32 else self.param_bytes

    @property
    def needs_main_params(self) -> bool:
        # NB: 16-bit weights train through fp32 main copies; fp32 weights are their own main copy.
        return self.param_bytes < 4
