"""Honest checkpoints: atomic writes, one clear error for a bad file, settings checked on resume.

* :class:`AtomicCheckpointIO` writes each checkpoint to a temporary file beside the target and
  renames it into place, so a run killed mid-write leaves the previous checkpoint intact; stale
  temporary files of an interrupted write are settled when the next run starts. Beside each
  checkpoint it writes its content digest, ``<checkpoint>.sha256`` (:mod:`lppo.run.digests`).
* :func:`check_checkpoint` turns a missing, empty, corrupt, changed or foreign file into one
  :class:`CheckpointError` that names the file and what is wrong with it. Every load checks the
  file against its digest first (:func:`verify_digest`): one changed after lppo wrote it is
  refused. Every checkpoint is loaded weights-only (:func:`load_checkpoint`): a file holding
  any other pickled object is refused before that object is built, so a resume or an export
  never runs code from a file.
* :func:`run_settings` records the settings that shape training in every checkpoint;
  :func:`settings_changes` compares them on resume: the few that are well defined on a restored
  run are applied, any other difference stops the run with the list of differences.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import os
import pickle
import re
import shlex
import zipfile
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities import rank_zero_info

from lppo._moved import canonical_path
from lppo.errors import SetupError
from lppo.init_args import Record, check_resume_safe, class_path, record
from lppo.run.digests import (
    SUFFIX,
    HashingWriter,
    digest_path,
    file_sha256,
    read_digest,
    roll_forward_beside,
    temporary,
    write_digest_file,
)
from lppo.run.digests import TMP_MARK as TMP_MARK  # re-exported: its long-standing home

#: The system's components, each recorded under ``model.<name>`` with its class and settings.
COMPONENTS = ("actor", "critic", "task", "engine", "estimator", "reward_model")
#: The system's dataclass groups of settings, recorded as ``model.<group>.<field>``.
GROUPS = ("rollout", "ppo")
#: System arguments a resumed run may change freely: where rollouts are generated changes
#: timing, never rows.
FREE = ("runner",)
#: Entry of the recorded settings listing the keys a resumed run may change (not a setting).
RESUME_SAFE = "<resume_safe>"
#: Entry of the recorded settings: what the recorder knew to record (not a setting).
SETTINGS_VERSION = "<version>"
#: 0: no :data:`RESUME_SAFE` entry; 1: it, no version entry; 2: callable settings objects
#: (objectives, verifiers), factories given by ``class_path`` and ``trainer.precision`` too.
VERSION = 3
SETTINGS_KEY = "lppo_settings"
RUN_LOG_KEY = "lppo_run_log"
ROLLOUTS_KEY = "lppo_rollouts"
#: What every :class:`CheckpointError` about a file ends with.
HINT = "pass a checkpoint written by `lppo fit` (e.g. <run>/checkpoints/last.ckpt)."
#: How torch begins the message of a weights-only load that met a non-weights object.
WEIGHTS_ONLY_FAILED = "Weights only load failed"


class CheckpointError(SetupError):
    """A file passed as a checkpoint cannot be resumed from."""


class AtomicCheckpointIO(TorchCheckpointIO):
    """Checkpoints written atomically, each with its content digest beside it.

    ``torch.save`` goes to ``<target>.tmp-lppo-<pid>`` beside the target and is renamed into
    place; the digest (:mod:`lppo.run.digests`), computed on the way, goes to
    ``<target>.sha256`` the same way.
    """

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        """Write ``checkpoint`` to ``path`` and its digest beside it, neither half written.

        Order: checkpoint temporary (synced), digest temporary (synced), rename the
        checkpoint, rename the digest. A kill before the first rename keeps the previous pair;
        one between the renames leaves a digest temporary that matches the new checkpoint,
        which the next run rolls forward (:func:`~lppo.run.digests.remove_stale_temporaries`).
        """
        path = os.fspath(path)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        digest = digest_path(path)
        tmp, digest_tmp = temporary(path), temporary(digest)
        renamed = False
        try:
            with open(tmp, "wb") as f:
                writer = HashingWriter(f)
                torch.save(checkpoint, writer)
                f.flush()
                os.fsync(f.fileno())
            write_digest_file(digest_tmp, writer.hexdigest(), os.path.basename(path))
            os.replace(tmp, path)
            renamed = True
            os.replace(digest_tmp, digest)
        finally:
            _discard(tmp)
            if renamed and os.path.exists(digest_tmp):
                os.replace(digest_tmp, digest)  # the new checkpoint is in place: so is its digest
            _discard(digest_tmp)

    def remove_checkpoint(self, path: Any) -> None:
        """Remove the checkpoint ``path``, then its digest.

        In that order: a kill in between leaves a digest without a checkpoint (ignored), never
        a checkpoint without its digest (which a load would refuse).
        """
        super().remove_checkpoint(path)
        _discard(digest_path(os.fspath(path)))


def _discard(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)


def verify_digest(path: str) -> None:
    """Check the checkpoint ``path`` against the digest lppo wrote beside it.

    A digest temporary that a writer killed between its two renames left (see
    :class:`AtomicCheckpointIO`) and that matches the file is rolled forward first.

    Raises:
        CheckpointError: the digest file is missing, or records another digest than the
            file's content has (the file changed after lppo wrote it); the message names the
            file and the fix.
    """
    digest = digest_path(path)
    actual = file_sha256(path)
    recorded = read_digest(digest)
    if recorded == actual or roll_forward_beside(path, actual):
        return
    folder, name = os.path.split(os.path.abspath(path))
    if recorded is None:
        raise CheckpointError(
            f"checkpoint {path!r} has no digest file ({digest!r}): lppo writes one beside "
            "every checkpoint and checks it before loading. For a file you trust (written by "
            "an lppo from before digests, or copied without its digest), run "
            f"`sha256sum {shlex.quote(name)} > {shlex.quote(name + SUFFIX)}` in "
            f"{folder!r}, then load it again."
        )
    raise CheckpointError(
        f"checkpoint {path!r} changed after lppo wrote it: its SHA-256 is {actual[:16]}…, "
        f"its digest file {digest!r} records {recorded[:16] or '<nothing>'}…; it was not "
        "loaded. Restore the file, or resume from another checkpoint of "
        f"{folder!r} (e.g. an iteration-NNNN.ckpt: --ckpt_path <that file>)."
    )


def load_checkpoint(path: str) -> dict[str, Any]:
    """Load the Lightning checkpoint ``path`` weights-only (memory-mapped).

    Weights-only: tensors and plain values are read, any other pickled object is refused before
    it is built, so a file dropped into a run directory cannot run code through a resume or an
    export. lppo writes nothing else into its checkpoints.

    The file is checked against its digest first (:func:`verify_digest`).

    Raises:
        CheckpointError: the file is missing, empty, has no digest or changed after lppo wrote
            it, is not a torch checkpoint, holds non-weights content, or is not a Lightning
            checkpoint.
    """
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint {path!r} does not exist; {HINT}")
    if os.path.getsize(path) == 0:
        raise CheckpointError(f"checkpoint {path!r} is empty (0 bytes); {HINT}")
    verify_digest(path)  # before anything of the file is unpickled
    try:
        checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except pickle.UnpicklingError as err:
        if not str(err).startswith(WEIGHTS_ONLY_FAILED):
            raise _corrupt(path, err) from err
        found = re.search(r"GLOBAL (\S+)", str(err))
        what = f" (a pickled {found.group(1)})" if found else ""
        raise CheckpointError(
            f"checkpoint {path!r} holds non-weights content{what}: it was not loaded, since "
            "loading it could run code. lppo's checkpoints hold only tensors and plain values; "
            f"{HINT}"
        ) from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError) as err:
        raise _corrupt(path, err) from err
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise CheckpointError(f"{path!r} is not a Lightning checkpoint (no state_dict); {HINT}")
    return checkpoint


def _corrupt(path: str, err: BaseException) -> CheckpointError:
    return CheckpointError(
        f"checkpoint {path!r} is corrupt or not a torch file ({type(err).__name__}: "
        f"{str(err)[:200]}); {HINT}"
    )


def check_checkpoint(path: str) -> dict[str, Any]:
    """Load ``path`` (weights-only, :func:`load_checkpoint`) and check that it is lppo's.

    Raises:
        CheckpointError: the file cannot be loaded, or was not written by lppo.
    """
    checkpoint = load_checkpoint(path)
    if SETTINGS_KEY not in checkpoint:
        raise CheckpointError(f"{path!r} was not written by lppo (no {SETTINGS_KEY}); {HINT}")
    return checkpoint


def run_settings(system: Any, data: Any, trainer: Any = None) -> dict[str, Any]:
    """The settings of a run that shape its training, flat, as ``lppo fit`` keys.

    Each component's settings are its recorded init arguments (:mod:`lppo.init_args`); the
    system's own are its plain init arguments (``model.seed``, ``model.num_threads``, ...);
    the trainer's, its ``precision`` (the dtype of every model and stored column), its
    strategy, the strategy's layout and the world size (how the rows and the weights are
    split over the ranks: another split is another run).
    Under :data:`RESUME_SAFE` the result lists the keys the objects declare ``resume_safe``.
    """
    out: dict[str, Any] = {SETTINGS_VERSION: VERSION}
    if trainer is not None:
        out["trainer.precision"] = str(trainer.precision)
        out["trainer.strategy"] = class_path(type(trainer.strategy))
        layout = getattr(trainer.strategy, "layout", None)  # lppo's strategies have one
        out["trainer.strategy.layout"] = None if layout is None else class_path(type(layout))
        out["trainer.world_size"] = int(trainer.world_size)
    safe: set[str] = set()
    for name in COMPONENTS:
        obj = getattr(system, name, None)
        if obj is not None:
            _flatten(record(obj), f"model.{name}", out, safe)
    for group in GROUPS:
        _add(_fields(getattr(system, group)), "model", group, out, safe)
    _add(_fields(data.settings), "", "data", out, safe)
    own = record(system)  # the system's plain init arguments, its components recorded above
    settings = {k: v for k, v in own.settings.items() if k not in COMPONENTS + GROUPS + FREE}
    _add(dataclasses.replace(own, settings=settings), "", "model", out, safe)
    out[RESUME_SAFE] = sorted(safe)
    return out


def _fields(obj: Any) -> Record:
    """The :class:`Record` of a frozen settings dataclass (``model.ppo``, ``data``, ...)."""
    settings = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.init}
    return Record(class_path(type(obj)), settings, _declared(obj))


def _declared(obj: Any) -> tuple[str, ...]:
    return tuple(getattr(type(obj), "resume_safe", ()))


def _flatten(rec: Record, key: str, out: dict[str, Any], safe: set[str]) -> None:
    """Add ``key.class_path`` and ``key.init_args.<setting>`` (nested records recursively)."""
    out[f"{key}.class_path"] = rec.class_path
    _add(rec, key, "init_args", out, safe)


def _add(rec: Record, key: str, part: str, out: dict[str, Any], safe: set[str]) -> None:
    check_resume_safe(rec)
    prefix = f"{key}.{part}" if key else part
    for name, value in rec.settings.items():
        if isinstance(value, Record):
            _flatten(value, f"{prefix}.{name}", out, safe)
        else:
            out[f"{prefix}.{name}"] = value
    safe.update(f"{prefix}.{name}" for name in rec.resume_safe)


def settings_changes(saved: dict[str, Any], current: dict[str, Any]) -> tuple[list[str], list[str]]:
    """Split the differences into ``(applicable, refused)`` lines ``key: old -> new``.

    A difference is applicable when ``current`` lists its key under :data:`RESUME_SAFE` (what
    the components of the resuming run declare), refused otherwise; a key recorded on one
    side only is a difference (``<absent>``), unless the recorder of an older checkpoint
    (its :data:`SETTINGS_VERSION`) could not record it.
    """
    safe = set(current.get(RESUME_SAFE, ()))
    version = saved.get(SETTINGS_VERSION, 1 if RESUME_SAFE in saved else 0)
    applicable, refused = [], []
    for key in sorted((set(saved) | set(current)) - {RESUME_SAFE, SETTINGS_VERSION}):
        if _unrecorded(key, saved, version):
            continue
        old, new = _canonical(saved.get(key, "<absent>")), current.get(key, "<absent>")
        if old != new and not (isinstance(old, list) and list(old) == new):
            (applicable if key in safe else refused).append(f"{key}: {old!r} -> {new!r}")
    return applicable, refused


def _canonical(value: Any) -> Any:
    """A class path recorded before lppo's modules moved, at its new place (else ``value``)."""
    return canonical_path(value) if isinstance(value, str) else value


