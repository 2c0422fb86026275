"""A VLM under torch FSDP2 as Megatron-LM's ``--use-torch-fsdp2`` (megatron-core's
``TorchFullyShardedDataParallel``) wraps Megatron-Bridge's ``Qwen25VLModel``: the Hugging Face
Qwen2.5-VL tower (``visual``, registered first) before a megatron-core GPT, bf16
(``Float16Module``), one real step of megatron-core's schedule in 2 gloo processes, each forward
as Bridge's (tests/test_memory_vision.py::vlm_module). Checked against
:func:`megatron_flops.memory.decoder_fsdp.fsdp_decoder_rank` on every rank: which modules are
``fully_shard`` units (the tower has no ``TransformerLayer``: it joins the root), the parameter and
gradient shards, the optimizer's main copies and Adam moments, the all-gather/reduce-scatter
payloads, and the whole (unsharded) weights and gradients alive at once on CPU."""

from __future__ import annotations

import math

import pytest

import mcore_cpu
import mcore_dist
import test_memory_decoder_fsdp as fsdp_test
import test_memory_vision as vision_test
from megatron_flops.memory.decoder import DecoderOptions, chunk_parameters
from megatron_flops.memory.decoder_fsdp import fsdp_decoder_rank, fsdp_units, real_rows
from megatron_flops.memory.layout import Parallelism, Training
from megatron_flops.memory.vision import vision_parameters
from megatron_flops.model.spec import ModelSpec

pytestmark = [pytest.mark.dist, pytest.mark.skipif(not mcore_cpu.HAVE_MCORE, reason=mcore_cpu.SKIP_REASON)]

WORLD, SEQ, MBS, M = 2, 16, 2, 2
VOCAB = fsdp_test.VOCAB
IMAGE = VOCAB - 1
GRIDS = [[1, 4, 4], [1, 4, 8]]  # 4 + 8 image tokens in the first of 2 rows of 16
DECODER = dict(fsdp_test.BASE, add_bias_linear=False, normalization="RMSNorm")
# An odd MLP width (45 rows: 23 and 22 per rank) and the merger out to the decoder's width.
TOWER = dict(vision_test.QWEN25, intermediate_size=45, out_hidden_size=DECODER["hidden_size"])
FREEZE = {"trained": True, "frozen blocks": False}


class LiveMeter:
    """The bytes of whole (unsharded) parameters and gradients FSDP2 holds, sampled at every
    operator run under it: ``peak`` their largest sum."""

    def __init__(self, model) -> None:
        from torch.distributed.fsdp import FSDPModule

        self.units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        self.peak = 0

    def sample(self) -> None:
        import mcore_memory

        whole = []
        for unit in self.units:
            group = unit._get_fsdp_state()._fsdp_param_group
            for fp in group.fsdp_params if group is not None else ():
                param = getattr(fp, "_unsharded_param", None)
                if param is not None:
                    whole += [param] + ([param.grad] if param.grad is not None else [])
        self.peak = max(self.peak, mcore_memory.unique_bytes(whole))

    def mode(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        meter = self

        class Sampler(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                meter.sample()
                return out

        return Sampler()


def _worker(rank: int, world_size: int) -> dict:
    import torch

    import mcore_memory

    mcore_dist.init_worker()
    out = {}
    for freeze, model_trains in FREEZE.items():
        mcore_memory.reinit_parallel()
        torch.manual_seed(0)

        def wrap(gpt):
            vlm = vision_test.vlm_module(gpt, GRIDS, TOWER, image_token=IMAGE)
            for p in list(vlm.visual.blocks.parameters()) + list(vlm.visual.patch_embed.parameters()):
                p.requires_grad_(model_trains)
            return vlm

        model, optimizer = fsdp_test._fsdp_training(DECODER, params_dtype="bf16", wrap=wrap)
        from torch.distributed.fsdp import FSDPModule

        units = [type(m).__name__ for m in model.modules() if isinstance(m, FSDPModule)]
        comm = mcore_memory.CommMeter(mcore_memory.megatron_groups())
        live = LiveMeter(model)
        with comm, live.mode():
            mcore_dist.run_schedule(
                [model], num_microbatches=M, micro_batch_size=MBS, seq_length=SEQ, vocab_size=VOCAB,
                data_iterators=[vision_test.vlm_batches(GRIDS, M, MBS, SEQ, seed=rank, image_token=IMAGE)],
                count_flops=False,
                forward_step_func=mcore_memory.metered_forward_step(mcore_memory.SavedTensorMeter([]), [model]))
        states = fsdp_test._states(model, optimizer)
        with mcore_memory.on_cpu():
            optimizer.step()
        states.update(fsdp_test._optimizer_states(optimizer))
        out[freeze] = dict(
            units=units, states=states, comm=dict(comm.bytes), live=live.peak,
            names=[(n, tuple(fsdp_test._local(p).shape), tuple(p.shape)) for n, p in model.named_parameters()])
        del model, optimizer
    return out


@pytest.fixture(scope="module")
def measured():
    results = mcore_dist.run_distributed(_worker, WORLD, timeout=600)
    return {freeze: [r[freeze] for r in results] for freeze in FREEZE}


def _params(model_trains: bool):
    spec = ModelSpec.from_mapping(dict(DECODER, vocab_size=VOCAB, share_embeddings_and_output_weights=False))
    options = DecoderOptions.from_mapping(dict(DECODER, padded_vocab_size=VOCAB, attention_backend="local",
                                               position_embedding_type="rope"))
    tower = vision_test._tower("qwen2_5_vl", TOWER)
    return (vision_parameters(tower, model_trains=model_trains)
            + chunk_parameters(spec, options, Parallelism(dp=WORLD, fsdp=True), pp_rank=0, chunk=0, seq_length=SEQ))


def test_explore(measured):
    for freeze, model_trains in FREEZE.items():
        params = _params(model_trains)
        training = Training(seq_length=SEQ, micro_batch_size=MBS, num_microbatches=M, params_dtype="bf16")
        for rank, result in enumerate(measured[freeze]):
            print(freeze, rank, result["units"], result["live"])
            got = [(n.replace("module.", "").replace("language_model.", ""), local, whole)
                   for n, local, whole in result["names"]]
            want = [(p.name, real_rows(p, WORLD, rank), p.numel) for p in params]
            assert [(n, shape[0] if shape else 0, math.prod(whole)) for n, shape, whole in got] == want
            states, comm = fsdp_decoder_rank(params, training, dp=WORLD, rank=rank)
            print(states, result["states"])
            print(comm, result["comm"])
            print([sum(p.numel for p in u) for u in fsdp_units(params)])
    assert 0
