"""Test-only launcher and helpers for multi-process (gloo, CPU) megatron-core tests.

Parent side::

    results = mcore_dist.run_distributed(my_worker, 4, arg1, timeout=900)

``my_worker`` must be a top-level (picklable by reference) function
``my_worker(rank, world_size, *args)`` returning something picklable. Every worker runs in
a fresh ``spawn`` process with ``MASTER_ADDR=127.0.0.1``, ``MASTER_PORT`` the parent's store's
(``mcore_cpu.rendezvous_store``: no rank binds a port),
``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` set and ``torch.set_num_threads(1)``. Results are
written to files in a temporary directory and returned in rank order. A worker exception is
re-raised in the parent as :class:`WorkerError` carrying the worker's traceback; on failure or
timeout the remaining workers are killed by pid.

Worker side::

    def my_worker(rank, world_size):
        mcore_dist.init_worker(tp=1, pp=2, vpp=2)       # patches + gloo + model parallel
        chunks, config = mcore_dist.build_model_chunks(dict(num_layers=4, ...), 128, 32,
                                                       wrap_ddp=True)
        out = mcore_dist.run_schedule(chunks, num_microbatches=4, micro_batch_size=2,
                                      seq_length=32, vocab_size=128)
        return out["flops"]

Nothing here is imported by the ``megatron_flops`` package.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import shutil
import tempfile
import time
import traceback
from functools import partial
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import torch

try:  # tests/ imported as a package
    from . import mcore_cpu
except ImportError:  # tests/ on sys.path (pytest's default rootdir/prepend import mode)
    import mcore_cpu  # type: ignore[no-redef]

__all__ = [
    "WorkerError",
    "LAST_RUN_STATS",
    "run_distributed",
    "run_by_name",
    "init_worker",
    "reinit_model_parallel",
    "parallel_sizes",
    "build_model_chunks",
    "batch_iterator",
    "gpt_forward_step",
    "run_schedule",
    "schedule_flops_worker",
]


class WorkerError(RuntimeError):
    """A distributed worker raised; ``.tracebacks`` maps rank -> formatted traceback."""

    def __init__(self, message: str, tracebacks: Dict[int, str]):
        super().__init__(message)
        self.tracebacks = tracebacks


#: Timing of the most recent :func:`run_distributed` call (seconds):
#: ``spawn_to_entry`` per rank (process start + unpickling the worker function, i.e. the
#: imports of its module), ``fn_seconds`` per rank, ``wall`` for the whole launch.
LAST_RUN_STATS: Dict[str, Any] = {}

_RESULT_FILE = "rank{rank}.pkl"


# ---------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------


def _write_result(result_dir: str, rank: int, payload: Dict[str, Any]) -> None:
    path = os.path.join(result_dir, _RESULT_FILE.format(rank=rank))
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        pickle.dump(payload, f)
    os.replace(tmp, path)  # atomic: the parent never sees a half-written file


def _worker_entry(
    rank: int,
    world_size: int,
    port: int,
    t_launch: float,
    result_dir: str,
    fn: Callable,
    args: Sequence[Any],
) -> None:
    t_entry = time.time()
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        **mcore_cpu.AGENT_STORE_ENV,
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    payload: Dict[str, Any] = {"rank": rank, "spawn_to_entry": t_entry - t_launch}
    try:
        result = fn(rank, world_size, *args)
        payload.update(ok=True, result=result, fn_seconds=time.time() - t_entry)
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        payload.update(ok=False, traceback=traceback.format_exc(), fn_seconds=time.time() - t_entry)
    try:
        _write_result(result_dir, rank, payload)
    except Exception:  # unpicklable result: report that instead
        payload = {
            "rank": rank,
            "ok": False,
            "traceback": "result could not be pickled:\n" + traceback.format_exc(),
        }
        _write_result(result_dir, rank, payload)
    _shutdown_quietly()
    # Skip interpreter teardown (gloo/atexit hooks can hang when a peer is gone).
    os._exit(0 if payload.get("ok") else 1)


def _shutdown_quietly() -> None:
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass


def _read_result(result_dir: str, rank: int) -> Optional[Dict[str, Any]]:
    path = os.path.join(result_dir, _RESULT_FILE.format(rank=rank))
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        return pickle.load(f)


def run_distributed(
    fn: Callable,
    world_size: int,
    *args: Any,
    timeout: float = 900.0,
    grace_after_failure: float = 5.0,
) -> List[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned local processes.

    Returns the per-rank results (rank order). Raises :class:`WorkerError` if any worker
    raised or died, :class:`TimeoutError` after ``timeout`` seconds; stragglers are killed by
    pid (``Process.kill``) in both cases.
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    store = mcore_cpu.rendezvous_store(world_size)  # held until the workers are done
    port = store.port
    result_dir = tempfile.mkdtemp(prefix="mcore_dist_")
    procs = []
    t_launch = time.time()
    LAST_RUN_STATS.clear()
    try:
        for rank in range(world_size):
            p = ctx.Process(
                target=_worker_entry,
                args=(rank, world_size, port, t_launch, result_dir, fn, tuple(args)),
                name=f"mcore_dist_rank{rank}",
            )
            p.start()
            procs.append(p)

        deadline = t_launch + timeout
        failed_at: Optional[float] = None
        timed_out = False
        while True:
            alive = [p for p in procs if p.is_alive()]
            if not alive:
                break
            now = time.time()
            if failed_at is None:
                for rank, p in enumerate(procs):
                    done = _read_result(result_dir, rank)
                    if (done is not None and not done.get("ok")) or p.exitcode not in (None, 0):
                        failed_at = now
                        break
            if failed_at is not None and now - failed_at > grace_after_failure:
                break
            if now > deadline:
                timed_out = True
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()  # SIGKILL to this worker's pid only
        for p in procs:
            p.join(timeout=10)

    try:
        payloads = {rank: _read_result(result_dir, rank) for rank in range(world_size)}
    finally:
        shutil.rmtree(result_dir, ignore_errors=True)

    LAST_RUN_STATS.update(
        wall=time.time() - t_launch,
        spawn_to_entry={r: (pl or {}).get("spawn_to_entry") for r, pl in payloads.items()},
        fn_seconds={r: (pl or {}).get("fn_seconds") for r, pl in payloads.items()},
        exitcodes={r: p.exitcode for r, p in enumerate(procs)},
    )

    tracebacks = {r: pl["traceback"] for r, pl in payloads.items() if pl and not pl.get("ok")}
    missing = [r for r, pl in payloads.items() if pl is None]
    if tracebacks:
        # Rank whose error is not a gloo side effect of a peer dying goes first.
        def _secondary(tb: str) -> bool:
            return any(k in tb for k in ("Connection closed by peer", "Connection reset", "Timed out"))

        order = sorted(tracebacks, key=lambda r: (_secondary(tracebacks[r]), r))
        parts = [f"--- rank {r} ---\n{tracebacks[r]}" for r in order]
        if missing:
            parts.append(f"(ranks {missing} produced no result; killed or crashed)")
        raise WorkerError(
            f"{len(tracebacks)} of {world_size} workers failed; first: rank {order[0]}\n"
            + "\n".join(parts),
            tracebacks,
        )
    if timed_out or missing:
        raise TimeoutError(
            f"distributed run did not finish within {timeout:.0f}s "
            f"(no result from ranks {missing}; exit codes {LAST_RUN_STATS['exitcodes']})"
        )
    return [payloads[r]["result"] for r in range(world_size)]


def run_by_name(fn: Callable, world_size: int, runs: Dict[str, Any], *, timeout: float = 900.0) -> Dict[str, List[Any]]:
    """:func:`run_distributed` of ``fn(rank, world_size, runs)``, whose result on every rank is a
    dict by run name: regrouped as ``{name: [rank 0's result, rank 1's, ...]}``."""
    results = run_distributed(fn, world_size, runs, timeout=timeout)
    return {name: [r[name] for r in results] for name in runs}


# ---------------------------------------------------------------------------
# Worker-side helpers
# ---------------------------------------------------------------------------


def init_worker(
    tp: int = 1,
    pp: int = 1,
    vpp: Optional[int] = None,
    *,
    seed: int = 1234,
    timeout_s: float = 60.0,
) -> None:
    """In a worker: CPU patches, gloo process group (env://), model-parallel groups, seeds."""
    import torch.distributed as dist

    mcore_cpu.apply_cpu_patches()
    if not dist.is_initialized():
        dist.init_process_group(
            backend="gloo",
            init_method="env://",
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    reinit_model_parallel(tp=tp, pp=pp, vpp=vpp, seed=seed)


def reinit_model_parallel(
    tp: int = 1, pp: int = 1, vpp: Optional[int] = None, *, seed: int = 1234
) -> None:
    """(Re)create megatron's model-parallel groups with new sizes inside one process group.

    All ranks must call it together (group creation is collective). DP is implied:
    world_size // (tp * pp).
    """
    from megatron.core import parallel_state, tensor_parallel

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
    )
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)


