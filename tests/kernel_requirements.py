"""When tests of tpserve's CPU kernels may skip: only off x86-64 Linux, where the kernels are
optional. On x86-64 Linux (every developer machine and CI) a kernel that does not build fails
these tests instead of skipping them, so CI cannot go green without the kernels."""

from __future__ import annotations

import platform
import sys

import pytest

from workers.cpu import kernels

# The platforms tpserve ships its CPU kernels for.
REQUIRED = sys.platform == "linux" and platform.machine() == "x86_64"

# Loaded here, at collection: the kernel tests call torch.ops.tpserve_cpu directly.
LOADED = kernels.load()

requires_kernels = pytest.mark.skipif(not REQUIRED and not LOADED,
                                      reason="tpserve's CPU kernels are optional off x86-64 Linux and did not load")
