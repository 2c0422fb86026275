"""Test-only harness for running real megatron-core (0.16.x) on a CPU-only machine.

This is a plain helper module imported by tests; nothing here is imported by the
``megatron_flops`` package.  Patches are applied only when a test (fixture) calls
:func:`apply_cpu_patches`, and they can be undone with :func:`remove_cpu_patches`.

Typical use::

    from tests import mcore_cpu            # or: import mcore_cpu (tests/ on sys.path)

    mcore_cpu.init_single_process()        # applies the patches, gloo world of size 1
    model = mcore_cpu.build_gpt(dict(num_layers=2, hidden_size=64, num_attention_heads=4,
                                     ffn_hidden_size=256), vocab_size=128, max_seq_len=32)
    flops = mcore_cpu.measure_train_flops(model, batch_size=2, seq_len=32, vocab_size=128)

See ``tests/MCORE_CPU_FINDINGS.md`` for the GEMMs megatron-core executes per feature.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from typing import Any, Callable, Dict, Iterator, Optional

import torch
from torch.overrides import TorchFunctionMode

try:  # megatron-core is optional for the package; tests skip without it.
    import megatron.core  # noqa: F401

    HAVE_MCORE = True
    MCORE_IMPORT_ERROR: Optional[BaseException] = None
except Exception as exc:  # pragma: no cover - depends on the environment
    HAVE_MCORE = False
    MCORE_IMPORT_ERROR = exc

SKIP_REASON = (
    "megatron.core cannot be imported "
    f"({type(MCORE_IMPORT_ERROR).__name__}: {MCORE_IMPORT_ERROR}); "
    "install it with `pip install torch==2.13.0 megatron-core==0.16.1`"
    if not HAVE_MCORE
    else ""
)

__all__ = [
    "HAVE_MCORE",
    "SKIP_REASON",
    "apply_cpu_patches",
    "remove_cpu_patches",
    "cuda_to_cpu_mode",
    "AGENT_STORE_ENV",
    "rendezvous_store",
    "GatedRMSNormStub",
    "stub_mamba_ssm",
    "init_single_process",
    "make_config",
    "build_layer_spec",
    "build_gpt",
    "make_batch",
    "measure_train_flops",
    "measure_train_flop_counts",
    "measure_forward_flops",
]


# ---------------------------------------------------------------------------
# Patching machinery (idempotent, reversible)
# ---------------------------------------------------------------------------

_MISSING = object()
# (owner object, attribute name) -> raw original value (from owner.__dict__), or _MISSING
_ORIGINALS: Dict[tuple, Any] = {}
_PATCHED = False


def _set(owner: Any, name: str, value: Any) -> None:
    """setattr that remembers the original (raw, un-bound) value once."""
    key = (owner, name)
    if key not in _ORIGINALS:
        _ORIGINALS[key] = vars(owner).get(name, _MISSING)
    setattr(owner, name, value)


def _orig(owner: Any, name: str) -> Any:
    """The attribute as it was before we patched it (a plain function for methods)."""
    raw = _ORIGINALS.get((owner, name), _MISSING)
    if raw is _MISSING:
        return getattr(owner, name)
    return raw


@contextlib.contextmanager
def _current_device_is_cpu() -> Iterator[None]:
    """Temporarily make ``torch.cuda.current_device()`` return ``"cpu"``."""
    saved = torch.cuda.current_device
    torch.cuda.current_device = _cpu_current_device
    try:
        yield
    finally:
        torch.cuda.current_device = saved


def _cpu_current_device() -> str:
    return "cpu"


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


def _wrap_on_cpu(fn: Callable) -> Callable:
    """Wrap ``fn`` so every ``torch.cuda.current_device()`` inside it yields "cpu"."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with _current_device_is_cpu():
            return fn(*args, **kwargs)

    wrapper.__name__ = getattr(fn, "__name__", "wrapper")
    wrapper.__doc__ = getattr(fn, "__doc__", None)
    wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
    return wrapper


class _NullStream:
    """Stand-in for ``torch.cuda.Stream`` in the alltoall dispatcher."""

    def wait_stream(self, *a: Any, **k: Any) -> None:
        return None

    def record_event(self, *a: Any, **k: Any) -> "_NullEvent":
        return _NullEvent()


