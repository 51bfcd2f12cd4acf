"""Telemetry (NVML when present, host otherwise; absent values stay None) and the node's metrics registry."""
from __future__ import annotations

import sys
import types
from collections import namedtuple

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

import engine.node.telemetry as telemetry
from engine.node.config import ModelSpec, NodeConfig
from engine.node.metrics import FinishedSequence, ModelSnapshot, NodeMetrics, NodeSnapshot
from engine.node.node import Node
from engine.node.telemetry import Telemetry, TelemetrySample
from tests.node_fixtures import tiny_models  # noqa: F401 (fixture)

Temp = namedtuple("Temp", "label current high critical")


def fake_nvml(power_supported: bool = True) -> types.ModuleType:
    nv = types.ModuleType("pynvml")
    nv.NVML_TEMPERATURE_GPU = 0
    nv.nvmlInit = lambda: None
    nv.nvmlShutdown = lambda: None
    nv.nvmlDeviceGetCount = lambda: 1
    nv.nvmlDeviceGetHandleByIndex = lambda i: ("handle", i)
    nv.nvmlDeviceGetName = lambda h: b"NVIDIA H100 80GB HBM3"
    nv.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=3 << 30, total=80 << 30, free=77 << 30)
    nv.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=42, memory=10)
    nv.nvmlDeviceGetTemperature = lambda h, sensor: 61

    def power(h):
        if not power_supported:
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
        return 123400   # milliwatts
    nv.nvmlDeviceGetPowerUsage = power
    return nv


def test_nvml_readings(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml())
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    t = Telemetry()
    s = t.sample()
    assert t.is_gpu and s.device == "cuda:0 NVIDIA H100 80GB HBM3"
    assert (s.memory_used_bytes, s.memory_total_bytes) == (3 << 30, 80 << 30)
    assert s.utilization == pytest.approx(0.42) and s.power_w == pytest.approx(123.4) and s.temperature_c == 61
    t.close()


def test_nvml_follows_cuda_visible_devices(monkeypatch):
    nv = fake_nvml()
    nv.nvmlDeviceGetHandleByUUID = lambda uuid: ("uuid", uuid)
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-1234,GPU-5678")
    t = Telemetry()
    assert t.is_gpu and t.device.startswith("cuda:GPU-1234 ")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert not Telemetry().is_gpu    # the fake board has one device: index 3 is not there


def test_cuda_visible_devices_set_but_empty_means_no_gpu(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    t = Telemetry()
    assert not t.is_gpu and t.sample().device == "cpu"     # GPUs hidden: not GPU 0


@pytest.mark.parametrize("backend", ["cpu", "cuda"])
def test_a_cpu_backend_node_reports_the_host_not_the_gpu(monkeypatch, backend):
    """On a GPU host, a --backend cpu node's state, temperature and default memory budget are the host's."""
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml())
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(psutil, "sensors_temperatures", lambda: {}, raising=False)
    node = Node(NodeConfig(models=[ModelSpec("/nonexistent", "m")], backend=backend))
    try:
        assert node.telemetry.is_gpu == (backend == "cuda")
        budget = node.registry.memory_budget_bytes
        if backend == "cpu":
            sample = node.telemetry.sample()
            assert sample.device == "cpu" and sample.temperature_c is None    # not the GPU's 61 °C
            assert budget <= psutil.virtual_memory().total                   # not 90% of 80 GiB of GPU memory
        else:
            assert budget == int((80 << 30) * 0.9)
    finally:
        node.close()


def test_nvml_unsupported_query_is_none(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(power_supported=False))
    s = Telemetry().sample()
    assert s.power_w is None and s.temperature_c == 61


def test_host_without_sensors_reports_none(monkeypatch):
    monkeypatch.setattr(psutil, "sensors_temperatures", lambda: {}, raising=False)
    monkeypatch.setattr(telemetry.glob, "glob", lambda pattern: [])
    t = Telemetry(use_nvml=False)
    s = t.sample()
    assert not t.is_gpu and s.device == "cpu"
    assert s.temperature_c is None and s.power_w is None
    assert 0 < s.memory_used_bytes < s.memory_total_bytes and s.process_rss_bytes > 0
    assert 0.0 <= s.utilization <= 1.0


def test_host_sensors_and_rapl(monkeypatch, tmp_path):
    monkeypatch.setattr(psutil, "sensors_temperatures", lambda: {
        "nvme": [Temp("Composite", 80.0, None, None)],
        "coretemp": [Temp("Package id 0", 55.0, 80, 100), Temp("Core 0", 52.0, 80, 100)]}, raising=False)
    energy = tmp_path / "energy_uj"
    energy.write_text("1000000")
    monkeypatch.setattr(telemetry.glob, "glob", lambda pattern: [str(energy)])
    clock = iter([100.0, 100.0, 102.0, 102.0])
    t = Telemetry(use_nvml=False, min_interval_s=1.0, clock=lambda: next(clock))
    first = t.sample()
    assert first.temperature_c == 55.0      # the CPU package, not the disk
    assert first.power_w is None            # one energy reading is not a rate
    energy.write_text("31000000")           # +30 J over 2 s
    assert t.sample().power_w == pytest.approx(15.0)


def _samples(m: NodeMetrics) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(m.render().decode()) for s in fam.samples}


