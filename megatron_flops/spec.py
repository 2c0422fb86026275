"""Model description: the architecture facts that FLOPs depend on (stdlib only).

A :class:`ModelSpec` is built from a megatron-core ``TransformerConfig`` (duck-typed: no import),
a Megatron-LM ``args`` namespace, a mapping of ``TransformerConfig`` field names (JSON/YAML), or a
Hugging Face ``config.json``. Every constructor funnels into one validating builder that speaks
``TransformerConfig`` field names (and names each field as its source spells it in errors), so
the rules live in one place. Repeated layers are stored as runs, never one entry per layer.
"""

from __future__ import annotations

import difflib
import itertools
import json
import reprlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_flops._mcore_fields import TRANSFORMER_CONFIG_FIELDS

# Activation name -> whether the name itself implies a gated linear unit.
_ACTIVATIONS: dict[str, bool] = {
    "gelu": False,
    "gelu_new": False,
    "gelu_pytorch_tanh": False,
    "fast_gelu": False,
    "quick_gelu": False,
    "openai_gelu": False,
    "erf_gelu": False,
    "silu": False,
    "swish": False,
    "relu": False,
    "squared_relu": False,
    "relu2": False,
    "tanh": False,
    "swiglu": True,
    "geglu": True,
    "reglu": True,
}

# Keys a model file may carry beside TransformerConfig fields.
_EXTRA_KEYS = frozenset(
    {
        "vocab_size",
        "padded_vocab_size",
        "make_vocab_size_divisible_by",
        "tensor_model_parallel_size",
        "share_embeddings_and_output_weights",
        "untie_embeddings_and_output_weights",
        "hybrid_override_pattern",
        "hybrid_layer_pattern",
        "seq_length",
        "max_position_embeddings",
        "position_embedding_type",
        "model_type",
        "vision_config",
        "vision",
        "lora",
        "dit",
    }
)

_HYBRID_SYMBOLS = {"M": ("mamba", "none"), "*": ("attention", "none"), "-": ("none", "mlp"), "E": ("none", "moe")}
# A real model changes layer kind a few dozen times; far more is a malformed layout.
MAX_LAYER_RUNS = 10_000
# Nesting deeper than this in a model or rows file is malformed (and would exhaust recursion).
MAX_NESTING = 32
MAX_FILE_BYTES = 16 * 2**20

_short = reprlib.Repr()
_short.maxstring = _short.maxother = 40
_short.maxlist = _short.maxtuple = _short.maxdict = 6
_short.maxlevel = 2
_short.maxlong = 40


def show(value: Any) -> str:
    """A short, always one-line ``repr`` of a user value for an error message."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 10**30:
        return f"an integer of {len(str(abs(value)))} digits"
    return _short.repr(value).replace("\n", " ")


@dataclass(frozen=True, kw_only=True)
class MoESpec:
    """Routed experts (dropless top-k), optional shared experts and latent projections."""

    num_experts: int
    router_topk: int
    ffn_hidden_size: int
    shared_expert_ffn_hidden_size: int = 0
    shared_expert_gate: bool = False
    latent_size: int | None = None


@dataclass(frozen=True, kw_only=True)
class MLASpec:
    """Multi-latent attention (DeepSeek-V2/V3) projection sizes."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_head_dim: int
    qk_pos_emb_head_dim: int
    v_head_dim: int


