"""Telemetry alerts: one event per crossing, re-armed only once the reading is clearly back."""

from __future__ import annotations

from phalanx.config.schema import ObserveSection
from phalanx.run.records import JsonlEventSink, read_events
from phalanx.safe.telemetry import TelemetrySampler


def record(temperature: float, free_gib: float = 100.0) -> dict:
    return {
        "host": {"memory_used_bytes": 1, "memory_total_bytes": 10, "disk_free_bytes": free_gib * 2**30},
        "devices": [{"device": 0, "temperature_c": temperature, "memory_ratio": 0.5}],
    }


def test_a_reading_hovering_at_its_limit_alerts_once_and_rearms_after_coming_back(tmp_path):
    sampler = TelemetrySampler(tmp_path, ObserveSection(alert_device_temp_c=90), JsonlEventSink(tmp_path))
    for temperature in (85, 91, 89.9, 90.5, 89.5, 90.2):  # hovering around 90: one alert
        sampler._check_alerts(record(temperature))
    assert len(read_events(tmp_path)) == 1
    sampler._check_alerts(record(80))  # clearly back under the limit
    sampler._check_alerts(record(95))
    alerts = read_events(tmp_path)
    assert [(a["metric"], a["device"], a["value"]) for a in alerts] == [
        ("device_temperature_c", 0, 91),
        ("device_temperature_c", 0, 95),
    ]


def test_low_free_disk_alerts_with_positive_figures(tmp_path):
    sampler = TelemetrySampler(tmp_path, ObserveSection(alert_disk_free_gib=5), JsonlEventSink(tmp_path))
    sampler._check_alerts(record(50, free_gib=2.5))
    (alert,) = read_events(tmp_path)
    assert (alert["metric"], alert["value"], alert["threshold"]) == ("disk_free_gib", 2.5, 5)


def test_a_sample_on_this_machine_has_the_host_and_no_devices(tmp_path):
    sampler = TelemetrySampler(tmp_path, ObserveSection(), JsonlEventSink(tmp_path))
    sample = sampler.sample()
    assert sample["devices"] == [] and sample["host"]["memory_total_bytes"] > 0
    assert (tmp_path / "telemetry.jsonl").read_text().count("\n") == 1
