"""Framework adapters against stand-ins of the upstream training modules.

The real training loops run in ``tests/test_frameworks_*.py`` (in venvs of their own, in local
gloo processes); these fast tests cover the hook mechanics and failure paths. The stand-ins below are built in ``sys.modules`` per test from source
text (so that each function's module globals are the stand-in's, as upstream): same names,
signatures, log-line format and per-iteration call order as upstream, with the bodies reduced to
what the adapters touch. ``megatron`` itself is the real namespace package of megatron-core;
only ``megatron.training*`` / ``megatron.bridge*`` entries are added, so ``megatron.core``
imports as usual.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import itertools
import logging
import subprocess
import sys
import types
from types import SimpleNamespace

import pytest
import torch

import megatron_flops.adapters as adapters_pkg
from megatron_flops import launch
from megatron_flops.adapters import _hooks, env, megatron_bridge, megatron_lm
from megatron_flops.adapters._setup import framework_version
from megatron_flops.reporting.session import Session, get_session, install_session, record, uninstall_session
from megatron_flops.model.spec import ModelSpec
from megatron_flops.tracking.tracker import FlopsTracker

# Stand-in of megatron/training/training.py at Megatron-LM d98e8a6 (2026-08-22): train_step,
# num_floating_point_operations and training_log with upstream's signatures, training_log's
# log-line format (timestamp frozen, interval time given), and train()'s per-iteration order:
# train_step -> iteration += 1 -> num_floating_point_operations -> training_log -> evaluation.
MEGATRON_LM_TRAINING = '''
from datetime import datetime

ARGS = None
TB_WRITER = None
WANDB_WRITER = None
PRINTED = []
INTERVAL_TIME_S = 0.0
NOW = datetime(2026, 8, 22, 12, 0, 0)


def get_args():
    return ARGS


def get_tensorboard_writer():
    return TB_WRITER


def get_wandb_writer():
    return WANDB_WRITER


def print_rank_last(message):
    PRINTED.append(message)


def forward_backward_func(*, forward_step_func, data_iterator, model, num_microbatches, forward_only):
    for _ in range(num_microbatches):
        forward_step_func(data_iterator, model)


def num_floating_point_operations(args, batch_size, seqlen_squared_sum_in_batch=None,
                                  total_real_tokens_in_batch=None):
    return float(args.stock_flops_per_sample * batch_size)


def train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config,
               forward_backward_func, iteration=None, pg_collection=None, p2p_communicator=None):
    forward_backward_func(forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
                          num_microbatches=get_args().num_microbatches, forward_only=False)
    return {}, 0, False, False, 0, 1.0, None, None


def training_log(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale, report_memory_flag,
                 skipped_iter, grad_norm, params_norm, num_zeros_in_grad, max_attention_logit,
                 pg_collection=None, is_first_iteration=False, seqlen_squared_sum_in_batch=None,
                 total_real_tokens_in_batch=None):
    args = get_args()
    writer = get_tensorboard_writer()
    batch_size = args.global_batch_size
    if iteration % args.log_interval == 0 or is_first_iteration:
        elapsed_time_per_iteration = INTERVAL_TIME_S / args.log_interval
        throughput = num_floating_point_operations(
            args, batch_size, seqlen_squared_sum_in_batch=seqlen_squared_sum_in_batch,
            total_real_tokens_in_batch=total_real_tokens_in_batch,
        ) / (elapsed_time_per_iteration * 10**12 * args.world_size)
        if args.log_timers_to_tensorboard and writer:
            writer.add_scalar('throughput', throughput, iteration)
        log_string = f" [{NOW.strftime('%Y-%m-%d %H:%M:%S.%f')}]"
        log_string += ' iteration {:8d}/{:8d} |'.format(iteration, args.train_iters)
        log_string += ' consumed samples: {:12d} |'.format(args.consumed_train_samples)
        log_string += ' elapsed time per iteration (ms): {:.1f} |'.format(elapsed_time_per_iteration * 1000.0)
        if args.log_throughput:
            log_string += f' throughput per GPU (TFLOP/s/GPU): {throughput:.1f} |'
        if learning_rate is not None:
            log_string += f' learning rate: {learning_rate:.6E} |'
        log_string += f' global batch size: {batch_size:5d} |'
        log_string += f' loss scale: {loss_scale:.1f} |'
        if grad_norm is not None:
            log_string += f' grad norm: {grad_norm:.3f} |'
        log_string += ' number of skipped iterations: {:3d} |'.format(0)
        log_string += ' number of nan iterations: {:3d} |'.format(0)
        print_rank_last(log_string)
    return report_memory_flag


def train(forward_step_func, model, data_iterator, num_iterations, eval_interval=None):
    args = get_args()
    iteration = 0
    for _ in range(num_iterations):
        train_step(forward_step_func, data_iterator, model, None, None, None, forward_backward_func,
                   iteration=iteration)
        iteration += 1
        args.consumed_train_samples += args.global_batch_size
        num_floating_point_operations(args, args.global_batch_size)
        training_log({}, {}, 1e-4, iteration, 1.0, False, 0, 1.0, None, None, None)
        if eval_interval and iteration % eval_interval == 0:
            forward_step_func(data_iterator, model)  # evaluate(): forward only, outside train_step
'''

# Stand-ins of Megatron-Bridge main 067f987 (2026-08-22): training_log in
# src/megatron/bridge/training/utils/train_utils.py (signature, interval FLOPs as the delta of
# train_state.floating_point_operations_so_far, log-line format), and train.py, which imports
# it by name, with train_step's signature and train()'s per-iteration order: train_step ->
# step += 1 -> floating_point_operations_so_far += stock FLOPs -> training_log -> evaluation.
MEGATRON_BRIDGE_TRAIN_UTILS = '''
from datetime import datetime

PRINTED = []
NOW = datetime(2026, 8, 22, 12, 0, 0)


def print_rank_last(message):
    PRINTED.append(message)


def training_log(loss_dict, total_loss_dict, learning_rate, decoupled_learning_rate, loss_scale,
                 report_memory_flag, skipped_iter, grad_norm, params_norm, num_zeros_in_grad, config,
                 global_state, history_wct, model, *, pg_collection=None, log_max_attention_logit=None,
                 loaded_iteration=0, seq_length=None):
    train_state = global_state.train_state
    iteration = train_state.step
    logger_config = config.logger
    if iteration % logger_config.log_interval == 0:
        elapsed_time = global_state.interval_time_s
        elapsed_time_per_iteration = elapsed_time / logger_config.log_interval
        num_flops = max(train_state.floating_point_operations_so_far - global_state._flops_at_last_log, 0.0)
        global_state._flops_at_last_log = train_state.floating_point_operations_so_far
        per_gpu_tf = num_flops / elapsed_time / global_state.world_size / 1e12
        log_string = f" [{NOW.strftime('%Y-%m-%d %H:%M:%S')}]"
        log_string += " iteration {:8d}/{:8d} |".format(iteration, config.train.train_iters)
        log_string += " consumed samples: {:12d} |".format(train_state.consumed_train_samples)
        log_string += " elapsed time per iteration (ms): {:.1f} |".format(elapsed_time_per_iteration * 1000.0)
        if logger_config.log_throughput:
            log_string += f" throughput per GPU (TFLOP/s/GPU): {per_gpu_tf:.1f} |"
        log_string += f" learning rate: {learning_rate:.6E} |"
        log_string += f" global batch size: {config.train.global_batch_size:5d} |"
        log_string += f" loss scale: {loss_scale:.1f} |"
        log_string += " number of skipped iterations: {:3d} |".format(0)
        log_string += " number of nan iterations: {:3d} |".format(0)
        print_rank_last(log_string)
    return report_memory_flag
'''

MEGATRON_BRIDGE_TRAIN = '''
from megatron.bridge.training.utils.train_utils import training_log


def forward_backward_func(*, forward_step_func, data_iterator, model, num_microbatches, forward_only):
    for _ in range(num_microbatches):
        forward_step_func(data_iterator, model)


def train_step(forward_step_func, data_iterator, model, optimizer, scheduler, global_state, pg_collection,
               forward_backward_func, p2p_communicator):
    forward_backward_func(forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
                          num_microbatches=global_state.cfg.train.num_microbatches, forward_only=False)
    return {}, 0, False, False, 0, 1.0, None, None


def train(forward_step_func, model, data_iterator, global_state, num_iterations, eval_interval=None):
    config = global_state.cfg
    for _ in range(num_iterations):
        wrapped_train_step = train_step
        wrapped_train_step(forward_step_func, data_iterator, model, None, None, global_state, None,
                           forward_backward_func, None)
        global_state.train_state.step += 1
        global_state.train_state.consumed_train_samples += config.train.global_batch_size
        global_state.train_state.floating_point_operations_so_far += global_state.stock_flops_per_step
        training_log({}, {}, 1e-4, None, 1.0, False, 0, 1.0, None, None, config, global_state, [], model,
                     pg_collection=None, log_max_attention_logit=None, loaded_iteration=0, seq_length=None)
        if eval_interval and global_state.train_state.step % eval_interval == 0:
            forward_step_func(data_iterator, model)  # evaluate_and_print_results(): outside train_step
'''

# The model: 1 layer, h=64, 4 heads of 16, ffn 256 (gelu), vocab 128. Training FLOPs of T tokens
# with sum s^2 = P: x3 of forward qkv 2*T*64*192 + out 2*T*64*64 + mlp 2*2*T*64*256
# + logits 2*T*64*128 = 114,688*T, plus core 2*4*(16+16)*P/2 = 128*P (causal): 344,064*T + 384*P.
MODEL = dict(num_layers=1, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, vocab_size=128)
SEQ_LENGTH = 16
# Each micro-batch: one packed row of 16 slots, sub-sequences 4, 8, 4: T = 16, P = 16 + 64 + 16 = 96,
# 344,064*16 + 384*96 = 5,541,888 FLOPs. A step is 2 micro-batches: 11,083,776.
CU_SEQLENS = [0, 4, 12, 16]
STEP_FLOPS = 11_083_776
# The stock formula prices each of the step's 2 rows as a full 16-token sequence:
# 344,064*16 + 384*256 = 5,603,328 per sample.
STOCK_FLOPS_PER_SAMPLE = 5_603_328
STEP_S = 2e-6
# Peak = 2x the corrected rate: 11,083,776 FLOPs / 2e-6 s = 5.541888 TFLOP/s -> MFU 50%.
PEAK_FLOPS_PER_S = 11_083_776_000_000
# Interval of 2 steps: 22,167,552 FLOPs / 4e-6 s = 5.541888 TFLOP/s; 64 tokens / 4e-6 s.
# Static (our full-row formula) and framework (the fake's num_floating_point_operations) agree here:
# 4 x 5,603,328 / 4e-6 s = 5.603 TFLOP/s -> "5.6". Over-report vs static: 4 x 5,603,328 / 22,167,552 =
# 1.011 -> "1.01x". Below 10 TFLOP/s: 3 significant digits.
FIELDS = (" corrected throughput per GPU (TFLOP/s/GPU): 5.54 | static throughput per GPU (TFLOP/s/GPU): 5.6 |"
          " framework throughput per GPU (TFLOP/s/GPU): 5.6 | over-report factor vs static: 1.01x |"
          " tokens per GPU (tokens/s/GPU): 16000000.0 | MFU (%): 50.0 | HFU (%): 50.0 |")
SCALARS = {
    "throughput/tflops_per_s_per_gpu": 22_167_552 / 4e-6 / 1e12,
    "throughput/static_tflops_per_s_per_gpu": 2 * 2 * STOCK_FLOPS_PER_SAMPLE / 4e-6 / 1e12,
    "throughput/framework_tflops_per_s_per_gpu": 2 * 2 * STOCK_FLOPS_PER_SAMPLE / 4e-6 / 1e12,
    "throughput/over_report_factor_vs_static": 2 * 2 * STOCK_FLOPS_PER_SAMPLE / 22_167_552,
    "throughput/tokens_per_s_per_gpu": 16_000_000.0,
    "throughput/mfu_percent": 50.0,
    "throughput/hfu_percent": 50.0,
    "throughput/num_fallback_iterations": 0.0,
}


def _module(name: str, source: str | None = None) -> types.ModuleType:
    module = types.ModuleType(name)
    if source is None:
        module.__path__ = []  # a package
    else:
        exec(compile(source, f"<stand-in {name}>", "exec"), module.__dict__)
    return module


@pytest.fixture(autouse=True)
def _no_session():
    uninstall_session()
    yield
    uninstall_session()


@pytest.fixture
def mlm(monkeypatch):
    """A fresh Megatron-LM stand-in in sys.modules, with args for a 2-micro-batch, world-1 run."""
    monkeypatch.setitem(sys.modules, "megatron.training", _module("megatron.training"))
    module = _module("megatron.training.training", MEGATRON_LM_TRAINING)
    monkeypatch.setitem(sys.modules, "megatron.training.training", module)
    module.ARGS = argparse.Namespace(
        **MODEL, seq_length=SEQ_LENGTH, world_size=1, context_parallel_size=1, num_microbatches=2,
        global_batch_size=2, log_interval=2, train_iters=10, consumed_train_samples=0, log_throughput=True,
        log_timers_to_tensorboard=False, stock_flops_per_sample=STOCK_FLOPS_PER_SAMPLE,
    )
    # The stock interval time also holds the logging between steps: 5e-6 s for 2 iterations.
    module.INTERVAL_TIME_S = 5e-6
    return module


@pytest.fixture
def bridge(monkeypatch):
    """Fresh Megatron-Bridge stand-ins in sys.modules, and a GlobalState-like object."""
    for name in ("megatron.bridge", "megatron.bridge.training", "megatron.bridge.training.utils"):
        monkeypatch.setitem(sys.modules, name, _module(name))
    utils = _module("megatron.bridge.training.utils.train_utils", MEGATRON_BRIDGE_TRAIN_UTILS)
    monkeypatch.setitem(sys.modules, utils.__name__, utils)
    train = _module("megatron.bridge.training.train", MEGATRON_BRIDGE_TRAIN)
    monkeypatch.setitem(sys.modules, train.__name__, train)
    cfg = SimpleNamespace(
        model=SimpleNamespace(**MODEL, seq_length=SEQ_LENGTH, context_parallel_size=1, tensor_model_parallel_size=1,
                              make_vocab_size_divisible_by=128, should_pad_vocab=False, fp8=None),
        train=SimpleNamespace(train_iters=10, global_batch_size=2, num_microbatches=2),
        logger=SimpleNamespace(log_interval=2, log_throughput=True),
    )
    state = SimpleNamespace(
        cfg=cfg, world_size=1, interval_time_s=5e-6, _flops_at_last_log=0.0, tensorboard_logger=None,
        wandb_logger=None, stock_flops_per_step=2.0 * STOCK_FLOPS_PER_SAMPLE,
        train_state=SimpleNamespace(step=0, consumed_train_samples=0, floating_point_operations_so_far=0.0),
    )
    return SimpleNamespace(train=train, utils=utils, state=state)


class _Writer:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def add_scalar(self, key, value, step):
        self.calls.append((key, value, step))

    def log(self, values, step):
        self.calls.append((values, step))


def _batches():
    while True:
        yield {"tokens": torch.zeros(1, SEQ_LENGTH, dtype=torch.long), "cu_seqlens": torch.tensor(CU_SEQLENS)}


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    record(model=model, tokens=batch["tokens"], cu_seqlens=batch["cu_seqlens"])


def _session(**kw) -> Session:
    ticks = itertools.count()
    return install_session(
        FlopsTracker(ModelSpec.from_mapping(MODEL), seq_length=SEQ_LENGTH),
        peak_flops_per_s=PEAK_FLOPS_PER_S, world_size=1, clock=lambda: next(ticks) * STEP_S, **kw,
    )


MODEL_CHUNK = SimpleNamespace(pre_process=True)  # the first pipeline stage: it owns its micro-batches


def _run_mlm(mlm, num_iterations=2, eval_interval=None):
    mlm.train(_forward_step, MODEL_CHUNK, _batches(), num_iterations, eval_interval=eval_interval)
    return mlm.PRINTED


def _run_bridge(bridge, num_iterations=2, eval_interval=None):
    bridge.train.train(_forward_step, MODEL_CHUNK, _batches(), bridge.state, num_iterations,
                       eval_interval=eval_interval)
    return bridge.utils.PRINTED


# Megatron-LM line at iteration 2: stock 2 x 5,603,328 FLOPs per iteration / 2.5e-6 s = 4.48 TFLOP/s.
MLM_LINE = (
    " [2026-08-22 12:00:00.000000] iteration        2/      10 | consumed samples:            4 |"
    " elapsed time per iteration (ms): 0.0 | throughput per GPU (TFLOP/s/GPU): 4.5 |{fields}"
    " learning rate: 1.000000E-04 | global batch size:     2 | loss scale: 1.0 | grad norm: 1.000 |"
    " number of skipped iterations:   0 | number of nan iterations:   0 |"
)


# ---- the session -----------------------------------------------------------------------------


def test_record_needs_a_session_and_an_open_step():
    tokens = torch.zeros(1, SEQ_LENGTH, dtype=torch.long)
    record(tokens=tokens)  # no session: a no-op
    session = _session()
    record(tokens=tokens)  # no step open (evaluation): ignored
    session.begin_step()
    record(tokens=tokens)
    result = session.end_step()
    # One full-length row of 16: 344,064*16 + 384*256 = 5,603,328.
    assert (result.num_microbatches, result.flops, result.ok) == (1, STOCK_FLOPS_PER_SAMPLE, True)


def test_record_failure_falls_back_and_logs_once(caplog):
    session = _session()
    with caplog.at_level(logging.WARNING, logger="megatron_flops"):
        for _ in range(2):
            session.begin_step()
            record(tokens=torch.zeros(1, SEQ_LENGTH, dtype=torch.long), cu_seqlen=None)  # a typo
            assert session.end_step().ok is False
    # Once each: why, and that the failed step (nothing counted: no rows) has no static number.
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2 and "record() failed (TypeError" in messages[0], messages
    assert "no static number is known" in messages[1]
    report = session.report()
    assert (report.num_iterations, report.num_fallback_iterations) == (2, 2)


def test_session_steps_and_framework_flops():
    session = _session()
    with pytest.raises(ValueError, match="without begin_step"):
        session.end_step()
    assert session.report() is None
    session.begin_step()
    session.end_step(elapsed_s=0.5, iteration=7)
    session.set_framework_flops(1000.4)  # rounded
    with pytest.raises(ValueError, match="framework's FLOPs"):
        session.set_framework_flops(float("nan"))
    report = session.report()
    assert (report.first_iteration, report.elapsed_s, report.framework_flops) == (7, 0.5, 1000)
    session.set_framework_flops(5.0)  # the step was reported: nothing to attach to
    assert session.report() is None


# ---- Megatron-LM -----------------------------------------------------------------------------


def test_mlm_log_line_gains_the_corrected_fields(mlm):
    assert megatron_lm.install() is True
    _session()
    assert _run_mlm(mlm) == [MLM_LINE.format(fields=FIELDS)]


def test_mlm_unpatched_line_is_the_stock_one(mlm):
    assert _run_mlm(mlm) == [MLM_LINE.format(fields="")]


def test_mlm_scalars_written_with_exact_keys(mlm):
    mlm.TB_WRITER, mlm.WANDB_WRITER = _Writer(), _Writer()
    megatron_lm.install()
    _session()
    _run_mlm(mlm)
    assert [(key, step) for key, _, step in mlm.TB_WRITER.calls] == [(key, 2) for key in SCALARS]
    assert {key: value for key, value, _ in mlm.TB_WRITER.calls} == pytest.approx(SCALARS, rel=1e-12)
    [(values, step)] = mlm.WANDB_WRITER.calls
    assert step == 2 and values == pytest.approx(SCALARS, rel=1e-12)


def test_mlm_evaluation_forward_steps_are_not_counted(mlm):
    megatron_lm.install()
    _session()
    # evaluate() after every iteration calls forward_step (and record()) outside train_step.
    assert _run_mlm(mlm, eval_interval=1) == [MLM_LINE.format(fields=FIELDS)]


def test_mlm_end_step_on_every_train_step(mlm, monkeypatch):
    megatron_lm.install()
    session = _session()
    calls = []
    end_step = session.tracker.end_step
    monkeypatch.setattr(session.tracker, "end_step", lambda **kw: calls.append(1) or end_step(**kw))
    _run_mlm(mlm, num_iterations=5)  # logs at 2 and 4 only
    assert len(calls) == 5


def test_mlm_wrappers_pass_arguments_and_results_through(mlm):
    original = mlm.training_log
    seen = []

    @functools.wraps(original)
    def spy(*args, **kwargs):
        seen.append((args, kwargs))
        return original(*args, **kwargs)

    mlm.training_log = spy
    megatron_lm.install()
    _session()
    assert mlm.training_log is not spy and inspect.signature(mlm.training_log) == inspect.signature(original)
    flag = object()
    args = ({}, {}, 1e-4, 1, 1.0, flag, 0, 1.0, None, None, None)
    kwargs = {"is_first_iteration": False, "total_real_tokens_in_batch": None}
    assert mlm.training_log(*args, **kwargs) is flag
    assert seen == [(args, kwargs)]
    assert mlm.train_step(lambda *a: None, None, None, None, None, None, mlm.forward_backward_func) == (
        {}, 0, False, False, 0, 1.0, None, None)
    assert mlm.num_floating_point_operations(mlm.ARGS, 3) == 3.0 * STOCK_FLOPS_PER_SAMPLE


def test_mlm_install_twice_does_not_double_wrap(mlm):
    originals = {name: getattr(mlm, name) for name in ("train_step", "training_log", "num_floating_point_operations")}
    assert megatron_lm.install() and megatron_lm.install()
    for name, original in originals.items():
        wrapper = getattr(mlm, name)
        assert getattr(wrapper, _hooks.ORIGINAL_ATTR) is original and wrapper.__wrapped__ is original
    _session()
    assert _run_mlm(mlm) == [MLM_LINE.format(fields=FIELDS)]


def test_mlm_missing_symbol_warns_once_and_patches_nothing(mlm, caplog):
    del mlm.num_floating_point_operations
    train_step = mlm.train_step
    with caplog.at_level(logging.WARNING, logger="megatron_flops"):
        assert megatron_lm.install() is False
    [warning] = caplog.records
    message = warning.getMessage()
    assert "num_floating_point_operations not found in megatron.training.training" in message
    assert "megatron-core 0.16.1" in message
    assert mlm.train_step is train_step


def test_mlm_not_importable_returns_false(caplog):
    with caplog.at_level(logging.WARNING, logger="megatron_flops"):
        assert megatron_lm.install() is False
    assert "cannot import megatron.training.training" in caplog.records[0].getMessage()


def test_mlm_accounting_failure_logged_once_and_line_unchanged(mlm, monkeypatch, caplog):
    megatron_lm.install()
    _session()

    def broken(self):
        raise RuntimeError("boom")

    monkeypatch.setattr(Session, "report", broken)
    with caplog.at_level(logging.WARNING, logger="megatron_flops"):
        printed = _run_mlm(mlm, num_iterations=4)
    assert printed == [MLM_LINE.format(fields=""), MLM_LINE.format(fields="").replace(
        "iteration        2/", "iteration        4/").replace("samples:            4", "samples:            8")]
    [warning] = caplog.records
    assert "Megatron-LM log line (RuntimeError: boom)" in warning.getMessage()


def test_mlm_session_built_from_args_at_first_step(mlm):
    megatron_lm.install(peak_tflops=11.083776)
    assert get_session() is None  # nothing happens before training
    _run_mlm(mlm, num_iterations=3)
    session = get_session()
    assert session.tracker.spec == ModelSpec.from_mapping(MODEL)
    assert (session.tracker.seq_length, session.tracker.attention) == (SEQ_LENGTH, "causal")
    assert " corrected throughput per GPU (TFLOP/s/GPU): " in mlm.PRINTED[0]
    # Iteration 3 is not reported yet; 11.083776 TFLOP/s is exactly PEAK_FLOPS_PER_S.
    report = session.report()
    assert (report.num_iterations, report.flops, report.peak_flops_per_s) == (1, STEP_FLOPS, PEAK_FLOPS_PER_S)


def test_mlm_bad_args_warn_once_and_training_goes_on(mlm, caplog):
    del mlm.ARGS.hidden_size
    megatron_lm.install()
    with caplog.at_level(logging.WARNING, logger="megatron_flops"):
        printed = _run_mlm(mlm, num_iterations=4)
    assert get_session() is None and len(printed) == 2 and "corrected" not in printed[0]
    [warning] = caplog.records
    assert "cannot set up accounting from the Megatron-LM configuration" in warning.getMessage()


def test_mlm_flags_and_maybe_install(mlm):
    parser = megatron_lm.extra_args_provider(argparse.ArgumentParser())
    static = parser.parse_args([])
    assert (static.flops_accounting, static.flops_peak_tflops, static.flops_attention) == ("static", None, "causal")
    assert megatron_lm.maybe_install_from_args(static) is False
    assert not _hooks.is_wrapped(mlm.training_log)
    args = parser.parse_args(["--flops-accounting", "corrected", "--flops-peak-tflops", "11.083776",
                              "--flops-attention", "full"])
    assert megatron_lm.maybe_install_from_args(args) is True
    assert _hooks.is_wrapped(mlm.training_log)
    mlm.ARGS = argparse.Namespace(**vars(mlm.ARGS), **vars(args))
    megatron_lm.install(mlm.ARGS)
    _run_mlm(mlm, num_iterations=1)
    session = get_session()
    assert session.tracker.attention == "full" and session.report().peak_flops_per_s == PEAK_FLOPS_PER_S
    with pytest.raises(ValueError, match="flops_accounting"):
        megatron_lm.maybe_install_from_args(argparse.Namespace(flops_accounting="exact"))


# ---- Megatron-Bridge -------------------------------------------------------------------------

# Bridge's line at step 2: stock 2 x 11,206,656 FLOPs / 5e-6 s = 4.48 TFLOP/s.
BRIDGE_LINE = (
    " [2026-08-22 12:00:00] iteration        2/      10 | consumed samples:            4 |"
    " elapsed time per iteration (ms): 0.0 | throughput per GPU (TFLOP/s/GPU): 4.5 |{fields}"
    " learning rate: 1.000000E-04 | global batch size:     2 | loss scale: 1.0 |"
    " number of skipped iterations:   0 | number of nan iterations:   0 |"
)


def test_bridge_log_line_and_scalars(bridge):
    bridge.state.tensorboard_logger, bridge.state.wandb_logger = _Writer(), _Writer()
    assert megatron_bridge.install() is True
    _session()
    assert _run_bridge(bridge, eval_interval=1) == [BRIDGE_LINE.format(fields=FIELDS)]
    # The static number is the step's increase of floating_point_operations_so_far.
    assert {key: value for key, value, _ in bridge.state.tensorboard_logger.calls} == pytest.approx(SCALARS, rel=1e-12)
    [(values, step)] = bridge.state.wandb_logger.calls
    assert step == 2 and values == pytest.approx(SCALARS, rel=1e-12)


def test_bridge_unpatched_line_is_the_stock_one(bridge):
    assert _run_bridge(bridge) == [BRIDGE_LINE.format(fields="")]


def test_bridge_patches_the_name_train_py_looks_up(bridge):
    original = bridge.train.training_log
    megatron_bridge.install()
    assert bridge.utils.training_log is original  # train_utils keeps its own function
    assert bridge.train.training_log.__wrapped__ is original
    assert megatron_bridge.install() is True and bridge.train.training_log.__wrapped__ is original


def test_bridge_config_field_enables_it(bridge):
    assert megatron_bridge.maybe_install_from_config(bridge.state.cfg) is False  # field absent: off
    assert not _hooks.is_wrapped(bridge.train.train_step)
    bridge.state.cfg.logger.flops_accounting = "corrected"
    bridge.state.cfg.logger.flops_peak_tflops = 11.083776
    assert megatron_bridge.maybe_install_from_config(bridge.state.cfg) is True
    _run_bridge(bridge, num_iterations=3)
    session = get_session()
    assert session.tracker.spec == ModelSpec.from_mapping(MODEL)
    assert " corrected throughput per GPU (TFLOP/s/GPU): " in bridge.utils.PRINTED[0]
    report = session.report()
    assert (report.num_iterations, report.flops, report.peak_flops_per_s) == (1, STEP_FLOPS, PEAK_FLOPS_PER_S)
    # Its static number: the step's 11,206,656 increase of floating_point_operations_so_far.
    assert report.static_flops == 2 * STOCK_FLOPS_PER_SAMPLE


def test_bridge_missing_symbol_warns_once(bridge, caplog):
    bridge.utils.__dict__.pop("print_rank_last")
    with caplog.at_level(logging.WARNING, logger="megatron_flops"):
        assert megatron_bridge.install() is False
    [warning] = caplog.records
    assert "training_log's print_rank_last not found in megatron.bridge.training.train" in warning.getMessage()
    assert f"megatron-bridge {framework_version('megatron-bridge')}" in warning.getMessage()
    assert not _hooks.is_wrapped(bridge.train.train_step)


# ---- environment, launcher, imports -----------------------------------------------------------


def test_env_installs_the_requested_frameworks(mlm, bridge):
    assert env.install_from_env({}) is False
    assert not _hooks.is_wrapped(mlm.train_step)
    assert env.install_from_env({env.ACCOUNTING: "corrected", env.FRAMEWORK: "megatron-bridge"}) is True
    assert _hooks.is_wrapped(bridge.train.train_step) and not _hooks.is_wrapped(mlm.train_step)
    assert env.install_from_env({env.ACCOUNTING: "corrected", env.PEAK_TFLOPS: "11.083776"}) is True
    assert _hooks.is_wrapped(mlm.train_step)
    _run_mlm(mlm, num_iterations=1)
    assert get_session().report().peak_flops_per_s == PEAK_FLOPS_PER_S


@pytest.mark.parametrize("environ, match", [
    ({env.ACCOUNTING: "on"}, "MEGATRON_FLOPS must be"),
    ({env.ACCOUNTING: "corrected", env.PEAK_TFLOPS: "fast"}, "MEGATRON_FLOPS_PEAK_TFLOPS must be a number"),
    ({env.ACCOUNTING: "corrected", env.PEAK_TFLOPS: "-1"}, "MEGATRON_FLOPS_PEAK_TFLOPS must be a positive"),
    ({env.ACCOUNTING: "corrected", env.ATTENTION: "sliding"}, "MEGATRON_FLOPS_ATTENTION must be one of"),
    ({env.ACCOUNTING: "corrected", env.FRAMEWORK: "nemo"}, "MEGATRON_FLOPS_FRAMEWORK must be"),
])
def test_env_rejects_bad_values(environ, match):
    with pytest.raises(ValueError, match=match):
        env.install_from_env(environ)


def test_env_without_frameworks_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="megatron_flops"):
        assert env.install_from_env({env.ACCOUNTING: "corrected"}) is False
    assert "neither Megatron-LM nor Megatron-Bridge is installed" in caplog.records[0].getMessage()


def test_launcher_installs_then_runs_the_script(mlm, tmp_path, monkeypatch):
    script = tmp_path / "pretrain_stub.py"
    script.write_text(
        "import importlib, sys\n"
        "training = importlib.import_module('megatron.training.training')\n"
        "RESULT = (__name__, sys.argv, hasattr(training.train_step, '__megatron_flops_original__'))\n"
        "sys.modules['megatron.training.training'].LAUNCHED = RESULT\n"
    )
    monkeypatch.setattr(sys, "argv", ["python -m megatron_flops.launch"])
    monkeypatch.setattr(sys, "path", list(sys.path))
    launch.main(["--flops-accounting", "corrected", "--flops-framework", "megatron-lm", str(script),
                 "--num-layers", "2"])
    assert mlm.LAUNCHED == ("__main__", [str(script), "--num-layers", "2"], True)
    assert sys.path[0] == str(tmp_path)


def test_nothing_is_patched_on_import(mlm, bridge):
    for module in (adapters_pkg, megatron_lm, megatron_bridge, env, launch):
        importlib.reload(module)
    assert not any(_hooks.is_wrapped(getattr(mlm, name)) for name in ("train_step", "training_log",
                                                                      "num_floating_point_operations"))
    assert not any(_hooks.is_wrapped(getattr(bridge.train, name)) for name in ("train_step", "training_log"))


def test_importing_the_adapters_imports_no_framework():
    code = ("import sys, megatron_flops.adapters.env, megatron_flops.launch; "
            "print(sorted(m for m in sys.modules if m.startswith(('megatron.', 'transformer_engine'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_bridge_vlm_provider_gets_its_vision_tower():
    # Megatron-Bridge's Qwen25VLModelProvider carries the Hugging Face vision config object.
    transformers = pytest.importorskip("transformers")
    from megatron_flops.adapters.megatron_bridge import _vision_spec

    config = transformers.Qwen2_5_VLConfig(
        vision_config=dict(depth=4, hidden_size=32, intermediate_size=40, num_heads=2, patch_size=2,
                           window_size=8, out_hidden_size=48, fullatt_block_indexes=[3]),
    ).vision_config

    class Provider:
        vision_config = config

    spec = _vision_spec(Provider())
    assert (spec.depth, spec.hidden_size, spec.window_size, spec.fullatt_block_indexes) == (4, 32, 8, (3,))
    assert _vision_spec(object()) is None