@dataclass(frozen=True, kw_only=True)
class MambaSpec:
    """Mamba-2 mixer sizes as megatron-core configures them (expand factor 2)."""

    state_dim: int
    head_dim: int
    num_groups: int
    num_heads: int


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A decoder-only megatron-core model, as far as GEMM FLOPs are concerned.

    ``layer_runs`` lists the decoder sub-layers in order as runs ``((mixer, ffn), count)`` of
    consecutive layers of one kind, with mixer in ``attention``/``window``/``mamba``/``none`` and
    ffn in ``mlp``/``moe``/``none``: a 32-layer GPT is ``((("attention", "mlp"), 32),)``, a hybrid
    ``M`` symbol is ``("mamba", "none")``.
    """

    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    ffn_hidden_size: int
    gated_linear_unit: bool
    activation: str
    vocab_size: int
    padded_vocab_size: int
    layer_runs: tuple[tuple[tuple[str, str], int], ...]
    attention_output_gate: bool = False
    window_size: int | None = None
    moe: MoESpec | None = None
    mla: MLASpec | None = None
    mamba: MambaSpec | None = None
    mtp_num_layers: int = 0
    mtp_ffn: str = "mlp"
    tied_output: bool = True

    @property
    def num_layers(self) -> int:
        return sum(count for _, count in self.layer_runs)

    @property
    def layers(self) -> tuple[tuple[str, str], ...]:
        """One ``(mixer, ffn)`` per decoder layer (expands the runs: for inspecting small models)."""
        return tuple(itertools.chain.from_iterable(itertools.repeat(kind, n) for kind, n in self.layer_runs))

    # ---- constructors -------------------------------------------------------------------

    @classmethod
    def from_mapping(
        cls, fields: Mapping[str, Any], *, source: str = "model file", options: ModelOptions | None = None
    ) -> ModelSpec:
        """Build from ``TransformerConfig`` field names plus ``vocab_size`` (JSON/YAML files)."""
        unknown = [k for k in fields if k not in TRANSFORMER_CONFIG_FIELDS and k not in _EXTRA_KEYS]
        if unknown:
            raise ValueError(f"{source}: {_unknown_keys_message(unknown)}")
        return _build(_with_options(dict(fields), options), source=source)

    @classmethod
    def from_transformer_config(
        cls,
        config: Any,
        *,
        vocab_size: int,
        make_vocab_size_divisible_by: int = 128,
        tensor_model_parallel_size: int | None = None,
        share_embeddings_and_output_weights: bool = True,
        hybrid_override_pattern: str | None = None,
    ) -> ModelSpec:
        """Build from a megatron-core ``TransformerConfig`` (or ``MLATransformerConfig``)."""
        fields = {name: getattr(config, name) for name in _CONFIG_FIELDS_READ if hasattr(config, name)}
        fields["activation_func"] = _activation_name(getattr(config, "activation_func", None))
        fields["vocab_size"] = vocab_size
        fields["make_vocab_size_divisible_by"] = make_vocab_size_divisible_by
        fields["tensor_model_parallel_size"] = (
            tensor_model_parallel_size
            if tensor_model_parallel_size is not None
            else getattr(config, "tensor_model_parallel_size", 1)
        )
        fields["share_embeddings_and_output_weights"] = share_embeddings_and_output_weights
        if hybrid_override_pattern is not None:
            fields["hybrid_override_pattern"] = hybrid_override_pattern
        return _build(fields, source="TransformerConfig")

    @classmethod
    def from_megatron_args(
        cls, args: Any, *, source: str = "Megatron-LM args", options: ModelOptions | None = None,
        option_names: bool = False,
    ) -> ModelSpec:
        """Build from a Megatron-LM ``args`` namespace (``megatron.training.get_args()``), with
        Megatron-LM's own rules: grouped-query attention only with ``group_query_attention``, a
        gated SiLU MLP with ``swiglu``, experts from ``num_experts``, and ``validate_args``'
        defaults for ``ffn_hidden_size``. ``option_names``: name fields as ``--options`` in errors."""
        get = lambda name, default=None: getattr(args, name, default)  # noqa: E731
        fields: dict[str, Any] = {
            name: get(name) for name in _CONFIG_FIELDS_READ if get(name) is not None
        }
        fields.pop("num_query_groups", None)
        if get("group_query_attention"):
            fields["num_query_groups"] = get("num_query_groups")
        if get("num_experts"):
            fields["num_moe_experts"] = get("num_experts")
        if get("swiglu"):
            fields["gated_linear_unit"] = True
            fields["activation_func"] = "silu"
        elif get("squared_relu"):
            fields["activation_func"] = "squared_relu"
        elif get("quick_geglu"):
            fields["gated_linear_unit"] = True
            fields["activation_func"] = "quick_gelu"
        else:
            fields["activation_func"] = "gelu"
        hidden = get("hidden_size")
        if get("ffn_hidden_size") is None and isinstance(hidden, int) and not isinstance(hidden, bool):
            # validate_args: a SwiGLU MLP keeps ~4h parameters: 2/3 of 4h, rounded down to 64.
            fields["ffn_hidden_size"] = (8 * hidden // 3) // 64 * 64 if get("swiglu") else 4 * hidden
        if not get("multi_latent_attention"):
            for name in ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
                fields.pop(name, None)
        if get("padded_vocab_size") is not None:
            fields["padded_vocab_size"] = get("padded_vocab_size")
        fields["vocab_size"] = get("vocab_size") or get("padded_vocab_size")
        fields["make_vocab_size_divisible_by"] = get("make_vocab_size_divisible_by", 128)
        fields["tensor_model_parallel_size"] = get("tensor_model_parallel_size", 1)
        fields["share_embeddings_and_output_weights"] = not get("untie_embeddings_and_output_weights", False)
        pattern = get("hybrid_layer_pattern") or get("hybrid_override_pattern")
        if pattern:
            fields["hybrid_override_pattern"] = pattern
        names = dict(_MLM_NAMES)
        if option_names:
            names = {k: "--" + names.get(k, k).replace("_", "-") for k in _ALL_FIELD_NAMES}
        if fields["vocab_size"] is None:
            raise ValueError(f"{source}: the vocabulary size is unknown: give {names['vocab_size']} "
                             "(the tokenizer's vocabulary before padding)")
        return _build(_with_options(fields, options), source=source, names=names)

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], *, options: ModelOptions | None = None) -> ModelSpec:
        """Build from a Hugging Face ``config.json`` with the rules of its ``model_type``
        (:data:`HF_FAMILIES`, and the text decoders of Qwen2-VL/2.5-VL/3-VL). ``vocab_size`` is
        the embedding as built: no padding unless the file or ``options`` asks for it."""
        options = options or ModelOptions()
        fields = _hf_to_mcore(config, family=options.hf_family)
        return _build(_with_options(fields, options), source=_HF_SOURCE, names=_HF_NAMES)


@dataclass(frozen=True, kw_only=True)
class ModelOptions:
    """Choices a model file leaves open (the CLI's flags).

    ``hf_family``: price a Hugging Face file with this family's rules whatever its ``model_type``;
    ``vocab_multiple``: pad the vocabulary to a multiple of this (1: no padding), overriding the
    file; ``mtp_num_layers``: multi-token-prediction layers trained, overriding the file.
    """

    hf_family: str | None = None
    vocab_multiple: int | None = None
    mtp_num_layers: int | None = None

    def __post_init__(self) -> None:
        if self.hf_family is not None and self.hf_family not in HF_FAMILIES:
            raise ValueError(f"unknown Hugging Face family {self.hf_family!r}; known: {', '.join(HF_FAMILIES)}")
        for name, minimum in (("vocab_multiple", 1), ("mtp_num_layers", 0)):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < minimum):
                raise ValueError(f"{name} must be an integer >= {minimum}, got {show(value)}")


def parse_document(text: str, *, name: str, yaml_format: bool = False) -> Any:
    """Parse JSON (or YAML) text; every failure is one ``ValueError`` line naming ``name``, and
    nesting deeper than :data:`MAX_NESTING` is refused."""
    if yaml_format:
        try:
            import yaml
        except ImportError:
            raise ValueError(f"{name}: YAML files need PyYAML: pip install 'megatron-flops[yaml]'") from None
        try:
            data = yaml.safe_load(text)
        except yaml.MarkedYAMLError as exc:
            mark = exc.problem_mark or exc.context_mark
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            raise ValueError(f"{name}: invalid YAML{where}: {exc.problem or exc.context}") from None
        except yaml.YAMLError as exc:
            raise ValueError(f"{name}: invalid YAML: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
        except RecursionError:
            raise ValueError(f"{name}: nested deeper than {MAX_NESTING} levels") from None
        except ValueError as exc:  # an integer past Python's digit limit
            raise ValueError(f"{name}: invalid YAML: {str(exc).splitlines()[0]}") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{name}: invalid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}") from None
        except RecursionError:
            raise ValueError(f"{name}: nested deeper than {MAX_NESTING} levels") from None
        except ValueError as exc:  # an integer past Python's digit limit
            raise ValueError(f"{name}: invalid JSON: {str(exc).split(';')[0]}") from None
    _check_nesting(data, name)
    return data


def read_document(path: str | Path, *, what: str) -> Any:
    """Read a JSON or YAML (``.yaml``/``.yml``) file of at most :data:`MAX_FILE_BYTES`."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            raise ValueError(f"{what} {str(path)!r} is {size / 2**20:.0f} MiB; the limit is "
                             f"{MAX_FILE_BYTES // 2**20} MiB")
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"cannot read {what} {str(path)!r}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{what} {str(path)!r} is not UTF-8 text") from None
    return parse_document(text, name=path.name, yaml_format=path.suffix in (".yaml", ".yml"))


