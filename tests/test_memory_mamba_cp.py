"""Context parallelism of Mamba layers (megatron-core's ``MambaContextParallel``): the scan's saved
bytes and the ``cp/all_to_all`` payload, labelled unmeasured in the report (the scan is a
CUDA/Triton kernel: no Mamba layer runs on CPU), consistent with the report without CP.

What megatron-core's own code does around the kernels does run on CPU: a real ``MambaMixer``
(megatron-core 0.16.1) in 2 gloo processes under CP 2, the scan and the gated norm replaced by
stand-ins that save what mamba_ssm's kernels save (their inputs as handed over, and ``out_x`` and
``rstd`` of the kernels' sizes). Measured there: the ``cp/all_to_all`` payloads forward and backward,
and every storage saved for backward (the sequence-to-head ``zxBCdt``, the sliced conv weight and
bias, ``A``, the ``dt_bias`` copy, the norm's and the projections' inputs)."""

from __future__ import annotations

import json

import pytest
import torch

import mcore_cpu
import mcore_dist

from megatron_flops.cli import main
from megatron_flops.memory.decoder import DecoderOptions
from megatron_flops.memory.layout import Parallelism, Training
from megatron_flops.memory.report import decoder_memory
from megatron_flops.memory.ssm import mamba_cp_all_to_all, mamba_saved
from megatron_flops.model.spec import ModelSpec

# hidden 64: inner 128, 8 heads of 16, 2 groups of state 16.
SMALL = dict(hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, normalization="RMSNorm",
             add_bias_linear=False, vocab_size=256, mamba_state_dim=16, mamba_head_dim=16, mamba_num_groups=2)
OPTIONS = DecoderOptions(normalization="RMSNorm", add_bias_linear=False, position_embedding_type="rope",
                         padded_vocab_size=256, attention_backend="unfused")


def _spec(pattern: str = "M*-M") -> ModelSpec:
    return ModelSpec.from_mapping(dict(SMALL, hybrid_override_pattern=pattern))


def test_mamba_cp_formulas():
    spec = _spec()
    # CP 1 is the formula without CP (tests/test_memory_ssm.py derives 45,920 for T = 32, bf16).
    assert mamba_saved(spec, tokens=32, tp=1, act=2, cp=1) == mamba_saved(spec, tokens=32, tp=1, act=2) == 45_920
    assert mamba_cp_all_to_all(spec, tokens=32, tp=1, cp=1, act=2) == 0
    # CP 2, T = 16 tokens on this rank, bf16. The scan: 32 tokens (the whole sequence), 4 heads,
    # inner 64, 1 group: zxBCdt [32, 2*64 + 2*16 + 4 = 164] 10,496; out_x [32, 64] 4,096; A and
    # exp(A_log) 2 x 4 x 4 = 32 and the dt_bias copy 16; the conv weight and bias sliced for this
    # rank [64 + 2*16 = 96] x (4 + 1) x 2 = 960. After the all-to-all back: the norm's input [16, 128]
    # 4,096 and rstd 16 x 2 x 4 = 128, out_proj's input 4,096. Total 23,920.
    assert mamba_saved(spec, tokens=16, tp=1, act=2, cp=2) == 23_920
    # All-to-all in (z, x [16, 128] each, B, C [16, 32] each, dt [16, 8]) and out ([32, 64]):
    # 16 x (3 x 128 + 2 x 32 + 8) x 2 = 14,592 bytes per layer and direction.
    assert mamba_cp_all_to_all(spec, tokens=16, tp=1, cp=2, act=2) == 14_592
    # CP 4 > 2 groups: each group's B and C repeated to 2 ranks: 16 x (384 + 2 x 2 x 2 x 16 + 8) x 2.
    assert mamba_cp_all_to_all(spec, tokens=16, tp=1, cp=4, act=2) == 16_640
    # TP 2 x CP 2: per TP rank inner 64, 1 group, 4 heads; per CP rank a scan of 2 heads, inner 32 and
    # the one group (repeated) on 32 tokens: 32 x (64 + 32 + 2) x 2 + 32 x 32 x 2 + 2 x 2 x 4 + 2 x 4
    # = 8,344; conv slices (32 + 32) x 5 x 2 = 640; norm and out_proj 16 x 64 x 2 x 2 + 16 x 4 = 4,160.
    assert mamba_saved(spec, tokens=16, tp=2, act=2, cp=2) == 13_144


