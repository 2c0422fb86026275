"""A small WAN-2.1-like video DiT with LoRA on a frozen base, trained under torch FSDP2
(``fully_shard``) with per-block activation checkpointing, in 2 local gloo processes on CPU;
megatron-flops prices every step from the real clip lengths.

    python examples/wan_dit_fsdp2.py                       # spawns 2 processes
    torchrun --nproc-per-node 2 examples/wan_dit_fsdp2.py  # or let torchrun launch them

The model file ``examples/wan_tiny_dit.json`` drives both the model and the tracker: its ``dit``
section is the architecture, ``lora`` the adapters (rank, PEFT-style target names matched by
module-name suffix), ``recompute_granularity: full`` checkpoints every block. Each micro-batch
holds clips of random size (frames x height x width latents) and prompts of random length,
packed into one sequence per micro-batch (as Megatron-Bridge's WAN packs them): the linear layers
run over the packed tokens, attention within each clip and its prompt. The loop calls
``tracker.record(video_seqlens=..., text_seqlens=...)`` once per micro-batch and
``tracker.end_step()`` once per step on every rank, and prints static vs corrected TFLOP/s/GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import random
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from typing import IO
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

from megatron_flops import FlopsTracker
from megatron_flops.flops.dit import DiTSpec
from megatron_flops.reporting.meter import ThroughputMeter, format_log_line, format_summary
from megatron_flops.tracking.result import StepResult

MODEL_FILE = Path(__file__).resolve().parent / "wan_tiny_dit.json"
GLOO_TIMEOUT_S = 120

# ---- the model: WanModel's modules and names, packed clips ---------------------------------------


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_lens: Sequence[int], kv_lens: Sequence[int],
           heads: int) -> torch.Tensor:
    """Unmasked attention of each clip's queries to its own keys: ``[S, D]`` x ``[C, D]`` -> ``[S, D]``,
    with explicit matmuls (what FlopCounterMode and the formulas count)."""
    out = []
    for qi, ki, vi in zip(q.split(list(q_lens)), k.split(list(kv_lens)), v.split(list(kv_lens))):
        qi, ki, vi = (t.unflatten(-1, (heads, -1)).transpose(0, 1) for t in (qi, ki, vi))
        probs = torch.softmax(qi @ ki.transpose(-1, -2) / math.sqrt(qi.shape[-1]), dim=-1)
        out.append((probs @ vi).transpose(0, 1).flatten(1))
    return torch.cat(out)


class WanSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.norm_q, self.norm_k = nn.RMSNorm(dim), nn.RMSNorm(dim)

    def forward(self, x: torch.Tensor, lens: Sequence[int]) -> torch.Tensor:
        q, k = self.norm_q(self.q(x)), self.norm_k(self.k(x))
        return self.o(attend(q, k, self.v(x), lens, lens, self.heads))


class WanCrossAttention(nn.Module):
    """Text cross-attention, plus image-to-video's second key/value pair on the CLIP tokens."""

    def __init__(self, dim: int, heads: int, image: bool) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.norm_q, self.norm_k = nn.RMSNorm(dim), nn.RMSNorm(dim)
        if image:
            self.k_img, self.v_img = nn.Linear(dim, dim), nn.Linear(dim, dim)
            self.norm_k_img = nn.RMSNorm(dim)

    def forward(self, x, lens, context, text_lens, image, image_lens) -> torch.Tensor:
        q = self.norm_q(self.q(x))
        out = attend(q, self.norm_k(self.k(context)), self.v(context), lens, text_lens, self.heads)
        if image is not None:
            out = out + attend(q, self.norm_k_img(self.k_img(image)), self.v_img(image), lens, image_lens, self.heads)
        return self.o(out)


class WanAttentionBlock(nn.Module):
    def __init__(self, spec: DiTSpec) -> None:
        super().__init__()
        d = spec.hidden_size
        self.norm1 = nn.LayerNorm(d, elementwise_affine=False)
        self.self_attn = WanSelfAttention(d, spec.num_heads)
        self.norm3 = nn.LayerNorm(d)
        self.cross_attn = WanCrossAttention(d, spec.num_heads, spec.image_dim is not None)
        self.norm2 = nn.LayerNorm(d, elementwise_affine=False)
        self.ffn = nn.Sequential(nn.Linear(d, spec.ffn_hidden_size), nn.GELU(approximate="tanh"),
                                 nn.Linear(spec.ffn_hidden_size, d))
        self.modulation = nn.Parameter(torch.randn(1, 6, d) / d**0.5)

    def forward(self, x, e, lens, context, text_lens, image, image_lens) -> torch.Tensor:
        # e: [S, 6, d], each token's adaLN input (its clip's time projection).
        e = (self.modulation + e).unbind(1)
        x = x + self.self_attn(self.norm1(x) * (1 + e[1]) + e[0], lens) * e[2]
        x = x + self.cross_attn(self.norm3(x), lens, context, text_lens, image, image_lens)
        return x + self.ffn(self.norm2(x) * (1 + e[4]) + e[3]) * e[5]