def parallel_sizes() -> Dict[str, Any]:
    """Current sizes and this rank's coordinates (tp/pp/dp rank, vpp size)."""
    from megatron.core import parallel_state as ps

    return dict(
        tp=ps.get_tensor_model_parallel_world_size(),
        pp=ps.get_pipeline_model_parallel_world_size(),
        vpp=ps.get_virtual_pipeline_model_parallel_world_size(),
        dp=ps.get_data_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
    )


def build_model_chunks(
    config_kwargs: Dict[str, Any],
    vocab_size: int,
    max_seq_len: int,
    *,
    share_embeddings: bool = True,
    position_embedding_type: str = "rope",
    mtp: bool = False,
    wrap_ddp: bool = False,
    ddp_config_kwargs: Optional[Dict[str, Any]] = None,
):
    """megatron ``get_model``-like: one GPTModel per virtual stage for this rank.

    The config gets the current tp/pp/vpp sizes. ``pre_process``/``post_process`` come from
    ``is_pipeline_first_stage/last_stage(ignore_virtual=False, vp_stage=i)`` and ``vp_stage``
    is passed to the specs and the model. With ``wrap_ddp`` each chunk is wrapped in megatron
    ``DistributedDataParallel`` (bucketing only for chunk 0, as megatron does) and the config's
    ``no_sync_func`` / ``finalize_model_grads_func`` are set for the schedules.
    Returns ``(chunks, config)``.
    """
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    pp = ps.get_pipeline_model_parallel_world_size()
    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    kwargs = dict(config_kwargs)
    if mtp and not kwargs.get("mtp_num_layers"):
        kwargs["mtp_num_layers"] = 1
    kwargs.update(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
    )
    if tp > 1:
        kwargs.setdefault("sequence_parallel", False)
    if vpp is not None:
        # As Megatron-LM sets it for interleaving: with PP=2 both neighbours are the same rank, and
        # batched p2p would pair an activation with a gradient.
        kwargs.setdefault("overlap_p2p_comm", True)
        kwargs.setdefault("batch_p2p_comm", False)
    config = mcore_cpu.make_config(kwargs)

    chunks = []
    for i in range(vpp or 1):
        vp_stage = i if vpp is not None else None
        pre = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
        post = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
        # Tied embeddings with PP > 1: setup_embeddings_and_output_layer calls
        # ``weight.data.cuda()`` before all-reducing the shared weight.
        with mcore_cpu.cuda_to_cpu_mode():
            model = mcore_cpu.build_gpt(
                {},
                vocab_size,
                max_seq_len,
                share_embeddings=share_embeddings,
                position_embedding_type=position_embedding_type,
                pre_process=pre,
                post_process=post,
                vp_stage=vp_stage,
                config=config,
            )
        chunks.append(model)

    if wrap_ddp:
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )

        ddp_kwargs = dict(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=False,
        )
        ddp_kwargs.update(ddp_config_kwargs or {})
        ddp_config = DistributedDataParallelConfig(**ddp_kwargs)
        chunks = [
            DistributedDataParallel(
                config=config, ddp_config=ddp_config, module=m, disable_bucketing=(i > 0)
            )
            for i, m in enumerate(chunks)
        ]
        config.no_sync_func = [c.no_sync for c in chunks] if len(chunks) > 1 else chunks[0].no_sync
        config.finalize_model_grads_func = finalize_model_grads
    return chunks, config


