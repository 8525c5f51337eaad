"""Measuring what the planner takes as input: a module's per-layer costs (``profile``) and this machine's
(``calibrate``, on layers that emulate an accelerator: ``emulated``; its parts: ``links``, ``emulated_jobs``,
``fitting``). These run torch (and Lightning); the planner itself (:mod:`lightning_bfpp.plan`) is pure.

Nothing here imports above the engine (the adapter, the integrations, the package root): what measuring needs
from there, the step's capture and the strategy to train with, is passed in by the caller.
"""