def load_model_file(
    path: str | Path, *, options: ModelOptions | None = None
) -> tuple[ModelSpec | None, dict[str, Any]]:
    """Read a JSON/YAML model file; return the decoder spec (None for a vision-only or DiT-only
    file) and the raw mapping (vision and other sections are read by their own modules)."""
    path = Path(path)
    data = read_document(path, what="model file")
    if not isinstance(data, dict):
        raise ValueError(f"{path.name}: the top level must be a mapping of field names, got {type(data).__name__}")
    return model_from_mapping(data, source=path.name, options=options), data


def model_from_mapping(
    data: Mapping[str, Any], *, source: str, options: ModelOptions | None = None
) -> ModelSpec | None:
    """Dispatch a mapping to the Hugging Face or the megatron-core reader; None when it holds
    only a vision tower or a DiT (``"dit"``)."""
    if is_hf_config(data):
        text = hf_text_config(data)
        if text is None:
            return None
        return ModelSpec.from_hf_config(text, options=options)
    if "dit" in data:
        return None  # a DiT model file (dit_passes.dit_setup reads it)
    decoder = {k: v for k, v in data.items() if k not in ("vision_config", "vision", "lora")}
    if not decoder and ("vision_config" in data or "vision" in data):
        return None
    return ModelSpec.from_mapping(decoder, source=source, options=options)


def is_hf_config(data: Mapping[str, Any]) -> bool:
    """A Hugging Face config names its layers ``num_hidden_layers`` or carries ``model_type``."""
    return "num_hidden_layers" in data or "model_type" in data or "text_config" in data


def hf_text_config(data: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The text decoder's keys of a Hugging Face config (``text_config`` of a VLM, inheriting the
    outer ``model_type``), or None for a vision-only file."""
    text = data.get("text_config")
    if text is not None:
        if not isinstance(text, Mapping):
            raise ValueError(f"{_HF_SOURCE}: 'text_config' must be a mapping, got {show(text)}")
        if "model_type" not in text and "model_type" in data:
            text = {**text, "model_type": data["model_type"]}
        return text
    if "num_hidden_layers" not in data and "vision_config" in data:
        return None
    return data


# ---- internals ------------------------------------------------------------------------------

# TransformerConfig fields that change GEMM FLOPs (read from configs and args).
_CONFIG_FIELDS_READ = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "ffn_hidden_size",
    "gated_linear_unit",
    "attention_output_gate",
    "num_moe_experts",
    "moe_router_topk",
    "moe_ffn_hidden_size",
    "moe_shared_expert_intermediate_size",
    "moe_shared_expert_gate",
    "moe_layer_freq",
    "moe_latent_size",
    "multi_latent_attention",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_head_dim",
    "qk_pos_emb_head_dim",
    "v_head_dim",
    "mtp_num_layers",
    "window_size",
    "window_attn_skip_freq",
    "mamba_state_dim",
    "mamba_head_dim",
    "mamba_num_groups",
    "mamba_num_heads",
    "experimental_attention_variant",
)
_ALL_FIELD_NAMES = _CONFIG_FIELDS_READ + (
    "activation_func", "vocab_size", "padded_vocab_size", "make_vocab_size_divisible_by",
    "tensor_model_parallel_size", "share_embeddings_and_output_weights", "hybrid_override_pattern",
)
# How Megatron-LM's args name the fields whose names differ from TransformerConfig's.
_MLM_NAMES = {"num_moe_experts": "num_experts", "gated_linear_unit": "swiglu", "activation_func": "swiglu",
              "share_embeddings_and_output_weights": "untie_embeddings_and_output_weights"}


def _unknown_keys_message(unknown: list[str]) -> str:
    from megatron_flops import _mlm_args

    mlm = [k for k in unknown if k in _mlm_args.DESTS]
    if mlm:
        return (f"{', '.join(repr(k) for k in mlm[:3])} {'is a' if len(mlm) == 1 else 'are'} Megatron-LM "
                "argument(s), not TransformerConfig fields: read an args dump with --megatron-args FILE")
    known = sorted(TRANSFORMER_CONFIG_FIELDS | _EXTRA_KEYS)
    hints = []
    for key in unknown[:5]:
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.75) if isinstance(key, str) else []
        hints.append(show(key) + (f" (did you mean {close[0]!r}?)" if close else ""))
    more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
    return f"unknown key(s) {', '.join(hints)}{more}"


def _check_nesting(data: Any, name: str) -> None:
    stack = [(data, 0)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, (list, dict)):
            if depth >= MAX_NESTING:
                raise ValueError(f"{name}: nested deeper than {MAX_NESTING} levels")
            stack.extend((v, depth + 1) for v in (value.values() if isinstance(value, dict) else value))


def _activation_name(func: Any) -> str:
    if func is None:
        return "gelu"
    if isinstance(func, str):
        return func
    name = getattr(func, "__name__", None) or type(func).__name__
    return name.lower()


def _with_options(fields: dict[str, Any], options: ModelOptions | None) -> dict[str, Any]:
    if options is None:
        return fields
    if options.vocab_multiple is not None:
        fields.pop("padded_vocab_size", None)
        fields["make_vocab_size_divisible_by"] = options.vocab_multiple
        fields["tensor_model_parallel_size"] = 1
    if options.mtp_num_layers is not None:
        fields["mtp_num_layers"] = options.mtp_num_layers
    return fields


class _Fields:
    """Typed reads of one source's fields; errors name each field as the source spells it."""

    def __init__(self, fields: Mapping[str, Any], source: str, names: Mapping[str, str]) -> None:
        self.fields, self.source, self.names = fields, source, names

    def name(self, key: str) -> str:
        return self.names.get(key, key)

    def error(self, message: str) -> ValueError:
        return ValueError(f"{self.source}: {message}")

    def int(self, key: str, *, minimum: int = 1, default: int | None = None) -> int:
        value = self.fields.get(key, default)
        if value is None and default is not None:
            value = default
        if isinstance(value, bool) or not isinstance(value, int):
            missing = key not in self.fields or self.fields[key] is None
            raise self.error(f"{'missing ' + repr(self.name(key)) if missing else repr(self.name(key)) + ' must be an integer'}"
                             f"{'' if missing else ', got ' + show(value)}")
        if value < minimum:
            raise self.error(f"{self.name(key)!r} must be >= {minimum}, got {value}")
        return value

    def opt_int(self, key: str, *, minimum: int = 1) -> int | None:
        return None if self.fields.get(key) is None else self.int(key, minimum=minimum)

    def bool(self, key: str, default: bool = False) -> bool:
        value = self.fields.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.error(f"{self.name(key)!r} must be true or false, got {show(value)}")
        return value


