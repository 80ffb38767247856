"""Root conftest. It has no fixtures; it exists so pytest imports it as
`tests.conftest` and so puts the repository root on `sys.path` before collecting
anything (see tests/__init__.py)."""
