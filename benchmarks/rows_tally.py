"""CPU time of the functions on the routed-experts rows path, inside running servers.

A whole deployment's CPU per request moves by 3-8 % between rounds on a 2-core host
(the model's forward dominates it), which hides a cost of a few µs per row. This
tally times the functions that handle rows, in every process of a server: each call's
thread CPU time (`time.thread_time_ns`, so time the thread waits is not counted),
summed per function with the number of calls. Run with the rows and without, the
difference per returned row is each component's cost, whatever the forward does.

How it gets in: a server started with `tally_env(directory)` in its environment puts
`benchmarks/rows_tally_site` on its PYTHONPATH, whose `sitecustomize` calls `install`
in every Python process (API server, engine core, workers, the proxy). `install`
wraps the functions of `TALLIED` right after their module is imported, and a daemon
thread writes the process's tally to `<directory>/<pid>.json` every `FLUSH_S`
seconds. `read_tally(directory)` sums the files; read it `FLUSH_S` after the work ends.

Inclusive times: a tallied function that calls another tallied function counts the
callee's time too (they are reported per function, never added up across names). A
function that this vLLM does not have is listed under `missing`, not skipped silently.
Benchmark tooling: never part of the fork wheel.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

ENV = "R3_TALLY_DIR"
SITE_DIR = Path(__file__).resolve().parent / "rows_tally_site"
FLUSH_S = 0.25

# module -> (qualified name, component) of the functions timed in it.
TALLIED: dict[str, tuple[tuple[str, str], ...]] = {
    "vllm.model_executor.layers.fused_moe.routed_experts_capturer": (
        ("RoutedExpertsCapturer.capture", "capture (upstream, per layer and step)"),
        ("RoutedExpertsCapturer.snapshot_routing_data", "capture (upstream, per step)"),
    ),
    "vllm.distributed.aux_output_connector.worker": (
        ("AuxOutputWorkerConnector.begin_step", "worker connector"),
        ("AuxOutputWorkerConnector.prepare_output", "worker connector"),
        ("AuxOutputWorkerConnector.process_output", "worker connector"),
    ),
    "vllm.distributed.aux_output_connector.connector": (
        ("AuxOutputSchedulerConnector.build_connector_meta", "scheduler connector"),
        ("AuxOutputSchedulerConnector.take_output", "scheduler connector"),
        ("AuxOutputSchedulerConnector.attach_chunk_starts", "scheduler connector"),
        ("AuxOutputSchedulerConnector.request_finished", "scheduler connector"),
    ),
    "vllm.distributed.kv_transfer.kv_connector.v1.nixl.rows_transfer": (
        ("NixlRowsTransfer.clear_landing_slots", "rows over NIXL"),
        ("NixlRowsTransfer.post_read", "rows over NIXL"),
        ("NixlRowsTransfer.failed_blocks", "rows over NIXL"),
    ),
    # Upstream's polling of NIXL transfers and the engine's step: not rows code, but
    # where a P/D request that waits longer for its transfers spends more.
    "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker": (
        ("NixlBaseConnectorWorker.get_finished", "NIXL polling (upstream)"),
        ("NixlBaseConnectorWorker._pop_done_transfers", "NIXL polling (upstream)"),
    ),
    "vllm.v1.engine.core": (("EngineCore.step", "engine step (upstream, all work)"),),
    # NIXL's agent (nixl/__init__.py puts the backend's _api module on the package):
    # every READ posted and polled, the KV's and the rows'.
    "nixl": (
        ("_api.nixl_agent.transfer", "NIXL post (every READ)"),
        ("_api.nixl_agent.check_xfer_state", "NIXL polling (every READ)"),
    ),
    "vllm.distributed.aux_output_connector.offload_rows": (
        ("OffloadedRowsSlots.write_stored", "offload"),
        ("OffloadedRowsSlots.import_loaded", "offload"),
    ),
    "vllm.v1.serial_utils": (
        ("MsgpackEncoder.encode", "IPC (msgpack, all outputs)"),
        ("MsgpackEncoder.encode_into", "IPC (msgpack, all outputs)"),
        ("MsgpackDecoder.decode", "IPC (msgpack, all outputs)"),
    ),
    "vllm.v1.engine.output_processor": (
        ("RequestState.add_routed_experts", "output processor"),
    ),
    "vllm.utils.serial_utils": (("numpy2base64", "encode (API server)"),),
    "vllm_r3_pdproxy.server": (("merge_response", "proxy merge"),),
}
COMPONENTS: dict[str, str] = {
    f"{module}:{name}": component
    for module, functions in TALLIED.items()
    for name, component in functions
}


@dataclass
class Tally:
    """Thread CPU seconds and calls per function ("module:Class.method")."""

    seconds: dict[str, float] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    missing: set[str] = field(default_factory=set)

    def __add__(self, other: Tally) -> Tally:
        return Tally(_merge(self.seconds, other.seconds, 1),
                     _merge(self.calls, other.calls, 1), self.missing | other.missing)

    def __sub__(self, earlier: Tally) -> Tally:
        return Tally(_merge(self.seconds, earlier.seconds, -1),
                     _merge(self.calls, earlier.calls, -1), self.missing | earlier.missing)


def _merge(a: dict[str, Any], b: dict[str, Any], sign: int) -> dict[str, Any]:
    return {key: a.get(key, 0) + sign * b.get(key, 0) for key in a.keys() | b.keys()}


def tally_env(directory: Path) -> dict[str, str]:
    """What a server's environment needs for its processes to tally into `directory`."""
    path = os.environ.get("PYTHONPATH")
    return {ENV: str(directory),
            "PYTHONPATH": str(SITE_DIR) + (os.pathsep + path if path else "")}


