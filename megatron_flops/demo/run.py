"""``megatron-flops demo``: train a megatron-core GPT on CPU and print static vs corrected throughput.

The training loop is megatron-core's own: ``get_forward_backward_func()`` (no pipelining, 1F1B,
or interleaved 1F1B), megatron ``DistributedDataParallel`` over gloo, and a ``forward_step``
that calls ``megatron_flops.reporting.session.record(...)`` once, exactly as a user's loop would. Every rank
installs the accounting session and brackets each step with ``begin_step()``/``end_step()``;
the last pipeline stage of data-parallel rank 0 prints Megatron-style lines from its reports.

megatron-core is imported lazily, inside :func:`train`, and runs under
:func:`~megatron_flops.demo.cpu_shim.cpu_shim`.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from megatron_flops.demo.data import DataConfig, MicroBatch, microbatches
from megatron_flops.flops.formulas import ATTENTION_CONVENTIONS
from megatron_flops.reporting.meter import format_log_line, format_summary
from megatron_flops.reporting.peaks import resolve_peak
from megatron_flops.tracking.result import StepResult
from megatron_flops.reporting.session import Session, install_session, record, uninstall_session
from megatron_flops.model.spec import ModelSpec
from megatron_flops.tracking.tracker import FlopsTracker

if TYPE_CHECKING:
    from megatron.core.distributed import DistributedDataParallel

# TransformerConfig fields of the demo model (Llama-like: GQA, SwiGLU, RMSNorm, RoPE, untied).
MODEL_FIELDS: dict[str, Any] = dict(
    num_layers=4,
    hidden_size=128,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=352,
    gated_linear_unit=True,
    normalization="RMSNorm",
)
VOCAB_SIZE = 1024
LEARNING_RATE = 3e-3
GLOO_TIMEOUT_S = 60
SPAWN_TIMEOUT_S = 300
FAILURE_GRACE_S = 5


@dataclass(frozen=True, kw_only=True)
class DemoOptions:
    """The demo's layout and run length. ``dp`` None: 2 with ``pp > 1``, else 1. ``trace``: a file
    the per-step trace is appended to (``megatron_flops.reporting.trace``)."""

    pp: int = 1
    vpp: int | None = None
    dp: int | None = None
    iterations: int = 12
    num_microbatches: int = 4
    log_interval: int = 1
    warmup: int = 2
    peak_tflops: float | None = None
    seed: int = 0
    attention: str = "causal"
    data: DataConfig = field(default_factory=DataConfig)
    trace: str | None = None

    def __post_init__(self) -> None:
        for name in ("pp", "iterations", "num_microbatches", "log_interval"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.dp is not None and self.dp < 1:
            raise ValueError(f"dp must be >= 1, got {self.dp}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if self.vpp is not None:
            if self.vpp < 2 or self.pp < 2:
                raise ValueError(f"vpp needs pp >= 2 and vpp >= 2, got pp={self.pp} vpp={self.vpp}")
            if self.num_microbatches % self.pp:
                raise ValueError(f"interleaving needs micro-batches ({self.num_microbatches}) divisible by pp ({self.pp})")
        num_layers, stages = MODEL_FIELDS["num_layers"], self.pp * (self.vpp or 1)
        if num_layers % stages:
            raise ValueError(f"pp x vpp = {stages} must divide the model's {num_layers} layers")
        if self.attention not in ATTENTION_CONVENTIONS:
            raise ValueError(f"attention must be one of {ATTENTION_CONVENTIONS}, got {self.attention!r}")
        if self.peak_tflops is not None:
            resolve_peak(None, "bf16", self.peak_tflops)  # validates the value

    @property
    def data_parallel_size(self) -> int:
        return self.dp if self.dp is not None else (2 if self.pp > 1 else 1)

    @property
    def world_size(self) -> int:
        return self.pp * self.data_parallel_size


@dataclass(frozen=True, kw_only=True)
class DemoRun:
    """What one rank saw: the model spec and every step's global result."""

    spec: ModelSpec
    results: tuple[StepResult, ...]


