"""Room sizes, read with ast: the largest functions, every class over the limit, and the
largest modules. The house's limits (shared/STYLE.md) are 400 lines a class and 60 a
function; this prints what stands over them so a change can show before and after.

Usage: python scripts/sizes.py [ROOT ...] [--top N] [--json]
"""

from __future__ import annotations

import argparse
import ast
import json
from pathlib import Path

CLASS_LIMIT = 400
FUNCTION_LIMIT = 60


def _spans(path: Path) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """(lines, qualified name) of every function and every class in one file."""
    tree = ast.parse(path.read_text())
    functions: list[tuple[int, str]] = []
    classes: list[tuple[int, str]] = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = f"{prefix}{child.name}"
                size = (child.end_lineno or child.lineno) - child.lineno + 1
                bucket = classes if isinstance(child, ast.ClassDef) else functions
                bucket.append((size, f"{path}:{child.lineno} {name}"))
                walk(child, f"{name}.")
            else:
                walk(child, prefix)

    walk(tree, "")
    return functions, classes


def measure(roots: list[str], top: int) -> dict[str, object]:
    """The figures for every .py file under ``roots`` (generated code left out)."""
    files = sorted(
        p for r in roots for p in Path(r).rglob("*.py") if "_proto" not in p.parts
    )
    functions: list[tuple[int, str]] = []
    classes: list[tuple[int, str]] = []
    modules: list[tuple[int, str]] = []
    for f in files:
        fn, cl = _spans(f)
        functions += fn
        classes += cl
        modules.append((len(f.read_text().splitlines()), str(f)))
    return {
        "lines": sum(n for n, _ in modules),
        "largest_functions": sorted(functions, reverse=True)[:top],
        "functions_over_limit": sum(1 for n, _ in functions if n > FUNCTION_LIMIT),
        "classes_over_limit": sorted(c for c in classes if c[0] > CLASS_LIMIT)[::-1],
        "largest_modules": sorted(modules, reverse=True)[:top],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("roots", nargs="*", default=["kvstore", "engine"])
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    figures = measure(args.roots, args.top)
    if args.json:
        print(json.dumps(figures, indent=1))
        return
    print(f"lines: {figures['lines']}")
    print(f"functions over {FUNCTION_LIMIT} lines: {figures['functions_over_limit']}")
    for title in ("largest_functions", "classes_over_limit", "largest_modules"):
        print(f"{title.replace('_', ' ')}:")
        for n, where in figures[title]:  # type: ignore[attr-defined]
            print(f"  {n:5d}  {where}")


if __name__ == "__main__":
    main()
