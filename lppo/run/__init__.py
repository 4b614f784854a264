"""The run: ``PPOSystem``, ``PPOTrainer``, the fit loop, the run plan and the CLI.

Also run directories, checkpoints, signals, the run log and export.
"""
