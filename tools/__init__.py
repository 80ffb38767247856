"""Repository tooling, imported as the package `tools` from the repository root.

- `tools.fork`, `tools.forkbuild`: build the fork wheel and work on the patch series;
- `tools.testbed`: what a CPU deployment of the fork needs (the tiny random MoE, the
  `vllm serve` runner); tests, tools and benchmarks import it, never the reverse;
- `tools.e2e`: the equivalence harness; `tools.demo`: `make demo`.

Run them as modules from the repository root (`python -m tools.fork ...`,
`python -m tools.e2e`, `python -m tools.demo`; the Makefile does). Nothing under
`tools/` imports from `tests/`.
"""
