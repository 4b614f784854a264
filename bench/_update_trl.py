"""TRL's side of ``race_update.py``: ``GRPOTrainer`` trained on lppo's recorded rows.

Usage: ``python _update_trl.py SPEC ROWS OUT_DIR [shuffle=0|1]`` (runs in the TRL venv). The
trainer is ``_race_trl.grpo_config``'s (the race's settings: the spec's iterations, two
optimizer steps each), but it generates nothing: ``_generate_single_turn`` returns, for each
prompt TRL tokenized, the next response lppo sampled for that prompt (ROWS, from
``_update_lppo.py``), so both trainers update from the same tokens and, through the shared
verifier, the same rewards. With ``shuffle=0`` (the default) TRL's shuffle of the generation
batch is the identity, so its steps train the same rows as lppo's unshuffled run. Writes
``OUT_DIR/policy`` (``save_pretrained``) and ``OUT_DIR/metrics.json`` (TRL's logged metrics).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import _race_common as common  # noqa: E402
import _race_trl as race  # noqa: E402


def replay(trainer: Any, rows: list[dict[str, Any]]) -> None:
    """Make ``trainer`` take its completions from ``rows``, each row once, prompt by prompt."""
    pending: dict[tuple[int, ...], list[list[int]]] = {}
    for row in rows:
        pending.setdefault(tuple(row["prompt"]), []).append(row["response"])

    def generate(prompt_ids: list[list[int]], *args: Any, **kwargs: Any) -> tuple[Any, None]:
        try:
            return [pending[tuple(p)].pop(0) for p in prompt_ids], None
        except (KeyError, IndexError) as err:
            raise SystemExit("TRL asked for a prompt lppo did not sample (or too often)") from err

    trainer._generate_single_turn = generate


def main() -> None:
    """Train on the rows, then write the policy and the metrics."""
    spec, out_dir = common.load_spec(sys.argv[1]), sys.argv[3]
    with open(sys.argv[2]) as f:
        rows = json.load(f)
    opts = dict(a.split("=", 1) for a in sys.argv[4:])
    import torch

    torch.set_num_threads(spec["threads"])
    import transformers
    from trl.trainer import grpo_trainer

    if opts.get("shuffle", "0") == "0":
        grpo_trainer.shuffle_sequence_dict = lambda batch: batch
    logged: list[dict[str, float]] = []

    class Log(transformers.TrainerCallback):
        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            logged.append({k: float(v) for k, v in (logs or {}).items()})

    def correct(completions: list[Any], answer: list[str], **kwargs: Any) -> list[float]:
        return [common.reward(a, c[0]["content"]) for a, c in zip(answer, completions, strict=True)]

    args = race.grpo_config(spec, {})
    args.logging_steps = 1
    trainer = race.build_trainer(spec, args, correct, [Log()])
    replay(trainer, rows)
    trainer.train()
    trainer.model.save_pretrained(os.path.join(out_dir, "policy"))
    with open(os.path.join(out_dir, "metrics.json"), "w") as f:
        json.dump(logged, f, indent=1)


if __name__ == "__main__":
    main()
