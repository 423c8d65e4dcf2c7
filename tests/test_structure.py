"""The layering of the package, read from the source: ``service -> engine -> models ->
kernels`` (a lower layer never imports an upper one, lazily or not) and no import cycle
between modules."""
import ast
import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("kernels", "models", "engine", "service")  # lowest first


def _modules() -> dict[str, Path]:
    return {f"{layer}.{p.stem}": p for layer in LAYERS for p in sorted((ROOT / layer).glob("*.py"))
            if p.stem != "__init__"}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules ``name`` imports anywhere in its file (function-level imports too)."""
    layer = name.split(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:
                base = [layer] + ([node.module] if node.module else [])
            elif node.level == 2:
                base = node.module.split(".") if node.module else []
            elif node.module and node.module.startswith("woq."):
                base = node.module.split(".")[1:]
            else:
                continue
            for alias in node.names:
                for cand in (".".join(base + [alias.name]), ".".join(base)):
                    if cand in known:
                        out.add(cand)
                        break
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "woq" and ".".join(parts[1:3]) in known:
                    out.add(".".join(parts[1:3]))
    return out - {name}


def test_lower_layers_never_import_upper_ones():
    mods = _modules()
    graph = {m: _imports(m, p, set(mods)) for m, p in mods.items()}
    wrong = [(m, d) for m, deps in graph.items() for d in deps
             if LAYERS.index(d.split(".")[0]) > LAYERS.index(m.split(".")[0])]
    assert not wrong, wrong


def test_no_import_cycles():
    mods = _modules()
    graph = {m: _imports(m, p, set(mods)) for m, p in mods.items()}
    assert len(graph) > 30 and sum(len(d) for d in graph.values()) > 40  # (the parser sees the imports)
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph[m]):
            assert state.get(d) != 1, " -> ".join(path + [m, d])
            if d not in state:
                visit(d, path + [m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])


@pytest.mark.parametrize("cwd", ["", "benchmarks"])
def test_python_run_in_the_repository_imports_the_installed_kernels_package(cwd):
    """``python -c``/``-m`` put the working directory first on sys.path; from the root, the
    top-level kernels/ directory (woq.kernels) must not stand in for Hugging Face's ``kernels``,
    which transformers imports while it loads (a dependency of transformers since 5.25), nor
    may a benchmark module of that name from benchmarks/."""
    try:
        expected = str(importlib.metadata.distribution("kernels").locate_file("kernels/__init__.py"))
    except importlib.metadata.PackageNotFoundError:
        expected = None  # (older transformers: none installed; the import must still succeed)
    code = ("import kernels, transformers.activations, woq.kernels.ops as ops; "
            "print(kernels.__file__); print(ops.__file__)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT / cwd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    kernels_file, ops_file = out.stdout.split()
    assert Path(ops_file) == ROOT / "kernels" / "ops.py"
    if expected is not None:
        assert Path(kernels_file).resolve() == Path(expected).resolve()