def test_cp1_equals_the_report_without_cp(tmp_path, capsys):
    spec = _spec()
    training = Training(seq_length=16, micro_batch_size=2, num_microbatches=2)
    assert decoder_memory(spec, OPTIONS, Parallelism(cp=1, dp=2), training) == \
        decoder_memory(spec, OPTIONS, Parallelism(dp=2), training)
    model = tmp_path / "hybrid.json"
    model.write_text(json.dumps(dict(SMALL, hybrid_override_pattern="M*-M")))
    reports = []
    for flags in ([], ["--cp", "1"]):
        assert main(["memory", "--model", str(model), "--seq-length", "16", "--dp", "2", "--json", *flags]) == 0
        reports.append(json.loads(capsys.readouterr().out))
    assert reports[0] == reports[1] and not any(k.startswith("cp/") for k in reports[0]["communication_per_step"])


def test_cp2_prices_mamba_all_to_all_and_the_attention_ring():
    spec = _spec()
    training = Training(seq_length=16, micro_batch_size=2, num_microbatches=2)
    report = decoder_memory(spec, OPTIONS, Parallelism(cp=2), training)
    comm = report.per_gpu.communication
    # 2 micro-batches x 2 Mamba layers x (forward + backward) x 14,592 (8 of 16 tokens x 2 sequences).
    assert comm["cp/all_to_all"] == 2 * 2 * 2 * 14_592
    # The ring passes K and V of the one attention layer only (not of the MLP-only or Mamba layers):
    # 2 micro-batches x 1 layer x (CP - 1) x 2 x 3 x K, V [16 tokens, 4 heads x 16] bf16.
    kv = 2 * 16 * 4 * 16 * 2
    assert comm["cp/send_recv"] == 2 * 1 * 1 * 2 * 3 * kv
    act = report.per_gpu.activations_per_microbatch[0]["mamba"]
    # Two Mamba layers: in_proj's input [16, 64] bf16 and the formula above.
    assert act == 2 * (16 * 64 * 2 + mamba_saved(spec, tokens=16, tp=1, act=2, cp=2))
    assert any("context parallelism of Mamba layers (CP 2)" in u and "out_x" in u for u in report.unmeasured)
    assert not report.not_modelled


@pytest.mark.parametrize("flags, message", [
    (["--cp", "16"], "mamba_num_heads / TP = 8 is not divisible by --cp 16"),
    (["--tp", "2", "--cp", "2", "--sequence-parallel"], None),
])
def test_megatron_core_cp_limits(tmp_path, capsys, flags, message):
    model = tmp_path / "hybrid.json"
    model.write_text(json.dumps(dict(SMALL, hybrid_override_pattern="M*-M")))
    rc = main(["memory", "--model", str(model), "--seq-length", "64", *flags])
    if message is None:
        assert rc == 0 and "cp/all_to_all" in capsys.readouterr().out
    else:
        assert rc == 2 and message in capsys.readouterr().err


class _Scan(torch.autograd.Function):
    """mamba_ssm's ``mamba_split_conv1d_scan_combined`` stand-in: saves what the kernel saves
    (``zxbcdt``, the conv weight and bias, ``out_x`` [b, l, inner], ``A``, ``D``, ``dt_bias``) and
    returns [b, l, inner] (the z part: no scan)."""

    @staticmethod
    def forward(ctx, zxbcdt, weight, bias, dt_bias, A, D, inner):
        out_x = torch.empty(*zxbcdt.shape[:2], inner, dtype=zxbcdt.dtype)
        ctx.save_for_backward(zxbcdt, weight, bias, out_x, A, D, dt_bias)
        return zxbcdt[..., :inner].clone()

    @staticmethod
    def backward(ctx, grad):
        zxbcdt = ctx.saved_tensors[0]
        dx = torch.zeros_like(zxbcdt)
        dx[..., :grad.shape[-1]] = grad
        return dx, None, None, None, None, None, None