def main(options: DemoOptions) -> int:
    """Run the demo in this process (one rank) or in ``world_size`` spawned local processes."""
    if options.world_size == 1:
        train(options)
        return 0
    return _spawn(options)


def train(
    options: DemoOptions,
    *,
    rank: int = 0,
    init_method: str | None = None,
    out: Callable[[str], None] | None = None,
) -> DemoRun:
    """One rank of the demo. With a world of one, an existing world-size-1 process group is reused."""
    out = out or _print
    with warnings.catch_warnings():
        # Import-time notices about Transformer Engine and Apex, which a CPU run never uses.
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state as ps
        from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_flops.demo.cpu_shim import cpu_shim

    with _one_thread(), cpu_shim(), _process_group(rank, options.world_size, init_method), _model_parallel(options):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Apex/TE fallbacks and deprecated defaults
            chunks, config = _build_model(options)
        spec = ModelSpec.from_transformer_config(
            config, vocab_size=VOCAB_SIZE, share_embeddings_and_output_weights=False
        )
        tracker = FlopsTracker(spec, attention=options.attention, seq_length=options.data.seq_length)
        dp_rank = ps.get_data_parallel_rank()
        is_last_stage = ps.is_pipeline_last_stage(ignore_virtual=True)
        printing = is_last_stage and dp_rank == 0

        def forward_step(data_iterator: Iterator[MicroBatch], model: torch.nn.Module) -> tuple[torch.Tensor, Callable]:
            batch = next(data_iterator)
            record(model=model, tokens=batch.tokens, cu_seqlens=batch.cu_seqlens, seq_lengths=batch.seq_lengths)
            output = model(batch.tokens, batch.position_ids, batch.attention_mask, labels=batch.labels)
            return output, partial(_loss, batch.loss_mask)

        # Every chunk of a rank reads the same stream, one micro-batch per forward_step call.
        streams = [microbatches(options.data, seed=options.seed, dp_rank=dp_rank) for _ in chunks]
        optimizer = torch.optim.Adam([p for chunk in chunks for p in chunk.parameters()], lr=LEARNING_RATE)
        peak = resolve_peak(None, "bf16", options.peak_tflops)
        if printing:
            out(_header(options, peak))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a missing peak is reported once, in the header
            session = install_session(tracker, peak_flops_per_s=peak, warmup_iterations=options.warmup,
                                      world_size=options.world_size, trace=options.trace, framework="demo",
                                      framework_version=_megatron_core_version())
        loss_sums = torch.zeros(2, dtype=torch.float64)
        results = []
        try:
            for iteration in range(1, options.iterations + 1):
                session.begin_step()
                losses = _train_step(options, chunks, streams, forward_step, optimizer, get_forward_backward_func())
                results.append(session.end_step(iteration=iteration))
                if is_last_stage:
                    loss_sums += _global_loss(losses, ps.get_data_parallel_group())
                if printing and (iteration % options.log_interval == 0 or iteration == options.iterations):
                    out(_log_line(session, iteration, options.iterations, loss_sums))
                    loss_sums.zero_()
            if printing:
                out(format_summary(session.summary(), warmup_iterations=options.warmup))
        finally:
            uninstall_session()
    return DemoRun(spec=spec, results=tuple(results))


def _train_step(options: DemoOptions, chunks: list[DistributedDataParallel], streams: list[Iterator[MicroBatch]],
                forward_step: Callable[..., Any], optimizer: torch.optim.Optimizer,
                forward_backward: Callable[..., Any]) -> list[dict[str, torch.Tensor]]:
    """One iteration: megatron-core's forward-backward schedule over every micro-batch, then the
    optimizer step; the last stage's per-micro-batch losses."""
    for chunk in chunks:
        chunk.zero_grad_buffer()
    losses = forward_backward(
        forward_step_func=forward_step,
        data_iterator=streams if len(chunks) > 1 else streams[0],
        model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=options.num_microbatches,
        seq_length=options.data.seq_length,
        micro_batch_size=1,  # shapes travel with the tensors (variable_seq_lengths)
        forward_only=False,
    )
    for group in optimizer.param_groups:  # megatron DDP accumulates (and all-reduces) gradients in main_grad
        for p in group["params"]:
            p.grad = p.main_grad
    optimizer.step()
    return losses


