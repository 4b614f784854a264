"""The Hugging Face ``generate`` engine (the default) and its helpers.

Prefill, attention, the Gumbel sampler, cutting samples and turn-by-turn generation.
"""

from lppo.rollout.hf.engine import HFGenerateEngine

__all__ = ["HFGenerateEngine"]
