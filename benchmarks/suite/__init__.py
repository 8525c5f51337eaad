"""The benchmark suite behind ``python -m benchmarks.run`` (see ``benchmarks/run.py``).

Modules, in the order a run uses them: :mod:`~benchmarks.suite.spec` (what a configuration is, and its analytic
bound), :mod:`~benchmarks.suite.launch` (real processes, forked from one pre-imported parent),
:mod:`~benchmarks.suite.instrument` (per-rank counters: compute, waits, collectives, memory),
:mod:`~benchmarks.suite.models` (emulated accelerators and the small GPT), :mod:`~benchmarks.suite.workers` (one
function per implementation: bfpp through Lightning, the same schedule by hand, torch's schedules with FSDP2,
Lightning's ``ModelParallelStrategy``, independent processes), and :mod:`~benchmarks.suite.report` (table and plot).
"""
