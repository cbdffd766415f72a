"""Scheduling: requests, the paged block manager with prefix caching, and the policy.

Pure Python (no torch, no ray): testable with hand-made model outputs in microseconds.
"""
