"""The quantized-linear kernels: CUDA sources (csrc/), their bindings, plans and dispatch.

This directory installs as ``woq.kernels``. Python run from the repository's root (``python -m
pytest``, ``python -m woq``, ``python -c``) puts the root first on ``sys.path``, where this
directory also answers ``import kernels``: the name of Hugging Face's kernels package, which
transformers imports (and requires since 5.25). Imported under that name, this module loads
the installed package from the rest of ``sys.path`` in its place; with none installed it
stays an empty module, which transformers reads as "not installed".
"""
import importlib.machinery
import importlib.util
import os
import sys


def _load_the_installed_package() -> None:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    elsewhere = [p for p in sys.path if os.path.abspath(p or os.curdir) != root]
    spec = importlib.machinery.PathFinder.find_spec("kernels", elsewhere)
    if spec is not None and spec.loader is not None:
        installed = importlib.util.module_from_spec(spec)
        # The import statement returns what sys.modules holds once this module has run.
        sys.modules["kernels"] = installed
        spec.loader.exec_module(installed)


if __name__ == "kernels":
    _load_the_installed_package()
