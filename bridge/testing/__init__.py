"""Test harness: a numpy reference trainer, its collectives and checks, scenarios, demo state.

Importable by tests, benchmarks and GPU scripts; never imported by product code.
"""