def read_tally(directory: Path) -> Tally:
    """The sum of every process's last written tally in `directory`."""
    total = Tally()
    for path in sorted(directory.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):  # being replaced: the rename is atomic
            continue
        total = total + Tally(data["seconds"], data["calls"], set(data["missing"]))
    return total


class _Counters:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.missing: set[str] = set()

    def add(self, key: str, nanoseconds: int) -> None:
        with self.lock:
            self.seconds[key] = self.seconds.get(key, 0.0) + nanoseconds / 1e9
            self.calls[key] = self.calls.get(key, 0) + 1

    def dump(self) -> str:
        with self.lock:
            return json.dumps({"seconds": self.seconds, "calls": self.calls,
                               "missing": sorted(self.missing)})


_COUNTERS = _Counters()


def timed(key: str, function: Callable[..., Any]) -> Callable[..., Any]:
    """`function`, adding each call's thread CPU time to `key`."""
    clock = time.thread_time_ns

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = clock()
        try:
            return function(*args, **kwargs)
        finally:
            _COUNTERS.add(key, clock() - started)

    return wrapper


def wrap_module(module: ModuleType, names: Iterable[str]) -> None:
    for name in names:
        key = f"{module.__name__}:{name}"
        owner: Any = module
        *path, attribute = name.split(".")
        try:
            for part in path:
                owner = getattr(owner, part)
            function = getattr(owner, attribute)
        except AttributeError:
            _COUNTERS.missing.add(key)
            continue
        setattr(owner, attribute, timed(key, function))


class _WrapAfterImport(importlib.abc.MetaPathFinder):
    """Wraps a module's tallied functions right after the module is executed."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in TALLIED:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        original = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            original(module)
            wrap_module(module, (n for n, _ in TALLIED[name]))

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _write_forever(directory: Path) -> None:
    while True:
        _flush(directory)
        time.sleep(FLUSH_S)


def _flush(directory: Path) -> None:
    target = directory / f"{os.getpid()}.json"
    partial = directory / f".{os.getpid()}.tmp"
    partial.write_text(_COUNTERS.dump())
    partial.replace(target)


def _start_writer(directory: Path) -> None:
    threading.Thread(target=_write_forever, args=(directory,), daemon=True,
                     name="rows-tally").start()


def _after_fork(directory: Path) -> None:
    # A forked child starts from its parent's counts: start from zero, in its own file.
    global _COUNTERS
    missing = _COUNTERS.missing
    _COUNTERS = _Counters()
    _COUNTERS.missing = set(missing)
    _start_writer(directory)


def install(directory: Path) -> None:
    """Tally this process (and the children it forks or spawns) into `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    sys.meta_path.insert(0, _WrapAfterImport())
    for name in TALLIED:  # already imported (not at interpreter start, but in tests)
        if name in sys.modules:
            wrap_module(sys.modules[name], (n for n, _ in TALLIED[name]))
    os.register_at_fork(after_in_child=lambda: _after_fork(directory))
    _start_writer(directory)
