"""Peak dense tensor-core throughput per accelerator, the denominator of MFU and HFU (stdlib only).

Every figure is dense (no 2:4 structured sparsity), per device, in TFLOP/s. NVIDIA prints
the H100/H200/B200/GB200 tensor numbers "with sparsity"; the table holds half of those.
fp16 peaks equal bf16 peaks on every listed device, so both read the bf16 column.
Devices are matched on the tokens of the name ``torch.cuda.get_device_name()`` returns, never
on substrings, so "H20" cannot match "H200" and "H200" cannot match "H200 NVL".
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from decimal import Decimal

DTYPES = ("bf16", "fp16", "fp8")


@dataclass(frozen=True, kw_only=True)
class PeakEntry:
    """One accelerator's dense peaks and how its device name is recognised.

    A device name matches when its tokens contain one of ``model_tokens``, all of
    ``required_tokens`` and none of ``excluded_tokens``. ``fp8_tflops`` is None where the
    hardware has no fp8 tensor cores.
    """

    name: str
    bf16_tflops: float
    fp8_tflops: float | None
    source: str
    model_tokens: frozenset[str]
    required_tokens: frozenset[str] = frozenset()
    excluded_tokens: frozenset[str] = frozenset()

    def matches(self, tokens: frozenset[str]) -> bool:
        """Whether a tokenised device name designates this accelerator."""
        return (
            not self.model_tokens.isdisjoint(tokens)
            and self.required_tokens <= tokens
            and self.excluded_tokens.isdisjoint(tokens)
        )

    def flops_per_s(self, dtype: str) -> int | None:
        """Dense peak FLOP/s for ``dtype``; None where the device lacks that dtype."""
        _check_dtype(dtype)
        tflops = self.fp8_tflops if dtype == "fp8" else self.bf16_tflops
        return None if tflops is None else _tflops_to_flops(tflops)


_H100_DATASHEET = "NVIDIA H100 Tensor Core GPU datasheet (https://www.nvidia.com/en-us/data-center/h100/)"
_H200_DATASHEET = "NVIDIA H200 Tensor Core GPU datasheet (https://www.nvidia.com/en-us/data-center/h200/)"
_A100_DATASHEET = (
    "NVIDIA A100 Tensor Core GPU datasheet (https://www.nvidia.com/en-us/data-center/a100/): "
    "BF16 312 TFLOPS dense (624 with sparsity), same for SXM4 40/80GB and PCIe 40/80GB; "
    "Ampere has no fp8 tensor cores"
)

PEAKS: tuple[PeakEntry, ...] = (
    PeakEntry(
        name="NVIDIA H100 SXM",
        bf16_tflops=989.5,
        fp8_tflops=1979.0,
        source=f"{_H100_DATASHEET}, H100 SXM: BF16 1,979 / FP8 3,958 TFLOPS with sparsity; dense = half",
        model_tokens=frozenset({"H100"}),
        excluded_tokens=frozenset({"PCIE", "NVL"}),
    ),
    PeakEntry(
        name="NVIDIA H100 PCIe",
        bf16_tflops=756.5,
        fp8_tflops=1513.0,
        source=f"{_H100_DATASHEET}, H100 PCIe: BF16 1,513 / FP8 3,026 TFLOPS with sparsity; dense = half",
        model_tokens=frozenset({"H100"}),
        required_tokens=frozenset({"PCIE"}),
        excluded_tokens=frozenset({"NVL"}),
    ),
    PeakEntry(
        name="NVIDIA H100 NVL",
        bf16_tflops=835.5,
        fp8_tflops=1670.5,
        source=f"{_H100_DATASHEET}, H100 NVL (94GB): BF16 1,671 / FP8 3,341 TFLOPS with sparsity; dense = half",
        model_tokens=frozenset({"H100"}),
        required_tokens=frozenset({"NVL"}),
    ),
    PeakEntry(
        name="NVIDIA H200 SXM",
        bf16_tflops=989.5,
        fp8_tflops=1979.0,
        source=f"{_H200_DATASHEET}, H200 SXM: BF16 1,979 / FP8 3,958 TFLOPS with sparsity; dense = half",
        model_tokens=frozenset({"H200"}),
        excluded_tokens=frozenset({"NVL"}),
    ),
    PeakEntry(
        name="NVIDIA H200 NVL",
        bf16_tflops=835.5,
        fp8_tflops=1670.5,
        source=f"{_H200_DATASHEET}, H200 NVL: BF16 1,671 / FP8 3,341 TFLOPS with sparsity; dense = half",
        model_tokens=frozenset({"H200"}),
        required_tokens=frozenset({"NVL"}),
    ),
    PeakEntry(
        name="NVIDIA GH200",
        bf16_tflops=989.5,
        fp8_tflops=1979.0,
        source=(
            "NVIDIA GH200 Grace Hopper Superchip datasheet "
            "(https://www.nvidia.com/en-us/data-center/grace-hopper-superchip/): "
            "BF16 1,979 / FP8 3,958 TFLOPS with sparsity; dense = half"
        ),
        model_tokens=frozenset({"GH200"}),
    ),
    PeakEntry(
        name="NVIDIA B200",
        bf16_tflops=2250.0,
        fp8_tflops=4500.0,
        source=(
            "NVIDIA HGX B200 specifications (https://www.nvidia.com/en-us/data-center/hgx/), "
            "per GPU: FP16/BF16 4.5 / FP8 9 PFLOPS with sparsity; dense = half"
        ),
        model_tokens=frozenset({"B200"}),
    ),
    PeakEntry(
        name="NVIDIA GB200",
        bf16_tflops=2500.0,
        fp8_tflops=5000.0,
        source=(
            "NVIDIA GB200 NVL72 specifications (https://www.nvidia.com/en-us/data-center/gb200-nvl72/), "
            "per Blackwell GPU: FP16/BF16 5 / FP8 10 PFLOPS with sparsity; dense = half"
        ),
        model_tokens=frozenset({"GB200"}),
    ),
    PeakEntry(
        name="NVIDIA A100 SXM4",
        bf16_tflops=312.0,
        fp8_tflops=None,
        source=_A100_DATASHEET,
        model_tokens=frozenset({"A100"}),
        excluded_tokens=frozenset({"PCIE"}),
    ),
    PeakEntry(
        name="NVIDIA A100 PCIe",
        bf16_tflops=312.0,
        fp8_tflops=None,
        source=_A100_DATASHEET,
        model_tokens=frozenset({"A100"}),
        required_tokens=frozenset({"PCIE"}),
    ),
    PeakEntry(
        name="AMD Instinct MI300X",
        bf16_tflops=1307.4,
        fp8_tflops=2614.9,
        source=(
            "AMD Instinct MI300X data sheet (https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html): "
            "peak BF16 1,307.4 / FP8 2,614.9 TFLOPS dense (sparsity doubles them)"
        ),
        model_tokens=frozenset({"MI300X"}),
    ),
    PeakEntry(
        name="AMD Instinct MI325X",
        bf16_tflops=1307.4,
        fp8_tflops=2614.9,
        source=(
            "AMD Instinct MI325X data sheet (https://www.amd.com/en/products/accelerators/instinct/mi300/mi325x.html): "
            "peak BF16 1,307.4 / FP8 2,614.9 TFLOPS dense (sparsity doubles them)"
        ),
        model_tokens=frozenset({"MI325X"}),
    ),
    PeakEntry(
        name="Huawei Ascend 910B2",
        bf16_tflops=354.0,
        fp8_tflops=None,
        source=(
            "Unconfirmed: Huawei publishes no per-variant 910B datasheet. 354 TFLOP/s FP16/BF16 is the "
            "figure open-source MFU counters use for '910B', consistent with 24 AI cores x 4,096 FP16 "
            "MAC/cycle x 2 x 1.8 GHz (910B2 has 24 AI cores). Ascend910B1/B2C/B3/B4/B4-1 differ in AI-core "
            "count or clock and are not listed: pass an override for them. No fp8 on Ascend 910B."
        ),
        model_tokens=frozenset({"ASCEND910B2"}),
    ),
)


def lookup(device_name: str) -> PeakEntry | None:
    """The table entry for a device name as ``torch.cuda.get_device_name()`` prints it, or None."""
    tokens = frozenset(token for token in re.split(r"[^A-Z0-9]+", device_name.upper()) if token)
    found = [entry for entry in PEAKS if entry.matches(tokens)]
    assert len(found) <= 1, f"peak table entries overlap for {device_name!r}: {[e.name for e in found]}"
    return found[0] if found else None


def peak_flops_per_s(device_name: str, dtype: str = "bf16") -> int | None:
    """Dense peak FLOP/s of one device; None for an unknown device or a dtype it lacks."""
    _check_dtype(dtype)
    entry = lookup(device_name)
    return None if entry is None else entry.flops_per_s(dtype)


def resolve_peak(device_name: str | None, dtype: str, override_tflops: float | None) -> int | None:
    """Peak FLOP/s per device: ``override_tflops`` if given, else the table; None if neither knows."""
    _check_dtype(dtype)
    if override_tflops is not None:
        if not (math.isfinite(override_tflops) and override_tflops > 0):
            raise ValueError(f"peak TFLOP/s override must be a positive finite number, got {override_tflops!r}")
        return _tflops_to_flops(override_tflops)
    return None if device_name is None else peak_flops_per_s(device_name, dtype)


def _check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")


def _tflops_to_flops(tflops: float) -> int:
    # Through the decimal repr, so 1307.4 TFLOP/s is exactly 1_307_400_000_000_000 FLOP/s.
    return round(Decimal(repr(tflops)) * 10**12)
