"""The start-up check that the training state fits counts only what each offload config keeps on
the device: host-placed master weights and moments move to the host's side of the ledger."""

import pytest

from ferry.config.train import StatePlacement
from ferry.train import memory
from ferry.train.memory import InsufficientMemoryError, StateBytes, check_fits

GIB = 2**30


def test_bytes_per_parameter_follow_the_offload_config():
    assert StateBytes.of(StatePlacement(optimizer="device", params="device")) == StateBytes(device=18, host=0)
    assert StateBytes.of(StatePlacement(optimizer="host", params="device")) == StateBytes(device=10, host=8)
    assert StateBytes.of(StatePlacement(optimizer="host", params="host")) == StateBytes(device=6, host=12)


def _machine(monkeypatch, hbm: int, host_ram: int) -> None:
    monkeypatch.setattr(memory, "available_bytes", lambda: (hbm, "1 x TPU HBM", False))
    monkeypatch.setattr(memory.psutil, "virtual_memory", lambda: type("Memory", (), {"available": host_ram}))


def test_a_state_on_the_host_fits_where_the_same_state_on_the_device_does_not(monkeypatch):
    _machine(monkeypatch, hbm=16 * GIB, host_ram=40 * GIB)
    parameters = 2 * 10**9  # 33.5 GiB at 18 B, 11.2 GiB at 6 B on the device and 22.4 GiB on the host
    with pytest.raises(InsufficientMemoryError, match=r"18 B per parameter on the device.* 33\.5 GiB"):
        check_fits("m", parameters, "2B parameters", "Shard it.", StateBytes.of(StatePlacement("device", "device")))
    check_fits("m", parameters, "2B parameters", "Shard it.", StateBytes.of(StatePlacement("host", "host")))


def test_a_host_too_small_for_its_share_is_refused(monkeypatch):
    _machine(monkeypatch, hbm=16 * GIB, host_ram=20 * GIB)
    with pytest.raises(InsufficientMemoryError, match=r"22\.4 GiB of host memory .*offload\.params=device"):
        check_fits("m", 2 * 10**9, "2B parameters", "Shard it.", StateBytes.of(StatePlacement("host", "host")))


def test_on_the_cpu_backend_device_and_host_share_the_ram(monkeypatch):
    monkeypatch.setattr(memory, "available_bytes", lambda: (30 * GIB, "host RAM", True))
    with pytest.raises(InsufficientMemoryError, match=r"33\.5 GiB"):  # 11.2 + 22.4, not 11.2
        check_fits("m", 2 * 10**9, "2B parameters", "Shard it.", StateBytes.of(StatePlacement("host", "host")))
