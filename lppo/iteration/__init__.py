"""The RL iteration: the controller, its phases, the chunk planner, the data module, the hooks.

The phases are score, advantages, critic, actor and release; chunks are planned and read here,
rows balanced over the data-parallel ranks, and lppo's hooks defined.
"""
