"""Faults for the fork behind Ray Serve LLM 2.60.0's own P/D app, on the local
multi-node Ray cluster of `tools.testbed.ray_serve_pd` (head, prefill raylet, decode
raylet, all on this machine, CPU).

A test fixture (`tests/v1/kv_connector/test_ray_serve_pd_faults_e2e.py`) and a
script::

    python -m tools.testbed.ray_serve_faults            # every fault, one cluster
    python -m tools.testbed.ray_serve_faults --prefill-raylet   # and the prefill raylet

One cluster serves every fault in turn, each followed by a drain check:

1. `scale_up_prefill`: the prefill deployment goes from 1 to 2 replicas while a
   client sends requests (a declarative config update, as `serve run config.yaml`
   applies it: only `num_replicas` changes, so Serve adds a replica and restarts
   nothing);
2. `kill_decode_engine`: SIGKILL of the decode replica's vLLM engine-core process
   (a child of the replica actor, found by the replica's pid from Ray's state API);
   Serve's health check fails and Serve replaces the replica;
3. `kill_raylet`: SIGKILL of a node's raylet (the node's `ray start --block` then
   kills the rest of the node); a replacement raylet with the same custom resource
   is started, and Serve places the lost replicas there;
4. `drained`: each prompt once, then, after traffic stops, every live engine
   reports no running or waiting request and (decode) an empty KV cache, read
   from the engines' own metrics as
   Ray exports them (Ray Serve LLM records vLLM's metrics through `ray.util.metrics`,
   `RayPrometheusStatLogger`; each node's metrics agent serves them on its
   `--metrics-export-port`), and each replica has exactly one engine-core process.

Every answer with HTTP 200 is decoded by the fork's client decoder and compared with
the colocated reference (rows and tokens): a fault may cost a request, never give a
wrong one. Every process is found by pid (Ray's state API, the process trees the
cluster started), never by a name pattern across the machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil

from tools.testbed.cpu_server import free_port, post_json
from tools.testbed.ray_serve_pd import (
    MODEL_NAME,
    Answer,
    RayCluster,
    pd_serving_args,
    prompts,
    reference_answers,
    request_body,
    require_ray_serve,
    wait_models,
)

APP = "pd"
PREFILL = f"Prefill:{MODEL_NAME}"
DECODE = f"Decode:{MODEL_NAME}"
# Serve's proxy answers 408 when a request is not done in this time (http_options
# request_timeout_s); without it a request sent while no replica can take it waits
# for one indefinitely.
REQUEST_TIMEOUT_S = 180.0
# How long a client waits for any answer (longer than Serve's own timeout).
CLIENT_TIMEOUT_S = REQUEST_TIMEOUT_S + 60.0
# Serve's health-check period for both roles here (app_config says why).
HEALTH_CHECK_PERIOD_S = 10
# How long a replica may take to come up on two busy cores.
RECOVERY_TIMEOUT_S = 900.0


def log(message: str) -> None:
    print(f"ray-serve-faults: {message}", flush=True)


# --- the cluster and the app ----------------------------------------------------


def fault_cluster(workdir: Path) -> RayCluster:
    """The head (with the dashboard, for Ray's state API), a prefill node with room
    for two prefill replicas (replica actor CPU + engine bundle CPU each) and a
    decode node with room for one decode replica."""
    return RayCluster(workdir, dashboard=True, workers=[
        ("prefill-node", 4, {"pnode": 2}),
        ("decode-node", 2, {"dnode": 1}),
    ])


def app_config(model: Path, http_port: int, prefill_replicas: int) -> dict[str, Any]:
    """The Serve config (a `ServeDeploySchema`) of Ray's P/D app: the import path is
    Ray's own builder, its args the LLMConfigs of `ray_serve_pd.pd_serving_args`,
    and the prefill deployment's replica count a per-deployment override. Changing
    only the override keeps the app's code version (import path, args, runtime env),
    so Serve scales the deployment without restarting any replica."""
    return {
        "proxy_location": "HeadOnly",
        "http_options": {"host": "127.0.0.1", "port": http_port,
                         "request_timeout_s": REQUEST_TIMEOUT_S},
        "applications": [{
            "name": APP,
            "route_prefix": "/",
            "import_path": "ray.serve.llm:build_pd_openai_app",
            "args": pd_serving_args(model, num_prefill=1),
            "runtime_env": {"env_vars": {"RAY_USAGE_STATS_ENABLED": "0"}},
            # Serve marks a replica unhealthy after 3 failed health checks in a
            # row (REPLICA_HEALTH_CHECK_UNHEALTHY_THRESHOLD,
            # ray/serve/_private/constants.py:329): with ray_serve_pd's 30 s
            # period a dead decode engine answered 500s for 126 s. vLLM's check
            # only reads a flag (AsyncLLM.check_health), so checking every 10 s
            # costs nothing; the 300 s timeout stays for busy CPU engines.
            "deployments": [
                {"name": PREFILL, "num_replicas": prefill_replicas,
                 "health_check_period_s": HEALTH_CHECK_PERIOD_S},
                {"name": DECODE, "health_check_period_s": HEALTH_CHECK_PERIOD_S},
            ],
        }],
    }


@dataclass
class Replica:
    """One Serve replica as Ray's state API lists its actor."""
    deployment: str
    replica_id: str
    actor_id: str
    pid: int
    node: str  # the raylet's name in the cluster ("prefill-node", ...)
    state: str


@dataclass
class PDApp:
    """Ray's P/D app deployed from a Serve config on a `RayCluster`."""
    cluster: RayCluster
    model: Path
    http_port: int
    client: Any  # ray.serve._private.client.ServeControllerClient
    prefill_replicas: int = 1

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def deploy(self, prefill_replicas: int) -> None:
        """Apply the app's config with this many prefill replicas (what `serve run
        config.yaml` does: `ServeControllerClient.deploy_apps`, Ray 2.60.0
        `ray/serve/scripts.py:545`). Returns once the controller has the config."""
        from ray.serve.schema import ServeDeploySchema

        config = app_config(self.model, self.http_port, prefill_replicas)
        self.client.deploy_apps(ServeDeploySchema.model_validate(config))
        self.prefill_replicas = prefill_replicas

    def status(self) -> dict[str, dict[str, Any]]:
        """Each deployment's Serve status and replica states, as `serve.status()`
        reports them."""
        from ray import serve

        app = serve.status().applications.get(APP)
        if app is None:
            return {}
        return {name: {"status": str(getattr(d.status, "value", d.status)),
                       "replicas": {str(getattr(k, "value", k)): v
                                    for k, v in d.replica_states.items()}}
                for name, d in app.deployments.items()}

    def replicas(self, deployment: str, detail: bool = False) -> list[Replica]:
        """The deployment's live replica actors, from Ray's state API."""
        return [r for r in self.actors(deployment, detail) if r.state == "ALIVE"]

    def actors(self, deployment: str, detail: bool = False) -> list[Replica]:
        """Every replica actor of the deployment Ray knows, dead ones included.
        Serve names them `SERVE_REPLICA::<app>#<deployment>#<replica id>`."""
        from ray.util.state import list_actors

        prefix = f"SERVE_REPLICA::{APP}#{deployment}#"
        nodes = node_names(self.cluster)
        out = []
        for actor in list_actors(address=self.cluster.dashboard_url, detail=detail,
                                 limit=1000, raise_on_missing_output=False):
            name = actor.name or ""
            if name.startswith(prefix):
                out.append(Replica(deployment, name[len(prefix):], actor.actor_id,
                                   int(actor.pid or 0),
                                   nodes.get(actor.node_id or "", "?"),
                                   str(actor.state)))
        return out

    def death_cause(self, actor_id: str) -> str:
        """What Ray's state API says ended an actor (empty while it lives)."""
        from ray.util.state import get_actor

        try:
            actor = get_actor(actor_id, address=self.cluster.dashboard_url)
        except Exception as exc:  # the state API is a report here, not a check
            return f"(state API: {type(exc).__name__}: {exc})"[:300]
        if actor is None or not actor.death_cause:
            return ""
        return json.dumps(actor.death_cause)[:600]

    def wait_healthy(self, deployment: str, replicas: int, *, exclude: Sequence[str]
                     = (), timeout: float = RECOVERY_TIMEOUT_S) -> list[Replica]:
        """Wait until Serve reports the deployment HEALTHY with `replicas` RUNNING
        replicas, none of them in `exclude` (replica ids of replicas that died).
        Returns the live replicas."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                last = self.status().get(deployment)
                live = self.replicas(deployment)
                if (last and last["status"] == "HEALTHY"
                        and last["replicas"].get("RUNNING") == replicas
                        and len(live) == replicas
                        and not {r.replica_id for r in live} & set(exclude)):
                    return live
            time.sleep(3)
        raise RuntimeError(f"{deployment} not healthy with {replicas} replicas after "
                           f"{timeout:.0f} s: {last}")


def node_names(cluster: RayCluster) -> dict[str, str]:
    """Ray node id -> the raylet's role, told by its custom resource."""
    import ray

    out = {}
    for node in ray.nodes():
        resources = node.get("Resources", {})
        role = ("prefill-node" if "pnode" in resources else
                "decode-node" if "dnode" in resources else "head")
        out[node["NodeID"]] = role
    return out


@contextlib.contextmanager
def serve_pd_config(cluster: RayCluster, model: Path, prefill_replicas: int = 1,
                    timeout: float = 1200.0) -> Iterator[PDApp]:
    """Start Serve on the cluster and deploy Ray's P/D app from its config; yields
    the app once its ingress lists the model and every deployment is healthy."""
    import ray
    from ray import serve
    from ray.serve._private import api as serve_api
    from ray.serve.config import ProxyLocation

    http_port = free_port()
    ray.init(address=cluster.address, namespace="serve", logging_level="WARNING",
             runtime_env={"env_vars": {"RAY_USAGE_STATS_ENABLED": "0"}})
    try:
        # What `serve run config.yaml` does (ray/serve/scripts.py:536-545).
        client = serve_api.serve_start(
            http_options={"host": "127.0.0.1", "port": http_port,
                          "request_timeout_s": REQUEST_TIMEOUT_S},
            proxy_location=ProxyLocation.HeadOnly)
        app = PDApp(cluster, model, http_port, client)
        app.deploy(prefill_replicas)
        wait_models(app.url, timeout)
        app.wait_healthy(DECODE, 1, timeout=timeout)
        app.wait_healthy(PREFILL, prefill_replicas, timeout=timeout)
        yield app
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()


# --- requests and their outcomes -------------------------------------------------


@dataclass
class Outcome:
    """One request and what came back. `verdict` is "equal" (HTTP 200, rows and
    tokens equal to colocated), "differs" (HTTP 200 with other rows or tokens, or
    rows the decoder refuses: never allowed), "http_error" (a status other than 200)
    or "no_response" (the connection failed or the client timed out)."""
    prompt: int  # index into prompts()
    sent: float  # seconds since the fault's start
    done: float
    verdict: str
    status: int = 0
    detail: str = ""


def send(url: str, prompt: int, reference: Sequence[Answer], t0: float) -> Outcome:
    """Send prompt `prompt` once and judge the answer against the reference."""
    body = request_body(prompts()[prompt])
    sent = time.monotonic() - t0
    try:
        status, response = post_json(url, "/v1/completions", body,
                                     timeout=CLIENT_TIMEOUT_S)
    except (OSError, urllib.error.URLError) as exc:
        return Outcome(prompt, sent, time.monotonic() - t0, "no_response",
                       detail=f"{type(exc).__name__}: {exc}"[:300])
    done = time.monotonic() - t0
    if status != 200:
        return Outcome(prompt, sent, done, "http_error", status,
                       json.dumps(response)[:600])
    try:
        diffs = Answer.of(response).differences(reference[prompt])
    except (AssertionError, ValueError, KeyError) as exc:
        diffs = [f"rows refused: {type(exc).__name__}: {exc}"]
    return Outcome(prompt, sent, done, "differs" if diffs else "equal", status,
                   "; ".join(diffs)[:600])


class Traffic:
    """A client sending the prompts in turn, one request at a time (two cores),
    from a thread, until stopped; every outcome is kept."""

    def __init__(self, url: str, reference: Sequence[Answer], t0: float,
                 gap: float = 1.0) -> None:
        self.url, self.reference, self.t0, self.gap = url, reference, t0, gap
        self.outcomes: list[Outcome] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            outcome = send(self.url, i % len(self.reference), self.reference, self.t0)
            self.outcomes.append(outcome)
            log(f"  request {len(self.outcomes)} (prompt {outcome.prompt}) sent at "
                f"{outcome.sent:.0f} s: {outcome.verdict} {outcome.status or ''} "
                f"{outcome.detail[:160]}")
            i += 1
            self._stop.wait(self.gap)

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=CLIENT_TIMEOUT_S + 30)

    def done_after(self, t: float) -> list[Outcome]:
        """Outcomes of the requests sent at or after `t` (seconds since t0)."""
        return [o for o in list(self.outcomes) if o.sent >= t]

    def wait_done_after(self, t: float, count: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(self.done_after(t)) < count and time.monotonic() < deadline:
            time.sleep(1)


def tally(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    """Counts: sent, equal, differs, http_error, no_response, and the HTTP errors
    by status."""
    out: dict[str, Any] = {"sent": len(outcomes), "equal": 0, "differs": 0,
                           "http_error": 0, "no_response": 0}
    statuses: dict[str, int] = {}
    for o in outcomes:
        out[o.verdict] += 1
        if o.verdict == "http_error":
            statuses[str(o.status)] = statuses.get(str(o.status), 0) + 1
    out["errors_by_status"] = statuses
    return out


def check_prompts(url: str, reference: Sequence[Answer], t0: float) -> list[Outcome]:
    """Each prompt once, in turn."""
    return [send(url, i, reference, t0) for i in range(len(reference))]


# --- metrics as Ray exports them ----------------------------------------------------


def scrape(cluster: RayCluster) -> list[tuple[str, dict[str, str], float]]:
    """Every sample from the metrics agents of the cluster's live raylets."""
    from prometheus_client.parser import text_string_to_metric_families

    samples = []
    for raylet in cluster.raylets:
        if raylet.process.poll() is not None or not raylet.metrics_port:
            continue
        try:
            with urllib.request.urlopen(
                    f"http://127.0.0.1:{raylet.metrics_port}/metrics", timeout=30) as r:
                text = r.read().decode()
        except (OSError, urllib.error.URLError):
            continue
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                samples.append((s.name, dict(s.labels), float(s.value)))
    return samples


ENGINE_GAUGES = ("vllm_num_requests_running", "vllm_num_requests_waiting",
                 "vllm_kv_cache_usage_perc")


def engine_gauges(cluster: RayCluster, replica_ids: Sequence[str]
                  ) -> dict[str, dict[str, float]]:
    """replica id -> {gauge: value} for vLLM's gauges as Ray exports them
    (`ray_vllm_num_requests_running{ReplicaId=...}`, vLLM's names with `:` made
    `_` by `RayPrometheusMetric._get_sanitized_opentelemetry_name`). A gauge with
    several series for one replica (e.g. per engine index) is summed."""
    out: dict[str, dict[str, float]] = {rid: {} for rid in replica_ids}
    for name, labels, value in scrape(cluster):
        rid = labels.get("ReplicaId", "")
        if rid not in out:
            continue
        for gauge in ENGINE_GAUGES:
            if name.removeprefix("ray_") == gauge:
                out[rid][gauge] = out[rid].get(gauge, 0.0) + value
    return out


def requests_by_replica(cluster: RayCluster, deployment: str) -> dict[str, float]:
    """replica id -> requests Serve counted for it (`serve_deployment_request_counter`,
    tagged with the deployment and the replica)."""
    out: dict[str, float] = {}
    for name, labels, value in scrape(cluster):
        if ("serve_deployment_request_counter" in name and name.endswith("_total")
                and labels.get("deployment") == deployment):
            rid = labels.get("replica") or labels.get("ReplicaId") or "?"
            out[rid] = out.get(rid, 0.0) + value
    return out


def engine_requests_by_replica(cluster: RayCluster, replica_ids: Sequence[str]
                               ) -> dict[str, float]:
    """replica id -> requests its vLLM engine finished (`vllm:request_success`,
    every finish reason, as Ray exports it with the replica's `ReplicaId`)."""
    out: dict[str, float] = {rid: 0.0 for rid in replica_ids}
    for name, labels, value in scrape(cluster):
        rid = labels.get("ReplicaId", "")
        if rid in out and name.removeprefix("ray_") == "vllm_request_success_total":
            out[rid] += value
    return out


def engine_processes(replica: Replica) -> list[int]:
    """The pids of vLLM engine-core processes among the replica process's children
    (vLLM titles them `VLLM::EngineCore...`)."""
    found = []
    with contextlib.suppress(psutil.NoSuchProcess):
        for child in psutil.Process(replica.pid).children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                if "EngineCore" in " ".join(child.cmdline()[:1]) or (
                        "EngineCore" in child.name()):
                    found.append(child.pid)
    return found


def drained(app: PDApp, reference: Sequence[Answer],
            watch: float = 45.0) -> dict[str, Any]:
    """Fault 4, nothing left on the survivors: send each prompt once, stop, and
    watch the engines' gauges as Ray's metrics agents export them for `watch`
    seconds; judge the last value seen of each live replica's gauge. Drained means:
    every gauge seen shows 0 requests running and waiting, decode's gauges were seen
    and its KV cache usage is 0, and each replica has exactly one engine-core
    process. `leaked` lists what is not so (prefill's KV usage is reported, not
    required: a prefill holds a request's blocks until decode has read them, and
    the blocks of a request whose decode died until the NIXL lease, 900 s here,
    expires).

    Why the prompts first: Ray 2.60.0 exports a gauge only while the process keeps
    setting it; the metrics agent drops a series not refreshed for two report
    intervals (`ray/_private/telemetry/open_telemetry_metric_recorder.py:76-150`,
    20 s by default), and vLLM sets its gauges when its engine steps. An idle
    engine's gauges are gone, so they are read in the window after the last
    request, where the last value exported is the engine's state after its last
    step."""
    t0 = time.monotonic()
    sent = check_prompts(app.url, reference, t0)
    replicas = app.replicas(PREFILL) + app.replicas(DECODE)
    ids = [r.replica_id for r in replicas]
    last: dict[str, dict[str, float]] = {rid: {} for rid in ids}
    t_stop = time.monotonic()
    while time.monotonic() - t_stop < watch:
        for rid, gauges in engine_gauges(app.cluster, ids).items():
            last[rid].update(gauges)
        time.sleep(2)
    leaked = []
    for r in replicas:
        g = last[r.replica_id]
        if r.deployment == DECODE and not g:
            leaked.append(f"{r.deployment} {r.replica_id}: no gauge exported")
        for gauge in ENGINE_GAUGES:
            required = (gauge != "vllm_kv_cache_usage_perc"
                        or r.deployment == DECODE)
            if required and g.get(gauge, 0.0) != 0:
                leaked.append(f"{r.deployment} {r.replica_id} {gauge}={g[gauge]}")
    engines = {r.replica_id: engine_processes(r) for r in replicas}
    for r in replicas:
        if len(engines[r.replica_id]) != 1:
            leaked.append(f"{r.deployment} {r.replica_id} has engine-core processes "
                          f"{engines[r.replica_id]}")
    return {"sent": tally(sent),
            "replicas": [{**asdict(r), "gauges": last[r.replica_id],
                          "engine_pids": engines[r.replica_id]} for r in replicas],
            "leaked": leaked, "outcomes": [asdict(o) for o in sent]}


# --- the faults ----------------------------------------------------------------------


def scale_up_prefill(app: PDApp, reference: Sequence[Answer],
                     after: int = 4) -> dict[str, Any]:
    """Fault 2: with a client sending requests, apply the config with 2 prefill
    replicas. Waits until Serve reports both RUNNING, then for `after` more requests
    sent after that, and (a few more, up to 12) until Serve's request counter shows
    the new replica served. Returns the outcomes' tally during and after the
    scale-up, the time until the second replica ran, which replicas served how many
    requests, and where Ray placed them. Nothing may restart: the first replica's
    actor and pid stay."""
    before = app.replicas(PREFILL)
    t0 = time.monotonic()
    with Traffic(app.url, reference, t0) as traffic:
        traffic.wait_done_after(0.0, 1, CLIENT_TIMEOUT_S)
        t_update = time.monotonic() - t0
        app.deploy(prefill_replicas=2)
        live = app.wait_healthy(PREFILL, 2)
        t_up = time.monotonic() - t0
        log(f"scale-up: 2 prefill replicas running {t_up - t_update:.0f} s after "
            f"the update")
        new = [r for r in live if r.replica_id not in {b.replica_id for b in before}]
        traffic.wait_done_after(t_up, after, RECOVERY_TIMEOUT_S)
        ids = [r.replica_id for r in live]

        def new_served() -> bool:
            return bool(new) and engine_requests_by_replica(
                app.cluster, ids).get(new[0].replica_id, 0) > 0

        for extra in range(after, 13):
            if new_served():
                break
            traffic.wait_done_after(t_up, extra + 1, CLIENT_TIMEOUT_S)
    # The counters lag the requests by Ray's metrics report interval.
    time.sleep(15)
    served = requests_by_replica(app.cluster, PREFILL)
    engine_served = engine_requests_by_replica(app.cluster, ids)
    return {
        "update_at_s": round(t_update, 1),
        "second_replica_running_after_s": round(t_up - t_update, 1),
        "replicas_before": [asdict(r) for r in before],
        "replicas_after": [asdict(r) for r in live],
        "new_replica": new[0].replica_id if new else None,
        "first_replica_kept": bool(before) and before[0].replica_id in {
            r.replica_id for r in live} and before[0].pid in {r.pid for r in live},
        "served_by_replica": served,  # Serve's request counter
        "engine_served_by_replica": engine_served,  # vLLM's request_success
        "during": tally([o for o in traffic.outcomes if o.sent < t_up]),
        "after": tally(traffic.done_after(t_up)),
        "outcomes": [asdict(o) for o in traffic.outcomes],
    }


def kill_decode_engine(app: PDApp, reference: Sequence[Answer]) -> dict[str, Any]:
    """Fault 1: SIGKILL the decode replica's engine-core process (the replica's child
    by pid; the replica's pid from Ray's state API) while a client sends requests.
    Serve's periodic health check (`LLMServer.check_health` -> vLLM's
    `AsyncLLM.check_health`, which raises once the engine is dead) fails, Serve
    stops the replica and starts another. Waits for Serve to report decode HEALTHY
    with a replica other than the killed one, then sends each prompt once. Returns
    the times (Serve's first non-HEALTHY report, HEALTHY again), the old actor's
    death cause, and the outcomes during the outage and after it."""
    (old,) = app.replicas(DECODE)
    engines = engine_processes(old)
    if len(engines) != 1:
        raise RuntimeError(f"decode replica {old} has engine-core processes {engines}")
    t0 = time.monotonic()
    seen_unhealthy: float | None = None
    with Traffic(app.url, reference, t0, gap=2.0) as traffic:
        traffic.wait_done_after(0.0, 1, CLIENT_TIMEOUT_S)
        t_kill = time.monotonic() - t0
        os.kill(engines[0], signal.SIGKILL)
        log(f"decode engine: SIGKILL to engine-core pid {engines[0]} of replica "
            f"{old.replica_id} (pid {old.pid})")
        deadline = time.monotonic() + RECOVERY_TIMEOUT_S
        live: list[Replica] = []
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                status = app.status().get(DECODE, {})
                if status.get("status") != "HEALTHY" and seen_unhealthy is None:
                    seen_unhealthy = time.monotonic() - t0
                    log(f"decode engine: Serve reports {status} at "
                        f"{seen_unhealthy - t_kill:.0f} s")
                live = app.replicas(DECODE)
                if (status.get("status") == "HEALTHY"
                        and status["replicas"].get("RUNNING") == 1 and len(live) == 1
                        and live[0].replica_id != old.replica_id):
                    break
            time.sleep(3)
        else:
            raise RuntimeError("decode not replaced after "
                               f"{RECOVERY_TIMEOUT_S:.0f} s: {app.status()}")
        t_healthy = time.monotonic() - t0
        log(f"decode engine: new replica {live[0].replica_id} (pid {live[0].pid}) "
            f"healthy {t_healthy - t_kill:.0f} s after the kill")
        traffic.stop()
    after = check_prompts(app.url, reference, t0)
    return {
        "killed_engine_pid": engines[0],
        "old_replica": asdict(old),
        "new_replica": asdict(live[0]),
        "old_actor_death_cause": app.death_cause(old.actor_id),
        "unhealthy_reported_after_s": (None if seen_unhealthy is None
                                       else round(seen_unhealthy - t_kill, 1)),
        "healthy_after_s": round(t_healthy - t_kill, 1),
        "kill_at_s": round(t_kill, 1),
        "before": tally([o for o in traffic.outcomes if o.sent < t_kill]),
        "during": tally([o for o in traffic.outcomes if o.sent >= t_kill]),
        "after": tally(after),
        "outcomes": [asdict(o) for o in traffic.outcomes + after],
    }


def raylet_process(cluster: RayCluster, name: str) -> psutil.Process:
    """The `raylet` binary in the process tree of the named node's `ray start`."""
    (node,) = [r for r in cluster.raylets if r.name == name]
    cluster.processes()  # remember the tree: its workers may outlive the raylet
    for proc in psutil.Process(node.process.pid).children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            if proc.name() == "raylet":
                return proc
    raise RuntimeError(f"no raylet process under {name} (pid {node.process.pid})")


def kill_raylet(app: PDApp, reference: Sequence[Answer], *, node: str,
                deployment: str, resources: dict[str, float], cpus: int,
                replacement: str, outage: float = 60.0) -> dict[str, Any]:
    """Fault 3: SIGKILL the named node's raylet while a client sends requests; its
    `ray start --block` sees a Ray process die and kills the node's other processes
    (Ray 2.60.0 `ray/scripts/scripts.py:1283-1321`), and the replica actors on it
    die with it. After `outage` seconds (Ray has marked the node dead by then, or
    the time it took is recorded), start a replacement raylet with the same custom
    resources under the name `replacement`; Serve places the lost replicas there.
    Waits until the deployment is HEALTHY with new replicas, then sends each prompt
    once. Returns when Ray marked the node dead, when the deployment was healthy
    again, the old actors' death causes, which processes of the killed node outlived
    it, and the outcomes during the outage and after it."""
    import ray

    old = app.replicas(deployment)
    raylet = raylet_process(app.cluster, node)
    node_ids = {nid for nid, role in node_names(app.cluster).items() if role == node}
    t0 = time.monotonic()
    with Traffic(app.url, reference, t0, gap=2.0) as traffic:
        traffic.wait_done_after(0.0, 1, CLIENT_TIMEOUT_S)
        t_kill = time.monotonic() - t0
        raylet.kill()
        log(f"raylet: SIGKILL to the raylet of {node} (pid {raylet.pid})")
        t_dead = None
        while time.monotonic() - t0 - t_kill < max(outage, 120.0):
            dead = [n for n in ray.nodes()
                    if n["NodeID"] in node_ids and not n["Alive"]]
            if dead and t_dead is None:
                t_dead = time.monotonic() - t0
                log(f"raylet: Ray marks {node} dead {t_dead - t_kill:.0f} s after "
                    f"the kill")
            if t_dead is not None and time.monotonic() - t0 - t_kill >= outage:
                break
            time.sleep(2)
        status_in_outage = app.status().get(deployment)
        survivors = [f"{p.pid} {p.name()}" for p in app.cluster.survivors()]
        log(f"raylet: in the outage Serve reports {status_in_outage}; processes of "
            f"{node} still running: {survivors}")
        attempts = app.cluster.start_worker(replacement, cpus, resources, attempts=3)
        t_node = time.monotonic() - t0
        log(f"raylet: replacement {replacement} joined {t_node - t_kill:.0f} s after "
            f"the kill")
        live = app.wait_healthy(deployment, len(old),
                                exclude=[r.replica_id for r in old])
        t_healthy = time.monotonic() - t0
        log(f"raylet: {deployment} healthy again {t_healthy - t_kill:.0f} s after the "
            f"kill, replicas on {[r.node for r in live]}")
        traffic.stop()
    after = check_prompts(app.url, reference, t0)
    return {
        "node": node,
        "killed_raylet_pid": raylet.pid,
        "old_replicas": [asdict(r) for r in old],
        "new_replicas": [asdict(r) for r in live],
        "old_actor_death_causes": [app.death_cause(r.actor_id) for r in old],
        "node_dead_after_s": None if t_dead is None else round(t_dead - t_kill, 1),
        "serve_status_in_outage": status_in_outage,
        "processes_outliving_the_node": survivors,
        "replacement_joined_after_s": round(t_node - t_kill, 1),
        "replacement_start_attempts": attempts,
        "healthy_after_s": round(t_healthy - t_kill, 1),
        "kill_at_s": round(t_kill, 1),
        "before": tally([o for o in traffic.outcomes if o.sent < t_kill]),
        "during": tally([o for o in traffic.outcomes if o.sent >= t_kill]),
        "after": tally(after),
        "outcomes": [asdict(o) for o in traffic.outcomes + after],
    }


def kill_decode_raylet(app: PDApp, reference: Sequence[Answer]) -> dict[str, Any]:
    """Fault 3 on the decode node (the orchestrating role): `kill_raylet`."""
    return kill_raylet(app, reference, node="decode-node", deployment=DECODE,
                       resources={"dnode": 1}, cpus=2, replacement="decode-node-2")


def kill_prefill_raylet(app: PDApp, reference: Sequence[Answer]) -> dict[str, Any]:
    """Fault 3 on the prefill node (every prefill replica is there): `kill_raylet`."""
    return kill_raylet(app, reference, node="prefill-node", deployment=PREFILL,
                       resources={"pnode": 2}, cpus=4, replacement="prefill-node-2")


# --- all of them ---------------------------------------------------------------


def wrong(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Every outcome in a fault's report that came back 200 with other rows or
    tokens than colocated (must be empty)."""
    return [o for o in report.get("outcomes", []) if o["verdict"] == "differs"]


def run_faults(workdir: Path, model: Path, reference: Sequence[Answer], *,
               prefill_raylet: bool = False,
               on_step: Callable[[dict[str, Any]], None] | None = None,
               only: Sequence[str] = ()) -> dict[str, Any]:
    """Serve Ray's P/D app (1P1D) on a fresh fault cluster and run, in turn: the
    baseline (each prompt once), the prefill scale-up, a drain check, the decode
    engine kill, a drain check, the decode raylet kill, a drain check, and with
    `prefill_raylet` the prefill raylet kill and a last drain check. Returns the
    report (one key per step); `on_step` gets it after every step, so a failure
    midway leaves what was measured. A step that raises is reported as
    `{"error": ...}` and the next steps still run."""
    report: dict[str, Any] = {}

    def step(name: str, fn: Callable[[], dict[str, Any]]) -> None:
        # `only`: run just the steps whose names start with one of these (the
        # baseline always runs).
        if only and name != "baseline" and not any(
                name.startswith(o) or name.endswith(o) for o in only):
            return
        t = time.monotonic()
        log(f"{name}: start")
        try:
            report[name] = fn()
        except Exception as exc:  # a failed step is reported; the next ones run
            report[name] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
        report[name]["step_seconds"] = round(time.monotonic() - t, 1)
        summary = {k: v for k, v in report[name].items() if k != "outcomes"}
        log(f"{name}: {json.dumps(summary)[:1500]}")
        if on_step is not None:
            on_step(report)

    with fault_cluster(workdir) as cluster:
        t0 = time.monotonic()
        with serve_pd_config(cluster, model, prefill_replicas=1) as app:
            report["up_seconds"] = round(time.monotonic() - t0, 1)
            log(f"1P1D up ({report['up_seconds']:.0f} s) at {app.url}")
            step("baseline", lambda: {"after": tally(o := check_prompts(
                app.url, reference, time.monotonic())),
                "outcomes": [asdict(x) for x in o]})
            step("scale_up_prefill", lambda: scale_up_prefill(app, reference))
            step("drained_after_scale_up", lambda: drained(app, reference))
            step("kill_decode_engine", lambda: kill_decode_engine(app, reference))
            step("drained_after_decode_engine", lambda: drained(app, reference))
            step("kill_decode_raylet", lambda: kill_decode_raylet(app, reference))
            step("drained_after_decode_raylet", lambda: drained(app, reference))
            if prefill_raylet:
                step("kill_prefill_raylet", lambda: kill_prefill_raylet(app, reference))
                step("drained_after_prefill_raylet",
                     lambda: drained(app, reference))
        report["processes_left_after_stop"] = [
            f"{p.pid} {p.name()}" for p in cluster.survivors()]
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.testbed.ray_serve_faults",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/ray-serve-faults"))
    parser.add_argument("--prefill-raylet", action="store_true",
                        help="also kill (and replace) the prefill node's raylet")
    parser.add_argument("--only", nargs="*", default=[],
                        help="run only these steps (and the baseline), e.g. "
                             "kill_decode_raylet drained_after_decode_raylet")
    args = parser.parse_args(argv)
    require_ray_serve()
    args.workdir.mkdir(parents=True, exist_ok=True)
    from tools.testbed.tiny_moe import build

    model = args.workdir / "tiny-moe"
    if not (model / "config.json").exists():
        build(model, num_experts=8, num_experts_per_tok=2, seed=0)
    bodies = [request_body(p) for p in prompts()]
    reference = reference_answers(model.resolve(), bodies, args.workdir)
    out = args.workdir / "faults.json"
    report = run_faults(args.workdir, model.resolve(), reference,
                        prefill_raylet=args.prefill_raylet,
                        on_step=lambda r: out.write_text(json.dumps(r, indent=1)),
                        only=args.only)
    out.write_text(json.dumps(report, indent=1))
    bad = [o for r in report.values() if isinstance(r, dict) for o in wrong(r)]
    log(f"report in {out}; {len(bad)} answers with wrong rows or tokens")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
