"""Megatron-LM arguments as users launch them (stdlib only): a pasted command line, a file holding
one (a launch script's arguments), or an args dump (JSON/YAML of ``vars(args)``), read with
Megatron-LM's own option tables (:mod:`megatron_flops.model._mlm_args`: core_v0.14.0, core_v0.16.1 and
core_v0.19.0) and defaults, then priced by :meth:`ModelSpec.from_megatron_args`.

Which release: the one named (``release``, ``--megatron-release``), whose options alone are
accepted; else any release's options are (their union) and the defaults are those of the newest
release that has every option given.
"""

from __future__ import annotations

import difflib
import shlex
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from megatron_flops.model.inputs import read_document, read_text, show
from megatron_flops.model.spec import ModelOptions, ModelSpec

# Megatron-LM dests that megatron-flops reads (the model, recompute, pipeline split, seq_length; the
# last lines: what ``memory`` reads besides).
READ = (
    "num_layers", "hidden_size", "num_attention_heads", "group_query_attention", "num_query_groups",
    "kv_channels", "ffn_hidden_size", "swiglu", "squared_relu", "quick_geglu", "attention_output_gate",
    "num_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
    "moe_shared_expert_gate", "moe_layer_freq", "moe_latent_size", "multi_latent_attention", "q_lora_rank",
    "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "mtp_num_layers", "window_size",
    "window_attn_skip_freq", "mamba_state_dim", "mamba_head_dim", "mamba_num_groups", "mamba_num_heads",
    "experimental_attention_variant", "linear_attention_freq", "linear_conv_kernel_dim", "linear_key_head_dim",
    "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads", "vocab_size", "padded_vocab_size", "make_vocab_size_divisible_by",
    "tensor_model_parallel_size", "untie_embeddings_and_output_weights", "hybrid_override_pattern", "hybrid_layer_pattern",
    "seq_length", "recompute_granularity", "recompute_method", "recompute_num_layers", "recompute_modules",
    "pipeline_model_parallel_size", "num_layers_per_virtual_pipeline_stage",
    "num_virtual_stages_per_pipeline_rank", "decoder_first_pipeline_num_layers",
    "decoder_last_pipeline_num_layers", "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split", "pipeline_model_parallel_layout",
    "normalization", "position_embedding_type", "rotary_percent", "max_position_embeddings", "hidden_dropout",
    "attention_dropout", "attention_backend", "moe_token_dispatcher_type", "moe_router_score_function",
    "transformer_impl", "micro_batch_size", "global_batch_size", "context_parallel_size", "expert_model_parallel_size",
)


def load_megatron_args(value: str, *, release: str | None = None) -> tuple[SimpleNamespace, str]:
    """``value``: a command line (options, optionally after ``torchrun ... pretrain_gpt.py``), or the
    path of a file holding one or of an args dump (``.json``/``.yaml``); ``release``: the
    Megatron-LM release (``core_v0.19.0`` or ``0.19.0``; default: any, see the module). Returns
    the args namespace (Megatron-LM's defaults filled in) and a source name for messages."""
    text = value.strip()
    path = Path(value)
    if text.startswith("--") or (any(c.isspace() for c in text) and not _is_file(path)):
        return parse_command_line(text, source="--megatron-args", release=release), "--megatron-args"
    if path.suffix in (".json", ".yaml", ".yml"):
        dump = read_document(path, what="--megatron-args file")
        if not isinstance(dump, Mapping):
            raise ValueError(f"{path.name}: an args dump must be a mapping of Megatron-LM argument names")
        return args_from_dump(dump, source=path.name, release=release), path.name
    if not _exists(path):
        raise ValueError(f"--megatron-args: {show(value)} is neither a command line (--num-layers ...) "
                         "nor a readable file")
    text = read_text(path, what="--megatron-args file")
    return parse_command_line(text, source=path.name, release=release), path.name


def release_index(release: str | None) -> int | None:
    """The index into ``_mlm_args.RELEASES`` of ``release`` (None: any release)."""
    from megatron_flops.model import _mlm_args

    if release is None:
        return None
    tag = release if release.startswith("core_v") else f"core_v{release}"
    if tag not in _mlm_args.RELEASES:
        raise ValueError(f"Megatron-LM release {show(release)} is not one of {', '.join(_mlm_args.RELEASES)}")
    return _mlm_args.RELEASES.index(tag)


def _releases_text(indices: Any) -> str:
    from megatron_flops.model import _mlm_args

    return ", ".join(_mlm_args.RELEASES[i] for i in indices)


def _defaults(index: int | None, having: set[int] | None, source: str) -> dict[str, Any]:
    """The defaults of release ``index`` or, for any release, of the newest one in ``having`` (the
    releases that have every option given; None: no option restricts them)."""
    from megatron_flops.model import _mlm_args

    if index is None:
        if having is not None and not having:
            raise ValueError(f"{source}: no one Megatron-LM release has all these options "
                             f"({_releases_text(range(len(_mlm_args.RELEASES)))} were searched)")
        index = max(range(len(_mlm_args.RELEASES)) if having is None else having)
    return dict(_mlm_args.DEFAULTS[_mlm_args.RELEASES[index]])


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except (OSError, ValueError):  # a name too long for the file system, a NUL byte
        return False


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:  # a name too long for the file system
        return False


