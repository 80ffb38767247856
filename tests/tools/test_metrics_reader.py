"""The /metrics reader (tools/testbed/metrics.py) on hand-written exposition text.

The text has the cases a prefix match gets wrong: a counter whose name is a prefix of
another's (`vllm:prompt_tokens_total` and `..._total_extra`), a gauge whose name is a
prefix of a labelled one (`vllm:num_requests_waiting` and `..._by_reason`), the
`_created` series prometheus_client adds beside each counter, a histogram's `_sum`,
`_count` and `_bucket` series, labels with escaped quotes, commas and braces, and
NaN / +Inf values. Every expected figure is worked out by hand from the text.
"""

from __future__ import annotations

import http.server
import math
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tools.testbed import metrics

TEXT = r"""# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="tiny"} 70.0
vllm:prompt_tokens_total{engine="1",model_name="tiny"} 30.0
# TYPE vllm:prompt_tokens_created gauge
vllm:prompt_tokens_created{engine="0",model_name="tiny"} 1.7e+09
vllm:prompt_tokens_total_extra{engine="0"} 1000
vllm:prompt_tokens_by_source_total{engine="0",source="local_compute"} 64
vllm:prompt_tokens_by_source_total{engine="0",source="external_kv_transfer"} 6
vllm:prompt_tokens_by_source_total{engine="0",source="local_cache_hit"} 0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0"} 2
vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 5
vllm:nixl_bytes_transferred_bucket{engine="0",le="1024.0"} 3
vllm:nixl_bytes_transferred_bucket{engine="0",le="+Inf"} 4
vllm:nixl_bytes_transferred_sum{engine="0"} 4096
vllm:nixl_bytes_transferred_count{engine="0"} 4
vllm:kv_cache_usage_perc{engine="0"} 0.25
odd_labels{path="a,b=\"c\"}",note="line\nbreak"} +Inf
not_a_number NaN
master_key_count 12 1700000000000

"""


@pytest.fixture(scope="module")
def samples() -> metrics.Samples:
    return metrics.parse(TEXT)


@pytest.mark.parametrize(("selector", "expected"), [
    ("vllm:prompt_tokens_total", 100.0),  # not the _extra one, not _created
    ('vllm:prompt_tokens_total{engine="1"}', 30.0),
    ('vllm:prompt_tokens_total{engine="1",model_name="tiny"}', 30.0),
    ('vllm:prompt_tokens_total{engine="2"}', 0.0),
    ("vllm:prompt_tokens", 0.0),  # a prefix of a name is not a name
    ("vllm:prompt_tokens_created", 1.7e9),
    ("vllm:prompt_tokens_by_source_total", 70.0),
    ('vllm:prompt_tokens_by_source_total{source="local_compute"}', 64.0),
    ('vllm:prompt_tokens_by_source_total{source="local"}', 0.0),  # values are exact too
    ("vllm:num_requests_waiting", 2.0),  # not ..._by_reason
    ("vllm:nixl_bytes_transferred_sum", 4096.0),
    ("vllm:nixl_bytes_transferred_count", 4.0),
    ('vllm:nixl_bytes_transferred_bucket{le="1024.0"}', 3.0),
    ("vllm:kv_cache_usage_perc", 0.25),
    ("master_key_count", 12.0),  # a timestamp after the value is not the value
    ("vllm:not_exposed", 0.0),
])
def test_total_matches_exact_names_and_label_subsets(
    samples: metrics.Samples, selector: str, expected: float
) -> None:
    assert metrics.total(samples, selector) == expected


def test_each_series_is_kept_apart_with_its_labels(samples: metrics.Samples) -> None:
    assert len(samples) == 17  # the sample lines of TEXT
    assert metrics.select(samples, "vllm:prompt_tokens_total") == {
        frozenset({("engine", "0"), ("model_name", "tiny")}): 70.0,
        frozenset({("engine", "1"), ("model_name", "tiny")}): 30.0,
    }
    odd = metrics.select(samples, 'odd_labels{path="a,b=\\"c\\"}"}')
    assert odd == {frozenset({("path", 'a,b="c"}'), ("note", "line\nbreak")}): math.inf}


def test_nan_and_infinity_are_values(samples: metrics.Samples) -> None:
    assert math.isnan(metrics.total(samples, "not_a_number"))
    assert metrics.total(samples, "odd_labels") == math.inf
    assert metrics.parse("g -Inf\n") == {metrics.Series("g", frozenset()): -math.inf}


@pytest.mark.parametrize(("text", "says"), [
    ("vllm:x_total\n", "line 1"),  # no value
    ("# TYPE a counter\nvllm:x_total{a=1} 3\n", "line 2"),  # an unquoted label value
    ('vllm:x_total{a="1" b="2"} 3\n', "bad labels"),  # no comma between labels
    ('vllm:x_total{a="1",a="2"} 3\n', "given twice"),
    ("vllm:x_total 3\nvllm:x_total 4\n", "series given twice"),
    ("vllm:x_total three\n", "value 'three'"),
])
def test_malformed_text_is_refused_with_its_line(text: str, says: str) -> None:
    with pytest.raises(metrics.MetricsFormatError, match=says):
        metrics.parse(text)


@pytest.mark.parametrize("selector", ["vllm:x{", 'vllm:x{a=1}', "1abc", "vllm x"])
def test_a_malformed_selector_is_refused(selector: str) -> None:
    with pytest.raises(metrics.MetricsFormatError, match="selector"):
        metrics.parse_selector(selector)


@pytest.fixture
def server() -> Iterator[str]:
    """An HTTP server that answers /metrics with TEXT."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
            body = TEXT.encode() if self.path == "/metrics" else b""
            self.send_response(200 if body else 404)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def test_read_total_fetches_the_servers_metrics(server: str) -> None:
    assert metrics.read_total(server, 'vllm:prompt_tokens_by_source_total{'
                              'source="external_kv_transfer"}') == 6.0
    assert str(metrics.read(server)) == str(metrics.parse(TEXT))  # NaN != NaN


def test_the_harness_reads_exact_series(server: str) -> None:
    """Cluster.gauge and Cluster.metric (what the harness and the benchmarks call) on
    a stand-in cluster whose decode is the server above."""
    from tools.e2e.cluster import Cluster

    cluster: Any = SimpleNamespace(servers={"decode": SimpleNamespace(url=server)})
    cluster.gauge = lambda name, selector: Cluster.gauge(cluster, name, selector)
    assert Cluster.gauge(cluster, "decode", "vllm:num_requests_waiting") == 2.0
    assert Cluster.gauge(cluster, "decode", "vllm:prompt_tokens_total") == 100.0
    assert Cluster.metric(cluster, "decode", "vllm:nixl_bytes_transferred_sum") == 4096
    assert Cluster.metric(cluster, "prefill", "vllm:prompt_tokens_total") == 0  # no such
    cluster.servers["decode"].url = "http://127.0.0.1:9"  # nothing listens there
    assert Cluster.gauge(cluster, "decode", "vllm:prompt_tokens_total") is None
    assert Cluster.metric(cluster, "decode", "vllm:prompt_tokens_total") == -1


def test_the_mooncake_master_count_is_its_gauge(server: str, tmp_path: Path) -> None:
    from tools.e2e.mooncake_master import MooncakeMaster

    assert MooncakeMaster(tmp_path, metrics_port=_port(server)).key_count() == 12
