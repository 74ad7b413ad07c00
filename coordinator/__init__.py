"""The coordinator: global index mirror, lookups, placement and status."""
