"""The runtime: the Lightning strategy over the layouts, Ray, and the run's lifetimes.

:mod:`lppo.runtime.lifetimes` is the one owner of the run's processes, threads and services.
"""
