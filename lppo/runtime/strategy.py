"""``PPOStrategy``: lppo's processes on Lightning's DDP launcher, laid out by a parallel layout.

Lightning's ``DDPStrategy`` wraps the LightningModule in ``DistributedDataParallel``, which
all-reduces gradients during every backward. lppo builds one optimizer step from any number of
chunks and sums the gradients across ranks exactly once, when the step finishes
(:meth:`lppo.modules.PPOModule.finish`), so the wrapper would be redundant at best and wrong or
deadlocking at worst (ranks run different numbers of backward passes). This strategy launches
the processes and initializes the process group exactly like ``DDPStrategy`` (``gloo`` on CPU,
``nccl`` on CUDA unless ``process_group_backend`` says otherwise), broadcasts rank 0's module
states once, and hands the module to its :class:`~lppo.layouts.ParallelLayout`
(:mod:`lppo.layouts`), which leaves it unwrapped (``ppo_ddp``), shards it (``ppo_fsdp``) or
takes megatron-core's data x tensor-parallel groups (``ppo_megatron``).

Use it as ``--trainer.strategy ppo_ddp`` / ``ppo_fsdp`` / ``ppo_megatron`` (the names of
:data:`lppo.layouts.LAYOUTS`, registered in Lightning's ``StrategyRegistry`` when
:mod:`lppo.run.trainer` is imported), ``--trainer.strategy lppo.runtime.strategy.PPOStrategy`` (with
``layout: class_path: ...``), or ``PPOTrainer(strategy=PPOStrategy(), devices=2)``.

Data layout: each rank generates and rewards its own contiguous blocks of the iteration's
prompts (``model.rollout.prompts_per_block``), puts those rows into its store (a rank-local
one, or its own row ids of a shared one), and scores, estimates and trains only them; one
all-gather of row metadata gives every rank the same plan with global normalizers and equal
chunk counts (zero-weight padding), and the statistics spanning rows are reduced across ranks.
"""

from __future__ import annotations

import atexit
import ipaddress
import os
import socket
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

from lppo.layouts import LAYOUTS
from lppo.layouts.base import DataParallelLayout, ParallelContext, ParallelLayout
from lppo.loop import plain_optimizer
from lppo.parallel import DEFAULT_TIMEOUT, close_process_group

#: Name of the data-parallel :class:`PPOStrategy` in Lightning's ``StrategyRegistry``.
STRATEGY_NAME = "ppo_ddp"


