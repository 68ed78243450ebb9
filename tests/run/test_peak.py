"""A CPU's matmul peak, for MFU, is measured once per machine and read from the cache after."""

import json

import jax

from ferry.xla.peak import device_peak, machine_key, peak_cache_dir


def test_a_cpu_peak_is_measured_once_and_read_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    measured = []

    def measure(dtype: str) -> float:
        measured.append(dtype)
        return 1.5e12 + len(measured)  # a second measurement would differ

    cpu = jax.devices("cpu")[0]
    first, source = device_peak(cpu, "bfloat16", measure)
    again, source_again = device_peak(cpu, "bfloat16", measure)
    assert measured == ["bfloat16"] and first == again == 1.5e12 + 1
    path = peak_cache_dir() / f"{machine_key('bfloat16')}.json"
    assert path.is_relative_to(tmp_path) and json.loads(path.read_text())["flops"] == first
    assert "measured on this CPU on" in source and f"cached in {path}" in source_again
    device_peak(cpu, "float32", measure)  # another dtype is another measurement
    assert measured == ["bfloat16", "float32"]


def test_an_unwritable_cache_labels_the_peak_rough(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # a file where the cache folder would be
    peak, source = device_peak(jax.devices("cpu")[0], "bfloat16", lambda dtype: 2e12)
    assert peak == 2e12 and "a rough figure" in source
