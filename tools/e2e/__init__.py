"""The equivalence harness: routed experts under P/D and KV offload must equal
colocated serving. `harness.py` runs the scenarios and judges them; `__main__.py` is
its command line (`python -m tools.e2e`)."""
