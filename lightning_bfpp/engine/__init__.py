"""The execution engine: stages, sharding, the runtime, tied parameters, weight passing, checkpoint files, failures.

Imports no Lightning and no torchmetrics (``tests/unit/test_layering.py`` imports every module here with both
blocked). It takes the user's step as callbacks (:class:`~lightning_bfpp.engine.pipeline.StepCode`), so a plain
torch loop drives it as the Lightning adapter does (``tests/distributed/plain_loop.py``).

Entry points: :func:`~lightning_bfpp.engine.build.build_pipeline` places and shards a module's layers and returns
a :class:`~lightning_bfpp.engine.pipeline.Pipeline`, whose ``run`` trains or evaluates one batch.
"""
