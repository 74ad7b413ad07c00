"""Operator and developer tools: the ``pegaflow`` CLI, the local dev cluster, the dashboard."""
