"""Benchmarks behind ``python -m course_utils bench ...``; results go to benchmarks/RESULTS.md."""