class PPOStrategy(DDPStrategy):
    """Multi-process lppo: DDP's launch and process group, the module laid out by ``layout``.

    Gradients are reduced across ranks once per optimizer step by the PPO modules through the
    layout (:meth:`~lppo.modules.PPOModule.finish`), diagnostics once per step,
    advantage-whitening moments once per iteration. Each rank generates, scores and trains
    only its own rows (see the module docstring).

    The replay store may be rank-local (each process its own, like the default
    :class:`~lppo.replay.MemoryReplayStore`) or shared (each rank then reads and releases only
    the row ids it put). A rank without a real chunk in a step trains a zero-weight padding
    chunk, so every rank runs the same number of chunks.

    Args:
        accelerator: see ``DDPStrategy``.
        parallel_devices: see ``DDPStrategy``.
        cluster_environment: see ``DDPStrategy``.
        checkpoint_io: see ``DDPStrategy``.
        precision_plugin: see ``DDPStrategy``.
        process_group_backend: ``torch.distributed`` backend; ``None`` picks ``nccl`` on CUDA
            devices and ``gloo`` otherwise.
        timeout: timeout of collective operations.
        start_method: how processes are started (``popen`` re-runs the launching command, as
            ``strategy="ddp"`` does; ``spawn``/``fork`` as ``ddp_spawn``/``ddp_fork``).
        layout: how the modules are held over the ranks (:mod:`lppo.layouts`): full replicas
            (:class:`~lppo.layouts.DataParallelLayout`, the default), FSDP2 shards
            (:class:`~lppo.layouts.FSDPLayout`) or megatron-core's groups
            (:class:`~lppo.layouts.MegatronLayout`).
    """

    def __init__(
        self,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = DEFAULT_TIMEOUT,
        start_method: str = "popen",
        layout: ParallelLayout | None = None,
    ) -> None:
        self.layout: ParallelLayout = layout if layout is not None else DataParallelLayout()
        #: This rank's groups, built by the layout once the process group is up and before
        #: the models are built (:meth:`setup_environment`); ``None`` until then.
        self.parallel: ParallelContext | None = None
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,  # type: ignore[arg-type]
        )

    def setup_distributed(self) -> None:
        """Bind the process group's sockets to loopback when the main address is loopback.

        Gloo and NCCL otherwise pick the interface of the machine's hostname, which may be an
        external one even when every rank runs here (``MASTER_ADDR`` unset or 127.0.0.1).
        The group is destroyed at interpreter exit (:func:`~lppo.parallel.close_process_group`).
        """
        assert self.cluster_environment is not None
        bind_to_loopback(self.cluster_environment.main_address)
        super().setup_distributed()
        # Whoever runs the fit (lppo's CLI, a user's script): the group's gloo threads stop
        # while the interpreter is still whole, and collectives after fit still work.
        atexit.unregister(close_process_group)
        atexit.register(close_process_group)

    def setup_environment(self) -> None:
        """Start the processes' group, then have the layout build this rank's groups.

        Lightning runs this before the module's ``configure_model``, so a layout whose model
        specs need the groups to build (megatron's) hands them over before any model exists.
        """
        super().setup_environment()
        if self.lightning_module is not None:
            self.parallel = self.layout.build_context(
                self.lightning_module, self.world_size, self.global_rank
            )

    def configure_ddp(self) -> None:
        """Hand the module to the layout: rank 0's states everywhere, then wrap or shard.

        Under megatron tensor parallelism "everywhere" is the data-parallel group (each
        tensor-parallel rank's shards come from data-parallel rank 0 of the same tensor rank).
        """
        assert isinstance(self.model, LightningModule)
        self.layout.prepare(self.model, parallel_context(self))

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The full (unsharded) state of the module, from every rank (a collective)."""
        assert self.lightning_module is not None
        return self.layout.full_state_dict(self.lightning_module)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's full state, from every rank (a collective)."""
        return self.layout.optimizer_state(plain_optimizer(optimizer))

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Load each optimizer's full state as this rank's (sharded) optimizer holds it."""
        states = [
            self.layout.local_optimizer_state(optimizer, state)
            for optimizer, state in zip(
                self.optimizers, checkpoint["optimizer_states"], strict=True
            )
        ]
        super().load_optimizer_state_dict({**checkpoint, "optimizer_states": states})


#: The data-parallel strategy's former name (``ppo_ddp`` builds a :class:`PPOStrategy`).
PPODDPStrategy = PPOStrategy


#: Environment variables naming the interface gloo / NCCL open their sockets on.
SOCKET_IFNAME_VARS: tuple[str, ...] = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def is_loopback(address: str) -> bool:
    """Whether ``address`` (a host name or IP) resolves to a loopback address."""
    try:
        return ipaddress.ip_address(socket.gethostbyname(address)).is_loopback
    except (OSError, ValueError):
        return False


def loopback_interface() -> str | None:
    """The name of this machine's loopback interface (``lo`` on Linux, ``lo0`` on macOS)."""
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in names if n in ("lo", "lo0")), None)


def bind_to_loopback(main_address: str) -> None:
    """Make gloo and NCCL use the loopback interface when ``main_address`` is loopback.

    An interface configured by the user (``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``) or a
    non-loopback main address (a real multi-node run) is left alone.
    """
    interface = loopback_interface()
    if interface is None or not is_loopback(main_address):
        return
    for name in SOCKET_IFNAME_VARS:
        os.environ.setdefault(name, interface)


def parallel_context(strategy: Any) -> ParallelContext:
    """The process groups of ``strategy``: the one place a run's data-parallel group is decided.

    Built by the strategy's layout over the launched processes (megatron's data- and
    tensor-parallel groups under ``ppo_megatron``), once, in
    :meth:`PPOStrategy.setup_environment`; single-process for Lightning's own single-device
    strategies.
    """
    if isinstance(strategy, PPOStrategy):
        if strategy.parallel is not None:
            return strategy.parallel
        return strategy.layout.context(strategy.world_size, strategy.global_rank)
    return ParallelContext()


def check_strategy(strategy: Any, world_size: int) -> None:
    """Reject multi-process strategies other than :class:`PPOStrategy`.

    Raises:
        ValueError: ``world_size > 1`` with another strategy, naming ``trainer.strategy`` and
            the fix.
    """
    if world_size <= 1 or isinstance(strategy, PPOStrategy):
        return
    raise ValueError(
        f"trainer.strategy={type(strategy).__name__} with trainer.devices x trainer.num_nodes = "
        f"{world_size} processes is not supported: Lightning's own multi-process strategies "
        "wrap (or shard) the model so that gradients are synced on every backward, while lppo "
        "sums them across ranks once per optimizer step. Use "
        + " or ".join(f"trainer.strategy={name}" for name in LAYOUTS)
        + " (lppo.runtime.strategy.PPOStrategy), or trainer.devices=1."
    )


for _name, (_layout, _description) in LAYOUTS.items():
    if _name not in StrategyRegistry:
        StrategyRegistry.register(_name, PPOStrategy, description=_description, layout=_layout())
