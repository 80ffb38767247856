"""P/D proxy with routed-experts merge.

    python tools/pdproxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 \\
        [--prefill URL ...] [--decode URL ...] [--host 127.0.0.1] [--port 8000]

Serves /v1/completions, /v1/chat/completions and /health. Each request goes to
the next prefill and decode server in turn; routed experts from both are merged
by position (docs/pd-proxy.md).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from aiohttp import web  # noqa: E402

from memory import reuse_freed_memory  # noqa: E402
from merge import OVERLAP_POLICIES  # noqa: E402
from server import Backends, make_app  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdproxy", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefill", action="append", required=True, metavar="URL",
                        help="a prefill server (NixlConnector); repeat for several")
    parser.add_argument("--decode", action="append", required=True, metavar="URL",
                        help="a decode server (NixlConnector); repeat for several")
    parser.add_argument("--overlap", choices=OVERLAP_POLICIES, default="error",
                        help="when prefill and decode rows differ at a position both computed "
                             "(normally P - 1): error = fail the request (default); prefill = "
                             "keep prefill's row, as colocated serving returns it; decode = keep "
                             "decode's row, the routing that produced the first completion token")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s pdproxy %(levelname)s %(message)s")
    reused = reuse_freed_memory()
    backends = Backends([u.rstrip("/") for u in args.prefill], [u.rstrip("/") for u in args.decode])
    logging.getLogger("pdproxy").info(
        "prefill %s, decode %s, overlap policy %s, listening on %s:%d, allocator: %s",
        backends.prefill, backends.decode, args.overlap, args.host, args.port,
        "freed memory kept for reuse" if reused else "default (not glibc)")
    web.run_app(make_app(backends, args.overlap), host=args.host, port=args.port, print=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
