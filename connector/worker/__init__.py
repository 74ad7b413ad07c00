"""The worker side of the connector: :class:`~pegaflow.connector.worker.side.WorkerSide`
routes each step's loads and saves through the media (:mod:`pegaflow.connector.media`)
and keeps the books of their results."""
