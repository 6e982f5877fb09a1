"""Lazy package namespaces (PEP 562): a package lists its public names and the submodule each comes
from, and a name's submodule is imported on first use. ``import lp_decentral_nlp`` and the command
lines' flag check then import neither torch nor transformers (docs/design.md, "Lazy imports")."""
from __future__ import annotations

import importlib
import types


def lazy_namespace(package: str, exports: dict[str, str], subpackages=()):
    """``(__getattr__, __dir__)`` for package ``package`` (its ``__name__``).

    Args:
        exports: public name -> the submodule (relative, e.g. ``".surgery"``) that defines it.
        subpackages: submodules reachable as attributes (``lp_decentral_nlp.gossip``) before
            anything imported them.

    The name is imported from its submodule on first access and then cached in the package's
    namespace; any other name is an AttributeError, as for a module without laziness. ``dir()``
    lists the public names, the subpackages, the dunders and what the package itself defines, not
    what its ``__init__`` imported to work (``sys``, ``lazy_namespace``, ``Path``).
    """
    namespace = importlib.import_module(package).__dict__

    def __getattr__(name: str):
        if name in exports:
            value = getattr(importlib.import_module(exports[name], package), name)
        elif name in subpackages:
            value = importlib.import_module(f".{name}", package)
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        namespace[name] = value
        return value

    def own(name: str, value) -> bool:
        return name.startswith("__") or (not name.startswith("_") and not isinstance(value, types.ModuleType)
                                         and getattr(value, "__module__", None) == package)

    def __dir__():
        return sorted({*(name for name, value in namespace.items() if own(name, value)), *exports, *subpackages})

    return __getattr__, __dir__