def test_metrics_registries_are_per_app_and_absent_values_are_not_exported():
    accel = TelemetrySample("cpu", 10, 100, 0.5, None, None, 5)
    snap = NodeSnapshot([ModelSnapshot("m", "q8_0", 2, 1, 0.25, 100, 40, 1000, 0.5, 0.3)], accel, 5000, 1, 8,
                        {("m", "q8_0"): 0.5})
    a, b = NodeMetrics(snapshot=lambda: snap), NodeMetrics()
    a.observe_finished(FinishedSequence("m", "realtime", "stop", 0.0, 0.5, 1.0, [1.0, 1.5, 2.5], 2.5))
    a.observe_finished(FinishedSequence("m", "batch", "abort", 0.0, None, None, [], 3.0))
    a.count_tokens("m", "realtime", 7, 3)
    s = _samples(a)
    lab = (("latency_class", "realtime"), ("model", "m"))
    assert s[("zen_node_time_to_first_token_seconds_sum", lab)] == 1.0
    assert s[("zen_node_request_queue_time_seconds_sum", lab)] == 0.5
    assert s[("zen_node_request_prefill_time_seconds_sum", lab)] == 0.5
    assert s[("zen_node_request_decode_time_seconds_sum", lab)] == 1.5
    assert s[("zen_node_inter_token_latency_seconds_count", lab)] == 2
    assert s[("zen_node_e2e_request_latency_seconds_sum", lab)] == 2.5
    assert s[("zen_node_prompt_tokens_total", lab)] == 7 and s[("zen_node_generation_tokens_total", lab)] == 3
    aborted = (("finished_reason", "abort"), ("latency_class", "batch"), ("model", "m"))
    assert s[("zen_node_request_success_total", aborted)] == 1
    ml = (("model", "m"), ("quantization", "q8_0"))
    assert s[("zen_node_num_requests_running", ml)] == 2 and s[("zen_node_num_requests_waiting", ml)] == 1
    assert s[("zen_node_kv_cache_usage_perc", ml)] == 0.25 and s[("zen_node_prefix_cache_hit_rate", ml)] == 0.4
    assert s[("zen_node_model_load_time_seconds", ml)] == 0.5 and s[("zen_node_models_resident", ())] == 1
    assert s[("zen_node_accelerator_utilization_ratio", (("device", "cpu"),))] == 0.5
    names = {n for n, _ in s}
    assert "zen_node_accelerator_power_watts" not in names and "zen_node_accelerator_temperature_celsius" not in names
    assert not any(n.startswith("zen_node_time_to_first") for n, _ in _samples(b))   # b has its own registry
    les = [float(dict(ls)["le"]) for n, ls in s if n.endswith("_bucket") and "latency" in n and
           dict(ls)["le"] != "+Inf"]
    assert max(les) >= 480


def test_step_listener_counts_batch_prefix_and_preemption_deltas():
    m = NodeMetrics()
    on_step = m.step_listener("m", "f32")
    pool = types.SimpleNamespace(prefix_query_tokens=0, prefix_hit_tokens=0)
    eng = types.SimpleNamespace(last_batch_size=3, pool=pool, num_preemptions=0)
    for q, h, p in ((10, 0, 0), (30, 16, 2), (30, 16, 3)):
        pool.prefix_query_tokens, pool.prefix_hit_tokens, eng.num_preemptions = q, h, p
        on_step(eng, 0.01, [])
    s = _samples(m)
    ml = (("model", "m"), ("quantization", "f32"))
    assert s[("zen_node_prefix_cache_queries_total", ml)] == 30 and s[("zen_node_prefix_cache_hits_total", ml)] == 16
    assert s[("zen_node_num_preemptions_total", ml)] == 3
    assert s[("zen_node_iteration_batch_size_count", ml)] == 3 and s[("zen_node_iteration_batch_size_sum", ml)] == 9


def test_a_scrape_during_an_eviction_reads_no_released_model(tiny_models):
    """An eviction releases the engine's weights (model = None) while a scrape may still list the model:
    the snapshot reads only what the engine keeps."""
    node = Node(NodeConfig(models=[ModelSpec(tiny_models["a"], "tiny-a")], backend="cpu"))
    try:
        m = node.registry.load("tiny-a", wait_s=60)
        m.engine.release()                         # what the eviction does, the scrape not yet past it
        [model] = node.snapshot().models
        assert model.kv_window_saved_bytes == 0
    finally:
        node.close()


def test_a_containers_memory_limit_bounds_the_memory_available(tmp_path):
    """A pod limited to 8 GiB on a larger host: the default budget comes from its limit less its use."""
    from engine.node.telemetry import cgroup_memory_room, host_memory_available
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "memory.max").write_text("8589934592\n")
    (v2 / "memory.current").write_text("1073741824\n")
    assert cgroup_memory_room(str(v2)) == 7 << 30
    assert host_memory_available(str(v2)) <= 7 << 30
    (v2 / "memory.max").write_text("max\n")
    assert cgroup_memory_room(str(v2)) is None
    v1 = tmp_path / "v1" / "memory"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text(str(2 << 30))
    (v1 / "memory.usage_in_bytes").write_text(str(3 << 30))   # over its limit: no room
    assert cgroup_memory_room(str(tmp_path / "v1")) == 0
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712")   # v1's "no limit"
    assert cgroup_memory_room(str(tmp_path / "v1")) is None
    assert cgroup_memory_room(str(tmp_path / "none")) is None
