"""``megatron-flops estimate`` on a DiT model file (a ``"dit"`` section): --seqlens are video
tokens per sample, --kv-seqlens text tokens, --image-seqlens CLIP tokens; --frozen, --lora-rank,
--lora-targets and --recompute full (--recompute-num-layers: blocks) set up training."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megatron_flops.cli._common import format_components, json_list_arg
from megatron_flops.flops.formulas import Row, parse_rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The DiT-only flags of ``estimate``."""
    from megatron_flops.flops.dit import DEFAULT_DIT_LORA_TARGETS, DIT_LORA_TARGETS

    group = parser.add_argument_group(
        "DiT model file",
        f"--lora-targets takes WAN module names, matched by suffix as PEFT's target_modules: "
        f"{', '.join(DIT_LORA_TARGETS)} (default {','.join(DEFAULT_DIT_LORA_TARGETS)}: self- and "
        "cross-attention q, k, v, o); --recompute full checkpoints every block, or the first "
        "--recompute-num-layers blocks.",
    )
    group.add_argument("--image-seqlens", help="JSON list of image (CLIP) tokens per sample, image-to-video "
                                               "(default: image_len each)")


def _format_dit(report: dict[str, Any]) -> str:
    head = (f"DiT: {report['num_samples']} samples, {report['num_video_tokens']:,} video tokens, "
            f"{report['num_text_tokens']:,} text tokens"
            + (f", {report['num_image_tokens']:,} image tokens" if report["num_image_tokens"] else ""))
    if report["lora_rank"]:
        training = (f"LoRA rank {report['lora_rank']} on {', '.join(report['lora_modules'])} "
                    f"({report['num_adapters']} adapters), base {'frozen' if report['frozen'] else 'trained'}")
    else:
        training = "every weight trained"
    if report["checkpointed_blocks"]:
        training += f"; {report['checkpointed_blocks']} blocks checkpointed"
    params = (f"parameters: {report['num_params']:,} total, {report['num_trainable_params']:,} trainable "
              f"({report['num_trainable_params'] / report['num_params']:.2%}), {report['num_block_params']:,} "
              f"per block" + (f", {report['num_adapter_params']:,} in adapters" if report["num_adapters"] else ""))
    return "\n".join([
        head, training, params, f"attention: full; model FLOPs convention: {report['model_flops_convention']}", "",
        *format_components(report["components"], report["total_flops"]), "",
        f"executed: {report['executed_flops']:,}"
        + (f"  (of which recompute {report['recompute_flops']:,})" if report["recompute_flops"] else ""),
        f"static (every sample priced as {report['static_seq_length']:,} video tokens, every weight trained): "
        f"{report['static_flops']:,}  -> over-reports {report['over_report_factor']:.2f}x",
    ])


def _lengths(flag: str, value: str | None) -> list[int] | None:
    if value is None:
        return None
    try:
        return [s for row in parse_rows(json_list_arg(flag, value)) for s in row.seqlens]
    except ValueError as exc:
        raise ValueError(f"{flag}: {exc}") from None


def estimate_dit(args: argparse.Namespace, raw: dict[str, Any], rows: Sequence[Row] | None) -> int:
    """Print the DiT report for ``estimate``'s parsed arguments; ``raw`` is the model file."""
    from megatron_flops.flops.dit_passes import dit_report, dit_setup

    if rows is None:
        raise ValueError(f"{args.model}: a DiT model file needs --seqlens (video tokens per sample)")
    if args.grid_thw is not None or args.recompute_modules is not None:
        raise ValueError("--grid-thw and --recompute-modules do not apply to a DiT model file")
    video = [s for row in rows for s in row.seqlens]
    text, image = _lengths("--kv-seqlens", args.kv_seqlens), _lengths("--image-seqlens", args.image_seqlens)
    for flag, lengths in (("--kv-seqlens", text), ("--image-seqlens", image)):
        if lengths is not None and len(lengths) != len(video):
            raise ValueError(f"{flag} has {len(lengths)} lengths but --seqlens has {len(video)} samples")
    setup = dit_setup(
        raw,
        frozen=args.frozen,
        lora_rank=args.lora_rank,
        lora_targets=None if args.lora_targets is None else [t.strip() for t in args.lora_targets.split(",")],
        recompute=args.recompute,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        source=Path(args.model).name,
    )
    report = dit_report(setup, video, text, image, convention=args.convention)
    print(json.dumps(report) if args.json else _format_dit(report))
    return 0