def _log_line(session: Session, iteration: int, train_iters: int, loss_sums: torch.Tensor) -> str:
    """Megatron's log line for the interval ending at ``iteration``, with the corrected fields and the loss."""
    report = session.report()
    assert report is not None  # the session has closed at least one step
    line = format_log_line(report, iteration=iteration, train_iters=train_iters,
                           elapsed_ms_per_iter=1000 * report.elapsed_s / report.num_iterations)
    return line + f" lm loss: {float(loss_sums[0] / loss_sums[1]):.4E} |"


def _megatron_core_version() -> str | None:
    from megatron import core

    return getattr(core, "__version__", None)


# ---- model and loss ----------------------------------------------------------------------------


def _config(options: DemoOptions) -> Any:
    """The model's megatron-core ``TransformerConfig``: fp32 on CPU, no fused kernels."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        **MODEL_FIELDS,
        activation_func=F.silu,
        pipeline_model_parallel_size=options.pp,
        virtual_pipeline_model_parallel_size=options.vpp,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # Micro-batches differ in rows and length: the pipeline exchanges shapes before tensors
        # (megatron refuses that with its default MoE dispatcher, unused by this dense model).
        variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall",
        # Megatron-LM's setting for interleaving: with PP=2 both neighbours are the same rank, and
        # one batched exchange would pair an activation with a gradient (and their shapes).
        overlap_p2p_comm=options.vpp is not None,
        batch_p2p_comm=options.vpp is None,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        cross_entropy_loss_fusion=False,
    )


def _build_model(options: DemoOptions) -> tuple[list[DistributedDataParallel], Any]:
    """One GPTModel per virtual stage of this rank, each wrapped in megatron DDP."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    config = _config(options)
    layer_spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    torch.manual_seed(options.seed)
    chunks = []
    for i in range(options.vpp or 1):
        vp_stage = i if options.vpp is not None else None
        model = GPTModel(
            config=config,
            transformer_layer_spec=layer_spec,
            vocab_size=VOCAB_SIZE,
            max_sequence_length=options.data.seq_length,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            share_embeddings_and_output_weights=False,
            position_embedding_type="rope",
            vp_stage=vp_stage,
        )
        model.train()
        chunks.append(model)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False)
    chunks = [
        DistributedDataParallel(config=config, ddp_config=ddp_config, module=m, disable_bucketing=i > 0)
        for i, m in enumerate(chunks)
    ]
    config.no_sync_func = [c.no_sync for c in chunks] if len(chunks) > 1 else chunks[0].no_sync
    config.finalize_model_grads_func = finalize_model_grads
    return chunks, config


def _loss(loss_mask: torch.Tensor, per_token_loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Megatron's (loss, num_tokens, report) triple: the schedule divides by the token count."""
    mask = loss_mask.reshape(-1)
    loss = torch.sum(per_token_loss.float().reshape(-1) * mask)
    num_tokens = mask.sum().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.stack([loss.detach(), mask.sum()])}


def _global_loss(losses: list[dict[str, torch.Tensor]], dp_group: Any) -> torch.Tensor:
    """(sum of token losses, number of tokens) of the step over every data-parallel rank."""
    sums = torch.zeros(2, dtype=torch.float64)
    for item in losses:
        sums += item["lm loss"].double()
    dist.all_reduce(sums, group=dp_group)
    return sums


