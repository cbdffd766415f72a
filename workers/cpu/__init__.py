"""The CPU backend: the C++ kernels (csrc/) and their loader, the linear-kernel dispatch and huge-page memory."""
