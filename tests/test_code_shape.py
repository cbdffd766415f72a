"""Shape rules of the code base, checked: no function longer than 60 lines in tpserve's packages
(a longer one does several things; split it so each part has a name).

Triton kernels (`@triton.jit`) are exempt: a kernel is one GPU program whose body is its tile
loop, and Triton inlines any helper back into it, so splitting one names nothing the reader
does not already see as the loop's steps."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("bench", "deployments", "workers", "scheduler", "metrics")
MAX_FUNCTION_LINES = 60


def _long_functions(source: str, name: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source, filename=name)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _is_triton_kernel(node):
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                found.append(f"{name}:{node.lineno} {node.name} ({lines} lines)")
    return found


def _is_triton_kernel(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return any(ast.unparse(d).startswith(("triton.jit", "triton.autotune")) for d in node.decorator_list)


def test_no_function_is_over_60_lines():
    long = [entry for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))
            for entry in _long_functions(path.read_text(), str(path.relative_to(ROOT)))]
    assert long == []


def test_the_check_sees_a_long_function():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    assert _long_functions(f"def f():\n{body}\n", "m.py") == [f"m.py:1 f ({MAX_FUNCTION_LINES + 1} lines)"]
    assert _long_functions("def g():\n    return 1\n", "m.py") == []
    assert _long_functions(f"@triton.jit\ndef k():\n{body}\n", "m.py") == []
