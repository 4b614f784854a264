"""Export a trained policy (and critic) as Hugging Face directories, loadable offline.

Layout written by :func:`export_system` and :func:`export_from_checkpoint` (and by the
:class:`~lppo.callbacks.HFExport` callback)::

    <directory>/policy/   config.json, model.safetensors, generation_config.json, tokenizer files
    <directory>/critic/   config.json, model.safetensors (the backbone), value_head.safetensors,
                          lppo_critic.json

``transformers.AutoModelForCausalLM.from_pretrained("<directory>/policy")`` and
``AutoTokenizer.from_pretrained("<directory>/policy")`` load the policy (with
``local_files_only=True`` nothing is downloaded); :func:`load_critic` rebuilds an lppo
:class:`~lppo.modules.CriticModule` giving the same values. The policy's
``generation_config.json`` carries the rollout's sampling settings (``model.rollout``).

Command line: ``python -m lppo.run.export CKPT DIR [--no-critic]``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import transformers
from safetensors.torch import load_file, save_file

from lppo.modules.critic import CriticModule
from lppo.modules.lora import is_adapted
from lppo.run.checkpointing import load_checkpoint

if TYPE_CHECKING:
    from lppo.run.system import PPOSystem

__all__ = [
    "CRITIC_DIR",
    "POLICY_DIR",
    "VALUE_HEAD_FILE",
    "export_critic",
    "export_from_checkpoint",
    "export_policy",
    "export_system",
    "load_critic",
]

#: Sub-directory of the policy in an export.
POLICY_DIR = "policy"
#: Sub-directory of the critic in an export.
CRITIC_DIR = "critic"
#: Value-head weights inside a critic directory.
VALUE_HEAD_FILE = "value_head.safetensors"
#: lppo metadata inside a critic directory (critic and backbone class names).
CRITIC_META_FILE = "lppo_critic.json"


def _not_built(what: str) -> RuntimeError:
    return RuntimeError(
        f"cannot export: the {what} is not built yet. Call system.configure_model() (fit or "
        "PPOSystem.load_from_checkpoint do it) before exporting."
    )


def _pretrained(model: Any, what: str) -> transformers.PreTrainedModel:
    if not isinstance(model, transformers.PreTrainedModel):
        raise TypeError(
            f"cannot export the {what}: {type(model).__name__} is not a Hugging Face "
            "PreTrainedModel (it has no save_pretrained)."
        )
    return model


def _generation_config(
    system: Any, model: transformers.PreTrainedModel
) -> transformers.GenerationConfig:
    """The model's generation config with the rollout's sampling settings (a copy)."""
    config = transformers.GenerationConfig.from_model_config(model.config)
    sampling = system.rollout
    config.update(
        do_sample=True,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        max_new_tokens=sampling.max_new_tokens,
    )
    return config


def export_policy(system: PPOSystem, directory: str | os.PathLike[str], write: bool = True) -> Path:
    """Save the actor's Hugging Face model and the tokenizer into ``directory``.

    Args:
        system: a built system (after ``configure_model()``; e.g. trained or loaded from a
            checkpoint).
        directory: target folder (created; files already there are overwritten).
        write: ``False`` on the ranks that only take part in gathering the weights (under a
            sharding layout every rank must call this; one writes).

    Returns:
        The directory, loadable with ``AutoModelForCausalLM.from_pretrained`` and
        ``AutoTokenizer.from_pretrained``.

    Raises:
        RuntimeError: if the actor model or the tokenizer is not built yet.
        TypeError: if the actor's model is not a ``transformers.PreTrainedModel``.
    """
    if system.actor.model is None:
        raise _not_built("actor model")
    if system.tokenizer is None:
        raise _not_built("tokenizer")
    # policy(): the Hugging Face model the rollout engine samples from (for a megatron actor,
    # its weights converted back to Hugging Face names)
    model = _pretrained(system.actor.policy(), "actor model")
    state = system.actor.parallel.layout.full_state_dict(model)  # gathered under ppo_fsdp
    out = Path(directory)
    if not write:
        return out
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, state_dict=state)
    # Written after the model (which saves its own generation config), without touching the
    # live model's config: the rollout engine keeps generating with its own settings.
    _generation_config(system, model).save_pretrained(out)
    system.tokenizer.save_pretrained(out)
    return out


def export_critic(system: PPOSystem, directory: str | os.PathLike[str], write: bool = True) -> Path:
    """Save the critic's backbone (``save_pretrained``) and value head into ``directory``.

    Args:
        system: a built system (after ``configure_model()``).
        directory: target folder (created; files already there are overwritten).
        write: as for :func:`export_policy`.

    Returns:
        The directory; :func:`load_critic` rebuilds the critic from it.

    Raises:
        RuntimeError: if the critic is not built yet.
        TypeError: if the backbone is not a ``transformers.PreTrainedModel``.
    """
    critic = system.critic
    if critic.backbone is None or critic.value_head is None:
        raise _not_built("critic")
    backbone = critic.backbone
    if is_adapted(backbone):  # LoRA: an ordinary backbone with the adapters merged in
        backbone = copy.deepcopy(backbone).merge_and_unload()
    backbone = _pretrained(backbone, "critic backbone")
    state = critic.parallel.layout.full_state_dict(backbone)  # gathered under ppo_fsdp
    out = Path(directory)
    if not write:
        return out
    out.mkdir(parents=True, exist_ok=True)
    backbone.save_pretrained(out, state_dict=state)
    head = {k: v.detach().cpu().contiguous() for k, v in critic.value_head.state_dict().items()}
    save_file(head, str(out / VALUE_HEAD_FILE))
    cls = type(critic)
    meta = {
        "critic_class": f"{cls.__module__}.{cls.__qualname__}",
        "value_head_class": type(critic.value_head).__name__,
        "backbone_class": type(backbone).__name__,
    }
    (out / CRITIC_META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return out


def _load_backbone(directory: Path, dtype: torch.dtype | str) -> transformers.PreTrainedModel:
    """The backbone saved in ``directory``, as the class it was saved from when known."""
    config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
    names = getattr(config, "architectures", None) or []
    cls = getattr(transformers, names[0], None) if names else None
    loader = cls if cls is not None else transformers.AutoModel
    return loader.from_pretrained(directory, dtype=dtype, local_files_only=True)


def load_critic(
    directory: str | os.PathLike[str],
    critic_cls: type[CriticModule] = CriticModule,
    dtype: torch.dtype | str = "auto",
    **init_args: Any,
) -> CriticModule:
    """Rebuild a critic saved by :func:`export_critic`; it gives the same values.

    Args:
        directory: a critic directory (``<export>/critic``).
        critic_cls: the critic class to build (a subclass with its own
            :meth:`~lppo.modules.CriticModule.make_value_head` must be given here).
        dtype: dtype of the loaded backbone (``"auto"``: as saved); the head follows it.
        **init_args: further arguments of ``critic_cls`` (e.g. ``value_clip``, a subclass's
            head settings).

    Returns:
        The critic, with backbone and value head loaded, on CPU.

    Raises:
        FileNotFoundError: if ``directory`` holds no exported critic.
        ValueError: if the saved value head does not fit ``critic_cls``'s head.
    """
    path = Path(directory)
    head_file = path / VALUE_HEAD_FILE
    if not head_file.is_file() or not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"{path} is not an exported critic (needs config.json and {VALUE_HEAD_FILE}; "
            "write it with lppo.run.export.export_critic)."
        )
    critic = critic_cls(backbone=_load_backbone(path, dtype), **init_args)
    assert critic.value_head is not None  # built by __init__ for a backbone module
    state = load_file(str(head_file))
    try:
        critic.value_head.load_state_dict(state)
    except RuntimeError as err:
        meta_file = path / CRITIC_META_FILE
        saved = json.loads(meta_file.read_text()) if meta_file.is_file() else {}
        raise ValueError(
            f"the value head in {head_file} (saved by {saved.get('critic_class', '?')}) does not "
            f"fit {critic_cls.__name__}'s head; pass critic_cls= (and its init args) of the "
            f"critic that was trained. {err}"
        ) from err
    return critic


def export_adapter(system: PPOSystem, directory: str | os.PathLike[str]) -> Path:
    """Save a LoRA actor's adapters alone (PEFT's layout) and the tokenizer into ``directory``.

    ``peft.PeftModel.from_pretrained(base_model, directory)`` puts them back on the base model
    the run started from.

    Raises:
        ValueError: the actor has no LoRA adapters.
        RuntimeError: the actor or the tokenizer is not built yet.
    """
    actor = system.actor
    if actor.model is None:
        raise _not_built("actor model")
    if system.tokenizer is None:
        raise _not_built("tokenizer")
    if not is_adapted(actor.model):
        raise ValueError(
            "the adapter alone can only be exported from a LoRA actor "
            "(model.actor.init_args.lora); export the merged policy instead."
        )
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    actor.model.save_pretrained(out)
    system.tokenizer.save_pretrained(out)
    return out


def export_system(
    system: PPOSystem,
    directory: str | os.PathLike[str],
    critic: bool = True,
    adapter: bool = False,
    write: bool = True,
) -> dict[str, Path]:
    """Export the policy to ``<directory>/policy`` and the critic to ``<directory>/critic``.

    Args:
        system: a built system (after ``configure_model()``).
        directory: export root (created).
        critic: also export the critic.
        adapter: a LoRA actor's adapters alone (:func:`export_adapter`) instead of the merged
            model.
        write: as for :func:`export_policy` (every rank calls it; one writes).

    Returns:
        ``{"policy": path}`` plus ``"critic"`` when exported.
    """
    root = Path(directory)
    if adapter:
        paths = {"policy": export_adapter(system, root / POLICY_DIR) if write else root}
    else:
        paths = {"policy": export_policy(system, root / POLICY_DIR, write)}
    if critic:
        paths["critic"] = export_critic(system, root / CRITIC_DIR, write)
    return paths


def export_from_checkpoint(
    ckpt_path: str | os.PathLike[str],
    directory: str | os.PathLike[str],
    critic: bool = True,
    system_cls: type[PPOSystem] | None = None,
    adapter: bool = False,
) -> dict[str, Path]:
    """Rebuild the system of a checkpoint and export it like :func:`export_system`.

    Works for checkpoints of ``lppo fit`` (the hyperparameters are the parsed config).
    ``load_from_checkpoint`` runs ``configure_model()`` and loads the weights (strictly).

    Args:
        ckpt_path: a Lightning checkpoint (e.g. ``<run dir>/checkpoints/last.ckpt``).
        directory: export root.
        critic: also export the critic.
        system_cls: the ``PPOSystem`` (sub)class that wrote the checkpoint.
        adapter: a LoRA actor's adapters alone instead of the merged model.

    Returns:
        The exported directories, as :func:`export_system`.

    Raises:
        FileNotFoundError: if ``ckpt_path`` is not a file.
        ValueError: if the checkpoint's hyperparameters do not rebuild the system (a
            checkpoint written from Python, not by ``lppo fit``).
        CheckpointError: (a ``ValueError``) the file is empty, has no digest or changed after
            lppo wrote it, is corrupt, holds non-weights content (it is never unpickled) or is
            not a Lightning checkpoint.
    """
    path = Path(ckpt_path)
    if not path.is_file():
        raise FileNotFoundError(
            f"checkpoint not found: {path} (e.g. <run dir>/checkpoints/last.ckpt)"
        )
    load_checkpoint(str(path))  # digest, weights-only: one clear error before Lightning reads it
    if system_cls is None:
        from lppo.run.system import PPOSystem

        system_cls = PPOSystem
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        system = system_cls.load_from_checkpoint(path, map_location="cpu", weights_only=True)
    except TypeError as err:  # hparams without actor / critic / task: not a CLI checkpoint
        raise ValueError(
            f"{path} does not rebuild a {system_cls.__name__} from its hyperparameters ({err}); "
            "checkpoints of `lppo fit` do. Otherwise build the system, load the checkpoint's "
            "state_dict and call lppo.run.export.export_system."
        ) from err
    system.configure_model()  # idempotent: load_from_checkpoint already built it
    return export_system(system, directory, critic=critic, adapter=adapter)


def main(argv: list[str] | None = None) -> None:
    """``python -m lppo.run.export CKPT DIR [--no-critic] [--adapter]``."""
    parser = argparse.ArgumentParser(
        prog="python -m lppo.run.export",
        description="Export a checkpoint's policy (and critic) as Hugging Face directories.",
    )
    parser.add_argument("ckpt", help="Lightning checkpoint, e.g. runs/tiny/checkpoints/last.ckpt")
    parser.add_argument("directory", help="export root: DIR/policy and DIR/critic")
    parser.add_argument("--no-critic", action="store_true", help="export the policy only")
    parser.add_argument(
        "--adapter", action="store_true", help="a LoRA actor's adapters alone, not merged"
    )
    args = parser.parse_args(argv)
    try:
        paths = export_from_checkpoint(
            args.ckpt, args.directory, critic=not args.no_critic, adapter=args.adapter
        )
    except (FileNotFoundError, ValueError) as err:
        parser.error(str(err))
    for name, out in paths.items():
        print(f"{name}: {out}")


if __name__ == "__main__":
    main()
