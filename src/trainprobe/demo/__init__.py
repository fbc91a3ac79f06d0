"""A small GPT-style model and a synthetic training loop, used by ``trainprobe demo`` and the benchmarks."""
