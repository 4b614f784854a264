"""Honest checkpoints: atomic writes, one clear error for a bad file, settings checked on resume.

* :class:`AtomicCheckpointIO` writes each checkpoint to a temporary file beside the target and
  renames it into place, so a run killed mid-write leaves the previous checkpoint intact; stale
  temporary files of an interrupted write are removed when the next run starts.
* :func:`check_checkpoint` turns a missing, empty, corrupt or foreign file into one
  :class:`CheckpointError` that names the file and what is wrong with it.
* :func:`run_settings` records the settings that shape training in every checkpoint;
  :func:`settings_changes` compares them on resume: the few that are well defined on a restored
  run are applied, any other difference stops the run with the list of differences.
"""

from __future__ import annotations

import glob
import inspect
import os
import pickle
import zipfile
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

#: Settings a resumed run may change; each is applied to the restored state.
APPLICABLE = (
    "model.actor.init_args.lr",
    "model.critic.init_args.lr",
    "model.actor.init_args.rollback_non_finite",
    "model.critic.init_args.rollback_non_finite",
    "model.num_threads",
    "model.ppo.max_consecutive_skipped_steps",
    "model.ppo.max_skipped_steps",
    "model.ppo.max_failed_iterations",
    "model.ppo.transactional",
    "model.engine.init_args.batch_size",
)
#: Init arguments whose attribute of the same name holds runtime state (an optimizer object).
RUNTIME_NAMES = ("optimizer", "lr_scheduler")
TMP_MARK = ".tmp-lppo-"
SETTINGS_KEY = "lppo_settings"


class CheckpointError(ValueError):
    """A file passed as a checkpoint cannot be resumed from."""


class AtomicCheckpointIO(TorchCheckpointIO):
    """``torch.save`` to ``<target>.tmp-lppo-<pid>`` beside the target, then an atomic rename."""

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        """Write ``checkpoint`` to ``path`` so that ``path`` is never half written."""
        path = os.fspath(path)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        tmp = f"{path}{TMP_MARK}{os.getpid()}"
        try:
            with open(tmp, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)


def remove_stale_temporaries(directory: str | None) -> list[str]:
    """Delete temporary files an interrupted checkpoint write left in ``directory``."""
    if not directory or not os.path.isdir(directory):
        return []
    stale = glob.glob(os.path.join(glob.escape(directory), f"*{TMP_MARK}*"))
    for path in stale:
        os.remove(path)
    return stale


def check_checkpoint(path: str) -> dict[str, Any]:
    """Load ``path`` (memory-mapped) and check that it is an lppo checkpoint.

    Raises:
        CheckpointError: the file is missing, empty, not a torch checkpoint, or not lppo's.
    """
    hint = "pass a checkpoint written by `lppo fit` (e.g. <run>/checkpoints/last.ckpt)."
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint {path!r} does not exist; {hint}")
    if os.path.getsize(path) == 0:
        raise CheckpointError(f"checkpoint {path!r} is empty (0 bytes); {hint}")
    try:
        checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    except (RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, OSError) as err:
        raise CheckpointError(
            f"checkpoint {path!r} is corrupt or not a torch file ({type(err).__name__}: "
            f"{str(err)[:200]}); {hint}"
        ) from err
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise CheckpointError(f"{path!r} is not a Lightning checkpoint (no state_dict); {hint}")
    if SETTINGS_KEY not in checkpoint:
        raise CheckpointError(f"{path!r} was not written by lppo (no {SETTINGS_KEY}); {hint}")
    return checkpoint


def _plain(value: Any) -> bool:
    return value is None or isinstance(value, bool | int | float | str)


def object_settings(obj: Any, key: str) -> dict[str, Any]:
    """``{key.init_args.name: value}`` for ``obj``'s plain init arguments (and its class)."""
    out: dict[str, Any] = {f"{key}.class_path": f"{type(obj).__module__}.{type(obj).__qualname__}"}
    names: list[str] = []
    for klass in type(obj).__mro__:
        init = klass.__dict__.get("__init__")
        if init is not None and hasattr(init, "__code__"):
            names += [n for n in inspect.signature(init).parameters if n != "self"]
    for name in dict.fromkeys(names):
        if name in RUNTIME_NAMES:
            continue
        value = getattr(obj, name, None)
        if isinstance(value, tuple | list) and all(_plain(v) for v in value):
            value = list(value)
        elif not _plain(value):
            spec = getattr(obj, "spec", None) if name in ("model", "backbone") else None
            if spec is not None:
                out.update(object_settings(spec, f"{key}.init_args.{name}"))
            continue
        out[f"{key}.init_args.{name}"] = value
    return out


def run_settings(system: Any, data: Any) -> dict[str, Any]:
    """The settings of a run that shape its training, flat, as ``lppo fit`` keys."""
    out: dict[str, Any] = {}
    for name in ("actor", "critic", "task", "engine", "estimator", "reward_model"):
        obj = getattr(system, name, None)
        if obj is not None:
            out.update(object_settings(obj, f"model.{name}"))
    for group in ("rollout", "ppo"):
        for field, value in vars(getattr(system, group)).items():
            out[f"model.{group}.{field}"] = value
    out["model.seed"] = system.seed
    out["model.num_threads"] = system.num_threads
    for name in ("max_tokens_per_chunk", "drop_budget", "fixed_rows_per_rank", "shuffle", "seed"):
        out[f"data.{name}"] = getattr(data, name, None)
    return out


def settings_changes(saved: dict[str, Any], current: dict[str, Any]) -> tuple[list[str], list[str]]:
    """Split the differences into ``(applicable, refused)`` lines ``key: old -> new``."""
    applicable, refused = [], []
    for key in sorted(set(saved) | set(current)):
        old, new = saved.get(key, "<absent>"), current.get(key, "<absent>")
        if old != new and not (isinstance(old, list) and list(old) == new):
            (applicable if key in APPLICABLE else refused).append(f"{key}: {old!r} -> {new!r}")
    return applicable, refused