class _NullEvent:
    def synchronize(self) -> None:
        return None


class DuplicatedLinearStandIn(torch.nn.Module):
    """Test-only stand-in for Transformer Engine's ``TELinear(parallel_mode="duplicated")`` as
    megatron-core's ``MoELayer`` builds its latent projections: the whole weight [out, in] (and
    bias) on every rank, no collective, ``(y, None)`` out. It saves for backward what TE's
    ``_Linear`` saves outside FP8 (read in its source): its input only when the weight trains (the
    weight itself is a parameter), as torch's matmul does."""

    def __init__(self, input_size: int, output_size: int, *, config: Any, init_method: Callable, bias: bool,
                 parallel_mode: str, skip_bias_add: bool, **_: Any) -> None:
        super().__init__()
        assert parallel_mode == "duplicated" and not skip_bias_add
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype))
        init_method(self.weight)
        self.bias = torch.nn.Parameter(torch.zeros(output_size, dtype=config.params_dtype)) if bias else None

    def forward(self, x: torch.Tensor) -> tuple:
        return torch.nn.functional.linear(x, self.weight, self.bias), None


def apply_cpu_patches() -> None:
    """Apply every test-only patch needed to run megatron-core on CPU. Idempotent.

    Patches (see /work/shared/notes/megatron-core-on-cpu.md):
      * ``torch.cuda.current_device`` -> ``"cpu"`` (p2p buffers in the pipeline schedules and
        many ``device=torch.cuda.current_device()`` allocations), ``torch.cuda.synchronize``
        -> no-op (schedules with ``batch_p2p_comm``).
      * ``GlobalMemoryBuffer.get_tensor`` -> fresh CPU ``torch.empty``.
      * ``CudaRNGStatesTracker.fork`` -> ``nullcontext``; ``CudaRNGStatesTracker.add`` stores a
        CPU generator state (so ``model_parallel_cuda_manual_seed`` works without CUDA);
        ``_get_cuda_rng_state``/``_set_cuda_rng_state`` -> no-ops (activation recompute);
        ``CheckpointWithoutOutput`` only takes its TE/FP8 path for a truthy ``fp8``
        (selective recompute of "layernorm"/"moe_act" otherwise needs TE).
      * MoE: ``Router.gating`` keeps the router weight on CPU; ``moe_utils.te_general_gemm = None``;
        the alltoall dispatcher gets a null stream and a CPU ``_maybe_dtoh_and_synchronize``;
        latent projections are :class:`DuplicatedLinearStandIn` (``moe_layer.HAVE_TE = True``).
      * MLA: ``multi_latent_attention.HAVE_TE = False``; the local ``DotProductAttention``
        accepts ``k_channels``/``v_channels``.
      * RoPE: ``RotaryEmbedding.get_emb`` / ``YarnRotaryEmbedding.get_emb`` stay on CPU
        (models are built with ``use_cpu_initialization=True``).
      * MTP: ``MTPLossLoggingHelper.save_loss_to_tracker`` -> no-op.
    ``torch.zeros(..., device="cuda")`` inside the schedules needs :func:`cuda_to_cpu_mode`.
    """
    global _PATCHED
    if _PATCHED:
        return
    if not HAVE_MCORE:  # pragma: no cover
        raise RuntimeError(SKIP_REASON)

    import megatron.core.utils as mutils

    if getattr(mutils.GlobalMemoryBuffer.get_tensor, "_mcore_cpu_patch", False):
        # Already patched by another copy of this module (imported under a second name).
        _PATCHED = True
        return
    from megatron.core.tensor_parallel import random as tp_random

    # --- torch.cuda: device queries and syncs used by schedules / allocations -------------
    _set(torch.cuda, "current_device", _cpu_current_device)
    _set(torch.cuda, "synchronize", _noop)

    # --- scratch buffers --------------------------------------------------------------------
    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
        # A fresh tensor per call: the buffer is only ever used as baddbmm(beta=0) scratch
        # or as an all-gather destination, so no caching is needed on CPU.
        return torch.empty(tuple(tensor_shape), dtype=dtype, device="cpu", requires_grad=False)

    get_tensor._mcore_cpu_patch = True  # type: ignore[attr-defined]
    _set(mutils.GlobalMemoryBuffer, "get_tensor", get_tensor)

    # --- RNG tracker ------------------------------------------------------------------------
    def tracker_add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"cuda rng state {name} already exists")
        self.states_[name] = torch.Generator(device="cpu").manual_seed(seed).get_state()

    def tracker_fork(self, name=tp_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
        return contextlib.nullcontext()

    _set(tp_random.CudaRNGStatesTracker, "add", tracker_add)
    _set(tp_random.CudaRNGStatesTracker, "fork", tracker_fork)
    _set(tp_random, "_get_cuda_rng_state", lambda *a, **k: torch.zeros(0, dtype=torch.uint8))
    _set(tp_random, "_set_cuda_rng_state", _noop)

    # CheckpointWithoutOutput.__init__ sets ``self.fp8 = fp8 is not None``, so the default
    # ``fp8=False`` takes the Transformer-Engine FP8 path (NameError: FP8GlobalStateManager)
    # without TE. Affects selective recompute of "layernorm" and "moe_act". Only a real
    # (truthy) fp8 setting should select that path.
    cwo_init = _orig(tp_random.CheckpointWithoutOutput, "__init__")

    def cwo_init_fixed(self, fp8=False):
        cwo_init(self, fp8=fp8)
        self.fp8 = bool(fp8)

    _set(tp_random.CheckpointWithoutOutput, "__init__", cwo_init_fixed)

    # --- MoE --------------------------------------------------------------------------------
    from megatron.core.transformer.moe import moe_utils, router, token_dispatcher

    _set(router.Router, "gating", _wrap_on_cpu(_orig(router.Router, "gating")))
    _set(moe_utils, "te_general_gemm", None)

    a2a = token_dispatcher.MoEAlltoAllTokenDispatcher

    def maybe_dtoh_and_synchronize(self, point, tokens_per_expert=None):
        # On CPU every tensor is already host-resident: nothing to copy, nothing to wait for.
        return tokens_per_expert

    _set(a2a, "cuda_dtoh_stream", _NullStream())
    _set(a2a, "_maybe_dtoh_and_synchronize", maybe_dtoh_and_synchronize)
    # Latent projections (moe_latent_size): MoELayer builds them as Transformer Engine's TELinear only.
    from megatron.core.transformer.moe import moe_layer

    _set(moe_layer, "HAVE_TE", True)
    _set(moe_layer, "TELinear", DuplicatedLinearStandIn)

    # --- MLA --------------------------------------------------------------------------------
    from megatron.core.transformer import dot_product_attention as dpa
    from megatron.core.transformer import multi_latent_attention as mla

    _set(mla, "HAVE_TE", False)
    dpa_init = _orig(dpa.DotProductAttention, "__init__")

    def dpa_init_with_channels(self, *args, k_channels=None, v_channels=None, **kwargs):
        dpa_init(self, *args, **kwargs)
        # Mirror TEDotProductAttention's k/v channel handling for MLA: scores use the q/k head
        # dim (MLA passes softmax_scale explicitly), the context uses v_channels per head.
        tp = self.pg_collection.tp.size()
        if k_channels is not None:
            self.hidden_size_per_attention_head = k_channels
        if v_channels is not None:
            self.hidden_size_per_partition = v_channels * self.config.num_attention_heads // tp

    _set(dpa.DotProductAttention, "__init__", dpa_init_with_channels)

    # --- RoPE -------------------------------------------------------------------------------
    from megatron.core.models.common.embeddings import rotary_pos_embedding as rope
    from megatron.core.models.common.embeddings import yarn_rotary_pos_embedding as yarn

    _set(rope.RotaryEmbedding, "get_emb", _wrap_on_cpu(_orig(rope.RotaryEmbedding, "get_emb")))
    _set(
        yarn.YarnRotaryEmbedding,
        "get_emb",
        _wrap_on_cpu(_orig(yarn.YarnRotaryEmbedding, "get_emb")),
    )

    # --- MTP --------------------------------------------------------------------------------
    from megatron.core.transformer import multi_token_prediction as mtp

    _set(mtp.MTPLossLoggingHelper, "save_loss_to_tracker", staticmethod(_noop))

    _PATCHED = True


def remove_cpu_patches() -> None:
    """Undo :func:`apply_cpu_patches` (restores the original attributes)."""
    global _PATCHED
    for (owner, name), raw in reversed(list(_ORIGINALS.items())):
        if raw is _MISSING:
            with contextlib.suppress(AttributeError):
                delattr(owner, name)
        else:
            setattr(owner, name, raw)
    _ORIGINALS.clear()
    _PATCHED = False


def _is_cuda_device(dev: Any) -> bool:
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    if isinstance(dev, str):
        return dev == "cuda" or dev.startswith("cuda:")
    return False


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites ``device="cuda"`` arguments (and ``Tensor.cuda()``) to the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            # Tensor.cuda(device=None, non_blocking=False, memory_format=...) -> stay on CPU.
            return args[0]
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu") + tuple(args[2:])
        return func(*args, **kwargs)


def cuda_to_cpu_mode() -> TorchFunctionMode:
    """A ``TorchFunctionMode`` mapping CUDA device arguments to CPU (use as ``with``)."""
    return _CudaToCpuMode()


# ---------------------------------------------------------------------------
# Process group
# ---------------------------------------------------------------------------


#: In a rank's environment: ``env://`` and ``tcp://`` rendezvous join the store at MASTER_PORT as a
#: client (torch's ``_create_c10d_store``), so rank 0 binds no port (see :func:`rendezvous_store`).
AGENT_STORE_ENV: Dict[str, str] = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0"}


def rendezvous_store(world_size: int) -> "torch.distributed.TCPStore":
    """A TCPStore served by this process on a port the server binds itself (port 0), for ranks
    started with :data:`AGENT_STORE_ENV` and ``MASTER_PORT=store.port``; keep it until they finish.

    Not a probed free port that rank 0 binds later: between the probe and the bind (seconds of
    spawn and imports) another process's ``bind(0)`` (gloo's pair listeners in a concurrent test
    run) may take it, and rank 0 fails with EADDRINUSE.
    """
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=300))


