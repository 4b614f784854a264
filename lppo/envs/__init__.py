"""Environments for multi-turn rollouts: what answers the policy between its turns."""
