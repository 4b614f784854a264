"""lppo: streamed PPO post-training for language models, built on Lightning."""

__version__ = "0.1.0"