# ---- layer layouts as runs ------------------------------------------------------------------

_Runs = tuple[tuple[Any, int], ...]


class _FlagRuns(tuple):  # type: ignore[type-arg]
    """A per-layer 0/1 layout already given as runs ``((flag, count), ...)`` (HF readers)."""


def _merged(pairs: Iterable[tuple[Any, int]], what: str) -> _Runs:
    out: list[list[Any]] = []
    for value, count in pairs:
        if count <= 0:
            continue
        if out and out[-1][0] == value:
            out[-1][1] += count
        else:
            out.append([value, count])
            if len(out) > MAX_LAYER_RUNS:
                raise ValueError(f"{what} changes layer kind more than {MAX_LAYER_RUNS:,} times")
    return tuple((v, c) for v, c in out)


def _repeat(unit: _Runs, times: int, what: str) -> _Runs:
    """``unit`` concatenated ``times`` times, never expanded past the run limit."""
    unit = _merged(unit, what)
    if not unit or times == 0:
        return ()
    if len(unit) == 1:
        return ((unit[0][0], unit[0][1] * times),)
    if len(unit) * times > 2 * MAX_LAYER_RUNS:
        raise ValueError(f"{what} changes layer kind more than {MAX_LAYER_RUNS:,} times")
    return _merged(unit * times, what)


def _cycle(unit: _Runs, total: int, what: str) -> _Runs:
    """``unit`` repeated to cover exactly ``total`` layers (the last copy cut short)."""
    period = sum(c for _, c in unit)
    full, rest = divmod(total, period)
    tail: list[tuple[Any, int]] = []
    for value, count in unit:
        if rest <= 0:
            break
        tail.append((value, min(count, rest)))
        rest -= count
    return _merged(_repeat(unit, full, what) + tuple(tail), what)


def _zip(a: _Runs, b: _Runs) -> _Runs:
    """Runs of ``(a_i, b_i)`` pairs of two layouts of one length."""
    out: list[tuple[Any, int]] = []
    i = j = 0
    left_a, left_b = (a[0][1] if a else 0), (b[0][1] if b else 0)
    while i < len(a) and j < len(b):
        n = min(left_a, left_b)
        out.append(((a[i][0], b[j][0]), n))
        left_a -= n
        left_b -= n
        if not left_a:
            i += 1
            left_a = a[i][1] if i < len(a) else 0
        if not left_b:
            j += 1
            left_b = b[j][1] if j < len(b) else 0
    return _merged(out, "the layer layout")


def _length(runs: _Runs) -> int:
    return sum(c for _, c in runs)


