"""``lppo settings``: every setting of a configuration, one line each; roles as plain text."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from lppo.run.cli import PPOCLI
from lppo.run.rst import rst_to_text
from lppo.run.settings_list import resolved_config, settings

ROOT = Path(__file__).resolve().parents[2]


def lppo(*args: str) -> subprocess.CompletedProcess:
    code = "from lppo.run.cli import main; main()"
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300,
        check=False, cwd=ROOT,
    )  # fmt: skip


def test_every_setting_of_the_chosen_classes_is_listed_with_type_value_and_doc():
    config = resolved_config(PPOCLI, ["--config", str(ROOT / "configs" / "gspo.yaml")])
    rows = {row.key: row for row in settings(config)}
    lr = rows["model.actor.init_args.lr"]
    assert lr.type == "float" and lr.doc.startswith("learning rate of the default AdamW")
    assert rows["model.actor.init_args.objective"].value == "lppo.algorithms.GSPO"
    assert "model.actor.init_args.objective.init_args.clip_low" in rows
    assert rows["model.task.init_args.alphabet_size"].type == "int"
    assert rows["model.rollout.samples_per_prompt"].type == "int"
    assert rows["model.actor.init_args.off_policy.mode"].value == "auto"  # a dataclass group
    assert rows["trainer.max_epochs"].doc.startswith("Stop training once")
    keys = list(rows)
    assert keys[0].startswith("model.") and keys[-1].startswith("trainer.")
    assert keys.index("data.max_tokens_per_chunk") < keys.index("trainer.max_epochs")
    for row in rows.values():  # documentation is plain text
        assert ":class:" not in row.doc and "``" not in row.doc, row


def test_lppo_settings_prints_one_line_per_setting_and_overrides_apply():
    done = lppo("settings", "--config", "configs/tiny.yaml", "--model.actor.init_args.lr", "0.01")
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line.split() for line in done.stdout.splitlines()]
    actor_lr = next(line for line in lines if line[0] == "model.actor.init_args.lr")
    assert actor_lr[1:3] == ["float", "0.01"]
    assert "LightningCLI's args parameter" not in done.stderr


def test_lppo_settings_reports_a_bad_config_like_fit():
    done = lppo("settings", "--config", "does-not-exist.yaml")
    assert done.returncode == 2
    assert "does-not-exist.yaml" in done.stderr and not done.stdout


def test_roles_and_literals_become_plain_text():
    text = ":class:`~lppo.tasks.Task`, :mod:`lppo.rollout`, ``null`` and :meth:`t <a.b.c>`"
    assert rst_to_text(text) == "Task, lppo.rollout, null and t"


def test_fit_help_shows_no_roles():
    done = lppo("fit", "--help")
    assert done.returncode == 0
    assert ":class:" not in done.stdout and "``" not in done.stdout
    assert "lppo settings --config FILE" in " ".join(done.stdout.split())