def model_spec(args: SimpleNamespace, source: str, *, options: ModelOptions | None = None) -> ModelSpec:
    """The model a Megatron-LM args namespace trains, with its fields named as options in errors
    when it came from a command line."""
    return ModelSpec.from_megatron_args(args, source=source, options=options,
                                        option_names=getattr(args, "_from_command_line", False))


def training_fields(args: SimpleNamespace) -> dict[str, Any]:
    """Recompute and pipeline settings in ``TransformerConfig`` field names (for
    :meth:`RecomputeSpec.from_mapping`), as Megatron-LM's ``validate_args`` derives them."""
    pp = args.pipeline_model_parallel_size or 1
    vpp = args.num_virtual_stages_per_pipeline_rank
    if sum(v is not None for v in (args.num_layers_per_virtual_pipeline_stage, vpp,
                                   args.pipeline_model_parallel_layout)) > 1:
        raise ValueError("Megatron-LM refuses more than one of --num-layers-per-virtual-pipeline-stage, "
                         "--num-virtual-stages-per-pipeline-rank and --pipeline-model-parallel-layout")
    if vpp is None and args.num_layers_per_virtual_pipeline_stage:
        if not isinstance(args.num_layers, int) or not isinstance(pp, int) or pp < 1:
            raise ValueError("--num-layers-per-virtual-pipeline-stage needs integer --num-layers and "
                             "--pipeline-model-parallel-size")
        if args.decoder_first_pipeline_num_layers is not None or args.decoder_last_pipeline_num_layers is not None:
            raise ValueError("Megatron-LM refuses --num-layers-per-virtual-pipeline-stage with an uneven first/last "
                             "stage: use --num-virtual-stages-per-pipeline-rank")
        # NB: Megatron-LM counts the embedding and the loss as layers here when the split accounts for them.
        num_layers = args.num_layers + bool(args.account_for_embedding_in_pipeline_split) \
            + bool(args.account_for_loss_in_pipeline_split)
        if num_layers % pp:
            raise ValueError(f"Megatron-LM refuses {num_layers} layers (with the embedding and loss the split accounts "
                             f"for) over --pipeline-model-parallel-size {pp}: the number of layers of the model must "
                             "be divisible by the pipeline model parallel size")
        if num_layers // pp % args.num_layers_per_virtual_pipeline_stage:
            raise ValueError(f"Megatron-LM refuses {num_layers // pp} layers per pipeline stage with "
                             f"--num-layers-per-virtual-pipeline-stage {args.num_layers_per_virtual_pipeline_stage}: "
                             "the layers per pipeline stage must be divisible by the layers per virtual stage")
        vpp = num_layers // pp // args.num_layers_per_virtual_pipeline_stage
    return {
        "recompute_granularity": args.recompute_granularity,
        "recompute_method": args.recompute_method,
        "recompute_num_layers": args.recompute_num_layers,
        "recompute_modules": args.recompute_modules,
        "pipeline_model_parallel_size": pp,
        "virtual_pipeline_model_parallel_size": vpp,
        "num_layers_in_first_pipeline_stage": args.decoder_first_pipeline_num_layers,
        "num_layers_in_last_pipeline_stage": args.decoder_last_pipeline_num_layers,
        "account_for_embedding_in_pipeline_split": args.account_for_embedding_in_pipeline_split,
        "account_for_loss_in_pipeline_split": args.account_for_loss_in_pipeline_split,
        "pipeline_model_parallel_layout": args.pipeline_model_parallel_layout,
    }


def args_from_dump(dump: Mapping[str, Any], *, source: str, release: str | None = None) -> SimpleNamespace:
    """An args dump (``vars(args)`` as JSON/YAML): the keys megatron-flops reads and every on/off
    switch (``bf16``, ``sequence_parallel``, ``use_distributed_optimizer``, ...), over Megatron-LM's
    defaults (``release``'s, else the newest release's). Other keys are Megatron-LM state and are
    ignored, except near-misses of a key we read (a typo), which are an error with the suggestion."""
    from megatron_flops.model import _mlm_args

    index = release_index(release)
    for key in dump:
        if not isinstance(key, str):
            raise ValueError(f"{source}: keys must be argument names, got {show(key)}")
        if key in _mlm_args.DESTS:
            continue
        close = difflib.get_close_matches(key, READ, n=1, cutoff=0.85)
        if close:
            raise ValueError(f"{source}: unknown Megatron-LM argument {key!r} (did you mean {close[0]!r}?)")
    switches = {dest for dest, kind, _ in _mlm_args.OPTIONS.values() if kind in ("true", "false")}
    kept = {k: v for k, v in dump.items() if k in READ or (k in switches and isinstance(v, bool))}
    args = SimpleNamespace(**{**_defaults(index, None, source), **kept})
    args._unread = {k: [str(v)] for k, v in dump.items() if k not in kept and v is not None}
    return args


