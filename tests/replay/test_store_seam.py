"""``ReplayStore`` holds exactly what lppo calls: training runs on a store with nothing more."""

from __future__ import annotations

from typing import Any

from lppo.config import PPOConfig
from lppo.iteration.data import ReplayDataModule
from lppo.modules import ActorModule, CriticModule
from lppo.modules.models import HFCausalLM
from lppo.replay import InspectableStore, MemoryReplayStore, ReplayStore
from lppo.run.system import PPOSystem, RolloutSettings
from lppo.run.trainer import PPOTrainer
from lppo.tasks import CopyTask

PRODUCT = {name for name in vars(ReplayStore) if not name.startswith("_")}
INSPECTION = {name for name in vars(InspectableStore) if not name.startswith("_")} | {"__len__"}


class OnlyReplayStore:
    """A real ``MemoryReplayStore`` reachable only through the ``ReplayStore`` members."""

    def __init__(self) -> None:
        self.inner = MemoryReplayStore()
        self.used: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        if name not in PRODUCT:
            raise AttributeError(f"{name!r} is not a ReplayStore member")
        self.used.add(name)
        return getattr(self.inner, name)


def test_the_protocols_split_the_members():
    assert not PRODUCT & INSPECTION
    assert {"columns", "has", "claimed", "clear", "nbytes", "__len__"} == INSPECTION
    assert {"put", "write", "read", "meta", "release", "state_dict"} <= PRODUCT


def test_training_and_checkpoints_call_only_replay_store_members(tmp_path):
    store = OnlyReplayStore()
    assert isinstance(store, ReplayStore) and not isinstance(store, InspectableStore)
    spec = HFCausalLM(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    system = PPOSystem(
        actor=ActorModule(spec, lr=3e-3),
        critic=CriticModule(HFCausalLM(hidden_size=32, num_layers=1, num_heads=2, seed=1)),
        task=CopyTask(),
        rollout=RolloutSettings(prompts_per_iteration=2, samples_per_prompt=2, max_new_tokens=3),
        ppo=PPOConfig(kl_coef=0.05),
        num_threads=1,
    )
    trainer = PPOTrainer(max_epochs=1, default_root_dir=str(tmp_path), accelerator="cpu")
    trainer.fit(system, datamodule=ReplayDataModule(max_tokens_per_chunk=40, store=store))
    assert trainer.global_step == 1
    assert (tmp_path / "checkpoints" / "last.ckpt").exists()  # state_dict went through it
    assert {"allocate", "put", "write", "read", "meta", "release", "state_dict"} <= store.used
