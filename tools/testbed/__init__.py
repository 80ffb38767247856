"""What a CPU deployment of the fork needs, for tests, the harness, the demo and the
benchmarks alike: a tiny random-weight Qwen3-MoE (`tiny_moe`) and a `vllm serve`
runner with the CPU environment it needs (`cpu_server`), and the deprecated aliases
of renamed command-line names (`aliases`). It imports nothing else of the repository
(tests/test_tools_importable.py checks)."""
