"""The equivalence harness (`python -m tools.e2e`, see __main__.py): routed experts
under P/D and KV offload must equal colocated serving."""
