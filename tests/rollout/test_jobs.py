"""The background rollout process's wire format: samples come back exactly as generated."""

from __future__ import annotations

import pickle

import torch

from lppo.rollout.jobs import GeneratedRollout
from lppo.types import Rollout


def _rollout() -> Rollout:
    lengths = [3, 1, 5, 2]
    g = torch.Generator().manual_seed(0)
    return Rollout(
        input_ids=[torch.randint(0, 50, (n,), generator=g) for n in lengths],
        response_mask=[torch.rand(n, generator=g) > 0.5 for n in lengths],
        gen_logprobs=[-torch.rand(n, generator=g) for n in lengths],
        reward=torch.rand(4, generator=g),
        prompt_index=torch.tensor([0, 0, 1, 1]),
        extras={
            "for_iteration": [torch.tensor(7) for _ in lengths],
            "token_level": [torch.rand(n, generator=g, dtype=torch.float64) for n in lengths],
            "mixed": [torch.zeros(2, 2), torch.zeros(3), torch.tensor(1.0), torch.zeros(1)],
        },
        dropped=2,
    )


def test_dumps_loads_round_trip_is_exact() -> None:
    sent = GeneratedRollout(3, _rollout(), "", started=1.5, finished=2.5, idle_seconds=0.25)
    got = GeneratedRollout.loads(sent.dumps())
    assert (got.iteration, got.error, got.started, got.finished, got.idle_seconds) == (
        3,
        "",
        1.5,
        2.5,
        0.25,
    )
    a, b = sent.rollout, got.rollout
    assert isinstance(a, Rollout) and isinstance(b, Rollout)
    assert b.dropped == 2 and a.extras.keys() == b.extras.keys()
    pairs = [(a.input_ids, b.input_ids), (a.response_mask, b.response_mask)]
    pairs += [(a.gen_logprobs, b.gen_logprobs), *((a.extras[k], b.extras[k]) for k in a.extras)]
    pairs += [([a.reward], [b.reward]), ([a.prompt_index], [b.prompt_index])]
    for xs, ys in pairs:
        assert len(xs) == len(ys)
        for x, y in zip(xs, ys, strict=True):
            assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)


def test_rows_travel_as_one_storage_per_column() -> None:
    rollout = _rollout()
    many = GeneratedRollout(0, Rollout(**{**rollout.__dict__, "extras": {}}))
    packed, plain = len(many.dumps()), len(pickle.dumps(many))
    assert packed < plain / 2  # one storage per column instead of one per row


def test_a_failed_job_round_trips() -> None:
    got = GeneratedRollout.loads(GeneratedRollout(5, None, "boom").dumps())
    assert (got.iteration, got.rollout, got.error) == (5, None, "boom")
