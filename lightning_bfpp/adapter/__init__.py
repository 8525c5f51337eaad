"""The Lightning adapter: :class:`~lightning_bfpp.adapter.strategy.BFPPStrategy` and what only Lightning needs.

Capturing the user's ``training_step`` (``user_step``), replaying what it logged on every rank
(``logged_values``), checks of the Trainer's set-up (``guards``), checkpoint hooks (``checkpointing``), prediction
merging (``predictions``), the whole model's summary (``summary``), the planner's ``"auto"`` (``auto``) and
Lightning's private names (``_lightning_compat``). The engine below it imports none of this.
"""
