"""Optional dependencies: importing one where it is used, and a typed error naming the extra that installs it.

``pip install distckpt`` saves, loads, reshards, reads Hugging Face and DCP directories and runs the CLI. The
extras (pyproject.toml, README "Install") add what only some users need: ``s3`` (boto3), and one per framework
integration (``lightning``, ``torchtitan``, ``torch-checkpointing``; ``integrations`` is all of them).
"""

from __future__ import annotations

import importlib
from types import ModuleType

from .errors import MissingDependencyError

__all__ = ["import_or_explain"]


def import_or_explain(module: str, feature: str, extra: str, package: str | None = None) -> ModuleType:
    """``importlib.import_module(module)``, or :class:`MissingDependencyError` naming ``extra`` (and ``package``,
    the one users know, by default the top of ``module``) when the package of ``module`` is not installed. A
    package that is installed but fails to import raises its own error: installing the extra would not help."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        top = module.partition(".")[0]
        if exc.name is not None and exc.name.partition(".")[0] == top:
            raise MissingDependencyError.naming(feature, package or top, extra) from None
        raise
