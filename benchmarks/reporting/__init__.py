"""The sections of benchmarks/RESULTS.md, one module each; benchmarks/report.py puts them together."""
