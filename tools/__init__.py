"""Repository tooling: the equivalence harness (`tools.e2e`) and the demo (`tools.demo`).

Run them as modules from the repository root (`python -m tools.e2e`,
`python -m tools.demo`; the Makefile does), so `tools` and `tests` resolve as
packages of this checkout without touching `sys.path`. They use the installed fork
(`vllm`), the installed proxy (`vllm-r3-pdproxy`, from pdproxy/) and the test
fixtures under `tests/v1/` (the tiny model builder, the CPU server runner).
"""
