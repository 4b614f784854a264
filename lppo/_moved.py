"""Import paths of modules that moved when ``lppo/`` was grouped by concern (0.2).

``class_path: lppo.models.HFCausalLM`` in a user's config, ``import lppo.data`` in a user's
script and class paths recorded in checkpoints keep working: :class:`MovedModules` (installed
by ``lppo/__init__.py``) answers an old module name with the module at its new place, the same
module object, so patching or pickling through either name is the same. lppo itself, its
configs and its docs use the new paths.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from importlib.machinery import ModuleSpec
from types import CodeType, ModuleType

__all__ = ["MOVED", "MovedModules", "canonical_path", "install"]

#: Old module name → its module now.
MOVED: dict[str, str] = {
    "lppo.controller": "lppo.iteration.controller",
    "lppo.score_phase": "lppo.iteration.score_phase",
    "lppo.critic_targets": "lppo.iteration.critic_targets",
    "lppo.old_logprobs": "lppo.iteration.old_logprobs",
    "lppo.planner": "lppo.iteration.planner",
    "lppo.chunks": "lppo.iteration.chunks",
    "lppo.balance": "lppo.iteration.balance",
    "lppo.mismatch": "lppo.iteration.mismatch",
    "lppo.data": "lppo.iteration.data",
    "lppo.data_settings": "lppo.iteration.data_settings",
    "lppo.failure_policy": "lppo.iteration.failure_policy",
    "lppo.hooks": "lppo.iteration.hooks",
    "lppo.system": "lppo.run.system",
    "lppo.run_plan": "lppo.run.plan",
    "lppo.trainer": "lppo.run.trainer",
    "lppo.cli": "lppo.run.cli",
    "lppo.cli_parser": "lppo.run.cli_parser",
    "lppo.cli_loggers": "lppo.run.cli_loggers",
    "lppo.run_directory": "lppo.run.directory",
    "lppo.checkpointing": "lppo.run.checkpointing",
    "lppo.interrupts": "lppo.run.interrupts",
    "lppo.run_log": "lppo.run.log",
    "lppo.export": "lppo.run.export",
    "lppo.strategy": "lppo.runtime.strategy",
    "lppo.ray_runtime": "lppo.runtime.ray_runtime",
    "lppo._ray_reaper": "lppo.runtime._ray_reaper",
    "lppo.lifetimes": "lppo.runtime.lifetimes",
    "lppo.models": "lppo.modules.models",
    "lppo.tokenizer": "lppo.modules.tokenizer",
    "lppo.tail": "lppo.modules.tail",
    "lppo.rollout.hf_attention": "lppo.rollout.hf.attention",
    "lppo.rollout.hf_prefill": "lppo.rollout.hf.prefill",
    "lppo.rollout.hf_sampler": "lppo.rollout.hf.sampler",
    "lppo.rollout.hf_samples": "lppo.rollout.hf.samples",
    "lppo.rollout.hf_turns": "lppo.rollout.hf.turns",
    "lppo.rollout._ray_worker": "lppo.rollout.ray_workers.worker",
}


def canonical_path(path: str) -> str:
    """``path`` (a module or ``module.Name``) with a moved module's old name replaced."""
    for old in sorted(MOVED, key=len, reverse=True):
        if path == old or path.startswith(old + "."):
            return MOVED[old] + path[len(old) :]
    return path


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.InspectLoader):
    """Answers an old module name with the moved module (the same object).

    ``python -m <old name>`` (``python -m lppo.export CKPT DIR``) runs the moved module's
    code as ``__main__`` (:meth:`get_code`).
    """

    def __init__(self) -> None:
        self._specs: dict[str, ModuleSpec | None] = {}  # each moved module's own spec

    def find_spec(
        self, fullname: str, path: object = None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        """A spec loading the moved module under ``fullname`` (``None``: not a moved name)."""
        if fullname not in MOVED:
            return None
        # The moved file as origin: ``python -m <old name>`` gets it as __file__ / argv[0].
        moved = importlib.util.find_spec(MOVED[fullname])
        origin = moved.origin if moved is not None else None
        return importlib.util.spec_from_loader(fullname, self, origin=origin)

    def create_module(self, spec: ModuleSpec) -> ModuleType:
        """The module at its new place, imported (and kept with its own spec)."""
        module = importlib.import_module(MOVED[spec.name])
        self._specs[spec.name] = module.__spec__
        return module

    def get_code(self, fullname: str) -> CodeType | None:
        """The moved module's code (what ``runpy`` runs for ``python -m`` with the old name)."""
        loader = _inspect_loader(MOVED[fullname])
        return loader.get_code(MOVED[fullname]) if loader is not None else None

    def is_package(self, fullname: str) -> bool:
        """No: every moved name is a module."""
        return False

    def get_source(self, fullname: str) -> str | None:
        """The moved module's source (for tracebacks of ``python -m`` with the old name)."""
        loader = _inspect_loader(MOVED[fullname])
        return loader.get_source(MOVED[fullname]) if loader is not None else None

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module ran at its new place; give it back its own spec."""
        own = self._specs.get(module.__spec__.name) if module.__spec__ else None
        if own is not None:
            module.__spec__ = own
            module.__loader__ = own.loader


def _inspect_loader(name: str) -> importlib.abc.InspectLoader | None:
    """The loader of module ``name`` when it can give code and source (a file's loader)."""
    spec = importlib.util.find_spec(name)
    loader = spec.loader if spec is not None else None
    return loader if isinstance(loader, importlib.abc.InspectLoader) else None


def install() -> None:
    """Put :class:`MovedModules` on ``sys.meta_path`` once (after the regular finders)."""
    if not any(isinstance(f, MovedModules) for f in sys.meta_path):
        sys.meta_path.append(MovedModules())