class GatedRMSNormStub(torch.nn.Module):
    """mamba_ssm's gated RMSNorm stand-in for building a ``MambaMixer``: the same ``weight``."""

    def __init__(self, hidden_size, eps=1e-5, group_size=None, norm_before_gate=True, device=None, dtype=None):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))


def stub_mamba_ssm(set_attr: Callable[..., None] = setattr, norm: type = GatedRMSNormStub) -> None:
    """Let megatron-core's ``MambaMixer`` build without mamba_ssm (its kernels run in forward only):
    ``norm`` stands in for mamba_ssm's gated RMSNorm. ``set_attr``: ``monkeypatch.setattr`` in a test."""
    from megatron.core.ssm import mamba_mixer

    for name, value in (("HAVE_MAMBA_SSM", True), ("HAVE_EINOPS", True), ("RMSNormGated", norm),
                        ("ExtendedRMSNorm", norm)):
        set_attr(mamba_mixer, name, value)


def init_single_process(seed: int = 1234) -> None:
    """gloo world of size 1 on 127.0.0.1 + ``initialize_model_parallel(1, 1)``. Idempotent.

    ``tensor_parallel.model_parallel_cuda_manual_seed`` does need CUDA in 0.16.1
    (``CudaRNGStatesTracker.add`` calls ``torch.cuda.get_rng_state``); with
    :func:`apply_cpu_patches` the tracker stores CPU generator states instead, so the call
    works. The RNG tracker is re-seeded on every call (``force_reset_rng``) so repeated
    calls within one pytest process are deterministic.
    """
    apply_cpu_patches()
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        dist.init_process_group(
            backend="gloo",
            store=dist.HashStore(),  # one process: no port to bind
            rank=0,
            world_size=1,
            timeout=datetime.timedelta(seconds=60),
        )
    if dist.get_world_size() != 1:
        raise RuntimeError("init_single_process needs a world of size 1")
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=1, pipeline_model_parallel_size=1
        )
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)


