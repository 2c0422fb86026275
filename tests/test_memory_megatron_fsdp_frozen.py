"""Megatron-FSDP with a frozen base (LoRA adapters on ``linear_qkv``, ``linear_proj``, ``linear_fc1``,
``linear_fc2``; :mod:`megatron_flops.memory.megatron_fsdp`) against real steps in 2 gloo processes
(tests/mfsdp_frozen_step.py, the Megatron-FSDP step scaffolding of tests/test_memory_megatron_fsdp.py):

- megatron-core 0.16.1 (this environment) cannot wrap a frozen parameter;
- megatron-core 0.19.2 (Megatron-Bridge 0.6.2's Python 3.12 venv, skipped where it is absent) trains
  it under optim_grads and optim_grads_params: buffers, optimizer shards and dp/ collectives of a
  step after the first, per rank, to the byte; its optim strategy fails at finish_grad_sync, and
  the CLI refuses it."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
from pathlib import Path

import pytest

import mcore_cpu
from megatron_flops.cli import main
from megatron_flops.flops.passes import PeftSpec
from megatron_flops.memory.decoder import DecoderOptions, chunk_parameters
from megatron_flops.memory.layout import Parallelism, Training
from megatron_flops.memory.megatron_fsdp import megatron_fsdp_rank
from megatron_flops.model.spec import ModelSpec

TESTS = Path(__file__).resolve().parent
STEP = TESTS / "mfsdp_frozen_step.py"
VENV = "megatron-bridge-0.6.2"
# name -> (strategy, micro-batches, frozen base[, layers: 2])
RUNS = {"optim": ("optim", 2, True), "optim_grads": ("optim_grads", 3, True),
        "optim_grads_params": ("optim_grads_params", 3, True), "optim_grads_params m1": ("optim_grads_params", 1, True),
        "optim_grads_params, 3 layers": ("optim_grads_params", 2, True, 3)}
FIELDS = dict(num_layers=2, hidden_size=48, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=72,
              share_embeddings_and_output_weights=False)


def _params(num_layers: int = 2):
    fields = dict(FIELDS, num_layers=num_layers)
    spec = ModelSpec.from_mapping(dict(fields, vocab_size=96))
    options = DecoderOptions.from_mapping(dict(fields, padded_vocab_size=96, position_embedding_type="rope",
                                               add_bias_linear=False))
    return chunk_parameters(spec, options, Parallelism(), pp_rank=0, chunk=0, seq_length=16,
                            peft=PeftSpec(frozen=True, lora_rank=4))


@pytest.mark.dist
def test_megatron_core_0_16_1_cannot_wrap_a_frozen_base():
    if not mcore_cpu.HAVE_MCORE:
        pytest.skip(mcore_cpu.SKIP_REASON)
    import mcore_dist
    import mfsdp_frozen_step

    got = mcore_dist.run_by_name(mfsdp_frozen_step.step_worker, 2, {"optim_grads": RUNS["optim_grads"]}, timeout=600)
    assert got["optim_grads"][0] == {
        "error": "RuntimeError: cannot register a hook on a tensor that doesn't require gradient"}


@pytest.fixture(scope="module")
def measured_0_19_2():
    venvs = Path(os.environ.get("MEGATRON_FLOPS_TEST_VENVS") or Path.home() / ".cache" / "megatron-flops" / "venvs")
    python = venvs / VENV / "bin" / "python"
    if not python.is_file():
        pytest.skip(f"megatron-core 0.19.2 needs the {VENV} venv ({python} absent; tests/frameworks/envs.py makes it)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)])}
    done = subprocess.run([str(python), str(STEP), json.dumps(RUNS)], capture_output=True, text=True, env=env,
                          timeout=900, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.dist
@pytest.mark.parametrize("name", [n for n in RUNS if n != "optim"])
def test_megatron_core_0_19_2_states_and_collectives(measured_0_19_2, name):
    # Buckets (DP 2): optim_grads, one frozen (embedding, norms, bases, output layer: 37,440 elements
    # with padding) and one trainable (the 16 adapter matrices: 4,032); optim_grads_params, the frozen
    # ones outside the layers (9,312) and per layer a frozen (14,112) and an adapter bucket (2,016).
    # Measured e.g. optim_grads_params, m 3: bf16 weights 41,568 / 2 x 2 bytes; bf16 main gradients
    # 2,016 x 2; fp32 main weights 2,016 x 4; reduce-scatter 3 x 4,032 x 2; all-gather
    # 9,312 + (2 x 3 + 3 + 1) x 16,128 bf16 elements = 341,184 bytes (each layer 2m times, the last m + 1).
    strategy, m, _, *layers = RUNS[name]
    training = Training(seq_length=16, micro_batch_size=2, num_microbatches=m)
    for rank, got in enumerate(measured_0_19_2[name]):
        states, comm = megatron_fsdp_rank(_params(*layers), training, strategy=strategy, sizes={"dp": 2, "expt_dp": 2},
                                          ranks={"dp": rank, "expt_dp": rank}, bucket_size=None)
        states.pop("megatron_fsdp/unsharded_working_copies", None)  # (a formula: not measurable here)
        assert states == got["states"], rank
        assert comm == got["comm"], rank


@pytest.mark.dist
def test_megatron_core_0_19_2_optim_fails_and_is_refused(measured_0_19_2):
    assert measured_0_19_2["optim"][0]["error"].startswith("AttributeError")  # (finish_grad_sync)
    with pytest.raises(ValueError, match="optim strategy cannot train a frozen base"):
        megatron_fsdp_rank(_params(), Training(seq_length=16, micro_batch_size=2), strategy="optim",
                           sizes={"dp": 2, "expt_dp": 2}, ranks={"dp": 0, "expt_dp": 0}, bucket_size=None)


def test_the_report_says_which_megatron_core():
    out = io.StringIO()
    line = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 128 --seq-length 16 "
            "--max-position-embeddings 16 --vocab-size 100 --bf16")
    argv = ["memory", "--megatron-args", line, "--dp", "2", "--frozen", "--lora-rank", "4", "--json"]
    with contextlib.redirect_stdout(out):
        assert main([*argv, "--megatron-fsdp", "optim_grads_params"]) == 0
    report = json.loads(out.getvalue())
    assert any("megatron-core 0.19.2" in a and "0.16.1 cannot train" in a for a in report["assumptions"])
    with contextlib.redirect_stderr(io.StringIO()) as err:
        assert main([*argv, "--megatron-fsdp", "optim"]) == 2
    assert "optim strategy cannot train a frozen base" in err.getvalue()
