# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Prometheus metrics of the auxiliary-output control plane.

Contract:
- ``AuxOutputStats`` is one engine's snapshot, taken by the scheduler in
  ``make_stats`` from ``AuxOutputSchedulerConnector.make_stats``: counters hold
  what happened since the previous snapshot, gauges the current value.
- ``AuxOutputProm`` exposes them per engine (labels ``model_name``, ``engine``):

  - ``vllm:routed_experts_rows_loaded`` (counter): positions whose rows
    arrived with loaded KV blocks (a P/D pull or offloaded chunks with
    rows) and were queued for import into the auxiliary-output store.
  - ``vllm:routed_experts_emit_floors`` (gauge): P/D decode requests that
    hold an emit floor (rows before it come from the prefill instance).
  - ``vllm:routed_experts_tracked_requests`` (gauge): requests the control
    plane holds state for (block hashes sent, a load in flight, rows to
    export or import).

- A finished request leaves no floor and is not tracked: on an idle engine
  both gauges are 0, so a non-zero value there is leaked per-request state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import prometheus_client

from vllm.v1.metrics.utils import create_metric_per_engine

if TYPE_CHECKING:
    from vllm.config import VllmConfig


@dataclass
class AuxOutputStats:
    """One engine's auxiliary-output counters and gauges (see module doc)."""

    rows_loaded: int = 0
    emit_floors: int = 0
    tracked_requests: int = 0


class AuxOutputProm:
    """Record ``AuxOutputStats`` in Prometheus."""

    _counter_cls = prometheus_client.Counter
    _gauge_cls = prometheus_client.Gauge

    def __init__(
        self,
        vllm_config: VllmConfig,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        self.enabled = vllm_config.aux_output_config.enabled
        if not self.enabled:
            return
        self.counter_rows_loaded = create_metric_per_engine(
            self._counter_cls(
                name="vllm:routed_experts_rows_loaded",
                documentation=(
                    "Positions whose routed-experts rows arrived with loaded "
                    "KV blocks (P/D pull or KV offload), queued for import."
                ),
                labelnames=labelnames,
            ),
            per_engine_labelvalues,
        )
        self.gauge_emit_floors = create_metric_per_engine(
            self._gauge_cls(
                name="vllm:routed_experts_emit_floors",
                documentation=(
                    "P/D decode requests holding a routed-experts emit floor."
                ),
                multiprocess_mode="mostrecent",
                labelnames=labelnames,
            ),
            per_engine_labelvalues,
        )
        self.gauge_tracked_requests = create_metric_per_engine(
            self._gauge_cls(
                name="vllm:routed_experts_tracked_requests",
                documentation=(
                    "Requests the auxiliary-output control plane holds state "
                    "for; 0 on an idle engine."
                ),
                multiprocess_mode="mostrecent",
                labelnames=labelnames,
            ),
            per_engine_labelvalues,
        )

    def observe(self, stats: AuxOutputStats, engine_idx: int = 0) -> None:
        if not self.enabled:
            return
        if stats.rows_loaded:
            self.counter_rows_loaded[engine_idx].inc(stats.rows_loaded)
        self.gauge_emit_floors[engine_idx].set(stats.emit_floors)
        self.gauge_tracked_requests[engine_idx].set(stats.tracked_requests)
