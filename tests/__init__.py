"""The fork's tests, laid out like vLLM's `tests/` (a package, as vLLM's is).

Helpers are imported by package path: test-only ones from `tests.` (e.g.
`tests.rows_spec`), the CPU testbed from `tools.testbed` (e.g.
`from tools.testbed.tiny_moe import build`). Being a package makes pytest put the
repository root (this directory's parent) on `sys.path` when it imports
`tests/conftest.py`, so both resolve under `pytest` and `python -m pytest` alike.
Nothing outside `tests/` imports from it.
"""
