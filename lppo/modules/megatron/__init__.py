"""megatron-core actor and critic (extra ``[megatron]``): see docs/guides/megatron.md.

Importing this package fails with an ``ImportError`` naming the extra when megatron-core is
missing; nothing else in lppo imports it.
"""

from lppo.modules.megatron.model import require_megatron

require_megatron()

from lppo.modules.megatron.actor import MegatronActor  # noqa: E402
from lppo.modules.megatron.critic import MegatronCritic  # noqa: E402
from lppo.modules.megatron.model import MegatronGPT, ValueHead  # noqa: E402

__all__ = ["MegatronActor", "MegatronCritic", "MegatronGPT", "ValueHead"]
