"""The run plan: every ``auto`` setting and every rule across setting groups, decided once.

:meth:`PPOSystem.configure_model <lppo.run.system.PPOSystem.configure_model>` reads
build → plan → wire. Once the models are built (and the run's precision, layout and data
settings known), :meth:`RunPlan.resolve` asks each component what it can do and what stops it
and decides, in this order:

1. the rules across setting groups (staleness × layout, dynamic sampling × fixed rows per
   rank, failure budget × data parallelism, overlong shaping × response length) and the
   engine's own setup check against the task and tokenizer (a multi-turn opening ×
   ``max_tokens``, a tool environment × template, EOS and vocabulary);
2. the runner (``model.runner: null``) from the staleness and the engine's capabilities, and
   the Ray CPUs the run's actors take (each set of rollout workers, the store's services)
   against a local Ray's ``trainer.ray.num_cpus``;
3. the producer of each column: old values (score phase or the critic's first epoch) and π_old
   (the actor's first epoch, the engine, or a separate pass), at the run's final dtype; then
   every column a phase reads must have a writer;
4. the actor's off-policy correction for stale rows;
5. the score-chunk budget;
6. ``data.share_prompts`` against every model that runs over chunks.

Components that resolve an ``auto`` against what only they hold report it through
:func:`lppo.decisions.note`, once each: a module's ``trim_prompt`` against its body and the
run's layout (known before the models are built), an engine's cache, prefill and sampler
against the policy's layers and generation config. The plan
collects those too, logs every decision in one block, and is saved in checkpoints, where a
resumed run's plan is compared with the saved one (:func:`plan_changes`). The controller, the
rollout pipeline, the engine and the modules receive what the plan decided.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from lightning.pytorch.utilities import rank_zero_info

from lppo.algorithms.off_policy import OffPolicyCorrection
from lppo.config import PPOConfig
from lppo.decisions import Decision, note
from lppo.estimators import AdvantageEstimator
from lppo.iteration.columns import ColumnReader, check_read, check_reads, writers
from lppo.iteration.critic_targets import resolve_old_values
from lppo.iteration.data_settings import DataSettings
from lppo.iteration.old_logprobs import RowSource, engine_obstacles, resolve_old_logprobs
from lppo.layouts.base import ParallelContext
from lppo.modules import ActorModule, CriticModule
from lppo.modules.shared import decide as decide_share_prompts
from lppo.replay.base import ReplayStore, ray_cpus_of
from lppo.rollout.base import RolloutEngine, RolloutSettings
from lppo.rollout.capabilities import capabilities_of
from lppo.rollout.pipeline import default_runner, stale_correction
from lppo.rollout.runners import RolloutRunner
from lppo.runtime.ray_runtime import RaySettings, local_ray_cpus
from lppo.tasks.base import Task
from lppo.types import OLD_LOGPROBS, PROMPT_INDEX, REF_LOGPROBS, TEACHER_LOGPROBS
from lppo.validation import SettingError

__all__ = ["PLAN_KEY", "RunParts", "RunPlan", "plan_changes", "resolve_columns"]

#: Checkpoint key of the saved plan (``{key: {"setting": ..., "value": ...}}``).
PLAN_KEY = "lppo_run_plan"


@dataclass(frozen=True)
class RunParts:
    """What the plan decides for: the built components and the run's facts.

    Attributes:
        actor: the policy, built (``configure_model`` done).
        critic: the value model, built (``None``: critic-free).
        reference: the frozen reference policy (``None``: none needed).
        engine: the rollout engine (not yet set up).
        estimator: the advantage estimator.
        ppo: ``model.ppo`` as configured.
        rollout: ``model.rollout``.
        data: the data module's settings.
        runner: ``model.runner`` as configured (``None``: the plan picks).
        parallel: the run's process groups and layout.
        precision: ``trainer.precision`` (the dtype the models will compute in).
        strategy: the trainer's strategy class name (a fact, recorded).
        task: ``model.task`` (``None``: a plan without a run; the engine's setup check skipped).
        tokenizer: the run's tokenizer.
        store: the replay store (its Ray services are counted against ``ray``).
        ray: ``trainer.ray`` (``None``: the default settings).
        teacher: the frozen teacher of on-policy distillation (``None``: none).
    """

    actor: ActorModule
    critic: CriticModule | None
    reference: ActorModule | None
    engine: RolloutEngine
    estimator: AdvantageEstimator
    ppo: PPOConfig
    rollout: RolloutSettings
    data: DataSettings
    runner: RolloutRunner | None
    parallel: ParallelContext
    precision: str = "32-true"
    strategy: str = "SingleDeviceStrategy"
    task: Task | None = None
    tokenizer: Any = None
    store: ReplayStore | None = None
    ray: RaySettings | None = None
    teacher: ActorModule | None = None


@dataclass
class RunPlan:
    """Every setting of a run resolved, with the reasons.

    Attributes:
        ppo: ``model.ppo`` with ``old_logprobs`` and ``old_values`` resolved (the controller's).
        runner: where rollouts are generated.
        score_chunk_tokens: the score phase's padded-token budget per chunk.
        decisions: every decision, in the order made (components add theirs while wired).
        share_prompts: ``data.share_prompts`` decided (the modules are told, the planner is
            built with it).
    """

    ppo: PPOConfig
    runner: RolloutRunner
    score_chunk_tokens: int
    decisions: list[Decision] = field(default_factory=list)
    share_prompts: bool = False

    @classmethod
    def resolve(cls, parts: RunParts) -> RunPlan:
        """Decide everything for ``parts`` (steps 1–5 of the module docstring).

        Decisions are reported through :func:`~lppo.decisions.note`: call it inside
        :func:`~lppo.decisions.collecting` and give the collected list to the plan.

        Raises:
            SettingError: a rule across setting groups is broken, or an explicit setting
                would not be exact here (each message names the keys and the fix).
        """
        _check_rules(parts)
        runner = _runner(parts)
        _check_ray_cpus(parts, runner)
        layout = parts.parallel.layout
        ppo = resolve_columns(
            parts.ppo, parts.estimator, parts.actor, parts.critic, parts, parts.teacher is not None
        )
        parts.actor.off_policy = _off_policy(parts, ppo)
        score = parts.data.score_budget
        why = "" if parts.data.max_tokens_per_score_chunk is not None else "the training budget"
        if parts.data.max_tokens_per_score_chunk == "auto":
            why = f"{score // parts.data.max_tokens_per_chunk} x data.max_tokens_per_chunk"
        setting = str(parts.data.max_tokens_per_score_chunk)
        note("data.max_tokens_per_score_chunk", str(score), why, setting)
        note("trainer.strategy", parts.strategy, type(layout).__name__, setting="")
        modules = (parts.actor, parts.critic, parts.reference, parts.teacher)
        chars = parts.task.max_prompt_length() if parts.task is not None else None
        samples = parts.rollout.samples_per_prompt
        share = decide_share_prompts(parts.data.share_prompts, modules, chars, samples)
        return cls(ppo, runner, score, share_prompts=share)

    def final(self) -> list[Decision]:
        """Each key's last decision, in the order keys were first decided.

        A component built twice (``configure_model`` is idempotent) notes its decision again:
        the last one holds.
        """
        last = {d.key: d for d in self.decisions}
        return list(last.values())

    def log(self) -> None:
        """Log every final decision as one block (rank zero)."""
        final = self.final()
        width = max((len(d.key) for d in final), default=0)
        lines = [_row(d, width) for d in final]
        rank_zero_info(
            "lppo run plan (every auto decided once, before the first iteration):\n"
            + "\n".join(lines)
        )

    def state_dict(self) -> dict[str, dict[str, str]]:
        """The decisions, by key, as saved in checkpoints (the last decision of a key wins)."""
        return {d.key: {"setting": d.setting, "value": d.value} for d in self.final()}


def _row(decision: Decision, width: int) -> str:
    given = "" if decision.setting in ("", "auto") else f"  [set: {decision.setting}]"
    why = f"  ({decision.reason})" if decision.reason else ""
    return f"  {decision.key:<{width}}  {decision.value}{given}{why}"


def resolve_columns(
    config: PPOConfig,
    estimator: AdvantageEstimator,
    actor: ActorModule,
    critic: CriticModule | None,
    parts: RunParts | None = None,
    teacher: bool = False,
) -> PPOConfig:
    """``config`` with the producers of old values and π_old decided (step 3).

    Then every column a phase reads (the actor's, the critic's, the estimator's) must have
    a writer in the run (:func:`~lppo.iteration.columns.check_reads`).

    With ``parts`` (a run) the engine is asked whether its log-probs are π_old at the run's
    final dtype, and told to return them when it is picked; without (a controller built on its
    own) no engine is known and π_old comes from the first actor epoch or a separate pass.
    ``teacher``: a teacher is scored (it writes ``teacher_logprobs``, which someone must read).
    """
    config = resolve_old_values(config, estimator, critic)
    obstacles = None
    if parts is not None:
        rows = RowSource(
            staleness=parts.rollout.max_staleness,
            precision=parts.precision,
            shards_weights=parts.parallel.layout.shards_weights(),
        )
        obstacles = engine_obstacles(parts.engine, actor, config, rows)
    config = resolve_old_logprobs(config, estimator, actor, obstacles)
    if config.old_logprobs == "engine" and parts is not None:
        enable = capabilities_of(parts.engine).enable_policy_logprobs
        assert enable is not None  # engine_obstacles found the capability
        enable()
    reference = config.kl_coef > 0 or actor.needs_reference
    kl = [OLD_LOGPROBS, REF_LOGPROBS] if config.kl_coef > 0 else []
    readers = [
        ColumnReader("model.actor", tuple(actor.reads())),
        ColumnReader(f"model.estimator={type(estimator).__name__}", (*estimator.reads(), *kl)),
    ]
    if critic is not None:
        readers.append(ColumnReader("model.critic", tuple(critic.reads())))
    values = config.old_values if critic is not None else None
    written = writers(config.old_logprobs, values, reference, estimator, teacher)
    check_reads(readers, written)
    if teacher:
        check_read(TEACHER_LOGPROBS, "model.teacher", readers)
    return config


#: A prompt drawn ahead for dynamic sampling's refills, in memory (an estimate, generous for a
#: short prompt: the object, its text and answer).
PROMPT_BYTES = 1024


def available_memory() -> int:
    """Bytes of memory available now.

    ``/proc/meminfo``'s ``MemAvailable`` (page cache counts as available), else the free pages.
    """
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _check_memory(parts: RunParts) -> None:
    """Knobs whose size is memory: refused when they would take more than the machine has.

    Every admitted iteration (``max_staleness + 1`` at once) carries a copy of the policy's
    weights and, with dynamic sampling, the prompts of each refill round, drawn at admission.
    """
    r = parts.rollout
    jobs = r.max_staleness + 1
    weights = sum(p.numel() * p.element_size() for p in parts.actor.parameters())
    prompts = jobs * r.dynamic_sampling_rounds * r.prompts_per_iteration * PROMPT_BYTES
    need, free = jobs * weights + prompts, available_memory()
    if need > free:
        raise SettingError(
            f"model.rollout.max_staleness={r.max_staleness} with model.rollout."
            f"dynamic_sampling_rounds={r.dynamic_sampling_rounds}: {jobs} admitted iterations "
            f"would hold {need / 2**30:.1f} GiB ({jobs} copies of the policy's weights, "
            f"{weights / 2**20:.1f} MiB each, and the refill rounds' prompts), more than the "
            f"{free / 2**30:.1f} GiB free; lower them (DAPO's refills rarely need more than 10 "
            "rounds; a lag of 1 or 2 hides most generation time)."
        )


def _check_rules(parts: RunParts) -> None:
    """Step 1: the rules that span setting groups (each refusal names the keys and the fix)."""
    _check_memory(parts)
    r, data = parts.rollout, parts.data
    if r.dynamic_sampling_rounds and data.fixed_rows_per_rank:
        raise SettingError(
            f"model.rollout.dynamic_sampling_rounds={r.dynamic_sampling_rounds} with "
            "data.fixed_rows_per_rank=true: dynamic sampling keeps a varying number of rows "
            "per rank; set one of them off."
        )
    size = parts.parallel.data.size
    if size > 1 and parts.ppo.max_failed_iterations:
        raise SettingError(
            f"model.ppo.max_failed_iterations={parts.ppo.max_failed_iterations} under data "
            f"parallelism ({size} ranks): a failure on one rank would leave the others waiting "
            "in a collective; set it to 0."
        )
    parts.ppo.row_rules(r.max_new_tokens)  # overlong shaping fits the response length
    name = type(parts.estimator).__name__
    if PROMPT_INDEX in parts.estimator.reads() and r.samples_per_prompt < 2:
        raise SettingError(
            f"model.rollout.samples_per_prompt={r.samples_per_prompt} with model.estimator={name}, "
            "which compares the samples of each prompt: with one sample every advantage is 0 "
            "(or has no baseline) and nothing trains; set model.rollout.samples_per_prompt >= 2 "
            "(configs/grpo.yaml: 4), or use an estimator without groups (lppo.estimators.GAE, "
            "ReinforcePP)."
        )
    check = capabilities_of(parts.engine).check_setup  # e.g. multi-turn openings vs max_tokens
    if check is not None and parts.task is not None:
        check(parts.tokenizer, parts.task, r)
    if parts.ppo.overlong_buffer and capabilities_of(parts.engine).multi_turn:
        raise SettingError(
            f"model.ppo.overlong_buffer={parts.ppo.overlong_buffer} with a multi-turn engine "
            f"({type(parts.engine).__name__}): DAPO's overlong shaping measures one response "
            "against model.rollout.max_new_tokens, which bounds each turn here, not the "
            "episode (a row's turns together could take more than the documented floor "
            "-overlong_penalty); set model.ppo.overlong_buffer: 0 (bound episodes with the "
            "engine's max_tokens and max_turns instead)."
        )


def _runner(parts: RunParts) -> RolloutRunner:
    """Step 2: ``model.runner`` (``null``: from the staleness and the engine's capabilities)."""
    r = parts.rollout
    runner = parts.runner or default_runner(r.max_staleness, parts.engine)
    layout = parts.parallel.layout
    if layout.shards_weights() and (r.max_staleness or not runner.live_weights):
        raise SettingError(
            f"trainer.strategy shards the weights ({type(layout).__name__}) but "
            f"model.rollout.max_staleness={r.max_staleness} with runner "
            f"{type(runner).__name__} generates outside the training step; use "
            "max_staleness: 0 and the default runner, or trainer.strategy=ppo_ddp."
        )
    name = type(runner).__name__
    if parts.runner is not None:
        note("model.runner", name, setting=name)
    else:
        why = "generates in the trainer" if not r.max_staleness else "generates ahead"
        note("model.runner", name, f"model.rollout.max_staleness={r.max_staleness}: {why}")
    return runner


def _check_ray_cpus(parts: RunParts, runner: RolloutRunner) -> None:
    """What this run starts on a local Ray fits its ``trainer.ray.num_cpus``.

    Ray waits for an actor it cannot place (the workers' start then times out, minutes
    later), so the count is made before anything starts: the store's services and each set
    of rollout workers (a second set drives asynchronous rollouts, or any runner that
    generates on its own copy of the engine). An attached cluster (or a Ray already running
    in this process) is checked by the engine when its workers start.
    """
    total = local_ray_cpus(parts.ray)
    per_set, store = capabilities_of(parts.engine).ray_cpus, ray_cpus_of(parts.store)
    if total is None or not per_set:
        return
    s = parts.rollout.max_staleness
    sets = 2 if s or not runner.live_weights else 1
    need = store + sets * per_set
    if need <= total:
        return
    second = f" x 2 (model.rollout.max_staleness={s}: {type(runner).__name__} drives a second set)"
    raise SettingError(
        f"trainer.ray.num_cpus={total} cannot place this run's Ray actors: "
        f"{type(parts.engine).__name__}'s workers take {per_set} logical CPUs"
        f"{second if sets == 2 else ''}, the replay store's services {store}: {need} in all; "
        f"Ray would wait for them until the workers' start times out. Raise "
        f"trainer.ray.num_cpus to {need} (logical CPUs, not cores), or use fewer workers "
        "(model.engine.init_args.num_workers)"
        + (", or set model.rollout.max_staleness: 0." if sets == 2 else ".")
    )


def _off_policy(parts: RunParts, ppo: PPOConfig) -> OffPolicyCorrection:
    """Step 5: the actor's off-policy correction (truncated importance weights for stale rows)."""
    given = parts.actor.off_policy
    resolved = stale_correction(parts.rollout, ppo.old_logprobs, given)
    key = "model.actor.init_args.off_policy.mode"
    why = f"model.rollout.max_staleness={parts.rollout.max_staleness}"
    note(key, resolved.mode, why if given.mode == "auto" else "", given.mode)
    return resolved


def plan_changes(saved: dict[str, dict[str, str]], current: RunPlan) -> list[str]:
    """Decisions of ``auto`` that resolve otherwise on resume, the settings being the same.

    A setting changed on resume is judged by :func:`lppo.run.checkpointing.settings_changes`;
    here only an ``auto`` kept ``auto`` is compared, since its value sets what the run computes
    (π_old's producer, the runner, the off-policy correction…).

    Returns:
        Lines ``key: auto -> old, now new`` (empty: the plans agree).
    """
    out = []
    for key, now in current.state_dict().items():
        before = saved.get(key)
        if before is None or before["setting"] != "auto" or now["setting"] != "auto":
            continue
        if before["value"] != now["value"]:
            out.append(f"{key}: auto was {before['value']!r}, now {now['value']!r}")
    return out


def with_decisions(plan: RunPlan, decisions: list[Decision]) -> RunPlan:
    """``plan`` holding ``decisions`` (every note of build → plan → wire)."""
    return dataclasses.replace(plan, decisions=decisions)
