"""Benchmarks of tensorrt_llm_draftkv (run the modules with ``python -m benchmarks.<name>``)."""
