"""The fork's tests, laid out like vLLM's `tests/` (a package, as vLLM's is).

Helpers are imported by package path, e.g. `from tests.v1.tiny_moe import build`.
Being a package makes pytest put the repository root (this directory's parent) on
`sys.path` when it imports `tests/conftest.py`, so those imports resolve under
`pytest` and `python -m pytest` alike; the harness and the demo
(`python -m tools.e2e`, `python -m tools.demo`) run from the repository root and
import the same helpers.
"""
