"""griffe extension: ``lppo.callbacks`` lives in ``callbacks/`` (pyproject's ``package-dir``).

griffe finds ``lppo``'s submodules by walking ``lppo/``, where ``callbacks`` is not, so this
extension loads ``callbacks/`` and attaches it to the ``lppo`` package as ``lppo.callbacks``,
as the installed package has it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import griffe

ROOT = Path(__file__).resolve().parents[2]


class CallbacksPackage(griffe.Extension):
    """Attach ``callbacks/`` to the loaded ``lppo`` package as its ``callbacks`` member."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        """Load ``callbacks/`` with ``loader`` once ``lppo`` is loaded and attach it.

        Args:
            pkg: the package griffe just loaded.
            loader: the loader that loaded it (its collection resolves the aliases).
            **kwargs: griffe's other arguments (unused).
        """
        if pkg.name != "lppo" or "callbacks" in pkg.members:
            return
        module = loader.load("callbacks", try_relative_path=False, find_stubs_package=False)
        loader.modules_collection.del_member("callbacks")
        pkg.set_member("callbacks", module)
