"""Measuring what the planner takes as input: a module's per-layer costs (``profile``) and this machine's
(``calibrate``, on layers that emulate an accelerator: ``emulated``). These run torch (and Lightning); the
planner itself (:mod:`lightning_bfpp.plan`) is pure.
"""
