"""Megatron-LM's stock ``pretrain_gpt.py``, unmodified, trained on CPU in local gloo processes with
``python -m megatron_flops.launch --flops-accounting corrected`` (the flag only: no edit to
``forward_step``).

core_v0.19.0 (its own Python 3.12 venv, megatron-core 0.19.0): 1 process, TP2, PP2 x VPP2 x DP2,
and packed rows (``--dataloader-inter-document-masking``: offsets padded to ``S + 1`` entries,
``[mbs, S + 1]`` per micro-batch) at micro-batch sizes 1 and 2, each with an evaluation after
iteration 2 that its own accounting counts into iteration 3 and ours does not.
core_v0.16.1 (snapshot in ``../shared``, megatron-core 0.16.1 from the test extra): 1 process,
TP2, PP2 x VPP2 x DP2, and packed rows (``cu_seqlens`` from a dataset with known document
lengths) in 1 process and under PP2 x VPP2 x DP2. core_v0.14.0 (its own venv, megatron-core
0.14.0): 1 process, TP2, PP2 x VPP2 x DP2; its ``pretrain_gpt.py`` has no packed-sequence path.

Expected numbers: ``frameworks.megatron_lm.expected_step`` (a closed form over the model's shapes
and the dataset's document lengths). The CPU shims are listed in ``tests/frameworks/SHIMS.md``.
"""

from __future__ import annotations


import pytest

from frameworks import checks, envs, probes, procs
from frameworks import megatron_lm as mlm

pytestmark = pytest.mark.frameworks

RUNS = (
    [("0.19.0", name) for name in ("1proc", "tp2", "pp2-vpp2-dp2", "packed-eval", "packed-mbs2-eval")]
    + [("0.16.1", name) for name in ("1proc", "tp2", "pp2-vpp2-dp2", "packed", "packed-pp2-vpp2-dp2")]
    + [("0.14.0", name) for name in ("1proc", "tp2", "pp2-vpp2-dp2")]
)
_DONE: dict[tuple[str, str], list[procs.Rank]] = {}


def _run(version: str, name: str, tmp_path_factory) -> list[procs.Rank]:
    """The ranks of one training run; each run happens once per session, shared by the tests."""
    scenario = mlm.SCENARIOS[name]
    if (version, name) not in _DONE:
        env = checks.require(lambda: envs.megatron_lm(version))
        _DONE[version, name] = procs.launch(
            env.python, mlm.rank_args(scenario, envs.snapshot(version), version, framework_flops=scenario.evaluate),
            world_size=scenario.world_size, workdir=tmp_path_factory.mktemp(f"megatron-lm-{version}-{name}"),
            timeout_s=1800, pythonpath=list(env.pythonpath),
        )
    return _DONE[version, name]


@pytest.fixture(params=RUNS, ids=[f"{v}-{n}" for v, n in RUNS])
def run(request, tmp_path_factory):
    """(scenario, ranks) of one training run."""
    version, name = request.param
    return mlm.SCENARIOS[name], _run(version, name, tmp_path_factory)


def test_trains_and_logs_the_corrected_fields(run):
    scenario, ranks = run
    checks.assert_log_lines(ranks[-1].output, mlm.ITERATIONS)


def test_trace_has_the_exact_flops_and_tokens(run):
    scenario, ranks = run
    expected = [mlm.expected_step(scenario, i) for i in range(1, mlm.ITERATIONS + 1)]
    for rank, lines in checks.traces(ranks).items():
        checks.assert_trace(lines, expected, framework="megatron-lm", world_size=scenario.world_size)


def test_closed_form_on_hand_countable_rows():
    # The closed form's two halves, checked on hand-countable rows: one 64-token row, and the same
    # 64 tokens as documents of 16 + 48 (attention 16^2 + 48^2 = 2560 pairs instead of 4096).
    per_token = 6 * (4 * (4 * 64 * 64 + 2 * 64 * 256) + 64 * 4096)
    assert mlm.per_token_flops() == per_token == 2_752_512
    assert mlm.attention_flops(64 * 64) == 6 * 4 * 64 * 4096
    assert mlm.attention_flops(16 * 16 + 48 * 48) == 6 * 4 * 64 * 2560


@pytest.mark.parametrize("name", ["packed-eval", "packed-mbs2-eval"])
def test_core_v0_19_counts_evaluation_into_its_own_number_and_we_do_not(name, tmp_path_factory):
    # core_v0.19.0 sums every forward_step's real offsets into its packed FLOPs statistics and drains
    # them at the next training step: the evaluation after iteration 2 (one global batch of
    # validation rows) lands in iteration 3's number. Ours counts the training batches only.
    scenario = mlm.SCENARIOS[name]
    ranks = _run("0.19.0", name, tmp_path_factory)
    ours = [step["flops"] for step in checks.traces(ranks)[len(ranks) - 1][1:]]
    expected = [mlm.expected_step(scenario, i)["flops"] for i in range(1, mlm.ITERATIONS + 1)]
    assert ours == expected
    # Theirs: called twice an iteration (train() and training_log()), the same value each time.
    theirs = probes.framework_flops(ranks[-1].output)
    assert len(theirs) == 2 * mlm.ITERATIONS and theirs[::2] == theirs[1::2]
    theirs = theirs[::2]
    eval_rows = mlm.validation_rows(scenario)
    assert theirs[:2] == pytest.approx(expected[:2], rel=1e-12)  # exact on training-only iterations
    assert theirs[2] == pytest.approx(mlm.rows_flops(mlm.rows_of_step(scenario, 3) + eval_rows), rel=1e-12)
    ratio = theirs[2] / expected[2]
    assert ratio == pytest.approx(mlm.MEASURED_EVAL_FAULT[name], abs=5e-4)  # the README's faults table


def test_the_model_inputs_agree_with_the_batches_read(run):
    scenario, ranks = run
    checks.assert_model_inputs_agree(ranks)


def test_the_framework_number_is_captured_beside_ours(run, request):
    # core_v0.14.0 and core_v0.16.1 compute the stock full-row formula themselves
    # (num_floating_point_operations(args, batch_size)): their own number is the static one, so the
    # over-report factor vs static shows what packing changes. core_v0.19.0 prices packed rows
    # itself: its number is ours, except on the iteration after an evaluation (the test above).
    scenario, ranks = run
    version = request.node.callspec.params["run"][0]
    for rank, lines in checks.traces(ranks).items():
        steps = lines[1:]
        if version == "0.19.0":
            clean = [step for step in steps if not (scenario.evaluate and step["iteration"] == mlm.EVAL_INTERVAL + 1)]
            assert all(step["framework_flops"] == pytest.approx(step["flops"], rel=1e-12) for step in clean), lines
        else:
            assert all(step["framework_flops"] == step["static_flops"] for step in steps), lines
    factors = [fields["over-report factor vs static"] for fields in mlm.log_lines(ranks[-1].output).values()]
    assert all(f == "1.00x" for f in factors) is not scenario.packed, factors