# ---------------------------------------------------------------------------
# Model construction
# ---------------------------------------------------------------------------

#: Defaults applied under the caller's config_kwargs (the caller wins).
CONFIG_DEFAULTS: Dict[str, Any] = dict(
    params_dtype=torch.float32,
    pipeline_dtype=torch.float32,
    bf16=False,
    fp16=False,
    use_cpu_initialization=True,
    perform_initialization=True,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    add_bias_linear=False,
    gradient_accumulation_fusion=False,
    bias_activation_fusion=False,
    bias_dropout_fusion=False,
    masked_softmax_fusion=False,
    apply_rope_fusion=False,
    persist_layer_norm=False,
    cross_entropy_loss_fusion=False,
    # MoE: dispatcher that runs on CPU; no auxiliary losses (they add no GEMMs, but keep the
    # loss path simple and avoid aux-loss trackers).
    moe_token_dispatcher_type="allgather",
    moe_router_load_balancing_type="none",
    moe_aux_loss_coeff=0.0,
    moe_z_loss_coeff=None,
    moe_grouped_gemm=False,
    moe_permute_fusion=False,
    moe_router_fusion=False,
)

def make_config(config_kwargs: Dict[str, Any], **overrides: Any):
    """TransformerConfig (or MLATransformerConfig when ``multi_latent_attention``).

    MLA keeps MLATransformerConfig's own defaults (RMSNorm, ``rope_type="yarn"``); RoPE
    variants add no GEMMs.
    """
    from megatron.core.transformer.transformer_config import (
        MLATransformerConfig,
        TransformerConfig,
    )

    kwargs = dict(CONFIG_DEFAULTS)
    mla = bool(config_kwargs.get("multi_latent_attention", False))
    kwargs.update(config_kwargs)
    kwargs.update(overrides)
    if kwargs.get("num_moe_experts") is None:
        for key in ("moe_grouped_gemm", "moe_permute_fusion", "moe_router_fusion"):
            kwargs.pop(key, None)
    cls = MLATransformerConfig if mla else TransformerConfig
    return cls(**kwargs)