def parse_command_line(text: str, *, source: str, release: str | None = None) -> SimpleNamespace:
    """Megatron-LM options as ``pretrain_gpt.py`` parses them (no abbreviations), of ``release``
    (default: any release, see the module). A launcher prefix (``torchrun ... pretrain_gpt.py``) is
    skipped; ``#`` comments and ``\\`` line breaks are allowed."""
    from megatron_flops.model import _mlm_args

    index = release_index(release)
    having: set[int] | None = None  # the releases that have every option so far

    try:
        tokens = shlex.split(text.replace("\\\n", " "), comments=True)
    except ValueError as exc:
        raise ValueError(f"{source}: cannot split the command line: {exc}") from None
    scripts = [i for i, t in enumerate(tokens) if t.endswith(".py")]
    if scripts:
        tokens = tokens[scripts[-1] + 1:]
    values: dict[str, Any] = {}
    unread: dict[str, list[str]] = {}  # valued options megatron-flops does not read, as given
    i = 0
    while i < len(tokens):
        token = tokens[i]
        option, has_value, inline = token.partition("=")
        if option not in _mlm_args.OPTIONS or (index is not None and index not in _mlm_args.OPTIONS[option][2]):
            raise ValueError(f"{source}: {_unknown_option(token, index)}")
        dest, kind, releases = _mlm_args.OPTIONS[option]
        if index is not None:  # the named release's number of values, where it differs from the newest's
            kind = _mlm_args.OLDER_KINDS.get(option, {}).get(index, kind)
        having = set(releases) if having is None else having & set(releases)
        i += 1
        if kind in ("true", "false"):
            if has_value:
                raise ValueError(f"{source}: {option} takes no value")
            values[dest] = kind == "true"
            continue
        if has_value:
            given = [inline]
        else:
            count = 1 if kind == "value" else None if kind == "list" else int(kind)
            end = i
            while end < len(tokens) and not tokens[end].startswith("--") and (count is None or end - i < count):
                end += 1
            given = tokens[i:end]
            i = end
            if not given or (count is not None and len(given) != count):
                raise ValueError(f"{source}: {option} expects {count or 'one or more'} value(s)")
        if dest in _mlm_args.TYPES:
            values[dest] = _convert(option, _mlm_args.TYPES[dest], given if kind != "value" else given[0], source)
        else:
            unread[dest] = given
    args = SimpleNamespace(**{**_defaults(index, having, source), **values})
    args._from_command_line = True
    args._unread = unread
    return args


def _unknown_option(token: str, index: int | None) -> str:
    from megatron_flops.model import _mlm_args

    if not token.startswith("-"):
        return f"unexpected {show(token)}: expected an --option (a value must follow its option)"
    option = token.partition("=")[0]
    if option in _mlm_args.OPTIONS:  # another release's option
        return (f"{show(option)} is not a Megatron-LM {_mlm_args.RELEASES[index or 0]} argument "
                f"(it is one of {_releases_text(_mlm_args.OPTIONS[option][2])})")
    known = [o for o, (_, _, releases) in _mlm_args.OPTIONS.items() if index is None or index in releases]
    close = difflib.get_close_matches(option, known, n=1, cutoff=0.8)
    hint = f" (did you mean {close[0]}?)" if close else ""
    tags = _releases_text(range(len(_mlm_args.RELEASES)) if index is None else (index,))
    return f"unknown Megatron-LM argument {show(option)}{hint} (not in {tags})"


def _convert(option: str, type_name: str, value: Any, source: str) -> Any:
    if isinstance(value, list):
        return [_convert(option, type_name, v, source) for v in value]
    try:
        if type_name == "int":
            return int(value) if len(value) <= 30 else int("x")
        if type_name == "float":
            return float(value)
        if type_name == "tuple_type":
            return tuple(int(v) for v in value.strip("()").split(","))
        if type_name in ("moe_freq_type", "la_freq_type"):
            # An integer, or a pattern string such as "([0]*3+[1]*58)" (read by the spec, no eval).
            return value if "[" in value else int(value)
    except ValueError:
        hint = " (expand shell variables first)" if "$" in value else ""
        raise ValueError(f"{source}: {option} expects {_TYPE_WORDS.get(type_name, type_name)}, got {show(value)}{hint}") from None
    return value


_TYPE_WORDS = {"int": "an integer", "float": "a number", "tuple_type": "integers such as 4096,0",
               "moe_freq_type": "an integer or a pattern such as ([0]*3+[1]*29)",
               "la_freq_type": "an integer or a pattern such as ([1]*3+[0]*1)*12"}