class _NormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, groups):
        rstd = torch.empty(x.shape[0] * x.shape[1] * groups, dtype=torch.float32)
        ctx.save_for_backward(x, rstd)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatedNorm(torch.nn.Module):
    """mamba_ssm's gated RMSNorm stand-in: its ``weight``; saves the input and fp32 rstd per token and group."""

    def __init__(self, hidden_size, eps=1e-5, group_size=None, norm_before_gate=True, device=None, dtype=None):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.groups = hidden_size // group_size

    def forward(self, x, z=None):
        return _NormFn.apply(x, self.groups)


def _mamba_cp_worker(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm import mamba_mixer
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    import mcore_memory

    mcore_dist.init_worker()
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(context_parallel_size=world_size)
    for name, value in (("HAVE_MAMBA_SSM", True), ("RMSNormGated", _GatedNorm), ("ExtendedRMSNorm", _GatedNorm)):
        setattr(mamba_mixer, name, value)
    out = []
    for case in cases:
        fields = {k: v for k, v in case["model"].items() if k not in ("vocab_size", "hybrid_override_pattern")}
        config = mcore_cpu.make_config(dict(fields, num_layers=1, context_parallel_size=world_size))
        inner = 2 * fields["hidden_size"] // world_size
        mamba_mixer.mamba_split_conv1d_scan_combined = (
            lambda z, w, b, dt, A, D=None, **_: _Scan.apply(z, w, b, dt, A, D, inner))
        with mcore_cpu.cuda_to_cpu_mode():
            mixer = mamba_mixer.MambaMixer(config, mamba_mixer.MambaMixerSubmodules(
                in_proj=ColumnParallelLinear, out_proj=RowParallelLinear), d_model=fields["hidden_size"],
                layer_number=1, pg_collection=ProcessGroupCollection.use_mpu_process_groups()).bfloat16()
        meter = mcore_memory.SavedTensorMeter(mixer.parameters())
        comm = mcore_memory.CommMeter([("cp", ps.get_context_parallel_group())])
        x = torch.randn(case["seq"] // world_size, case["mbs"], fields["hidden_size"], dtype=torch.bfloat16,
                        requires_grad=True)
        with comm, meter.tracking(), meter.one_forward(), mcore_cpu.cuda_to_cpu_mode():
            y, _ = mixer(x)
        forward_comm = dict(comm.bytes)
        with comm:
            y.float().sum().backward()
        out.append(dict(saved=meter.forward[0], forward=forward_comm, step=dict(comm.bytes)))
    dist.barrier()
    return out


# 8 heads of 16 (inner 128), state 16: 2 groups (one per CP rank), 1 group (repeated to both ranks).
CP_CASES = [dict(model=dict(SMALL, hybrid_override_pattern="M"), seq=16, mbs=2),
            dict(model=dict(SMALL, hybrid_override_pattern="M", mamba_num_groups=1), seq=8, mbs=1)]


@pytest.mark.dist
@pytest.mark.skipif(not mcore_cpu.HAVE_MCORE, reason=mcore_cpu.SKIP_REASON)
def test_mamba_cp_collectives_and_saved_storages_on_gloo():
    ranks = mcore_dist.run_distributed(_mamba_cp_worker, 2, CP_CASES, timeout=600)
    for case, *measured in zip(CP_CASES, *ranks):
        spec = ModelSpec.from_mapping(case["model"])
        tokens = case["seq"] // 2 * case["mbs"]
        one_way = mamba_cp_all_to_all(spec, tokens=tokens, tp=1, cp=2, act=2)
        for rank in measured:
            assert rank["forward"] == {"cp/all_to_all": one_way}
            assert rank["step"] == {"cp/all_to_all": 2 * one_way}
            # in_proj's input [T, 64] bf16, then the formula.
            assert rank["saved"] == tokens * 64 * 2 + mamba_saved(spec, tokens=tokens, tp=1, act=2, cp=2)
