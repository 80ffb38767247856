"""Benchmarks (README.md). Run them from the repository root as modules,
`python -m benchmarks.<script>`, so they import the test fixtures as
`tests.v1...` like the harness does."""
