"""A package face that imports its heavy names on first use (PEP 562 ``__getattr__``).

    __getattr__, __dir__ = lazy_names(__name__, {"Reader": ".storage_reader", ...})

The face keeps the same names: ``package.Reader`` and ``from package import Reader`` import
``.storage_reader`` the first time and bind the name; any other public name is tried as a submodule
(``import ckpt; ckpt.root.open_root(...)`` works as when the face imported everything). What stays
out of start-up is torch.distributed.checkpoint, DTensor and the planners (~1.3 s of CPU), which a
reader of manifests (``ckpt-inspect``) never needs; tests/test_import_cost.py keeps them out. A face
lists the same imports under ``if TYPE_CHECKING:`` for type checkers and the import-graph tests.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable


def lazy_names(package: str, names: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for the face of ``package``; ``names`` maps a name to the module,
    relative to ``package``, that defines it."""
    namespace = sys.modules[package].__dict__

    def attribute(name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        if name in names:
            value = getattr(importlib.import_module(names[name], package), name)
        else:
            try:
                value = importlib.import_module(f".{name}", package)
            except ModuleNotFoundError as exc:
                if exc.name != f"{package}.{name}":
                    raise
                raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        namespace[name] = value
        return value

    def listing() -> list[str]:
        return sorted(set(namespace) | set(names))

    return attribute, listing
