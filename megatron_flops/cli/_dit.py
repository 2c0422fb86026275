"""``megatron-flops estimate`` on a DiT model file (a ``"dit"`` section): --seqlens are video
tokens per sample, --kv-seqlens text tokens."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megatron_flops.cli.estimate import _format_components, _json_list_arg
from megatron_flops.formulas import Row, parse_rows


def _format_dit(report: dict[str, Any]) -> str:
    head = (f"DiT: {report['num_samples']} samples, {report['num_video_tokens']:,} video tokens, "
            f"{report['num_text_tokens']:,} text tokens")
    return "\n".join([head, f"attention: full; model FLOPs convention: {report['model_flops_convention']}", "",
                      *_format_components(report["components"], report["total_flops"]), "",
                      f"static (every sample priced as {report['static_seq_length']:,} video tokens): "
                      f"{report['static_flops']:,}  -> over-reports {report['over_report_factor']:.2f}x"])


def estimate_dit(args: argparse.Namespace, raw: dict[str, Any], rows: Sequence[Row] | None) -> int:
    """Print the DiT report for ``estimate``'s parsed arguments; ``raw`` is the model file."""
    from megatron_flops.dit_passes import dit_report, dit_setup

    if rows is None:
        raise ValueError(f"{args.model}: a DiT model file needs --seqlens (video tokens per sample)")
    if args.grid_thw is not None or args.frozen or args.lora_rank is not None or args.recompute is not None:
        raise ValueError("--grid-thw, --frozen, --lora-rank and --recompute do not apply to a DiT model file")
    video = [s for row in rows for s in row.seqlens]
    text = None
    if args.kv_seqlens is not None:
        try:
            text = [s for row in parse_rows(_json_list_arg("--kv-seqlens", args.kv_seqlens)) for s in row.seqlens]
        except ValueError as exc:
            raise ValueError(f"--kv-seqlens: {exc}") from None
        if len(text) != len(video):
            raise ValueError(f"--kv-seqlens has {len(text)} lengths but --seqlens has {len(video)} samples")
    report = dit_report(dit_setup(raw, source=Path(args.model).name), video, text, convention=args.convention)
    print(json.dumps(report) if args.json else _format_dit(report))
    return 0
