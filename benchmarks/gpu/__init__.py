"""The GPU benchmark script (``python -m benchmarks.gpu.run_gpu``): documented on the results page, never run in CI."""