class Head(nn.Module):
    def __init__(self, spec: DiTSpec) -> None:
        super().__init__()
        d = spec.hidden_size
        self.norm = nn.LayerNorm(d, elementwise_affine=False)
        self.head = nn.Linear(d, spec.out_channels * math.prod(spec.patch_size))
        self.modulation = nn.Parameter(torch.randn(1, 2, d) / d**0.5)

    def forward(self, x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        shift, scale = (self.modulation + e[:, None]).unbind(1)
        return self.head(self.norm(x) * (1 + scale) + shift)


class WanLike(nn.Module):
    """``WanModel`` on packed clips: ``forward`` takes lists of per-clip tensors. The first
    ``checkpoint_blocks`` blocks run under non-reentrant ``torch.utils.checkpoint``."""

    def __init__(self, spec: DiTSpec, *, checkpoint_blocks: int = 0) -> None:
        super().__init__()
        d, self.spec, self.checkpoint_blocks = spec.hidden_size, spec, checkpoint_blocks
        self.patch_embedding = nn.Conv3d(spec.in_channels, d, kernel_size=spec.patch_size, stride=spec.patch_size)
        self.text_embedding = nn.Sequential(nn.Linear(spec.text_dim, d), nn.GELU(approximate="tanh"), nn.Linear(d, d))
        self.time_embedding = nn.Sequential(nn.Linear(spec.freq_dim, d), nn.SiLU(), nn.Linear(d, d))
        self.time_projection = nn.Sequential(nn.SiLU(), nn.Linear(d, 6 * d))
        self.blocks = nn.ModuleList(WanAttentionBlock(spec) for _ in range(spec.num_layers))
        self.head = Head(spec)
        if spec.image_dim is not None:
            w = spec.image_dim
            self.img_emb = nn.Module()
            self.img_emb.proj = nn.Sequential(nn.LayerNorm(w), nn.Linear(w, w), nn.GELU(), nn.Linear(w, d),
                                              nn.LayerNorm(d))

    def forward(self, latents: Sequence[torch.Tensor], t: torch.Tensor, text: Sequence[torch.Tensor],
                clip: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        """latents ``[C_in, f, h, w]`` per clip, ``t`` ``[B]`` timesteps, text ``[c_i, text_dim]``,
        clip ``[m_i, image_dim]``; returns ``[S, C_out * patch]`` for the packed video tokens."""
        x = torch.cat([self.patch_embedding(z[None]).flatten(2)[0].T for z in latents])
        lens = [z.shape[1] * z.shape[2] * z.shape[3] // math.prod(self.spec.patch_size) for z in latents]
        half = self.spec.freq_dim // 2
        angles = t[:, None].float() * torch.pow(10000.0, -torch.arange(half, device=t.device) / half)
        # The sinusoid is computed in fp32 and cast to the compute dtype (bf16 weights: no autocast needed).
        e = self.time_embedding(torch.cat([torch.cos(angles), torch.sin(angles)], dim=1).to(x.dtype))
        repeats = torch.tensor(lens, device=x.device)
        e0 = self.time_projection(e).unflatten(1, (6, -1)).repeat_interleave(repeats, dim=0)
        context, text_lens = self.text_embedding(torch.cat(list(text))), [c.shape[0] for c in text]
        image, image_lens = None, None
        if clip is not None:
            image, image_lens = self.img_emb.proj(torch.cat(list(clip))), [c.shape[0] for c in clip]
        for i, block in enumerate(self.blocks):
            args = (x, e0, lens, context, text_lens, image, image_lens)
            x = checkpoint(block, *args, use_reentrant=False) if i < self.checkpoint_blocks else block(*args)
        return self.head(x, e.repeat_interleave(repeats, dim=0))


class LoRALinear(nn.Module):
    """``base(x) + B(A(x)) * alpha / r`` (PEFT's LoRA Linear; B starts at zero)."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float) -> None:
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.Linear(base.in_features, rank, bias=False)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False)
        nn.init.zeros_(self.lora_B.weight)
        self.scaling = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.lora_B(self.lora_A(x)) * self.scaling


def add_lora(model: nn.Module, targets: Sequence[str], rank: int, alpha: float | None = None) -> int:
    """Freeze every weight, then wrap each ``nn.Linear`` whose name ends with a target at a dot
    (PEFT's ``target_modules`` rule); returns the number of adapters."""
    model.requires_grad_(False)
    names = [n for n, m in model.named_modules()
             if isinstance(m, nn.Linear) and any(n == t or n.endswith("." + t) for t in targets)]
    for name in names:
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent)
        setattr(owner, child, LoRALinear(getattr(owner, child), rank, alpha or rank))
    return len(names)


def build_model(raw: dict, *, seed: int = 0) -> WanLike:
    """The model a model file describes: architecture, LoRA, checkpointing (every block)."""
    spec = DiTSpec.from_mapping(raw["dit"])
    torch.manual_seed(seed)
    model = WanLike(spec, checkpoint_blocks=spec.num_layers if raw.get("recompute_granularity") else 0)
    if raw.get("lora"):
        add_lora(model, raw["lora"].get("target_modules", ["q", "k", "v", "o"]), raw["lora"]["dim"])
    return model


# ---- data: clips of random size and prompts of random length -------------------------------------


@dataclass(frozen=True)
class Clip:
    latent: torch.Tensor  # [C_in, frames, height, width]
    text: torch.Tensor  # [text tokens, text_dim]
    image: torch.Tensor | None  # [CLIP tokens, image_dim]
    target: torch.Tensor  # [video tokens, C_out * patch]


def clips(spec: DiTSpec, rng: random.Random, count: int) -> list[Clip]:
    """``count`` clips: 1-3 latent frames of 2-6 x 2-8 (even) latent pixels, 2-``text_len`` text tokens."""
    out = []
    for _ in range(count):
        frames, height, width = rng.randint(1, 3), 2 * rng.randint(1, 3), 2 * rng.randint(1, 4)
        tokens = frames * height * width // math.prod(spec.patch_size)
        gen = torch.Generator().manual_seed(rng.randrange(2**31))
        out.append(Clip(
            latent=torch.randn(spec.in_channels, frames, height, width, generator=gen),
            text=torch.randn(rng.randint(2, spec.text_len), spec.text_dim, generator=gen),
            image=None if spec.image_dim is None else torch.randn(spec.image_len, spec.image_dim, generator=gen),
            target=torch.randn(tokens, spec.out_channels * math.prod(spec.patch_size), generator=gen),
        ))
    return out


def video_tokens(spec: DiTSpec, clip: Clip) -> int:
    return math.prod(clip.latent.shape[1:]) // math.prod(spec.patch_size)


@dataclass(frozen=True)
class Options:
    iterations: int = 6
    micro_batches: int = 2
    clips_per_micro_batch: int = 2
    seed: int = 0
    warmup: int = 1
    trace: str | None = None  # rank 0 writes one JSON line per step
    check: bool = False  # measure every step with FlopCounterMode


def microbatches(spec: DiTSpec, options: Options, rank: int) -> Iterator[tuple[list[Clip], torch.Tensor]]:
    """Each rank's endless stream of (clips, diffusion timesteps): every rank sees different clips."""
    rng = random.Random(options.seed * 1000 + rank)
    while True:
        batch = clips(spec, rng, options.clips_per_micro_batch)
        yield batch, torch.tensor([rng.randrange(1000) for _ in batch])


# ---- training -----------------------------------------------------------------------------------


class Trainer:
    """One rank: the model sharded with FSDP2 over the world, the tracker in the loop."""

    def __init__(self, options: Options, rank: int, world_size: int) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        self.options, self.rank, self.world_size = options, rank, world_size
        self.raw = json.loads(MODEL_FILE.read_text())
        self.spec = DiTSpec.from_mapping(self.raw["dit"])
        self.model = build_model(self.raw, seed=options.seed)
        mesh = init_device_mesh("cpu", (world_size,))
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        # The one line megatron-flops needs at set-up: a tracker from the same model file.
        self.tracker = FlopsTracker.from_model_file(MODEL_FILE)
        self.optimizer = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=1e-3)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a CPU has no peak FLOP/s: no MFU
            self.meter = ThroughputMeter(world_size=world_size, peak_flops_per_s=None,
                                         warmup_iterations=options.warmup)
        self.stream = microbatches(self.spec, options, rank)

    def run(self) -> None:
        if self.rank == 0:
            print(_header(self.raw, self.world_size), flush=True)
        trace = Path(self.options.trace).open("w") if self.options.trace and self.rank == 0 else None
        try:
            for iteration in range(1, self.options.iterations + 1):
                started = time.perf_counter()
                measured, loss = self.step()
                # Every rank, once per step: the one all-reduce, then the step's FLOPs.
                result = self.tracker.end_step()
                elapsed = time.perf_counter() - started
                self.meter.record(iteration=iteration, result=result, elapsed_s=elapsed)
                if self.rank == 0:
                    self.log(iteration, result, elapsed, measured, loss, trace)
        finally:
            if trace is not None:
                trace.close()
        if self.rank == 0:
            print(format_summary(self.meter.summary(), warmup_iterations=self.options.warmup), flush=True)

    def step(self) -> tuple[int | None, float]:
        """Forward + backward over the micro-batches, then the optimizer: (the FLOPs FlopCounterMode
        measured on every rank with ``check``, the last loss)."""
        spec, counter = self.spec, FlopCounterMode(display=False)
        with counter if self.options.check else contextlib.nullcontext():
            for m in range(self.options.micro_batches):
                batch, t = next(self.stream)
                self.tracker.record(video_seqlens=torch.tensor([video_tokens(spec, c) for c in batch]),
                                    text_seqlens=torch.tensor([c.text.shape[0] for c in batch]))
                self.model.set_requires_gradient_sync(m == self.options.micro_batches - 1)
                out = self.model([c.latent for c in batch], t, [c.text for c in batch],
                                 None if spec.image_dim is None else [c.image for c in batch])
                loss = F.mse_loss(out.float(), torch.cat([c.target for c in batch])) / self.options.micro_batches
                loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        if not self.options.check:
            return None, loss.item()
        measured = torch.tensor([counter.get_total_flops()], dtype=torch.int64)
        dist.all_reduce(measured)
        return int(measured), loss.item()

    def log(self, iteration: int, result: StepResult, elapsed: float, measured: int | None, loss: float,
            trace: IO[str] | None) -> None:
        line = format_log_line(self.meter.interval(), iteration=iteration, train_iters=self.options.iterations,
                               elapsed_ms_per_iter=1000 * elapsed)
        if measured is not None:
            line += f" executed FLOPs {'==' if measured == result.executed_flops else '!='} FlopCounterMode |"
        print(line + f" loss: {loss:.4f} |", flush=True)
        if trace is not None:
            trace.write(json.dumps({"iteration": iteration, "flops": result.flops,
                                    "executed_flops": result.executed_flops, "static_flops": result.static_flops,
                                    "num_video_tokens": result.num_tokens, "ok": result.ok,
                                    "measured_flops": measured}) + "\n")


def _header(raw: dict, world_size: int) -> str:
    dit, lora = raw["dit"], raw.get("lora") or {}
    return (f"WAN-like DiT: {dit['num_layers']} blocks, hidden {dit['hidden_size']}; LoRA rank {lora.get('dim')} on "
            f"{','.join(lora.get('target_modules', []))}, base frozen; every block checkpointed; FSDP2 over "
            f"{world_size} gloo ranks (CPU: no peak FLOP/s, so no MFU)")


def _worker(rank: int, world_size: int, init_method: str, options: Options) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=GLOO_TIMEOUT_S))
    try:
        Trainer(options, rank, world_size).run()
    finally:
        dist.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=Options.iterations)
    parser.add_argument("--micro-batches", type=int, default=Options.micro_batches)
    parser.add_argument("--seed", type=int, default=Options.seed)
    parser.add_argument("--trace", help="write one JSON line per step to this file")
    parser.add_argument("--check", action="store_true",
                        help="measure each step with FlopCounterMode and compare it with the executed FLOPs")
    args = parser.parse_args(argv)
    options = Options(iterations=args.iterations, micro_batches=args.micro_batches, seed=args.seed,
                      trace=args.trace, check=args.check)
    if "RANK" in os.environ:  # under torchrun
        _worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://", options)
        return 0
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(2, f"tcp://127.0.0.1:{port}", options), nprocs=2, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
