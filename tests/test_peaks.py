"""Peak table: real device-name strings, exact integers, no cross-matching."""

from __future__ import annotations

import pytest

from megatron_flops.reporting.peaks import PEAKS, lookup, peak_flops_per_s, resolve_peak

# (name torch.cuda.get_device_name() returns, table entry, dense bf16 FLOP/s, dense fp8 FLOP/s)
KNOWN = [
    ("NVIDIA H100 80GB HBM3", "NVIDIA H100 SXM", 989_500_000_000_000, 1_979_000_000_000_000),
    ("NVIDIA H100 PCIe", "NVIDIA H100 PCIe", 756_500_000_000_000, 1_513_000_000_000_000),
    ("NVIDIA H100 NVL", "NVIDIA H100 NVL", 835_500_000_000_000, 1_670_500_000_000_000),
    ("NVIDIA H200", "NVIDIA H200 SXM", 989_500_000_000_000, 1_979_000_000_000_000),
    ("NVIDIA H200 NVL", "NVIDIA H200 NVL", 835_500_000_000_000, 1_670_500_000_000_000),
    ("NVIDIA GH200 480GB", "NVIDIA GH200", 989_500_000_000_000, 1_979_000_000_000_000),
    ("NVIDIA B200", "NVIDIA B200", 2_250_000_000_000_000, 4_500_000_000_000_000),
    ("NVIDIA GB200", "NVIDIA GB200", 2_500_000_000_000_000, 5_000_000_000_000_000),
    ("NVIDIA A100-SXM4-80GB", "NVIDIA A100 SXM4", 312_000_000_000_000, None),
    ("NVIDIA A100-SXM4-40GB", "NVIDIA A100 SXM4", 312_000_000_000_000, None),
    ("NVIDIA A100 80GB PCIe", "NVIDIA A100 PCIe", 312_000_000_000_000, None),
    ("NVIDIA A100-PCIE-40GB", "NVIDIA A100 PCIe", 312_000_000_000_000, None),
    ("AMD Instinct MI300X", "AMD Instinct MI300X", 1_307_400_000_000_000, 2_614_900_000_000_000),
    ("AMD Instinct MI325X", "AMD Instinct MI325X", 1_307_400_000_000_000, 2_614_900_000_000_000),
    ("Ascend910B2", "Huawei Ascend 910B2", 354_000_000_000_000, None),
]

# Names that contain a listed chip's name as a substring, or are look-alikes, and must not match.
UNKNOWN = [
    "NVIDIA H20",  # substring of "H200"
    "NVIDIA H800",
    "NVIDIA A10",  # substring of "A100"
    "NVIDIA A10G",
    "NVIDIA A800-SXM4-80GB",
    "NVIDIA B300",
    "NVIDIA GB300",
    "NVIDIA GeForce RTX 4090",
    "AMD Instinct MI300A",
    "AMD Instinct MI308X",
    "Ascend910B1",  # per-variant peaks unconfirmed: the caller must override
    "Ascend910B3",
    "Ascend910B4",
    "Ascend910_9391",
    "",
]


@pytest.mark.parametrize(("device_name", "entry_name", "bf16", "fp8"), KNOWN)
def test_known_devices_exact_peaks(device_name: str, entry_name: str, bf16: int, fp8: int | None) -> None:
    entry = lookup(device_name)  # lookup asserts that no two entries match one name
    assert entry is not None and entry.name == entry_name
    assert peak_flops_per_s(device_name) == bf16
    assert peak_flops_per_s(device_name, "bf16") == bf16
    assert peak_flops_per_s(device_name, "fp16") == bf16
    assert peak_flops_per_s(device_name, "fp8") == fp8
    assert type(peak_flops_per_s(device_name)) is int


@pytest.mark.parametrize("device_name", UNKNOWN)
def test_unknown_devices_return_none(device_name: str) -> None:
    assert lookup(device_name) is None
    assert peak_flops_per_s(device_name) is None
    assert resolve_peak(device_name, "bf16", None) is None


def test_a100_has_no_fp8() -> None:
    assert peak_flops_per_s("NVIDIA A100-SXM4-80GB", "fp8") is None
    assert resolve_peak("NVIDIA A100 80GB PCIe", "fp8", None) is None


def test_variants_do_not_cross_match() -> None:
    # The SXM part and its lower-clocked siblings are distinct entries with distinct peaks.
    assert lookup("NVIDIA H100 80GB HBM3") != lookup("NVIDIA H100 NVL")
    assert lookup("NVIDIA H100 80GB HBM3") != lookup("NVIDIA H100 PCIe")
    assert lookup("NVIDIA H200") != lookup("NVIDIA H200 NVL")
    assert lookup("NVIDIA B200") != lookup("NVIDIA GB200")
    assert lookup("NVIDIA H200") != lookup("NVIDIA GH200 480GB")
    assert lookup("AMD Instinct MI300X") != lookup("AMD Instinct MI325X")


def test_every_entry_cites_a_source_and_fp8_is_double_bf16() -> None:
    for entry in PEAKS:
        assert entry.source
        # Vendors round each figure separately (AMD 2 x 1,307.4 vs 2,614.9; NVL 2 x 835.5 vs 1,670.5).
        assert entry.fp8_tflops is None or entry.fp8_tflops == pytest.approx(2 * entry.bf16_tflops, abs=0.5)


def test_override_wins() -> None:
    assert resolve_peak("NVIDIA H100 80GB HBM3", "bf16", 500.0) == 500_000_000_000_000
    assert resolve_peak("NVIDIA H100 80GB HBM3", "bf16", 989.4) == 989_400_000_000_000
    assert resolve_peak("Ascend910B4", "fp16", 280.0) == 280_000_000_000_000
    assert resolve_peak(None, "bf16", 312.5) == 312_500_000_000_000
    assert resolve_peak("NVIDIA A100-SXM4-80GB", "fp8", 624.0) == 624_000_000_000_000


def test_resolve_without_device_or_override_is_none() -> None:
    assert resolve_peak(None, "bf16", None) is None


def test_resolve_uses_table() -> None:
    assert resolve_peak("NVIDIA H200 NVL", "fp8", None) == 1_670_500_000_000_000


@pytest.mark.parametrize("override", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_override_raises(override: float) -> None:
    with pytest.raises(ValueError, match="override"):
        resolve_peak("NVIDIA B200", "bf16", override)


@pytest.mark.parametrize("dtype", ["fp32", "bfloat16", "tf32", "BF16", ""])
def test_bad_dtype_raises(dtype: str) -> None:
    with pytest.raises(ValueError, match="dtype"):
        peak_flops_per_s("NVIDIA B200", dtype)
    with pytest.raises(ValueError, match="dtype"):
        resolve_peak("NVIDIA B200", dtype, 100.0)
    with pytest.raises(ValueError, match="dtype"):
        peak_flops_per_s("not a device", dtype)
