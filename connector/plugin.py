"""vLLM plugin entry point: registers ``PegaKVConnector`` in vLLM's connector registry.

pyproject.toml declares :func:`register` under the ``vllm.general_plugins`` entry-point
group, which vLLM loads in every process it starts (API server, engine core, workers).
Registered, the connector is known by name alone, without
``kv_connector_module_path``: inside ``MultiConnector``'s ``connectors`` list, and when
vLLM rebuilds its stats from the engine core's messages.  ``VLLM_PLUGINS`` (vLLM's
allow-list of plugins) must name ``pegaflow`` when it is set.

Importing this module imports nothing of vLLM; :func:`register` does.
"""

from __future__ import annotations

#: The name vLLM knows the connector by (also its class name: vLLM keys the stats of a
#: ``MultiConnector``'s children by class name and looks them up in the registry).
CONNECTOR_NAME = "PegaKVConnector"
CONNECTOR_MODULE = "pegaflow.connector"


def register() -> None:
    """Register ``PegaKVConnector`` with vLLM's ``KVConnectorFactory``, once per
    process (vLLM may call general plugins more than once; a second call does nothing).
    The class itself is imported lazily, when vLLM first creates the connector."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
    except ValueError:  # "already registered": by an earlier call in this process
        pass
