"""The peak a run reports: on TPU, whose runtime counts no program's temporaries, the runtime's
peak plus the step's compiled temporaries; elsewhere the runtime's own."""

from types import SimpleNamespace

import pytest

from ferry.run import memory_report
from ferry.train.memory import CompiledMemory

GIB = 2**30
STEP = CompiledMemory(
    arguments=4 * GIB, outputs=4 * GIB, aliased=4 * GIB, temporaries=5 * GIB, code=0, host_temporaries=3 * GIB
)


def fake_device(monkeypatch, platform: str, stats: dict | None) -> None:
    device = SimpleNamespace(platform=platform, memory_stats=lambda: stats)
    monkeypatch.setattr(memory_report.jax, "local_devices", lambda: [device])


@pytest.mark.parametrize(("platform", "expected"), [("tpu", 9 * GIB + 100), ("gpu", 4 * GIB + 100)])
def test_peak_adds_temporaries_only_where_the_runtime_omits_them(monkeypatch, platform, expected):
    fake_device(monkeypatch, platform, {"peak_bytes_in_use": 4 * GIB + 100, "bytes_limit": 16 * GIB})
    peak = memory_report.device_memory_peak(STEP)
    assert peak.peak_bytes == expected and peak.runtime_bytes == 4 * GIB + 100
    record = peak.record()
    assert record["device_memory_peak_bytes"] == expected and record["host_rss_peak_bytes"] > 0


def test_no_peak_where_the_backend_reports_none(monkeypatch):
    fake_device(monkeypatch, "cpu", None)
    assert memory_report.device_memory_peak(STEP) is None