def batch_iterator(
    num_microbatches: int, micro_batch_size: int, seq_len: int, vocab_size: int, seed: int = 0
) -> Iterator[Dict[str, torch.Tensor]]:
    """Deterministic micro-batches (same sequence on every rank and every model chunk)."""
    for i in range(num_microbatches):
        batch = mcore_cpu.make_batch(micro_batch_size, seq_len, vocab_size, seed=seed + i)
        batch["loss_mask"] = torch.ones(micro_batch_size, seq_len, dtype=torch.float32)
        yield batch


def _gpt_loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.cat([loss.detach().view(1), num_tokens.detach().float().view(1)])
    return loss, num_tokens, {"lm loss": report}


def gpt_forward_step(data_iterator, model):
    """Default ``forward_step_func``: full batch on every stage, labels -> per-token loss."""
    batch = next(data_iterator)
    output = model(
        batch["input_ids"],
        batch["position_ids"],
        batch["attention_mask"],
        labels=batch["labels"],
    )
    return output, partial(_gpt_loss_func, batch["loss_mask"])


def run_schedule(
    chunks: List[torch.nn.Module],
    *,
    num_microbatches: int,
    micro_batch_size: int,
    seq_length: int,
    vocab_size: int,
    forward_step_func: Callable = gpt_forward_step,
    data_iterators: Optional[List[Iterator]] = None,
    forward_only: bool = False,
    count_flops: bool = True,
    seed: int = 0,
) -> Dict[str, Any]:
    """Run megatron-core's ``get_forward_backward_func()`` schedule once.

    Interleaved 1F1B when vpp > 1 (one data iterator per chunk). Runs under
    :func:`mcore_cpu.cuda_to_cpu_mode` (the schedules create ``device="cuda"`` tensors) and,
    if ``count_flops``, under ``FlopCounterMode``. Returns ``{"losses", "flops",
    "flop_counts"}`` (``losses``: the schedule's list of per-micro-batch loss dicts, non-empty
    only on the last stage).
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from torch.utils.flop_counter import FlopCounterMode

    if data_iterators is None:
        data_iterators = [
            batch_iterator(num_microbatches, micro_batch_size, seq_length, vocab_size, seed)
            for _ in chunks
        ]
    for c in chunks:
        if hasattr(c, "zero_grad_buffer"):
            c.zero_grad_buffer()
        c.zero_grad(set_to_none=True)
        c.train()

    fb = get_forward_backward_func()
    counter = FlopCounterMode(display=False) if count_flops else None
    with mcore_cpu.cuda_to_cpu_mode():
        with counter if counter is not None else contextlib.nullcontext():
            losses = fb(
                forward_step_func=forward_step_func,
                data_iterator=data_iterators if len(chunks) > 1 else data_iterators[0],
                model=chunks if len(chunks) > 1 else chunks[0],
                num_microbatches=num_microbatches,
                seq_length=seq_length,
                micro_batch_size=micro_batch_size,
                forward_only=forward_only,
            )
    out: Dict[str, Any] = {"losses": [_detach_loss_dict(d) for d in (losses or [])]}
    if counter is not None:
        out["flops"] = int(counter.get_total_flops())
        out["flop_counts"] = {
            mod: {str(op).replace("aten.", ""): int(n) for op, n in ops.items()}
            for mod, ops in counter.get_flop_counts().items()
            if mod == "Global"
        }
    return out


def _detach_loss_dict(d: Any) -> Any:
    if isinstance(d, dict):
        return {k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in d.items()}
    return d



# ---------------------------------------------------------------------------
# A ready-made worker: run several parallel layouts in one process group
# ---------------------------------------------------------------------------


def schedule_flops_worker(
    rank: int, world_size: int, runs: List[Dict[str, Any]], model: Dict[str, Any]
) -> List[Dict[str, Any]]:
    """Worker for :func:`run_distributed`: for each layout in ``runs`` (re)initialise the
    model-parallel groups, build the model chunks and run the schedule once under
    ``FlopCounterMode``.

    ``runs``: dicts with ``tp``, ``pp``, ``vpp`` (None = not interleaved), ``ddp`` (wrap in
    megatron DDP), ``num_microbatches``, ``micro_batch_size``.
    ``model``: ``config_kwargs``, ``vocab_size``, ``seq_length`` and optional
    ``share_embeddings`` / ``position_embedding_type`` / ``mtp``.
    Returns one dict per run: ``sizes`` (see :func:`parallel_sizes`), ``flops`` (this rank),
    ``flop_counts`` (this rank, per op type), ``losses`` (per-micro-batch mean loss, last
    stage only), ``seconds``.
    """
    out = []
    for i, run in enumerate(runs):
        t0 = time.time()
        if i == 0:
            init_worker(tp=run["tp"], pp=run["pp"], vpp=run.get("vpp"))
        else:
            reinit_model_parallel(tp=run["tp"], pp=run["pp"], vpp=run.get("vpp"))
        chunks, _ = build_model_chunks(
            model["config_kwargs"],
            model["vocab_size"],
            model["seq_length"],
            share_embeddings=model.get("share_embeddings", True),
            position_embedding_type=model.get("position_embedding_type", "rope"),
            mtp=model.get("mtp", False),
            wrap_ddp=run.get("ddp", False),
        )
        res = run_schedule(
            chunks,
            num_microbatches=run["num_microbatches"],
            micro_batch_size=run["micro_batch_size"],
            seq_length=model["seq_length"],
            vocab_size=model["vocab_size"],
        )
        losses = [float(d["lm loss"][0] / d["lm loss"][1]) for d in res["losses"]]
        out.append(
            dict(
                sizes=parallel_sizes(),
                flops=res["flops"],
                flop_counts=res["flop_counts"].get("Global", {}),
                losses=losses,
                seconds=time.time() - t0,
            )
        )
    return out
