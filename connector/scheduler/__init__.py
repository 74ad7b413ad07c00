"""The scheduler side of the connector: lookups, the cost model, step plans, handoffs.

:class:`~pegaflow.connector.scheduler.side.SchedulerSide` is its facade; it runs in
vLLM's scheduler (engine-core process) and imports no torch.
"""
