"""The run: ``PPOSystem``, ``PPOTrainer``, the run plan and the CLI.

Also run directories, checkpoints, signals, the run log and export. The fit loop is
:mod:`lppo.loop`, the one user of Lightning's private API.
"""
