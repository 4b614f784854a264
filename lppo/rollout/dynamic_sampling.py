"""DAPO's dynamic sampling: drop prompt groups with no learning signal, refill from a reserve.

A group (the samples of one prompt) whose samples all got the same reward has zero advantage
under every group-relative estimator: it costs a training pass and teaches nothing. With
``model.rollout.dynamic_sampling_rounds: N`` such groups are dropped and each prompt block
refills itself from its own reserve, one extra block of fresh prompts per round, until it
holds as many informative groups as it has prompts, or its ``N`` refill rounds are spent
(then the iteration trains on what there is; counted as ``short_groups``). An iteration left
with no group trains nothing: its samples count as lost against ``data.drop_budget``
(:func:`lppo.iteration.planner.check_untrained`).

Why per block: a block is the unit ranks split and its samples depend only on its seed, so a
block's kept groups never depend on which rank generates it or on another block. The rows
are therefore the same for any number of data-parallel ranks and for any runner (in the
trainer, a thread or the background process), and the reserve's prompts are drawn when the
iteration is admitted (:meth:`~lppo.rollout.RolloutSource.admit`), so which prompts an
iteration may use never depends on what was generated. Rewards are still one
``Task.rewards`` call per round.
"""

from __future__ import annotations

import dataclasses

import torch

from lppo.rollout.base import (
    GenerationOutput,
    PromptBlock,
    RolloutEngine,
    concat_outputs,
    to_rollout,
)
from lppo.rollout.reward_call import score
from lppo.tasks.base import Task
from lppo.types import Rollout, SamplingReport


def informative_rows(
    reward: torch.Tensor, prompt_index: torch.Tensor, quota: int
) -> tuple[list[int], SamplingReport]:
    """The rows of the first ``quota`` informative groups, in order.

    A group is informative when its finite rewards hold two different values, compared
    exactly in the rewards' dtype (float64: rewards that differ anywhere differ here). A
    non-finite reward's row becomes invalid when put, so it carries no signal: its group is
    judged on the other rewards and counted in ``nonfinite_groups``.

    Args:
        reward: ``float64[n]`` one reward per sample.
        prompt_index: ``int64[n]`` the prompt each sample answers (a group's samples are
            contiguous).
        quota: informative groups wanted.

    Returns:
        The kept rows' indices and the counts (``uniform_groups``, ``surplus_groups``,
        ``nonfinite_groups``).
    """
    report = SamplingReport()
    kept: list[int] = []
    held = 0
    start = 0
    for size in torch.unique_consecutive(prompt_index, return_counts=True)[1].tolist():
        rows = list(range(start, start + size))
        start += size
        values = reward[rows]
        finite = values[torch.isfinite(values)]
        report.nonfinite_groups += int(len(finite) < len(values))
        if len(finite) < 2 or bool((finite == finite[0]).all()):
            report.uniform_groups += 1
        elif held < quota:
            kept += rows
            held += 1
        else:
            report.surplus_groups += 1
    return kept, report


def generate_dynamic(
    engine: RolloutEngine,
    task: Task,
    blocks: list[PromptBlock],
    samples_per_prompt: int,
    provenance: tuple[int, int],
) -> Rollout:
    """Generate ``blocks`` with dynamic sampling; rows come back block by block, in order.

    Round ``r`` generates refill ``r`` of every block still short (each with its own seed)
    and rewards them with one ``Task.rewards`` call; a block keeps its first informative
    groups up to its number of prompts. ``prompt_index`` of a refill row is its prompt's
    index in its round's draw plus ``r × prompts_per_iteration`` (the refill's ``start``), so
    every group of the iteration has its own index.

    Returns:
        The rewarded samples, with the :class:`~lppo.types.SamplingReport` in ``sampling``.
    """
    report = SamplingReport()
    kept: list[list[tuple[GenerationOutput, torch.Tensor]]] = [[] for _ in blocks]
    need = [len(b.prompts) for b in blocks]
    pending = list(enumerate(blocks))
    for round_ in range(1 + max(len(b.refills) for b in blocks)):
        if not pending:
            break
        report.refills += len(pending) if round_ else 0
        outputs = [engine.generate(b.prompts, samples_per_prompt, seed=b.seed) for _, b in pending]
        rewards = _score_round(task, [b for _, b in pending], outputs)
        if not round_:
            first = torch.cat(rewards)
            first = first[torch.isfinite(first)]
            report.first_reward_sum, report.first_samples = float(first.double().sum()), len(first)
        still: list[tuple[int, PromptBlock]] = []
        for (i, block), output, reward in zip(pending, outputs, rewards, strict=True):
            rows, counts = informative_rows(reward, output.prompt_index, need[i])
            report = report.merged(counts)
            output = output.select(rows)
            output.prompt_index = output.prompt_index + block.start
            kept[i].append((output, reward[rows]))
            need[i] -= len(torch.unique(output.prompt_index))
            if need[i] > 0 and round_ < len(blocks[i].refills):
                still.append((i, blocks[i].refills[round_]))
            elif need[i] > 0:
                report.short_groups += need[i]
                report.short_samples += need[i] * samples_per_prompt
        pending = still
    parts = [part for block_parts in kept for part in block_parts]
    output = concat_outputs([o for o, _ in parts])
    rollout = to_rollout(output, torch.cat([r for _, r in parts]), provenance=provenance)
    rollout.sampling = report
    return rollout


def _score_round(
    task: Task, blocks: list[PromptBlock], outputs: list[GenerationOutput]
) -> list[torch.Tensor]:
    """Each block's rewards, from one ``Task.rewards`` call over the round's samples."""
    shifted, prompts = [], []
    for block, output in zip(blocks, outputs, strict=True):
        shifted.append(dataclasses.replace(output, prompt_index=output.prompt_index + len(prompts)))
        prompts += block.prompts
    rewards = score(task, prompts, concat_outputs(shifted))
    return list(rewards.split([len(o) for o in outputs]))
