"""Importing an optional framework for an integration, with an error that names the extra.

    lightning = require("lightning", extra="lightning", integration="ckpt.integrations.lightning")

Each ``ckpt.integrations.<framework>`` module imports its framework at import time (its classes
subclass the framework's), and only when it is imported itself: ``import ckpt`` never imports any
framework. When the framework is missing, the ImportError says which extra installs it.
"""

from __future__ import annotations

import importlib
from types import ModuleType


def require(module: str, *, extra: str, integration: str, package: str | None = None) -> ModuleType:
    """Import ``module`` or raise an ImportError naming ``pip install 'ckpt-engine[<extra>]'``."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"{integration} needs {package or module.split('.')[0]}, which is not installed: "
            f"pip install 'ckpt-engine[{extra}]' (or the package itself)"
        ) from exc
