"""Metrics: request events, interval rules, per-step stats and exporters.

This package imports none of tpserve's other packages (see ARCHITECTURE.md): it is pure
data, interval math and exporters.
"""