class _Pattern:
    """Megatron-LM's layer-pattern strings, e.g. ``"([0]*3+[1]*58)"`` or ``"([1]*3+[0]*2)*2"``,
    evaluated as runs without ``eval``: sums of lists, parenthesised groups and integer repeats."""

    def __init__(self, text: str, what: str) -> None:
        self.text, self.what = "".join(text.split()), what
        self.pos = 0

    def runs(self) -> _Runs:
        runs = self._sum(0)
        if self.pos != len(self.text):
            self._fail()
        return runs

    def _fail(self) -> None:
        raise ValueError(f"{self.what} {show(self.text)} is not a sum of [0/1, ...]*n terms")

    def _peek(self) -> str:
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def _take(self, char: str) -> None:
        if self._peek() != char:
            self._fail()
        self.pos += 1

    def _number(self) -> int:
        start = self.pos
        while self._peek().isdigit():
            self.pos += 1
        if start == self.pos or self.pos - start > 18:
            self._fail()
        return int(self.text[start:self.pos])

    def _sum(self, depth: int) -> _Runs:
        runs = self._term(depth)
        while self._peek() == "+":
            self.pos += 1
            runs = _merged(runs + self._term(depth), self.what)
        return runs

    def _term(self, depth: int) -> _Runs:
        times = 1
        while self._peek().isdigit():
            times *= self._number()
            self._take("*")
        runs = self._factor(depth)
        while self._peek() == "*":
            self.pos += 1
            times *= self._number()
        return _repeat(runs, times, self.what)

    def _factor(self, depth: int) -> _Runs:
        if depth > MAX_NESTING:
            self._fail()
        if self._peek() == "(":
            self.pos += 1
            runs = self._sum(depth + 1)
            self._take(")")
            return runs
        self._take("[")
        values = [self._number()]
        while self._peek() == ",":
            self.pos += 1
            values.append(self._number())
        self._take("]")
        if any(v not in (0, 1) for v in values):
            raise ValueError(f"{self.what} entries must be 0 or 1, got {show(self.text)}")
        return _merged(((bool(v), 1) for v in values), self.what)


def _layer_flags(f: _Fields, key: str, value: Any, num_layers: int, *, every: bool) -> _Runs:
    """An int frequency or a 0/1 list of length ``num_layers``, as megatron-core reads them, as
    runs of booleans.

    ``every=True``: layer i (0-based) is set when ``i % freq == 0`` (``moe_layer_freq``);
    ``every=False``: set unless ``(i + 1) % freq == 0`` (``window_attn_skip_freq``). Megatron-LM's
    command-line form, a string such as ``"([0]*3+[1]*58)"`` (or ``"2"``), is read without ``eval``.
    """
    name = repr(f.name(key))
    if isinstance(value, _FlagRuns):
        runs = tuple(value)
    elif isinstance(value, str):
        text = value.strip()
        if text.isdigit() and len(text) <= 18:
            return _layer_flags(f, key, int(text), num_layers, every=every)
        runs = _Pattern(text, f"{f.source}: {name} string").runs()
    elif isinstance(value, bool) or not isinstance(value, (int, list, tuple)):
        raise f.error(f"{name} must be an integer or a list of 0/1, got {show(value)}")
    elif isinstance(value, int):
        if value < 1:
            raise f.error(f"{name} must be >= 1, got {value}")
        unit = ((True, 1), (False, value - 1)) if every else ((True, value - 1), (False, 1))
        return _cycle(unit, num_layers, f"{f.source}: {name}")
    else:
        if any(isinstance(v, bool) or v not in (0, 1) for v in value):
            raise f.error(f"{name} entries must be 0 or 1, got {show(list(value))}")
        runs = _merged(((bool(v), len(list(group))) for v, group in itertools.groupby(value)), f"{f.source}: {name}")
    if _length(runs) != num_layers:
        raise f.error(f"{name} has {_length(runs)} entries but the model has {num_layers} layers")
    return runs


# ---- the one builder ------------------------------------------------------------------------


