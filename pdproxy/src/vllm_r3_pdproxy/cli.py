"""The `vllm-r3-pdproxy` command line (also `python -m vllm_r3_pdproxy`).

Contract: `main(argv)` parses the flags, applies the allocator settings
(`memory.reuse_freed_memory`), and serves the proxy (`server.make_app`) until
interrupted; it returns the process exit code. Bad flags (a backend that is
not an http(s) URL, a port outside 1-65535, an unknown overlap policy or log
level) exit with status 2 and argparse's usage line naming the flag; an
address that cannot be bound exits with status 1 and says which.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import sys
from urllib.parse import urlsplit

from aiohttp import web

from vllm_r3_pdproxy.memory import reuse_freed_memory
from vllm_r3_pdproxy.merge import OVERLAP_POLICIES
from vllm_r3_pdproxy.server import DEFAULT_TIMEOUT_S, Backends, make_app

PROG = "vllm-r3-pdproxy"
DISTRIBUTION = "vllm-r3-pdproxy"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")

DESCRIPTION = """\
An OpenAI-compatible proxy in front of vLLM prefill and decode servers joined by
NixlConnector (1P1D or xPyD), for servers running the R3 fork with
--enable-return-routed-experts. Each request goes to the next prefill server
(max_tokens=1, asking for a remote decode), then to the next decode server with
the KV transfer parameters prefill returned. The routed-experts rows of both
halves are merged by position (each side's routed_experts_start), so the client
gets one row per token from routed_experts_prompt_start to P + C - 1, as a
colocated server returns them; any gap, overlap disagreement (see --overlap) or
coverage error fails the request with HTTP 502 instead of returning wrong rows.

Endpoints: POST /v1/completions, POST /v1/chat/completions, POST
/inference/v1/generate (servers started with --enable-scale-out), streamed or not
(each choice's final chunk gets its merged rows), and GET /health."""

EPILOG = f"""\
example:
  {PROG} --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000
  {PROG} --prefill http://10.0.0.1:8100 --prefill http://10.0.0.2:8100 \\
      --decode http://10.0.0.3:8200 --overlap prefill --host 0.0.0.0

The merge, its errors and the overlap policies: docs/pd-proxy.md of the fork."""


def backend_url(value: str) -> str:
    """An http(s) URL with a host, without a trailing slash."""
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not an http(s) URL with a host, e.g. http://127.0.0.1:8100")
    try:
        parts.port  # noqa: B018 (raises on a port that is not a number in range)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{value!r}: {exc}") from None
    if parts.path.rstrip("/") or parts.query or parts.fragment:
        raise argparse.ArgumentTypeError(
            f"{value!r} has a path; give the server's root URL, e.g. http://127.0.0.1:8100 "
            "(the proxy appends /v1/completions itself)")
    return value.rstrip("/")


def listen_port(value: str) -> int:
    try:
        port = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a port number") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port number in 1-65535")
    return port


def positive_seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of seconds") from None
    if not seconds > 0:
        raise argparse.ArgumentTypeError(f"{value} must be more than 0 seconds")
    return seconds


def version() -> str:
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Keep the description's and epilog's line breaks; wrap flag help as usual."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=_Formatter)
    parser.add_argument("--prefill", action="append", required=True, metavar="URL",
                        type=backend_url,
                        help="a prefill server (NixlConnector, kv_producer or kv_both); "
                             "repeat for several, used round robin (required)")
    parser.add_argument("--decode", action="append", required=True, metavar="URL",
                        type=backend_url,
                        help="a decode server (NixlConnector, kv_consumer or kv_both); "
                             "repeat for several, used round robin (required)")
    parser.add_argument("--overlap", choices=OVERLAP_POLICIES, default="error",
                        help="when prefill's and decode's rows differ at a position both "
                             "computed (normally P - 1): error = fail the request with HTTP "
                             "502; prefill = keep prefill's row, as colocated serving "
                             "returns it; decode = keep decode's row, the routing that "
                             "produced the first completion token (default: %(default)s)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on; 0.0.0.0 for every interface "
                             "(default: %(default)s)")
    parser.add_argument("--port", type=listen_port, default=8000,
                        help="port to listen on (default: %(default)s)")
    parser.add_argument("--timeout", type=positive_seconds, default=DEFAULT_TIMEOUT_S,
                        metavar="SECONDS",
                        help="limit for each backend request, prefill or decode "
                             "(default: %(default)s)")
    parser.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS, default="INFO",
                        help="log level (default: %(default)s)")
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level,
                        format="%(asctime)s pdproxy %(levelname)s %(message)s")
    reused = reuse_freed_memory()
    backends = Backends(args.prefill, args.decode)
    logging.getLogger("pdproxy").info(
        "prefill %s, decode %s, overlap policy %s, backend timeout %.0f s, listening on "
        "%s:%d, allocator: %s", backends.prefill, backends.decode, args.overlap, args.timeout,
        args.host, args.port,
        "freed memory kept for reuse" if reused else "default (not glibc)")
    try:
        web.run_app(make_app(backends, args.overlap, args.timeout), host=args.host,
                    port=args.port, print=None)
    except OSError as exc:
        print(f"{PROG}: error: cannot listen on {args.host}:{args.port}: "
              f"{exc.strerror or exc}", file=sys.stderr)
        return 1
    return 0