def build_layer_spec(config, *, vp_stage: Optional[int] = None, pp_rank: Optional[int] = None):
    """The local (non-TE) decoder spec for ``config``.

    Dense models get ``get_gpt_layer_local_spec`` (a single layer ModuleSpec); MoE models
    get ``get_gpt_decoder_block_spec(config, use_transformer_engine=False)`` so that
    ``moe_layer_freq`` patterns (mixed dense/MoE layers) are honoured.
    """
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
    )

    if config.num_moe_experts:
        return get_gpt_decoder_block_spec(
            config,
            use_transformer_engine=False,
            normalization=config.normalization,
            vp_stage=vp_stage,
            pp_rank=pp_rank,
        )
    return get_gpt_layer_local_spec(
        num_experts=None,
        moe_grouped_gemm=False,
        qk_layernorm=config.qk_layernorm,
        multi_latent_attention=config.multi_latent_attention,
        normalization=config.normalization,
    )


def build_gpt(
    config_kwargs: Dict[str, Any],
    vocab_size: int,
    max_seq_len: int,
    *,
    share_embeddings: bool = True,
    position_embedding_type: str = "rope",
    mtp: bool = False,
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: Optional[int] = None,
    config=None,
    rotary_percent: float = 1.0,
):
    """Build a megatron-core ``GPTModel`` in fp32 on CPU with the local layer spec.

    ``config_kwargs`` are TransformerConfig / MLATransformerConfig field names; they override
    :data:`CONFIG_DEFAULTS`. An MTP block is built when ``mtp`` is true or
    ``config_kwargs["mtp_num_layers"]`` is set (``mtp=True`` alone means 1 MTP layer).
    Pass a ready ``config`` to skip :func:`make_config` (used by the multi-process helper).
    Call :func:`init_single_process` (or the multi-process init) first.
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    apply_cpu_patches()
    if config is None:
        kwargs = dict(config_kwargs)
        if mtp and not kwargs.get("mtp_num_layers"):
            kwargs["mtp_num_layers"] = 1
        config = make_config(kwargs)
    layer_spec = build_layer_spec(config, vp_stage=vp_stage)
    mtp_block_spec = None
    if config.mtp_num_layers:
        mtp_block_spec = get_gpt_mtp_block_spec(
            config, layer_spec, use_transformer_engine=False, vp_stage=vp_stage
        )
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=vocab_size,
        max_sequence_length=max_seq_len,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=share_embeddings,
        position_embedding_type=position_embedding_type,
        rotary_percent=rotary_percent,
        mtp_block_spec=mtp_block_spec,
        vp_stage=vp_stage,
    )
    return model


# ---------------------------------------------------------------------------
# Measuring
# ---------------------------------------------------------------------------


def make_batch(batch_size: int, seq_len: int, vocab_size: int, seed: int = 0) -> Dict[str, Any]:
    """Random tokens/labels [b, s], position ids [b, s], causal bool mask [1, 1, s, s].

    The mask follows megatron's convention for the local DotProductAttention: ``True`` marks
    positions that are masked out (``attention_mask_func`` fills them with -10000).
    """
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (batch_size, seq_len), generator=gen)
    labels = torch.randint(0, vocab_size, (batch_size, seq_len), generator=gen)
    position_ids = torch.arange(seq_len).unsqueeze(0).expand(batch_size, seq_len).contiguous()
    attention_mask = torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool), diagonal=1)
    return dict(
        input_ids=tokens,
        position_ids=position_ids,
        attention_mask=attention_mask.view(1, 1, seq_len, seq_len),
        labels=labels,
    )


def _flop_counter():
    from torch.utils.flop_counter import FlopCounterMode

    return FlopCounterMode(display=False)


def _op_name(op: Any) -> str:
    name = str(op)
    return name[len("aten."):] if name.startswith("aten.") else name


def _plain_counts(counter) -> Dict[str, Dict[str, int]]:
    return {
        module: {_op_name(op): int(n) for op, n in ops.items()}
        for module, ops in counter.get_flop_counts().items()
    }


def _train_step(model, batch_size: int, seq_len: int, vocab_size: int, seed: int):
    batch = make_batch(batch_size, seq_len, vocab_size, seed)
    model.train()
    model.zero_grad(set_to_none=True)
    loss = model(**batch)  # [b, s] per-token losses (labels given)
    loss.sum().backward()
    return loss


def measure_train_flops(
    model, batch_size: int, seq_len: int, *, vocab_size: int, seed: int = 0
) -> int:
    """Total FLOPs (matmul-family ops) of one forward (with labels) + backward."""
    counter = _flop_counter()
    with counter:
        _train_step(model, batch_size, seq_len, vocab_size, seed)
    return int(counter.get_total_flops())


def measure_train_flop_counts(
    model, batch_size: int, seq_len: int, *, vocab_size: int, seed: int = 0
) -> Dict[str, Dict[str, int]]:
    """Per-module {op: flops} of forward+backward. The ``"Global"`` entry (totals per op
    type) is exact; per-module attribution of backward ops is not reliable."""
    counter = _flop_counter()
    with counter:
        _train_step(model, batch_size, seq_len, vocab_size, seed)
    return _plain_counts(counter)


def measure_forward_flops(
    model,
    batch_size: int,
    seq_len: int,
    *,
    vocab_size: int,
    with_labels: bool = True,
    seed: int = 0,
) -> Dict[str, Dict[str, int]]:
    """Per-module {op: flops} of a forward-only pass (reliable attribution).

    Keys are FlopCounterMode module paths (``"Global"``, ``"GPTModel"``,
    ``"GPTModel.decoder.layers.0.self_attention.linear_qkv"``, ...), values map op names
    (``mm``, ``addmm``, ``bmm``, ``baddbmm``) to FLOPs.
    """
    batch = make_batch(batch_size, seq_len, vocab_size, seed)
    if not with_labels:
        batch.pop("labels")
    model.train()  # same code path as training (MTP loss, MoE routing)
    counter = _flop_counter()
    with counter, torch.no_grad():
        model(**batch)
    return _plain_counts(counter)
