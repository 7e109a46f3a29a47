"""Benchmarks: run with `bash bench/run.sh` (see README)."""
