"""When a process asks glibc for huge pages (``pegaflow.huge_pages``): the kernel's mode
read from sysfs, the re-execution done only where it changes something and never twice,
and the status an operator sees.  A real coordinator's re-execution is checked in
tests/integration/test_coordinator.py (its restart and failover test)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pegaflow import huge_pages


@pytest.mark.parametrize(
    ("text", "mode"),
    [
        ("always [madvise] never\n", "madvise"),
        ("[always] madvise never\n", "always"),
        ("always madvise [never]\n", "never"),
        ("", ""),
    ],
)
def test_the_kernels_mode_is_the_bracketed_word(tmp_path: Path, text: str, mode: str) -> None:
    f = tmp_path / "enabled"
    f.write_text(text)
    assert huge_pages.thp_mode(f) == mode
    assert huge_pages.thp_mode(tmp_path / "missing") == ""


def test_no_reexecution_once_asked_or_where_it_changes_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple[str, list[str], dict[str, str]]] = []
    monkeypatch.setattr(os, "execve", lambda *a: calls.append(a))
    monkeypatch.setattr(huge_pages, "glibc_has_tunable", lambda: True)
    monkeypatch.setattr(huge_pages.sys, "platform", "linux")
    monkeypatch.setattr(huge_pages, "thp_mode", lambda: "never")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
    huge_pages.reexec_with_huge_pages()
    assert calls == []  # the kernel gives none
    monkeypatch.setattr(huge_pages, "thp_mode", lambda: "madvise")
    huge_pages.reexec_with_huge_pages()
    assert len(calls) == 1
    env = calls[0][2]
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:" + huge_pages.TUNABLE
    monkeypatch.setenv("GLIBC_TUNABLES", env["GLIBC_TUNABLES"])
    huge_pages.reexec_with_huge_pages()
    assert len(calls) == 1  # the re-executed process carries on
    assert huge_pages.status() == "on"
    monkeypatch.delenv("GLIBC_TUNABLES")
    assert huge_pages.status() == "off (not asked for at start)"