def _unrecorded(key: str, saved: dict[str, Any], version: int) -> bool:
    """Whether the recorder of ``saved`` (of ``version``) could not record ``key``.

    Such a key is not compared. Version 0 (settings read back by attribute name) wrote None
    for what it could not read (``*args`` / ``**kwargs``, an argument kept under another name,
    such as the copy task's ``alphabet_size``); version 1 left out callable settings objects,
    factories and ``trainer.precision``, version 2 the strategy, its layout and the world
    size: a key it lacks is skipped, unless it lacks the whole component (a critic or reward
    model added on resume is still refused).
    """
    if version == 0:
        return saved.get(key) is None
    if version >= VERSION or key in saved:
        return False
    parts = key.split(".")
    component = len(parts) > 2 and parts[0] == "model" and parts[1] in COMPONENTS
    return not component or f"model.{parts[1]}.class_path" in saved


def upgrade_layout(checkpoint: dict[str, Any]) -> None:
    """Bring a checkpoint written before the run log existed to today's layout, in place.

    Then the metrics axis and history were ``PPOMetricsLogger``'s callback state, each
    evaluation's history its ``Evaluation``'s, the failure count ``lppo_failed_iterations``,
    and the lifecycle callbacks' state ``lppo_builtin_callbacks``. Moved to the run log and to
    Lightning's callback states, a resumed run continues them instead of starting over.
    """
    if RUN_LOG_KEY in checkpoint:
        return
    callbacks = checkpoint.setdefault("callbacks", {})
    logger = callbacks.get("PPOMetricsLogger", {})
    evaluations = {
        ast.literal_eval(key[len("Evaluation") :])["prefix"]: state["history"]
        for key, state in callbacks.items()
        if key.startswith("Evaluation{") and state.get("history")
    }
    checkpoint[RUN_LOG_KEY] = {
        "step": logger.get("step", 0),
        "history": logger.get("history", []),
        "evaluations": evaluations,
        "failed": checkpoint.pop("lppo_failed_iterations", 0),
    }
    for name, state in checkpoint.pop("lppo_builtin_callbacks", {}).items():
        callbacks.setdefault(name, state)


