"""``RolloutSource``: prompt blocks split over ranks give the single process's samples."""

from __future__ import annotations

import random

import pytest
import torch

from lppo.errors import IterationError
from lppo.modules import ActorModule
from lppo.modules.models import HFCausalLM
from lppo.modules.tokenizer import build_char_tokenizer
from lppo.parallel import ProcessGroup
from lppo.replay import MemoryReplayStore, ReplayStore
from lppo.replay.rollout_rows import StoredRollout
from lppo.rollout import HFGenerateEngine, RolloutSettings, RolloutSource
from lppo.rollout.source import derive_seed, prompt_blocks, rank_share
from lppo.tasks import CopyTask
from lppo.types import GEN_LOGPROBS, INPUT_IDS, REWARD, Rollout

TASK = CopyTask()
TOK = build_char_tokenizer(TASK.vocabulary())


def source(
    settings: RolloutSettings, world: int = 1, rank: int = 0, store: ReplayStore | None = None
) -> RolloutSource:
    """A source over a fresh tiny actor (same seed everywhere) as ``rank`` of ``world``."""
    actor = ActorModule(HFCausalLM(hidden_size=32, num_layers=1, num_heads=2, seed=0))
    actor.configure_model(len(TOK), TOK.pad_token_id, TOK.bos_token_id, TOK.eos_token_id)
    engine = HFGenerateEngine()
    engine.setup(actor.model, TOK, settings)
    # Generation runs no collective, so a rank of a larger group can run in this process.
    group = ProcessGroup(world, rank)
    return RolloutSource(TASK, engine, actor, settings, seed=5, group=group, store=store)


def rows(rollout: Rollout) -> list[tuple]:
    return [
        (tuple(ids.tolist()), tuple(lp.tolist()), float(r), int(p))
        for ids, lp, r, p in zip(
            rollout.input_ids,
            rollout.gen_logprobs,
            rollout.reward,
            rollout.prompt_index,
            strict=True,
        )
    ]


def test_blocks_and_shares():
    settings = RolloutSettings(prompts_per_iteration=7, prompts_per_block=3)
    assert prompt_blocks(settings) == [range(0, 3), range(3, 6), range(6, 7)]
    assert [list(rank_share(5, 2, r)) for r in range(2)] == [[0, 1, 2], [3, 4]]
    assert [list(rank_share(3, 3, r)) for r in range(3)] == [[0], [1], [2]]
    # null: one block per rank.
    assert prompt_blocks(RolloutSettings(prompts_per_iteration=5), 2) == [range(0, 3), range(3, 5)]
    assert prompt_blocks(RolloutSettings(prompts_per_iteration=5)) == [range(0, 5)]


def test_too_few_blocks_for_the_ranks_fail_at_setup():
    settings = RolloutSettings(prompts_per_iteration=4, prompts_per_block=3)
    with pytest.raises(ValueError, match=r"model\.rollout\.prompts_per_block=3 gives 2 block"):
        source(settings, world=3)
    with pytest.raises(ValueError, match=r"prompts_per_block=0 is out of range"):
        RolloutSettings(prompts_per_block=0)


def test_ranks_generate_disjoint_blocks_that_make_up_the_single_process_rollout():
    settings = RolloutSettings(
        prompts_per_iteration=5, samples_per_prompt=2, max_new_tokens=4, prompts_per_block=1
    )
    one = source(settings).collect(iteration=3)
    parts = [source(settings, world=2, rank=r).collect(iteration=3) for r in range(2)]
    assert [sorted(set(p.prompt_index.tolist())) for p in parts] == [[0, 1, 2], [3, 4]]
    assert rows(parts[0]) + rows(parts[1]) == rows(one)  # bitwise, in sample order
    # Another iteration samples other responses; a block's seed does not depend on the rank.
    assert rows(source(settings).collect(iteration=4)) != rows(one)


def test_one_block_keeps_the_iteration_seed():
    """``prompts_per_block: null`` in one process samples as before blocks existed."""
    settings = RolloutSettings(prompts_per_iteration=3, samples_per_prompt=2, max_new_tokens=4)
    src = source(settings)
    got = src.collect(iteration=2)
    prompts = TASK.sample_prompts(3, random.Random(derive_seed(5, "prompts", 2)))
    want = src.engine.generate(prompts, 2, seed=derive_seed(5, "generate", 2))
    assert all(torch.equal(a, b) for a, b in zip(got.input_ids, want.input_ids, strict=True))


def test_with_a_store_the_source_puts_the_rows_and_hands_over_their_ids():
    """The samples go into the store as they are; only ids and per-row scalars come back."""
    settings = RolloutSettings(prompts_per_iteration=5, samples_per_prompt=2)
    samples = source(settings).collect(3)
    store = MemoryReplayStore()
    got = source(settings, store=store).collect(3)
    assert isinstance(got, StoredRollout) and len(got) == len(samples) == len(store)
    stored = store.read(got.row_ids, [INPUT_IDS, GEN_LOGPROBS, REWARD, "prompt_index"])
    as_rollout = Rollout(
        stored[INPUT_IDS],
        [torch.zeros(0)] * len(got),
        stored[GEN_LOGPROBS],
        torch.stack(stored[REWARD]),
        torch.stack(stored["prompt_index"]),
    )
    assert rows(as_rollout) == rows(samples)
    assert torch.equal(got.reward, samples.reward)


class BrokenStore(MemoryReplayStore):
    def put(self, ids, columns) -> None:
        super().put(ids, columns)
        raise OSError("disk full")


def test_a_failed_put_is_an_iteration_error_and_leaves_no_row():
    store = BrokenStore()
    with pytest.raises(IterationError, match=r"iteration 2, phase collect: OSError: disk full"):
        source(RolloutSettings(prompts_per_iteration=3), store=store).collect(1)
    assert len(store) == 0
