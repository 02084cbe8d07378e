"""Benchmarks: workloads, throughput runs and side-by-side comparisons."""
