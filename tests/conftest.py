"""Shared fixtures: a real etcd server (tests/etcd_fixture.py) and real service processes."""

pytest_plugins = ["tests.etcd_fixture"]
