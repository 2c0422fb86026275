"""Megatron-Bridge 0.3.1 ``pretrain()`` on CPU: the model, the scenarios, their datasets and their
expected numbers (test-only; the framework imports happen inside the rank processes).

GPT scenarios train the same small dense GPT as the Megatron-LM ones (``frameworks.megatron_lm``:
4 layers, hidden 64, 4 heads, GELU 256, RoPE, vocabulary 4096, rows of 64 tokens) with
``gpt_step.forward_step``: unpacked rows from megatron-core's mock dataset, or packed rows from
Megatron-Bridge's own ``GPTSFTPackedDataset`` reading a packed ``.npy`` file written here (the
collate function makes ``cu_seqlens`` with the ``-1`` sentinel, ``cu_seqlens_argmin``,
``max_seqlen`` and, with sub-sequence padding, ``cu_seqlens_unpadded``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from frameworks import megatron_lm as mlm

SEQ = mlm.SEQ
VOCAB = mlm.PADDED_VOCAB  # the provider's vocab_size, unpadded (should_pad_vocab is off)
ITERATIONS = 3
PACKED_SEED = 23
EOS = VOCAB - 1  # NullTokenizer's end-of-document id


@dataclass(frozen=True, kw_only=True)
class Scenario:
    name: str
    world_size: int = 1
    pp: int = 1
    micro_batch: int = 2
    global_batch: int = 8
    packed: bool = False
    pad_to_mult: int = 1  # GPTSFTPackedDataset's pad_seq_to_mult (> 1: cu_seqlens_unpadded too)
    vlm: bool = False
    config_flag: bool = False
    vpp: int | None = None  # virtual pipeline stages (interleaved schedule)
    release: str = "0.3.1"  # the Megatron-Bridge release (its venv: envs.megatron_bridge)

    @property
    def num_microbatches(self) -> int:
        return self.global_batch // self.micro_batch


SCENARIOS = {
    s.name: s
    for s in (
        Scenario(name="1proc"),
        Scenario(name="pp2", world_size=2, pp=2, config_flag=True),
        Scenario(name="packed", micro_batch=1, global_batch=4, packed=True, pad_to_mult=4),
        Scenario(name="packed-pp2", world_size=2, pp=2, micro_batch=1, global_batch=4, packed=True),
        Scenario(name="vlm", global_batch=4, vlm=True),
        Scenario(name="vlm-packed", global_batch=4, vlm=True, packed=True),
        Scenario(name="0.6.2-1proc", release="0.6.2"),
        Scenario(name="0.6.2-pp2", world_size=2, pp=2, config_flag=True, release="0.6.2"),
        Scenario(name="0.6.2-pp2-vpp2", world_size=2, pp=2, vpp=2, release="0.6.2"),
        Scenario(name="0.6.2-packed", micro_batch=1, global_batch=4, packed=True, pad_to_mult=4, release="0.6.2"),
        Scenario(name="0.6.2-vlm", global_batch=4, vlm=True, release="0.6.2"),
        Scenario(name="0.6.2-packed-pp2", world_size=2, pp=2, micro_batch=1, global_batch=4, packed=True,
                 release="0.6.2"),
    )
}
# Model settings for the CPU: fp32, local layers' unfused paths, no dropout.
CPU_MODEL_SETTINGS = dict(
    bf16=False, fp16=False, use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
    masked_softmax_fusion=False, cross_entropy_loss_fusion=False, gradient_accumulation_fusion=False,
    bias_activation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
)


# ---- the packed dataset: documents of known lengths ----------------------------------------------


def packed_rows(s: Scenario, num_rows: int) -> list[list[int]]:
    """Real document lengths of each packed row. With ``pad_to_mult`` > 1 every document is padded to
    that multiple and the padded documents leave a tail of the row empty; with 1 they fill it exactly."""
    rows = []
    for index in range(num_rows):
        rng = random.Random(PACKED_SEED * 1_000_003 + index)
        if s.pad_to_mult == 1:
            cuts = sorted(rng.sample(range(1, SEQ), rng.randint(0, 3)))
            rows.append([b - a for a, b in zip([0, *cuts], [*cuts, SEQ])])
            continue
        docs, used = [], 0
        while True:
            n = rng.randint(1, 24)
            padded = -(-n // s.pad_to_mult) * s.pad_to_mult
            if used + padded > SEQ - 4:  # keep a tail of at least 4 pad tokens
                break
            docs.append(n)
            used += padded
        rows.append(docs)
    return rows


def padded(s: Scenario, n: int) -> int:
    return -(-n // s.pad_to_mult) * s.pad_to_mult


def write_packed_file(s: Scenario, path: Path, num_rows: int) -> None:
    """The packed ``.npy`` ``GPTSFTPackedDataset`` reads: per row ``input_ids``, ``seq_start_id`` and
    ``loss_mask``. A document of n real tokens, padded to p, spans p + 1 ids (its collate function
    shifts labels by one): n non-EOS ids, then EOS."""
    import numpy as np

    items = []
    for index, docs in enumerate(packed_rows(s, num_rows)):
        rng = random.Random(PACKED_SEED + index)
        ids, starts = [], []
        for n in docs:
            starts.append(len(ids))
            ids += [rng.randrange(1, EOS) for _ in range(n)] + [EOS] * (padded(s, n) - n + 1)
        items.append({"input_ids": ids, "seq_start_id": starts, "loss_mask": [1] * len(ids)})
    np.save(path, np.array(items, dtype=object), allow_pickle=True)


# ---- the configuration (imports Megatron-Bridge: rank processes only) ------------------------------


def config(s: Scenario):
    """The ``ConfigContainer`` of scenario ``s``: CPU settings (gloo, fp32, local layers, no fusions,
    no gradient clipping), no evaluation and no checkpoints."""
    from megatron.bridge.models.gpt_provider import GPTModelProvider, local_layer_spec
    from megatron.bridge.training.config import (
        CheckpointConfig, ConfigContainer, DistributedDataParallelConfig, DistributedInitConfig, LoggerConfig,
        MockGPTDatasetConfig, OptimizerConfig, RNGConfig, SchedulerConfig, TokenizerConfig, TrainingConfig,
    )

    if s.vlm:
        from frameworks import vlm

        model, dataset = vlm.model_provider(s), vlm.dataset_provider(s)
    else:
        model = GPTModelProvider(
            num_layers=mlm.LAYERS, hidden_size=mlm.HIDDEN, num_attention_heads=mlm.HEADS, ffn_hidden_size=mlm.FFN,
            seq_length=SEQ, vocab_size=VOCAB, position_embedding_type="rope", transformer_layer_spec=local_layer_spec,
            **CPU_MODEL_SETTINGS,
        )
    model.pipeline_model_parallel_size = s.pp
    model.virtual_pipeline_model_parallel_size = s.vpp
    if s.vlm:
        pass
    elif s.packed:
        dataset = packed_dataset_provider(s)
    else:
        dataset = MockGPTDatasetConfig(
            random_seed=1234, seq_length=SEQ, reset_position_ids=False, reset_attention_mask=False,
            eod_mask_loss=False, num_dataset_builder_threads=1, split="1,0,0", dataloader_type="single",
            num_workers=0, data_sharding=True, pin_memory=False,
        )
    return ConfigContainer(
        model=model,
        train=TrainingConfig(micro_batch_size=s.micro_batch, global_batch_size=s.global_batch,
                             train_iters=ITERATIONS, eval_iters=0, eval_interval=1000),
        optimizer=OptimizerConfig(optimizer="adam", lr=1e-4, min_lr=1e-5, clip_grad=0.0, bf16=False, fp16=False,
                                  params_dtype=__import__("torch").float32, use_distributed_optimizer=False),
        scheduler=SchedulerConfig(lr_decay_style="constant", start_weight_decay=0.01, end_weight_decay=0.01),
        ddp=DistributedDataParallelConfig(use_distributed_optimizer=False),
        dataset=dataset,
        logger=LoggerConfig(log_interval=1, log_throughput=True),
        tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=VOCAB),
        checkpoint=CheckpointConfig(),
        rng=RNGConfig(seed=1234),
        dist=DistributedInitConfig(distributed_backend="gloo"),
    )


def packed_dataset_provider(s: Scenario):
    """A ``DatasetProvider`` (Megatron-Bridge's extension point for custom data) that builds the stock
    ``GPTSFTPackedDataset`` over a packed file written in the working directory."""
    import os
    from dataclasses import dataclass as dc

    try:
        from megatron.bridge.data.packing.gpt_sft import GPTSFTPackedDataset  # 0.6
    except ImportError:
        from megatron.bridge.data.datasets.sft import GPTSFTPackedDataset  # 0.3.1
    from megatron.bridge.training.config import DatasetProvider

    @dc(kw_only=True)
    class PackedFile(DatasetProvider):
        def build_datasets(self, context):
            path = Path(f"packed.rank{os.environ.get('RANK', '0')}.npy")
            write_packed_file(s, path, num_rows=context.train_samples)
            # NullTokenizer has no eos_id (the SFT datasets' real tokenizers do): its end-of-document id.
            tokenizer = type("NullTokenizerWithEos", (), {"eos_id": context.tokenizer.eod})()
            assert tokenizer.eos_id == EOS, (tokenizer.eos_id, type(context.tokenizer))
            train = GPTSFTPackedDataset(str(path), tokenizer, max_seq_length=SEQ, pad_to_max_length=True,
                                        pad_seq_to_mult=s.pad_to_mult, seed=1234, prompt_template="{input} {output}",
                                        label_key="output", truncation_field="input")
            return train, None, None

    return PackedFile(dataloader_type="single", num_workers=0, data_sharding=True, pin_memory=False)


# ---- expected numbers ------------------------------------------------------------------------------


def expected_step(s: Scenario, iteration: int) -> dict[str, int]:
    """The trace integers of one step, from the documents' lengths (closed forms: ``frameworks.megatron_lm``).

    Unpacked rows are full. Packed rows: real tokens and lengths are the documents'; the row's
    token slots and the padded lengths (each document padded to ``pad_to_mult``, plus the empty
    tail as one padded segment) price the executed FLOPs. The empty tail is no sequence."""
    first = (iteration - 1) * s.global_batch
    rows = s.global_batch
    if s.packed:
        docs = packed_rows(s, first + rows)[first:]
        real = [n for row in docs for n in row]
        pads = [padded(s, n) for n in real] + [SEQ - sum(padded(s, n) for n in row) for row in docs]
        pads = [p for p in pads if p]
    else:
        real = pads = [SEQ] * rows
    static = rows * SEQ * mlm.per_token_flops() + mlm.attention_flops(rows * SEQ * SEQ)
    return {
        "iteration": iteration,
        "flops": sum(real) * mlm.per_token_flops() + mlm.attention_flops(sum(n * n for n in real)),
        "executed_flops": rows * SEQ * mlm.per_token_flops() + mlm.attention_flops(sum(p * p for p in pads)),
        "static_flops": static,
        "num_tokens": sum(real),
        "num_padded_tokens": rows * SEQ,
        "num_sequences": len(real),
        "num_microbatches": s.num_microbatches,
    }


def framework_flops(s: Scenario, iteration: int) -> int:
    """Megatron-Bridge 0.6.2's own number for one step (``flop_utils.accumulate_flops_metadata``):
    the linear terms over every row slot, the attention over the real sub-sequence lengths, on
    the stage that runs the first layers. On the last pipeline stage, which logs, its forward
    step has no tokens and every row counts as one full-length sequence: the stock static number."""
    step = expected_step(s, iteration)
    if not s.packed or s.pp > 1:
        return step["static_flops"]
    first = (iteration - 1) * s.global_batch
    real = [n for row in packed_rows(s, first + s.global_batch)[first:] for n in row]
    return s.global_batch * SEQ * mlm.per_token_flops() + mlm.attention_flops(sum(n * n for n in real))
