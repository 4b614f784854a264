"""Logs a sample of each iteration's rows (texts, per-token numbers) and a page to browse them."""

from __future__ import annotations

import json
import os
import re

import lightning.pytorch as pl
from lightning.pytorch.loggers import WandbLogger
from lppo.callbacks.reward_plot import run_dir

from lppo.iteration.hooks import IterationContext, PPOCallback
from lppo.run.sample_page import page_html
from lppo.run.samples import SampleRow, choose_rows, read_samples
from lppo.types import IterationResult, iteration_number
from lppo.validation import SettingError, callback_key, check_number

#: An iteration's file in the samples folder.
FILE_PATTERN = re.compile(r"iteration-(\d+)\.jsonl")
#: The page, beside the iteration files.
PAGE_NAME = "index.html"
#: Columns of the wandb table (one row per sampled row).
TABLE_COLUMNS = (
    "iteration",
    "row",
    "prompt",
    "completion",
    "reward",
    "mean advantage",
    "max |mismatch|",
)


def file_name(number: int) -> str:
    """The file of iteration ``number`` (counted from 1): ``iteration-0007.jsonl``."""
    return f"iteration-{number:04d}.jsonl"


class RolloutSamples(PPOCallback):
    """Writes a few of each iteration's rows to the run directory, for people to read.

    At ``on_iteration_end`` (both phases done, the rows not yet released: every column the
    iteration wrote is there), global rank zero chooses ``rows_per_iteration`` of its own rows
    (the first row of each prompt in sample order, so the same rows on a rerun; under data
    parallelism only the rows rank zero generated), reads them back from the replay store and
    writes one JSON record per row (:class:`~lppo.run.samples.SampleRow`: prompt, completion,
    reward, a multi-turn row's turns and observations, and a record per token with the engine's
    log-prob, π_old's, the reference's, the critic's value and target, the advantage and the
    mismatch π_old − μ) to ``<dirpath>/iteration-NNNN.jsonl``. It then rewrites
    ``<dirpath>/index.html`` (:func:`~lppo.run.sample_page.page_html`), a page that shows the
    latest ``page_iterations`` of those files with the tokens coloured by advantage or mismatch,
    and, with a :class:`~lightning.pytorch.loggers.WandbLogger` among the trainer's loggers,
    logs a ``samples/table`` table (:data:`TABLE_COLUMNS`). The folder is recorded in the run
    log's ``files`` as ``samples`` (the run summary names it).

    Nothing is computed that the iteration did not store: the policy's per-token entropy is
    not in the records. A failed iteration writes nothing. A run resumed from a checkpoint of
    iteration ``k`` first deletes the files of iterations after ``k`` (written by the attempt
    the checkpoint does not hold; a fresh run deletes them all) and rewrites each iteration it
    runs. Needs a trainer (the run directory); a controller without one logs nothing.

    From YAML / the command line: ``--trainer.callbacks+=lppo.callbacks.RolloutSamples
    --trainer.callbacks.rows_per_iteration=8`` (given, it replaces the built-in one).

    Args:
        rows_per_iteration: rows sampled per logged iteration; 0 turns the log off.
        every_n_iterations: log iterations 1, 1 + N, 1 + 2N, …
        max_tokens_per_row: most token records per row (a longer row lists its first ones and
            counts the rest in ``tokens_omitted``); 0 writes the texts and row numbers only.
        page_iterations: iterations the page embeds, the latest ones (the files keep every
            one); 0 writes no page.
        wandb_table: log the ``samples/table`` table when a ``WandbLogger`` is in the run.
        dirpath: folder of the files; ``None`` means ``<run dir>/samples``.
    """

    def __init__(
        self,
        rows_per_iteration: int = 4,
        every_n_iterations: int = 1,
        max_tokens_per_row: int = 2048,
        page_iterations: int = 100,
        wandb_table: bool = True,
        dirpath: str | None = None,
    ) -> None:
        super().__init__()
        check_number(
            callback_key(self, "rows_per_iteration"), rows_per_iteration, integer=True, low=0
        )
        check_number(
            callback_key(self, "every_n_iterations"), every_n_iterations, integer=True, low=1
        )
        check_number(
            callback_key(self, "max_tokens_per_row"), max_tokens_per_row, integer=True, low=0
        )
        check_number(callback_key(self, "page_iterations"), page_iterations, integer=True, low=0)
        if not isinstance(wandb_table, bool):
            raise SettingError(
                f"{callback_key(self, 'wandb_table')}={wandb_table!r} must be true or false "
                "(false: no samples table in wandb; the files are written either way)."
            )
        self.rows_per_iteration = rows_per_iteration
        self.every_n_iterations = every_n_iterations
        self.max_tokens_per_row = max_tokens_per_row
        self.page_iterations = page_iterations
        self.wandb_table = wandb_table
        self.dirpath = dirpath
        self.folder: str | None = None
        #: The page's content: iteration number -> its file's text (the latest ones).
        self._page: dict[int, str] = {}

    # ------------------------------------------------------------------ hooks
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Resolve the folder and record it in the run log (the summary names it)."""
        self.folder = (
            self.dirpath if self.dirpath is not None else os.path.join(run_dir(trainer), "samples")
        )
        if self.rows_per_iteration > 0:
            pl_module.run_log.files["samples"] = self.folder

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Delete files of iterations the run's checkpoint does not hold; load the page's."""
        if self.rows_per_iteration == 0 or not trainer.is_global_zero or self.folder is None:
            return
        done = trainer.current_epoch  # iterations the checkpoint holds (0: a fresh run)
        found = self.iteration_files()
        stale = sorted(n for n in found if n > done)
        if stale:
            print(
                f"lppo: RolloutSamples: deleting the sample files of iterations "
                f"{stale[0]}..{stale[-1]} in {self.folder} (not in this run's checkpoint)",
                flush=True,
            )
            for number in stale:
                os.remove(found.pop(number))
        kept = sorted(found)[-self.page_iterations :] if self.page_iterations else []
        self._page = {n: _read(found[n]) for n in kept}
        if stale and self.page_iterations:
            self.write_page()

    def on_iteration_end(self, ctx: IterationContext, result: IterationResult) -> None:
        """Sample the iteration's rows, write them and the page (global rank zero)."""
        trainer = ctx.trainer
        if not self.due(ctx, result) or trainer is None or not trainer.is_global_zero:
            return
        ids = choose_rows(ctx.store, ctx.row_ids, self.rows_per_iteration)
        tokenizer = getattr(trainer.lightning_module, "tokenizer", None)
        number = iteration_number(ctx.iteration)
        rows = read_samples(ctx.store, ids, tokenizer, number, self.max_tokens_per_row)
        if not rows:
            return
        self.write(number, rows)
        if self.wandb_table:
            self.log_table(trainer, rows, ctx.run_log.step - 1)

    def due(self, ctx: IterationContext, result: IterationResult) -> bool:
        """Whether the iteration is logged: on, every N-th, finished, its rows still held."""
        return (
            self.rows_per_iteration > 0
            and ctx.iteration % self.every_n_iterations == 0
            and not result.failed
            and not ctx.rows_released
            and bool(ctx.row_ids)
        )

    # ------------------------------------------------------------------ outputs
    def iteration_files(self) -> dict[int, str]:
        """The iteration files in the folder: number -> path."""
        if self.folder is None or not os.path.isdir(self.folder):
            return {}
        found = {}
        for name in os.listdir(self.folder):
            if match := FILE_PATTERN.fullmatch(name):
                found[int(match.group(1))] = os.path.join(self.folder, name)
        return found

    def write(self, number: int, rows: list[SampleRow]) -> str:
        """Write iteration ``number``'s records and the page; returns the file's path."""
        assert self.folder is not None, "RolloutSamples.write before setup"
        os.makedirs(self.folder, exist_ok=True)
        text = "".join(
            json.dumps(row.to_json(), ensure_ascii=False, separators=(",", ":")) + "\n"
            for row in rows
        )
        path = os.path.join(self.folder, file_name(number))
        _write(path, text)
        if self.page_iterations:
            self._page[number] = text
            for old in sorted(self._page)[: -self.page_iterations]:
                del self._page[old]
            self.write_page()
        return path

    def write_page(self) -> str:
        """Rewrite the page from the iterations it holds; returns its path."""
        assert self.folder is not None, "RolloutSamples.write_page before setup"
        path = os.path.join(self.folder, PAGE_NAME)
        parent = os.path.basename(os.path.dirname(os.path.realpath(self.folder)))
        _write(path, page_html(self._page, title=f"lppo samples: {parent}"))
        return path

    @staticmethod
    def log_table(trainer: pl.Trainer, rows: list[SampleRow], step: int) -> None:
        """Log the rows as ``samples/table`` to every ``WandbLogger`` of the trainer.

        ``step`` is the run log's step of the iteration's metrics (``None`` below 0).
        """
        data = [
            [
                row.iteration,
                row.row_id,
                row.prompt,
                row.completion,
                row.reward,
                row.advantage_mean,
                row.max_abs_mismatch,
            ]
            for row in rows
        ]
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                logger.log_table(
                    "samples/table", list(TABLE_COLUMNS), data, step=step if step >= 0 else None
                )


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _write(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file: a reader never sees half of it."""
    temporary = f"{path}.tmp"
    with open(temporary, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(temporary, path)