# ---- process groups and launching ----------------------------------------------------------------


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    # The GEMMs are tiny, and intra-op threads that spin-wait stall whole iterations for seconds
    # whenever another process holds a core.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def _process_group(rank: int, world_size: int, init_method: str | None) -> Iterator[None]:
    if dist.is_initialized():
        if world_size != 1 or dist.get_world_size() != 1:
            raise ValueError("the demo needs its own process group: one is already initialized")
        yield
        return
    # NB: no TCP port (one probed now may be another process's by the time it is bound): a world of
    # one keeps its store in memory, spawned ranks meet in a file (_spawn).
    dist.init_process_group(
        backend="gloo",
        init_method=init_method,
        store=dist.HashStore() if init_method is None else None,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=GLOO_TIMEOUT_S),
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _model_parallel(options: DemoOptions) -> Iterator[None]:
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        pipeline_model_parallel_size=options.pp,
        virtual_pipeline_model_parallel_size=options.vpp,
    )
    try:
        yield
    finally:
        ps.destroy_model_parallel()


def _spawn(options: DemoOptions) -> int:
    """Run every rank in a spawned local process; kill the rest when one fails or time runs out."""
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="megatron-flops-demo-") as rendezvous:
        return _run_ranks(context, options, f"file://{os.path.join(rendezvous, 'store')}")


def _run_ranks(context: Any, options: DemoOptions, init_method: str) -> int:
    procs = [
        context.Process(target=_worker, args=(rank, options, init_method), name=f"demo-rank{rank}")
        for rank in range(options.world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    failed_at: float | None = None
    timed_out = False
    try:
        while any(p.is_alive() for p in procs):
            now = time.monotonic()
            if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
                failed_at = now
            timed_out = now > deadline
            if timed_out or (failed_at is not None and now - failed_at > FAILURE_GRACE_S):
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=10)
    if timed_out:
        print(f"megatron-flops demo: stopped after {SPAWN_TIMEOUT_S} s", file=sys.stderr)
    return 0 if all(p.exitcode == 0 for p in procs) else 1


def _worker(rank: int, options: DemoOptions, init_method: str) -> None:
    code = 0
    try:
        train(options, rank=rank, init_method=init_method)
    except BaseException:  # noqa: BLE001 - reported, then the process exits non-zero
        print(f"megatron-flops demo: rank {rank} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        code = 1
    sys.stdout.flush()
    # Skip interpreter teardown: gloo's exit hooks can hang once a peer is gone.
    os._exit(code)


# ---- output ----------------------------------------------------------------------------------


def _print(line: str) -> None:
    print(line, flush=True)


def _header(options: DemoOptions, peak_flops_per_s: int | None) -> str:
    model, data, world = MODEL_FIELDS, options.data, options.world_size
    layout = f"PP={options.pp}" + (f" x VPP={options.vpp}" if options.vpp else "") + f" x DP={options.data_parallel_size}"
    lines = [
        "megatron-flops demo: a megatron-core GPTModel trained on CPU by get_forward_backward_func(), "
        f"gloo, {world} process{'es' if world > 1 else ''} ({layout}) of one CPU thread each",
        f"model: {model['num_layers']} layers, hidden {model['hidden_size']}, {model['num_attention_heads']} heads "
        f"({model['num_query_groups']} query groups), SwiGLU ffn {model['ffn_hidden_size']}, vocab {VOCAB_SIZE}, "
        f"seq_length {data.seq_length}",
        f"data: each DP rank draws its own {options.num_microbatches} micro-batches per iteration, each a packed row "
        f"(whole documents of {data.min_length}-{data.seq_length} tokens, cu_seqlens) or {data.num_padded_rows} rows "
        f"dynamically padded to a multiple of {data.pad_multiple} (seq_lengths)",
        f"static: the stock formula (every row one {data.seq_length}-token sequence); corrected: the tracker's "
        f"real lengths; attention convention: {options.attention}",
        "note: on CPU the local attention runs each packed row unpacked under a block-diagonal mask, so the hardware "
        "executes the full s^2 score matrix; the FLOPs here are what a THD kernel is priced at",
    ]
    if peak_flops_per_s is None:
        lines.append("MFU: not reported (a CPU has no peak in the table; pass --peak-tflops)")
    return "\n".join(lines)
