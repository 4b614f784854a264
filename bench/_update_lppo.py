"""lppo's side of ``race_update.py``: the race's recipe for the spec's iterations, rows kept.

Usage: ``python _update_lppo.py SPEC OUT_DIR`` (SPEC from ``real_model_race.write_spec``). A
real ``lppo.PPOTrainer.fit`` of ``_race_lppo.build_system`` for the spec's iterations, rows left
in each iteration's sample order (``data.shuffle: false``), so an iteration's first optimizer
step trains the first half of its rows and its second step the rest. Writes
``OUT_DIR/rows.json`` (every row's prompt ids, response ids, reward and advantage, iteration
by iteration in that order), ``OUT_DIR/policy`` (the policy at the end, ``export_policy``) and
``OUT_DIR/metrics.json`` (every optimizer step's statistics).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import _race_common as common  # noqa: E402
import _race_lppo as race  # noqa: E402


def keeper(out_dir: str) -> Any:
    """The callback that keeps each iteration's rows and actor steps, and writes them and the
    policy when the fit ends."""
    from lppo.iteration.hooks import PPOCallback
    from lppo.run.export import export_policy
    from lppo.types import ADVANTAGES, INPUT_IDS, RESPONSE_MASK, REWARD

    class Keep(PPOCallback):
        def __init__(self) -> None:
            self.rows: list[dict[str, Any]] = []
            self.steps: list[dict[str, Any]] = []

        def on_phase_epoch_start(self, ctx: Any) -> None:
            if ctx.phase != "actor" or ctx.epoch != 0:
                return
            cols = ctx.store.read(ctx.row_ids, [INPUT_IDS, RESPONSE_MASK, REWARD, ADVANTAGES])
            for ids, mask, reward, adv in zip(
                cols[INPUT_IDS], cols[RESPONSE_MASK], cols[REWARD], cols[ADVANTAGES], strict=True
            ):
                start = int(mask.nonzero()[0])
                self.rows.append(
                    {
                        "prompt": ids[:start].tolist(),
                        "response": ids[start:].tolist(),
                        "reward": float(reward.sum()),
                        "advantage": float(adv[start]),
                    }
                )

        def on_iteration_end(self, ctx: Any, result: Any) -> None:
            self.steps += [dataclasses.asdict(s) for s in result.steps if s.role == "actor"]

        def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
            export_policy(pl_module, os.path.join(out_dir, "policy"))
            for name, value in (("rows", self.rows), ("metrics", self.steps)):
                with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
                    json.dump(value, f, indent=1)

    return Keep()


def main() -> None:
    """Fit the spec's iterations."""
    spec, out_dir = common.load_spec(sys.argv[1]), sys.argv[2]
    os.makedirs(out_dir, exist_ok=True)
    os.environ["OMP_NUM_THREADS"] = str(spec["threads"])
    import torch
    from lightning.pytorch import seed_everything

    from lppo import PPOTrainer
    from lppo.iteration.data import ReplayDataModule

    torch.set_num_threads(spec["threads"])
    seed_everything(spec["seed"], verbose=False)
    trainer = PPOTrainer(
        max_epochs=spec["iterations"],
        accelerator="cpu",
        devices=1,
        default_root_dir=os.path.join(out_dir, "run"),
        logger=False,
        enable_checkpointing=False,
        callbacks=[keeper(out_dir)],
    )
    data = ReplayDataModule(drop_budget=0, shuffle=False, max_tokens_per_chunk=2048)
    trainer.fit(race.build_system(spec, {}), datamodule=data)


if __name__ == "__main__":
    main()
