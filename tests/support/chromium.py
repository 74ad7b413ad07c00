"""A headless Chromium to render pages, where one is installed."""

from __future__ import annotations

import shutil
import subprocess
import tempfile

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def chromium(url: str, *args: str) -> str:
    """Run headless Chromium on ``url`` (loopback only) and return its stdout."""
    assert CHROMIUM is not None
    with tempfile.TemporaryDirectory(prefix="pegaflow-chromium-") as profile:
        cmd = [
            CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
            "--no-first-run", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", f"--user-data-dir={profile}", "--hide-scrollbars",
            "--window-size=1400,1050", "--virtual-time-budget=4000", *args, url,
        ]  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout
