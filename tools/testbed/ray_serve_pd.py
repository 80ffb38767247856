"""Serve the fork through Ray Serve LLM's own P/D app on a local multi-node Ray
cluster, on CPU, and compare its rows and tokens with a colocated `vllm serve`.

A test fixture (`tests/v1/kv_connector/test_ray_serve_pd_e2e.py`) and a script::

    python -m tools.testbed.ray_serve_pd --num-prefill 1     # 1P1D
    python -m tools.testbed.ray_serve_pd --num-prefill 2     # 2P1D

It needs a venv with the fork wheel and Ray Serve 2.60.0 beside it
(tools/setup-ray-serve-env.sh; docs/deployments/ray-serve.md says why Ray's `llm`
extra cannot be used as is). What runs, all on 127.0.0.1:

- a Ray cluster of three raylets on this one machine: the head (no custom resource),
  a "prefill node" (custom resource `pnode`) and a "decode node" (`dnode`); each
  role's LLMConfig asks for its node's resource in its placement-group bundle, so
  prefill and decode replicas land on different raylets;
- Ray's own `build_pd_openai_app` with prefill and decode LLMConfigs whose
  `kv_transfer_config` is the builder's chain (`vllm kv-transfer-config --role ...
  --routed-experts-transfer`) plus the two keys NIXL needs on a CPU host
  (`kv_buffer_device`, a long `kv_lease_duration`, as the harness adds them);
  Ray sets each replica's NIXL side channel itself (`NixlConnectorBackend`);
- the colocated reference, served first and stopped before the cluster starts (two
  cores cannot run four engines and Ray at once in reasonable time).

Every process this module starts is stopped by id on exit: the raylets are started
with `ray start --block` in sessions of their own, and stopping one kills its whole
process tree (engine cores included), never processes found by name.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from tools.testbed.aliases import deprecated_alias
from tools.testbed.cpu_server import (
    OPT_IN,
    VllmServer,
    choice_rows,
    cpu_env,
    final_chunk_rows,
    final_chunk_starts,
    free_port,
    post_json,
    post_stream,
)

MODEL_NAME = "tiny"
BLOCK_SIZE = 32
# What each engine is given, the same on both roles and on the reference: float32 so
# near-tie expert choices do not flip, 32-token blocks so prompts cross boundaries.
ENGINE_KWARGS: dict[str, Any] = {
    "dtype": "float32",
    "block_size": BLOCK_SIZE,
    "max_model_len": 512,
    "max_num_seqs": 4,
    "max_num_batched_tokens": 512,
    "enforce_eager": True,
    "enable_return_routed_experts": True,
}
REFERENCE_ARGS = ("--enable-return-routed-experts", "--dtype", "float32",
                  "--block-size", str(BLOCK_SIZE))
# NIXL's lease: decode on a starved 2-core host can take longer than the 30 s
# default to read (docs/deployments/1p1d.md); the harness uses the same.
KV_LEASE_SECONDS = 900
# What a CPU engine inside a Ray replica needs (the same as tools/testbed's
# `cpu_env`), passed through the LLMConfig's runtime_env.
REPLICA_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_CI_ENV": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_DO_NOT_TRACK": "1",
    **OPT_IN,
}
# Ray Serve LLM's replica health check defaults to a 10 s timeout
# (RAY_SERVE_LLM_DEFAULT_HEALTH_CHECK_TIMEOUT_S); a CPU engine busy with a step
# answers later than that and Serve would restart a healthy replica.
DEPLOYMENT_CONFIG = {"health_check_period_s": 30, "health_check_timeout_s": 300}


def role_chain(role: str, routed_experts_transfer: bool = True) -> dict[str, Any]:
    """The role's kv_transfer_config as `vllm kv-transfer-config` prints it, plus
    what NIXL needs on a CPU host (host buffers, a long lease)."""
    command = [str(Path(sys.executable).parent / "vllm"), "kv-transfer-config",
               "--role", role]
    if routed_experts_transfer:
        command.append("--routed-experts-transfer")
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    chain = json.loads(out)
    chain["kv_buffer_device"] = "cpu"
    chain.setdefault("kv_connector_extra_config", {})["kv_lease_duration"] = (
        KV_LEASE_SECONDS)
    return chain


def llm_config(role: str, model: Path, *, node_resource: str, num_replicas: int,
               core: int, routed_experts_transfer: bool = True) -> dict[str, Any]:
    """One role's LLMConfig (as a dict, what `build_pd_openai_app` validates)."""
    return {
        "model_loading_config": {"model_id": MODEL_NAME, "model_source": str(model)},
        "accelerator_config": {"kind": "cpu"},
        # One bundle per engine: the role's node resource places it (Ray adds the
        # replica actor's own CPU to the first bundle).
        "placement_group_config": {"bundles": [{"CPU": 1, node_resource: 1}]},
        "deployment_config": {"num_replicas": num_replicas, **DEPLOYMENT_CONFIG},
        "engine_kwargs": {**ENGINE_KWARGS,
                          "kv_transfer_config": role_chain(role,
                                                           routed_experts_transfer)},
        "runtime_env": {"env_vars": {**REPLICA_ENV,
                                     "VLLM_CPU_OMP_THREADS_BIND": str(core)}},
    }


def pd_serving_args(model: Path, num_prefill: int = 1,
                    routed_experts_transfer: bool = True) -> dict[str, Any]:
    decode = llm_config("decode", model, node_resource="dnode", num_replicas=1,
                        core=1, routed_experts_transfer=routed_experts_transfer)
    # Ray's pre-warm: at startup decode's replica sends one request through every
    # prefill replica that is up by then (one of two here, the other still
    # loading), so those NIXL handshakes happen before traffic. vLLM 0.31.0 gives
    # a handshake's reply 5 s (RCVTIMEO in nixl/base_worker.py); on a starved host
    # a first request's handshake once missed it and the request failed (500).
    decode["experimental_configs"] = {"_prewarm_prefill_decode": True}
    return {
        "prefill_config": llm_config("prefill", model, node_resource="pnode",
                                     num_replicas=num_prefill, core=0,
                                     routed_experts_transfer=routed_experts_transfer),
        "decode_config": decode,
        "ingress_deployment_config": {"num_replicas": 1},
    }


def prompts() -> list[list[int]]:
    """Token-id prompts: one inside the first block, one across a block boundary,
    one whose decode starts on a boundary (64 tokens)."""
    return [
        [5 + (7 * i) % 500 for i in range(20)],
        [5 + (37 * i + 11) % 500 for i in range(45)],
        [5 + (13 * i + 3) % 500 for i in range(64)],
    ]


def request_body(prompt: list[int], max_tokens: int = 8) -> dict[str, Any]:
    return {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0.0, "return_token_ids": True}


@dataclass
class Answer:
    """What one completion returned: its tokens and its rows, decoded and checked
    (one row per position from start to P + C - 1) by the fork's client decoder."""
    token_ids: list[int]
    start: int
    rows: np.ndarray

    @classmethod
    def of(cls, response: dict[str, Any]) -> Answer:
        choice = response["choices"][0]
        rows = choice_rows(choice)
        assert rows is not None, f"no routed_experts in {json.dumps(response)[:400]}"
        return cls(list(choice["token_ids"]), int(choice["routed_experts_start"]), rows)

    @classmethod
    def of_stream(cls, chunks: list[dict[str, Any]]) -> Answer:
        """A streamed completion: its chunks' tokens, the final chunk's rows."""
        rows = final_chunk_rows(chunks).get(0)
        assert rows is not None, "no routed_experts in the final chunk"
        tokens = [t for chunk in chunks for choice in chunk["choices"]
                  for t in (choice.get("token_ids") or [])]
        return cls(tokens, int(final_chunk_starts(chunks)[0]), rows)

    def differences(self, other: Answer) -> list[str]:
        out = []
        if self.token_ids != other.token_ids:
            out.append(f"tokens differ: {self.token_ids} vs {other.token_ids}")
        if self.start != other.start or self.rows.shape != other.rows.shape:
            out.append(f"rows differ: start {self.start} shape {self.rows.shape} vs "
                       f"start {other.start} shape {other.rows.shape}")
        elif not np.array_equal(self.rows, other.rows):
            bad = np.flatnonzero((self.rows != other.rows).any(axis=(1, 2)))
            out.append(f"rows differ at {len(bad)} positions, first {bad[:5].tolist()}")
        return out


def reference_answers(model: Path, bodies: Sequence[dict[str, Any]], logs: Path
                      ) -> list[Answer]:
    """The colocated reference: one `vllm serve` with routed experts, no connector."""
    server = VllmServer(model=model, log_path=logs / "reference.log",
                        extra_args=REFERENCE_ARGS, env=cpu_env(opt_in=True, core=0))
    with server:
        server.wait_ready(timeout=600)
        return [Answer.of(server.complete(body, timeout=600)) for body in bodies]


# --- the Ray cluster -------------------------------------------------------------


@dataclass
class Raylet:
    name: str
    process: subprocess.Popen[bytes]
    log: Path
    # Where this node's Ray metrics agent serves Prometheus text (`ray start
    # --metrics-export-port`): Ray's own metrics and what replicas record through
    # `ray.util.metrics` (Ray Serve LLM's engine metrics among them).
    metrics_port: int = 0


@dataclass
class RayCluster:
    """Head plus worker raylets on this machine, each with its own custom resources.
    `ray start --block` keeps each raylet's starter in the foreground, in a session
    of its own; `stop()` kills each one's process tree by id."""
    workdir: Path
    workers: Sequence[tuple[str, int, dict[str, float]]]  # name, CPUs, resources
    head_cpus: int = 2
    port: int = field(default_factory=free_port)
    raylets: list[Raylet] = field(default_factory=list)
    # The head's dashboard serves Ray's state API (`ray.util.state`); off by
    # default (two cores), on for the fault tests, which read replica actors' pids
    # and death causes from it.
    dashboard: bool = False
    dashboard_port: int = field(default_factory=free_port)
    # pid -> create time of every process seen in a raylet's tree: a killed node's
    # workers can outlive their raylet, reparented away from the tree, and `stop()`
    # still ends them by id.
    seen: dict[int, float] = field(default_factory=dict)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def temp_dir(self) -> Path:
        # Ray's socket paths must stay short (AF_UNIX's 107 bytes).
        return Path(f"/tmp/ray-pd-{self.port}")

    @property
    def dashboard_url(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def _start(self, name: str, args: list[str]) -> None:
        log = self.workdir / f"raylet-{name}.log"
        metrics_port = free_port()
        ray = str(Path(sys.executable).parent / "ray")
        # A raylet registers with the GCS within 60 s by default; on a 2-core host
        # busy with engines it has taken longer ("The current node timed out during
        # startup").
        env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0",
                   RAY_raylet_start_wait_time_s="300",
                   RAY_agent_register_timeout_ms="300000")
        # Every agent port given: a raylet whose agent ports are 0 waits for the
        # agents to write them to files, and aborts when one is slow ("Timed out
        # waiting for file .../metrics_agent", Ray 2.60.0 raylet node_manager.cc:3576;
        # seen on a replacement raylet with the host's load average above 80).
        agent_ports = ["--metrics-export-port", str(metrics_port),
                       "--dashboard-agent-grpc-port", str(free_port()),
                       "--dashboard-agent-listen-port", str(free_port()),
                       "--runtime-env-agent-port", str(free_port())]
        with open(log, "wb") as out:
            process = subprocess.Popen(
                [ray, "start", "--block", "--node-ip-address", "127.0.0.1",
                 "--object-store-memory", str(200 * 2**20), *agent_ports, *args],
                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.raylets.append(Raylet(name, process, log, metrics_port))

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        dashboard = (["--include-dashboard", "true", "--dashboard-host", "127.0.0.1",
                      "--dashboard-port", str(self.dashboard_port)]
                     if self.dashboard else ["--include-dashboard", "false"])
        self._start("head", ["--head", "--port", str(self.port),
                             "--num-cpus", str(self.head_cpus), *dashboard,
                             "--temp-dir", str(self.temp_dir)])
        self.wait_nodes(1)
        for name, cpus, resources in self.workers:
            self.start_worker(name, cpus, resources)

    def start_worker(self, name: str, cpus: int, resources: dict[str, float],
                     attempts: int = 1) -> int:
        """Start one more worker raylet (its name must be new) and wait until the
        cluster counts it among its nodes. With `attempts` > 1 a raylet that exits
        while starting is started again (as `<name>-retry<n>`); returns the attempts
        it took. On a host with a load average above 100 a replacement raylet
        aborted at start, waiting for its agent's port file
        (`dashboard_agent_listen_port`, raylet node_manager.cc:3588 in Ray
        2.60.0), even with every agent port given."""
        for attempt in range(1, attempts + 1):
            alive = sum(r.process.poll() is None for r in self.raylets)
            self._start(name if attempt == 1 else f"{name}-retry{attempt}",
                        ["--address", self.address, "--num-cpus", str(cpus),
                         "--resources", json.dumps(resources)])
            try:
                self.wait_nodes(alive + 1)
                return attempt
            except RuntimeError:
                if attempt == attempts or self.raylets[-1].process.poll() is None:
                    raise
        raise AssertionError("unreachable")

    def wait_nodes(self, count: int, timeout: float = 400.0) -> None:
        deadline = time.monotonic() + timeout
        ray = str(Path(sys.executable).parent / "ray")
        starting = [r for r in self.raylets if r.process.poll() is None]
        while time.monotonic() < deadline:
            for raylet in starting:
                if raylet.process.poll() is not None:
                    raise RuntimeError(f"raylet {raylet.name} exited: "
                                       f"{raylet.log.read_text()[-2000:]}")
            status = subprocess.run([ray, "status", "--address", self.address],
                                    capture_output=True, text=True)
            # `ray status` lists live nodes under "Active:" (dead ones, after a
            # fault, under "Recent failures:" without the node_ prefix count).
            active = status.stdout.split("Pending:")[0]
            if status.returncode == 0 and active.count("node_") >= count:
                return
            time.sleep(3)
        raise RuntimeError(f"{count} Ray nodes not up after {timeout:.0f} s")

    def processes(self) -> list[psutil.Process]:
        """Every live process this cluster started: the starters, their trees."""
        found: dict[int, psutil.Process] = {}
        for raylet in self.raylets:
            with contextlib.suppress(psutil.NoSuchProcess):
                root = psutil.Process(raylet.process.pid)
                for proc in [root, *root.children(recursive=True)]:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        self.seen.setdefault(proc.pid, proc.create_time())
                    found[proc.pid] = proc
        return list(found.values())

    def survivors(self) -> list[psutil.Process]:
        """Processes once seen in a raylet's tree that are still running now but no
        longer in any live tree (matched by pid and create time, so a reused pid is
        not taken for one)."""
        live = {proc.pid for proc in self.processes()}
        out = []
        for pid, created in self.seen.items():
            if pid in live:
                continue
            with contextlib.suppress(psutil.NoSuchProcess):
                proc = psutil.Process(pid)
                if (proc.create_time() == created
                        and proc.status() != psutil.STATUS_ZOMBIE):
                    out.append(proc)
        return out

    def stop(self) -> None:
        procs = self.processes() + self.survivors()
        for raylet in reversed(self.raylets):  # workers first, then the head
            with contextlib.suppress(ProcessLookupError):
                os.killpg(raylet.process.pid, signal.SIGTERM)
        _, alive = psutil.wait_procs(procs, timeout=30)
        for proc in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        psutil.wait_procs(alive, timeout=60)
        for raylet in self.raylets:
            with contextlib.suppress(subprocess.TimeoutExpired):
                raylet.process.wait(timeout=30)

    def __enter__(self) -> RayCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def cluster_for(workdir: Path, num_prefill: int) -> RayCluster:
    """The head, one prefill node with room for every prefill replica (replica actor
    CPU + engine bundle CPU each), one decode node."""
    return RayCluster(workdir, workers=[
        ("prefill-node", 2 * num_prefill, {"pnode": num_prefill}),
        ("decode-node", 2, {"dnode": 1}),
    ])


def require_ray_serve() -> None:
    """Raise, naming the fix, when Ray Serve LLM is not importable here."""
    import importlib.util

    if importlib.util.find_spec("ray") is None or importlib.util.find_spec(
            "ray.serve.llm") is None:
        raise RuntimeError("Ray Serve LLM is not installed in this Python "
                           f"({sys.executable}); tools/setup-ray-serve-env.sh makes "
                           ".venv-ray with it beside the fork (make e2e-ray-serve)")


@contextlib.contextmanager
def serve_pd(cluster: RayCluster, model: Path, num_prefill: int,
             routed_experts_transfer: bool = True,
             timeout: float = 1200.0) -> Iterator[str]:
    """Deploy Ray's P/D app on the cluster; yields the ingress URL."""
    import ray
    from ray import serve
    from ray.serve.llm import build_pd_openai_app

    port = free_port()
    ray.init(address=cluster.address, logging_level="WARNING",
             runtime_env={"env_vars": {"RAY_USAGE_STATS_ENABLED": "0"}})
    try:
        serve.start(proxy_location="HeadOnly",
                    http_options={"host": "127.0.0.1", "port": port})
        app = build_pd_openai_app(pd_serving_args(model, num_prefill,
                                                  routed_experts_transfer))
        serve.run(app, name="pd", blocking=False)
        url = f"http://127.0.0.1:{port}"
        wait_models(url, timeout)
        yield url
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()


def wait_models(url: str, timeout: float) -> None:
    """Wait until the ingress lists the model and answers a completion."""
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as resp:
                if MODEL_NAME in resp.read().decode():
                    return
        except (urllib.error.URLError, OSError) as exc:
            last = str(exc)
        time.sleep(5)
    raise RuntimeError(f"Ray Serve ingress not ready after {timeout:.0f} s: {last}")


def placement(cluster: RayCluster) -> dict[str, list[str]]:
    """Which raylet each Serve replica runs in: node name -> the replica processes in
    its tree (Ray titles a replica's process `ray::ServeReplica:<app>:<deployment>`).
    Read from the process trees this module started, so it needs no dashboard."""
    out: dict[str, list[str]] = {}
    for raylet in cluster.raylets:
        names = []
        with contextlib.suppress(psutil.NoSuchProcess):
            for proc in psutil.Process(raylet.process.pid).children(recursive=True):
                with contextlib.suppress(psutil.NoSuchProcess):
                    title = " ".join(proc.cmdline())
                    if title.startswith("ray::ServeReplica"):
                        names.append(title.split()[0].removeprefix("ray::ServeReplica:"))
        out[raylet.name] = sorted(names)
    return out


def run(workdir: Path, model: Path, num_prefill: int, *,
        routed_experts_transfer: bool = True,
        reference: list[Answer] | None = None) -> dict[str, Any]:
    """Serve the reference, then the Ray P/D app; send each prompt to both. Returns
    a report: each prompt's differences, the replicas' placement, the answers."""
    bodies = [request_body(p) for p in prompts()]
    if reference is None:
        t0 = time.monotonic()
        reference = reference_answers(model, bodies, workdir)
        print(f"ray-serve-pd: reference answered {len(bodies)} prompts "
              f"({time.monotonic() - t0:.0f} s)", flush=True)
    (workdir / "reference.json").write_text(json.dumps(
        [{"token_ids": a.token_ids, "start": a.start, "rows": a.rows.tolist(),
          "dtype": str(a.rows.dtype)}
         for a in reference]))
    report: dict[str, Any] = {"num_prefill": num_prefill, "mismatches": 0,
                              "prompts": []}
    with cluster_for(workdir, num_prefill) as cluster:
        t0 = time.monotonic()
        with serve_pd(cluster, model, num_prefill, routed_experts_transfer) as url:
            print(f"ray-serve-pd: {num_prefill}P1D up ({time.monotonic() - t0:.0f} s) "
                  f"at {url}", flush=True)
            report["placement"] = placement(cluster)
            # Each prompt twice: with 2 prefill replicas the second lands on the
            # other one (Serve's power-of-two router, not guaranteed).
            for body, ref in [(b, r) for b, r in zip(bodies, reference)
                              for _ in range(2 if num_prefill > 1 else 1)]:
                status, response = post_json(url, "/v1/completions", body, timeout=900)
                if status != 200:
                    diffs = [f"HTTP {status}: {json.dumps(response)[:2000]}"]
                    print(f"ray-serve-pd: prompt {len(body['prompt'])} tokens: "
                          f"HTTP {status}", flush=True)
                else:
                    try:
                        got = Answer.of(response)
                    except (AssertionError, ValueError) as exc:
                        # RoutedExpertsError (a ValueError): rows the decoder refuses,
                        # e.g. decode's half alone when rows do not travel.
                        diffs = [f"rows refused: {type(exc).__name__}: {exc}"]
                        print(f"ray-serve-pd: prompt {len(body['prompt'])} tokens: "
                              f"{diffs[0]}", flush=True)
                    else:
                        diffs = got.differences(ref)
                        print(f"ray-serve-pd: prompt {len(body['prompt'])} tokens: "
                              f"rows from {got.start}, shape {got.rows.shape}, "
                              f"tokens {got.token_ids}: "
                              f"{'equal to colocated' if not diffs else diffs}",
                              flush=True)
                report["prompts"].append({"prompt_len": len(body["prompt"]),
                                          "differences": diffs})
                report["mismatches"] += bool(diffs)
            # Streamed: Ray passes the engine's server-sent events through; the
            # rows come in the final chunk (patch
            # `return-routed-experts-rows-in-the-final-stream-chunk`).
            body, ref = bodies[1], reference[1]
            try:
                got = Answer.of_stream(post_stream(url, "/v1/completions", body,
                                                   timeout=900))
                diffs = got.differences(ref)
            except (AssertionError, OSError, ValueError) as exc:
                diffs = [f"stream: {type(exc).__name__}: {exc}"]
            print(f"ray-serve-pd: streamed prompt {len(body['prompt'])} tokens: "
                  f"{'equal to colocated' if not diffs else diffs}", flush=True)
            report["prompts"].append({"prompt_len": len(body["prompt"]),
                                      "stream": True, "differences": diffs})
            report["mismatches"] += bool(diffs)
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.testbed.ray_serve_pd",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--num-prefill", type=int, default=1)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/ray-serve-pd"))
    parser.add_argument("--model", type=Path, help="default: build the tiny MoE")
    parser.add_argument("--reuse-reference", action="store_true",
                        help="take the colocated answers from WORKDIR/reference.json "
                             "(written by an earlier run) instead of serving them")
    parser.add_argument("--no-routed-experts-transfer", action="store_true",
                        help="build both chains without --routed-experts-transfer (the "
                             "rows-transfer switch off)")
    deprecated_alias(parser, "--no-rows-transfer", "--no-routed-experts-transfer")
    args = parser.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    model = args.model
    if model is None:
        from tools.testbed.tiny_moe import build
        model = args.workdir / "tiny-moe"
        if not (model / "config.json").exists():
            build(model)
    reference = None
    if args.reuse_reference:
        reference = [Answer(a["token_ids"], a["start"], np.array(a["rows"], a["dtype"]))
                     for a in json.loads((args.workdir / "reference.json").read_text())]
    report = run(args.workdir, model.resolve(), args.num_prefill,
                 routed_experts_transfer=not args.no_routed_experts_transfer,
                 reference=reference)
    print(json.dumps(report, indent=1))
    print(f"ray-serve-pd: {args.num_prefill}P1D through Ray Serve LLM: "
          f"{len(report['prompts'])} requests, {report['mismatches']} mismatches")
    return 1 if report["mismatches"] else 0


if __name__ == "__main__":
    sys.exit(main())
