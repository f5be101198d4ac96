"""The runtime comparison across frameworks (run_benchmark.py) and the tools beside it."""