def check_resume(saved: dict[str, Any], current: dict[str, Any], planned: list[str]) -> None:
    """Refuse a resume whose settings (or run plan, ``planned``) differ where it matters.

    Changes to resume-safe settings are applied and logged (:func:`settings_changes`).

    Raises:
        CheckpointError: listing every refused difference and the fix.
    """
    applicable, refused = settings_changes(saved, current)
    refused += planned
    if refused:
        raise CheckpointError(
            "resuming with settings that differ from the checkpoint's:\n  "
            + "\n  ".join(refused)
            + "\nThese cannot be applied to a restored run: restore them, or start a new "
            "run from the trained weights (lppo.run.export / HFExport)."
        )
    if applicable:
        rank_zero_info("resuming with changed settings (applied): " + "; ".join(applicable))


def scale_resumed_lrs(resumed: dict[Any, float]) -> None:
    """Give restored optimizers the learning rate a resume changed (schedules scaled alike).

    Args:
        resumed: each module (actor / critic) whose ``lr`` differs from the checkpoint's,
            with the checkpoint's ``lr``.
    """
    for module, old in resumed.items():
        ratio = module.lr / old
        assert module.optimizer is not None
        for group in module.optimizer.param_groups:
            group["lr"] *= ratio
            if "initial_lr" in group:
                group["initial_lr"] *= ratio
        if module.scheduler is not None:
            module.scheduler.base_lrs = [lr * ratio for lr in module.scheduler.base_lrs]