def _build(fields: dict[str, Any], *, source: str, names: Mapping[str, str] | None = None) -> ModelSpec:
    f = _Fields(fields, source, names or {})
    if fields.get("experimental_attention_variant"):
        raise f.error(f"experimental_attention_variant={show(fields['experimental_attention_variant'])} "
                      "is not supported")
    hidden = f.int("hidden_size")
    heads = f.int("num_attention_heads")
    groups = f.opt_int("num_query_groups") or heads
    if heads % groups:
        raise f.error(f"{f.name('num_query_groups')}={groups} does not divide "
                      f"{f.name('num_attention_heads')}={heads}")
    kv_channels = f.opt_int("kv_channels")
    if kv_channels is None:
        if hidden % heads:
            raise f.error(f"{f.name('num_attention_heads')}={heads} does not divide {f.name('hidden_size')}="
                          f"{hidden} and {f.name('kv_channels')} is not given")
        kv_channels = hidden // heads
    ffn = f.opt_int("ffn_hidden_size") or 4 * hidden

    activation = fields.get("activation_func", "gelu")
    if not isinstance(activation, str) or activation.lower() not in _ACTIVATIONS:
        raise f.error(f"unknown {f.name('activation_func')} {show(activation)}; known: {', '.join(sorted(_ACTIVATIONS))}")
    activation = activation.lower()
    gated = f.bool("gated_linear_unit") or _ACTIVATIONS[activation]

    # Vocabulary: Megatron pads to a multiple of make_vocab_size_divisible_by x TP.
    vocab = f.int("vocab_size")
    if fields.get("padded_vocab_size") is not None:
        padded_vocab = f.int("padded_vocab_size")
        if padded_vocab < vocab:
            raise f.error(f"{f.name('padded_vocab_size')}={padded_vocab} < {f.name('vocab_size')}={vocab}")
    else:
        multiple = f.int("make_vocab_size_divisible_by", default=128) * f.int("tensor_model_parallel_size", default=1)
        padded_vocab = -(-vocab // multiple) * multiple

    moe = _moe_spec(f, ffn)
    mla = None
    if f.bool("multi_latent_attention"):
        mla = MLASpec(
            q_lora_rank=f.opt_int("q_lora_rank"),
            kv_lora_rank=f.opt_int("kv_lora_rank") or 512,
            qk_head_dim=f.opt_int("qk_head_dim") or 128,
            qk_pos_emb_head_dim=f.int("qk_pos_emb_head_dim", minimum=0, default=64),
            v_head_dim=f.opt_int("v_head_dim") or 128,
        )
    window = _window(f)
    layer_runs, mamba = _layers(f, hidden, moe, window)

    mtp = f.opt_int("mtp_num_layers", minimum=0) or 0
    if fields.get("share_embeddings_and_output_weights") is not None:
        tied = f.bool("share_embeddings_and_output_weights")
    else:
        tied = not f.bool("untie_embeddings_and_output_weights")
    last_ffn = layer_runs[-1][0][1]
    return ModelSpec(
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=kv_channels,
        ffn_hidden_size=ffn,
        gated_linear_unit=gated,
        activation=activation,
        vocab_size=vocab,
        padded_vocab_size=padded_vocab,
        layer_runs=layer_runs,
        attention_output_gate=f.bool("attention_output_gate"),
        window_size=window,
        moe=moe,
        mla=mla,
        mamba=mamba,
        mtp_num_layers=mtp,
        # MTP layers copy the last decoder layer's kind, as Megatron-LM counts them.
        mtp_ffn=last_ffn if last_ffn != "none" else "mlp",
        tied_output=tied,
    )


def _moe_spec(f: _Fields, ffn: int) -> MoESpec | None:
    num_experts = f.opt_int("num_moe_experts")
    if num_experts is None:
        freq = f.fields.get("moe_layer_freq")
        if freq is not None and freq != 1:
            raise f.error(f"{f.name('moe_layer_freq')!r} places MoE layers but {f.name('num_moe_experts')!r} "
                          "is not set")
        return None
    topk = f.opt_int("moe_router_topk") or 2
    if topk > num_experts:
        raise f.error(f"{f.name('moe_router_topk')}={topk} > {f.name('num_moe_experts')}={num_experts}")
    return MoESpec(
        num_experts=num_experts,
        router_topk=topk,
        ffn_hidden_size=f.opt_int("moe_ffn_hidden_size") or ffn,
        shared_expert_ffn_hidden_size=f.opt_int("moe_shared_expert_intermediate_size") or 0,
        shared_expert_gate=f.bool("moe_shared_expert_gate"),
        latent_size=f.opt_int("moe_latent_size"),
    )


def _window(f: _Fields) -> int | None:
    window_size = f.fields.get("window_size")
    name = f.name("window_size")
    if window_size is None:
        if f.fields.get("window_attn_skip_freq") is not None:
            raise f.error(f"{f.name('window_attn_skip_freq')!r} needs {name!r}")
        return None
    if not isinstance(window_size, (list, tuple)) or len(window_size) != 2:
        raise f.error(f"{name} must be a pair (left, right), got {show(window_size)}")
    left, right = window_size
    if (isinstance(right, bool) or right not in (0, -1) or not isinstance(left, int) or isinstance(left, bool)
            or left < -1):
        raise f.error(f"{name}={show(list(window_size))}: only causal sliding windows (left, 0) are supported")
    return None if left == -1 else left


def _layers(
    f: _Fields, hidden: int, moe: MoESpec | None, window: int | None
) -> tuple[tuple[tuple[tuple[str, str], int], ...], MambaSpec | None]:
    pattern = f.fields.get("hybrid_override_pattern") or f.fields.get("hybrid_layer_pattern")
    if not pattern:
        num_layers = f.int("num_layers")
        ffn_runs: _Runs = ((False, num_layers),)
        if moe is not None:
            ffn_runs = _layer_flags(f, "moe_layer_freq", f.fields.get("moe_layer_freq", 1), num_layers, every=True)
        windowed: _Runs = ((False, num_layers),)
        if window is not None:
            skip = f.fields.get("window_attn_skip_freq")
            windowed = ((True, num_layers),) if skip is None else _layer_flags(
                f, "window_attn_skip_freq", skip, num_layers, every=False)
        runs = _zip(windowed, ffn_runs)
        return tuple((("window" if w else "attention", "moe" if m else "mlp"), n) for (w, m), n in runs), None
    name = f.name("hybrid_override_pattern")
    if not isinstance(pattern, str) or set(pattern) - set(_HYBRID_SYMBOLS):
        raise f.error(f"{name} {show(pattern)} may only use the symbols {''.join(_HYBRID_SYMBOLS)}")
    num_layers = f.fields.get("num_layers")
    if num_layers is not None and num_layers != len(pattern):
        raise f.error(f"{f.name('num_layers')}={show(num_layers)} but {name} has {len(pattern)} layers")
    if "E" in pattern and moe is None:
        raise f.error(f"{name} has MoE layers ('E') but {f.name('num_moe_experts')} is unset")
    layer_runs = _merged(((_HYBRID_SYMBOLS[c], len(list(g))) for c, g in itertools.groupby(pattern)),
                         f"{f.source}: {name}")
    mamba = None
    if "M" in pattern:
        d_inner = 2 * hidden
        head_dim = f.opt_int("mamba_head_dim") or 64
        mamba = MambaSpec(
            state_dim=f.opt_int("mamba_state_dim") or 128,
            head_dim=head_dim,
            num_groups=f.opt_int("mamba_num_groups") or 8,
            num_heads=f.opt_int("mamba_num_heads") or max(d_inner // head_dim, 1),
        )
    return layer_runs, mamba


# ---- Hugging Face config.json ---------------------------------------------------------------

HF_FAMILIES = ("deepseek_v2", "deepseek_v3", "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe")
# VLM text decoders priced with their text family's rules.
_HF_TEXT_MODEL_TYPES = {
    "qwen2_vl": "qwen2", "qwen2_vl_text": "qwen2", "qwen2_5_vl": "qwen2", "qwen2_5_vl_text": "qwen2",
    "qwen3_vl": "qwen3", "qwen3_vl_text": "qwen3", "qwen3_vl_moe": "qwen3_moe", "qwen3_vl_moe_text": "qwen3_moe",
}
_HF_SOURCE = "Hugging Face config"
_HF_NAMES = {
    "num_layers": "num_hidden_layers", "ffn_hidden_size": "intermediate_size", "num_query_groups": "num_key_value_heads",
    "kv_channels": "head_dim", "activation_func": "hidden_act", "moe_router_topk": "num_experts_per_tok",
    "moe_ffn_hidden_size": "moe_intermediate_size", "num_moe_experts": "num_experts",
    "moe_shared_expert_intermediate_size": "shared_expert_intermediate_size", "window_size": "sliding_window",
    "share_embeddings_and_output_weights": "tie_word_embeddings", "attention_output_gate": "attn_output_gate",
    "q_lora_rank": "q_lora_rank", "kv_lora_rank": "kv_lora_rank", "qk_head_dim": "qk_nope_head_dim",
    "qk_pos_emb_head_dim": "qk_rope_head_dim", "moe_layer_freq": "first_k_dense_replace",
    "window_attn_skip_freq": "layer_types",
}
# Keys whose Hugging Face default is a fixed size rather than derived, so a file must give them.
_HF_FIXED_KV_HEADS = ("mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe")


def _hf_family(hf: Mapping[str, Any], family: str | None) -> str:
    if family is not None:
        return family
    model_type = hf.get("model_type")
    if model_type is None:
        raise ValueError(f"{_HF_SOURCE}: missing 'model_type' (one of {', '.join(HF_FAMILIES)}); "
                         "or name the family with --hf-family")
    if not isinstance(model_type, str):
        raise ValueError(f"{_HF_SOURCE}: 'model_type' must be a string, got {show(model_type)}")
    if model_type in HF_FAMILIES:
        return model_type
    if model_type in _HF_TEXT_MODEL_TYPES:
        return _HF_TEXT_MODEL_TYPES[model_type]
    raise ValueError(
        f"{_HF_SOURCE}: model_type {show(model_type)} is not supported (supported: {', '.join(HF_FAMILIES)}, "
        f"and the text decoders of {', '.join(sorted(k for k in _HF_TEXT_MODEL_TYPES if not k.endswith('_text')))}); "
        "--hf-family FAMILY prices it with that family's rules, ignoring whatever else differs"
    )


def _hf_to_mcore(hf: Mapping[str, Any], *, family: str | None = None) -> dict[str, Any]:
    """Translate Hugging Face config keys to TransformerConfig field names with ``family``'s rules
    (as transformers' modeling code reads them); every key is type-checked under its HF name."""
    family = _hf_family(hf, family)
    f = _Fields(hf, f"{_HF_SOURCE} ({family})", {})
    required = ["num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"]
    if family in _HF_FIXED_KV_HEADS:
        required.append("num_key_value_heads")
    if family == "qwen3":
        required.append("head_dim")
    missing = [k for k in required if hf.get(k) is None]
    if missing:
        raise f.error(f"missing required key(s) {', '.join(repr(k) for k in missing)}")
    num_layers = f.int("num_hidden_layers")
    heads = f.int("num_attention_heads")
    out: dict[str, Any] = {
        "num_layers": num_layers,
        "hidden_size": f.int("hidden_size"),
        "num_attention_heads": heads,
        "num_query_groups": f.opt_int("num_key_value_heads") or heads,
        "ffn_hidden_size": f.int("intermediate_size"),
        "vocab_size": f.int("vocab_size"),
        "share_embeddings_and_output_weights": f.bool("tie_word_embeddings"),
        "attention_output_gate": f.bool("attn_output_gate"),
        "activation_func": hf.get("hidden_act") or "silu",
        # Every supported family runs a gated MLP (gate_proj/up_proj/down_proj).
        "gated_linear_unit": True,
        # NB: a Hugging Face vocab_size is the embedding as built: padded only on request.
        "make_vocab_size_divisible_by": f.int("make_vocab_size_divisible_by", default=1),
        "tensor_model_parallel_size": f.int("tensor_model_parallel_size", default=1),
    }
    if hf.get("head_dim") is not None:
        out["kv_channels"] = f.int("head_dim")
    if family.startswith("deepseek"):
        _hf_deepseek(f, out, num_layers)
    elif family in ("mixtral", "qwen2_moe", "qwen3_moe"):
        _hf_moe(f, out, family, num_layers)
    _hf_window(f, out, family, num_layers)
    return out


def _hf_moe(f: _Fields, out: dict[str, Any], family: str, num_layers: int) -> None:
    hf = f.fields
    experts_key = "num_local_experts" if family == "mixtral" and "num_experts" not in hf else "num_experts"
    required = [experts_key, "num_experts_per_tok"] + (["moe_intermediate_size"] if family != "mixtral" else [])
    if family == "qwen2_moe":
        required.append("shared_expert_intermediate_size")
    missing = [k for k in required if hf.get(k) is None]
    if missing:
        raise f.error(f"missing required key(s) {', '.join(repr(k) for k in missing)}")
    num_experts = f.int(experts_key, minimum=0)
    if num_experts == 0:  # Qwen: no experts, every layer dense.
        return
    topk = f.int("num_experts_per_tok")
    if topk > num_experts:
        raise f.error(f"num_experts_per_tok={topk} > {experts_key}={num_experts}")
    out["num_moe_experts"] = num_experts
    out["moe_router_topk"] = topk
    out["moe_ffn_hidden_size"] = f.int("intermediate_size" if family == "mixtral" else "moe_intermediate_size")
    if family == "mixtral":
        return
    if family == "qwen2_moe":
        out["moe_shared_expert_intermediate_size"] = f.int("shared_expert_intermediate_size")
        # Qwen2-MoE scales the shared expert by a sigmoid gate: one [T, h] @ [h, 1] GEMM.
        out["moe_shared_expert_gate"] = True
    # Qwen: layer i is sparse when (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers.
    step = f.int("decoder_sparse_step", default=1)
    flags = _cycle(((False, step - 1), (True, 1)), num_layers, f"{f.source}: 'decoder_sparse_step'")
    mlp_only = hf.get("mlp_only_layers") or []
    if not isinstance(mlp_only, list) or any(
        isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_layers for i in mlp_only
    ):
        raise f.error(f"'mlp_only_layers' must be a list of layer indices in [0, {num_layers}), got {show(mlp_only)}")
    out["moe_layer_freq"] = _FlagRuns(_cleared(flags, sorted(set(mlp_only)), f.source))


def _cleared(runs: _Runs, indices: list[int], what: str) -> _Runs:
    """``runs`` with the layers at sorted ``indices`` set to False."""
    pieces: list[tuple[Any, int]] = []
    start = 0
    k = 0
    for value, count in runs:
        end = start + count
        pos = start
        while k < len(indices) and indices[k] < end:
            pieces += [(value, indices[k] - pos), (False, 1)]
            pos = indices[k] + 1
            k += 1
        pieces.append((value, end - pos))
        start = end
    return _merged(pieces, what)


def _hf_deepseek(f: _Fields, out: dict[str, Any], num_layers: int) -> None:
    hf = f.fields
    required = ["n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts",
                "first_k_dense_replace", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"]
    missing = [k for k in required if hf.get(k) is None and not (k == "n_shared_experts" and k in hf)]
    if "q_lora_rank" not in hf:
        missing.append("q_lora_rank")  # null is allowed (DeepSeek-V2-Lite): a plain q_proj.
    if missing:
        raise f.error(f"missing required key(s) {', '.join(repr(k) for k in missing)}")
    freq = f.int("moe_layer_freq", default=1)
    if freq != 1:
        # NB: transformers makes every layer from first_k_dense_replace on an MoE layer, DeepSeek's own
        # modeling code only every moe_layer_freq-th: the file does not say which one trains.
        raise f.error(f"moe_layer_freq={freq}: transformers ignores it (every layer from first_k_dense_replace "
                      "on is MoE) while DeepSeek's remote code places MoE layers every moe_layer_freq-th; set it "
                      "to 1 for transformers' placement, or describe the model in megatron-core fields")
    first_dense = f.int("first_k_dense_replace", minimum=0)
    if first_dense > num_layers:
        raise f.error(f"first_k_dense_replace={first_dense} > num_hidden_layers={num_layers}")
    num_experts = f.int("n_routed_experts")
    topk = f.int("num_experts_per_tok")
    if topk > num_experts:
        raise f.error(f"num_experts_per_tok={topk} > n_routed_experts={num_experts}")
    moe_ffn = f.int("moe_intermediate_size")
    out.update(
        num_moe_experts=num_experts,
        moe_router_topk=topk,
        moe_ffn_hidden_size=moe_ffn,
        moe_layer_freq=_FlagRuns(_merged(((False, first_dense), (True, num_layers - first_dense)), f.source)),
        multi_latent_attention=True,
        q_lora_rank=f.opt_int("q_lora_rank"),
        kv_lora_rank=f.int("kv_lora_rank"),
        qk_head_dim=f.int("qk_nope_head_dim"),
        qk_pos_emb_head_dim=f.int("qk_rope_head_dim", minimum=0),
        v_head_dim=f.int("v_head_dim"),
    )
    shared = f.opt_int("n_shared_experts", minimum=0)
    if shared:
        out["moe_shared_expert_intermediate_size"] = shared * moe_ffn
    out.pop("kv_channels", None)
    # NB: num_nextn_predict_layers (DeepSeek-V3's MTP module) is not counted: transformers never runs
    # it; ModelOptions.mtp_num_layers (--mtp-num-layers) counts MTP layers as Megatron-LM trains them.


def _hf_window(f: _Fields, out: dict[str, Any], family: str, num_layers: int) -> None:
    """Sliding windows as each family's modeling code applies them.

    NB: HF's window of W tokens includes the query itself (q - k < W): megatron's (W - 1, 0).
    """
    hf = f.fields
    if family in ("llama", "deepseek_v2", "deepseek_v3"):
        return
    if family in ("mistral", "mixtral"):
        if family == "mistral" and "sliding_window" not in hf:
            raise f.error("missing required key 'sliding_window' (null for none; transformers' default is 4096)")
        size = f.opt_int("sliding_window")
        if size is not None:
            out["window_size"] = (size - 1, 0)  # every layer
        return
    if not f.bool("use_sliding_window"):
        return
    size = f.opt_int("sliding_window", minimum=0)
    if not size:
        return
    out["window_size"] = (size - 1, 0)
    if family == "qwen3_moe":
        return  # every layer
    layer_types = hf.get("layer_types")
    if layer_types is not None:
        kinds = ("full_attention", "sliding_attention")
        if not isinstance(layer_types, list) or any(not isinstance(t, str) or t not in kinds for t in layer_types):
            raise f.error(f"'layer_types' must be a list of {' or '.join(map(repr, kinds))}, got {show(layer_types)}")
        flags = _merged(((t == "sliding_attention", len(list(g))) for t, g in itertools.groupby(layer_types)),
                        f"{f.source}: 'layer_types'")
        if _length(flags) != num_layers:
            raise f.error(f"'layer_types' has {len(layer_types)} entries but num_hidden_layers={num_layers}")
    else:
        if hf.get("max_window_layers") is None:
            raise f.error("missing required key 'max_window_layers' (use_sliding_window is true)")
        boundary = min(f.int("max_window_layers", minimum=0), num_layers)
        if family == "qwen2_moe":
            # Layers i < max_window_layers with (i + 1) % 2 != 0 (the even ones) slide.
            flags = _cycle(((True, 1), (False, 1)), boundary, f"{f.source}: 'max_window_layers'")
            flags = _merged(flags + ((False, num_layers - boundary),), f.source)
        else:
            flags = _merged(((False, boundary), (True, num_layers - boundary)), f.source)
    out["window_attn_skip_freq"] = _FlagRuns(flags)
