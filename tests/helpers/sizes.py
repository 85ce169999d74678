"""Size limits of srt's Python code (STYLE.md: split a module past ~400 lines and a function past
~60), read with ``ast`` (nothing is imported). Run ``python -m tests.helpers.sizes [dir]`` (default
``srt``): it prints every module and function over its limit and exits 1 when there is one.
``make lint`` runs it. A function's length counts its decorators, docstring and nested functions.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60


def oversized(root: Path) -> list[str]:
    """``path: N lines`` for each module and ``path:line name: N lines`` for each function over
    its limit, below ``root``, longest first."""
    found: list[tuple[int, str]] = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        lines = len(text.splitlines())
        if lines > MAX_MODULE_LINES:
            found.append((lines, f"{path}: {lines} lines (module limit {MAX_MODULE_LINES})"))
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                n = node.end_lineno - start + 1
                if n > MAX_FUNCTION_LINES:
                    found.append(
                        (
                            n,
                            f"{path}:{node.lineno} {node.name}: {n} lines (function limit {MAX_FUNCTION_LINES})",
                        )
                    )
    return [msg for _, msg in sorted(found, key=lambda f: -f[0])]


def main(argv: list[str]) -> int:
    problems = oversized(Path(argv[1] if len(argv) > 1 else "srt"))
    for p in problems:
        print(p)
    if not problems:
        print(f"no module over {MAX_MODULE_LINES} lines and no function over {MAX_FUNCTION_LINES}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
