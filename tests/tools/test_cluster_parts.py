"""The harness's `Cluster` (tools/e2e/cluster.py) and the modules it is split into,
one concern each (cluster_spec, role_servers, fronts, readiness, readings), without
starting anything: Cluster keeps the public names its users call, and each part does
what Cluster did with it before the split (the values below are typed by hand from
the documented flags and log lines)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.e2e import fronts, readings
from tools.e2e.cluster import Cluster
from tools.e2e.cluster_spec import ClusterSpec, native
from tools.e2e.role_servers import RoleServers
from vllm.distributed.kv_transfer.role_chains import Deployment

# What the harness, the entry points, the benchmarks and the tests call on a Cluster.
PUBLIC = {
    # fields
    "spec", "logs", "servers", "proxy_process", "proxy_port", "master",
    "reference_answers", "only_reference", "restarts",
    # starting, stopping, where requests go
    "start", "stop", "url", "proxy_url", "prefill_names", "has_prefill_twin",
    "start_front_end", "process_owners",
    # reading it
    "overlap_flips", "rows_check_failures", "recovered_loads", "expired_leases",
    "metric", "gauge", "decode_preemptions", "log_count",
}


def test_cluster_keeps_its_public_names(tmp_path: Path) -> None:
    cluster = Cluster(ClusterSpec(tmp_path), logs=tmp_path)
    names = {n for n in dir(cluster) if not n.startswith("_")}
    assert names == PUBLIC


def test_prefill_names_follow_the_number_of_prefill_instances(tmp_path: Path) -> None:
    assert Cluster(ClusterSpec(tmp_path), logs=tmp_path).prefill_names == ["prefill"]
    spec = ClusterSpec(tmp_path, num_prefill=3)
    assert Cluster(spec, logs=tmp_path).prefill_names == ["prefill", "prefill-1",
                                                          "prefill-2"]


def test_only_an_offloading_prefill_with_a_small_cache_gets_a_twin(tmp_path: Path) -> None:
    offload = Deployment(pd=True, prefill_offload=native())
    assert Cluster(ClusterSpec(tmp_path, deployment=offload, offload_num_blocks=8),
                   logs=tmp_path).has_prefill_twin
    assert not RoleServers(ClusterSpec(tmp_path, deployment=offload), tmp_path
                           ).has_prefill_twin
    assert not RoleServers(ClusterSpec(tmp_path, offload_num_blocks=8), tmp_path
                           ).has_prefill_twin


@pytest.fixture
def executables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fronts, "router_executable", lambda: "vllm-router")
    monkeypatch.setattr(fronts, "proxy_executable", lambda: "vllm-r3-pdproxy")


@pytest.mark.usefixtures("executables")
def test_the_router_gets_every_prefill_the_decode_and_a_patient_health_check() -> None:
    command = fronts.front_command("vllm-router", 8000, ["http://p0", "http://p1"],
                                   "http://d", "prefill")
    assert command[:12] == ["vllm-router", "--vllm-pd-disaggregation", "--host",
                            "127.0.0.1", "--port", "8000", "--prefill", "http://p0",
                            "--prefill", "http://p1", "--decode", "http://d"]
    assert command[12:16] == ["--kv-connector", "nixl", "--health-check-timeout-secs",
                              "180"]
    assert command[16] == "--prometheus-port" and int(command[17]) > 0


@pytest.mark.usefixtures("executables")
def test_the_proxy_gets_the_overlap_policy() -> None:
    assert fronts.front_command("pdproxy", 8001, ["http://p0"], "http://d", "decode") == [
        "vllm-r3-pdproxy", "--port", "8001", "--overlap", "decode",
        "--prefill", "http://p0", "--decode", "http://d"]


def test_log_counts_read_only_the_servers_the_deployment_runs(tmp_path: Path) -> None:
    (tmp_path / "decode.log").write_text(
        "3 blocks failed their check\nok\nRecovered from KV load failure\n"
        "2 blocks failed their check\n")
    (tmp_path / "prefill.log").write_text("Releasing expired KV blocks\n")
    (tmp_path / "subject.log").write_text("1 block failed their check\n")  # not running
    cluster = Cluster(ClusterSpec(tmp_path), logs=tmp_path)
    cluster.servers = {name: None for name in ("prefill", "decode")}  # type: ignore[misc]
    assert cluster.rows_check_failures() == 2
    assert cluster.recovered_loads() == 1
    assert cluster.expired_leases() == 1
    assert cluster.log_count("twin", "anything") == 0
    assert readings.loading_servers(["prefill", "prefill-1"]) == (
        "decode", "subject", "prefill", "prefill-1")
