"""Read a server's Prometheus /metrics: exact series, summed on request.

`parse` turns exposition text into {Series(name, labels): value}; `total` sums the
values of the series a selector names. A selector is a metric name with an optional
label subset, as PromQL writes it: `vllm:prompt_tokens_by_source_total` or
`vllm:prompt_tokens_by_source_total{source="local_compute"}`. Matching is exact: the
series' name must equal the selector's (so `vllm:foo_total` never matches
`vllm:foo_total_bar`, `vllm:foo_created` or `vllm:foo_total_sum`), and each label the
selector gives must be on the series with exactly that value; other labels are summed
over. No matching series sums to 0.0.

Malformed text raises `MetricsFormatError` naming the line, and so does a series that
appears twice. `read` fetches `<url>/metrics`; its network errors are urllib's.
"""

from __future__ import annotations

import re
import urllib.request
from typing import NamedTuple

Labels = frozenset[tuple[str, str]]

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
# Name, the label block's inside, value, optional timestamp. The block runs to the
# line's last `}`: a label value may hold one, the value and timestamp cannot.
_SAMPLE = re.compile(rf"^({_NAME})(?:\{{(.*)\}})?[ \t]+(\S+)(?:[ \t]+(-?\d+))?[ \t]*$")
_SELECTOR = re.compile(rf"^({_NAME})(?:\{{(.*)\}})?$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*(,|$)')
_ESCAPES = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


class MetricsFormatError(ValueError):
    """Exposition text or a selector that does not parse."""


class Series(NamedTuple):
    name: str
    labels: Labels


Samples = dict[Series, float]


def _labels(body: str | None, where: str) -> Labels:
    """`a="1",b="x\\"y"` -> {("a", "1"), ("b", 'x"y')}."""
    if not body or not body.strip():
        return frozenset()
    pairs: dict[str, str] = {}
    position = 0
    while position < len(body):
        match = _LABEL.match(body, position)
        if match is None:
            raise MetricsFormatError(f"{where}: bad labels at {body[position:]!r}")
        key = match.group(1)
        if key in pairs:
            raise MetricsFormatError(f"{where}: label {key!r} given twice")
        pairs[key] = re.sub(r"\\[\\\"n]", lambda m: _ESCAPES[m.group(0)], match.group(2))
        position = match.end()
    return frozenset(pairs.items())


def parse(text: str) -> Samples:
    """Every sample of exposition text, keyed by its exact series."""
    samples: Samples = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        where = f"line {number} ({line[:120]!r})"
        match = _SAMPLE.match(line.strip())
        if match is None:
            raise MetricsFormatError(f"{where}: not a sample line")
        try:
            value = float(match.group(3))  # also NaN, +Inf, -Inf
        except ValueError:
            raise MetricsFormatError(f"{where}: value {match.group(3)!r}") from None
        series = Series(match.group(1), _labels(match.group(2), where))
        if series in samples:
            raise MetricsFormatError(f"{where}: series given twice")
        samples[series] = value
    return samples


def parse_selector(selector: str) -> tuple[str, Labels]:
    """`name` or `name{label="value",...}` -> (name, the labels it pins)."""
    match = _SELECTOR.match(selector.strip())
    if match is None:
        raise MetricsFormatError(f"selector {selector!r}: not `name` or `name{{label=\"v\"}}`")
    return match.group(1), _labels(match.group(2), f"selector {selector!r}")


def select(samples: Samples, selector: str) -> dict[Labels, float]:
    """The series `selector` matches (exact name, its labels a subset), by labels."""
    name, wanted = parse_selector(selector)
    return {series.labels: value for series, value in samples.items()
            if series.name == name and wanted <= series.labels}


def total(samples: Samples, selector: str) -> float:
    """The sum of the series `selector` matches; 0.0 when none does."""
    return float(sum(select(samples, selector).values()))


def read(url: str, timeout: float = 10.0) -> Samples:
    """`<url>/metrics`, parsed."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=timeout) as response:
        return parse(response.read().decode())


def read_total(url: str, selector: str, timeout: float = 10.0) -> float:
    """`total` of one selector on the server at `url`."""
    return total(read(url, timeout), selector)
