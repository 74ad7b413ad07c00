"""Test helper: a real vLLM engine process (``tests/support/vllm_runner.py``) to send
commands to."""

from __future__ import annotations

import glob
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
TINY_MODEL = str(HERE / "assets" / "tiny-llama")


def start_failure(name: str, log: list[str], tail: int = 60) -> str:
    """Why a vLLM process did not start: the first error lines of its log (the engine
    core's root cause, which the API server's own traceback only points "above" to), then
    its tail."""
    first = next(
        (i for i, line in enumerate(log) if "Traceback" in line or "ERROR" in line), len(log)
    )
    cause = log[first : min(first + 40, max(len(log) - tail, first))]
    return "\n".join([f"{name} did not start:", *cause, "[...]" if cause else "", *log[-tail:]])


class VllmEngine:
    """One engine process; :meth:`generate` / :meth:`ttft` block until it answers."""

    def __init__(
        self,
        spec: dict[str, Any],
        env: dict[str, str] | None = None,
        name: str = "engine",
        start_timeout: float = 900.0,
        prefix: list[str] | None = None,
    ) -> None:
        """``prefix``: a command prefix the engine runs under (a host of
        ``tests/support/netns_hosts.py``: its ``Host.prefix``)."""
        self.name = name
        self.prefix = list(prefix or [])
        self.spec = {"model": TINY_MODEL, **spec}
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.log: list[str] = []
        self._results: queue.Queue[str] = queue.Queue()
        self.popen = subprocess.Popen(
            [*self.prefix, sys.executable, str(HERE / "vllm_runner.py"), json.dumps(self.spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=full_env,
            cwd=REPO,
            start_new_session=True,  # its own process group: EngineCore and workers die with it
        )
        self._ready = threading.Event()
        self._pumping = threading.Thread(target=self._pump, daemon=True)
        self._pumping.start()
        deadline = time.monotonic() + start_timeout
        while not self._ready.wait(0.2):
            if self.popen.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(start_failure(name, self.log))

    def _pump(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            line = line.rstrip("\n")
            if line == "READY":
                self._ready.set()
            elif line.startswith("RESULT "):
                self._results.put(line[len("RESULT ") :])
            else:
                self.log.append(line)
                if len(self.log) > 5000:
                    del self.log[:2500]
        self._results.put("")

    def tail(self, n: int = 60) -> str:
        """The end of the engine's output."""
        return "\n".join(self.log[-n:])

    def call(self, cmd: dict[str, Any], timeout: float = 600.0) -> dict[str, Any]:
        """Send one command, return its answer."""
        assert self.popen.stdin is not None
        self.popen.stdin.write(json.dumps(cmd) + "\n")
        self.popen.stdin.flush()
        try:
            line = self._results.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(f"{self.name}: no answer in {timeout} s:\n{self.tail()}") from None
        if not line:
            raise RuntimeError(f"{self.name} exited:\n{self.tail()}")
        res = json.loads(line)
        if "error" in res:
            raise RuntimeError(f"{self.name}: {res['error']}\n{self.tail()}")
        return res

    def generate(self, prompts: list[list[int]], max_tokens: int = 8) -> dict[str, Any]:
        """Greedy outputs and per-request cached-token counts of one batch."""
        return self.call({"op": "generate", "prompts": prompts, "max_tokens": max_tokens})

    def kv_digest(self, prompt: list[int]) -> list[str | None]:
        """Per full block of ``prompt``, a digest of its KV bytes in the engine's cache
        (None: not cached); the engine needs ``VLLM_ENABLE_V1_MULTIPROCESSING=0``."""
        return self.call({"op": "kv_digest", "prompt": prompt})["digests"]

    def kv_group_digests(self, prompt: list[int]) -> list[list[str | None]]:
        """:meth:`kv_digest` per KV cache group (vLLM's hybrid KV cache manager: each
        group's blocks over its own layers; one group: one list)."""
        res = self.call({"op": "kv_digest", "prompt": prompt})
        return res.get("groups", [res["digests"]])

    def ttft(self, prompts: list[list[int]]) -> dict[str, Any]:
        """Per-prompt time to first token, one prompt at a time."""
        return self.call({"op": "ttft", "prompts": prompts})

    def stop(self, timeout: float = 180.0) -> None:
        """Quit gracefully (the connector drains its saves, vLLM frees its shared
        memory), else kill; returns once :attr:`log` holds all the engine wrote."""
        if self.popen.poll() is None:
            try:
                assert self.popen.stdin is not None
                self.popen.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.popen.stdin.flush()
                self.popen.wait(timeout)
            except (subprocess.TimeoutExpired, BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:  # let EngineCore and workers exit on their own
            try:
                os.killpg(self.popen.pid, 0)
            except (ProcessLookupError, PermissionError):
                break
            time.sleep(0.2)
        self.kill()  # leftovers of the group, if any
        self._pumping.join(30)  # the last lines (the final cache report) reach the log

    def kill(self) -> None:
        """SIGKILL the engine and every process it started (EngineCore, workers)."""
        # under a prefix, /dev/shm may be another mount's (a host's): its owner removes it
        kill_group(self.popen, unlink_shm=not self.prefix)


def kill_group(popen: subprocess.Popen[Any], unlink_shm: bool = True) -> None:
    """SIGKILL a process started in its own session and every process of its group, and
    remove the shared-memory segments they had mapped (vLLM's message queues are
    ``/dev/shm/psm_*``; a SIGKILL leaves them behind, a few hundred MiB each, and a
    machine running many tests or benchmarks fills its ``/dev/shm``).  ``unlink_shm``
    false: leave them (the group ran in another mount namespace, whose ``/dev/shm`` is
    not this process's: a host of ``tests/support/netns_hosts.py`` removes its own)."""
    leftovers = _shm_segments(popen.pid) if unlink_shm else set()
    try:
        os.killpg(popen.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if popen.poll() is None:
        popen.kill()
    popen.wait(30)
    for path in leftovers:
        try:
            os.unlink(path)
        except OSError:
            pass  # unlinked by its owner already


def _shm_segments(pgid: int) -> set[str]:
    """The ``/dev/shm/psm_*`` segments mapped by processes of group ``pgid``."""
    found: set[str] = set()
    for d in glob.glob("/proc/[0-9]*"):
        try:
            if os.getpgid(int(d[6:])) != pgid:
                continue
            with open(d + "/maps") as f:
                for line in f:
                    i = line.find("/dev/shm/psm_")
                    if i >= 0:
                        found.add(line[i:].split()[0])
        except (OSError, ValueError):
            continue  # gone, or not ours to read
    return found


def prompts(
    n: int, length: int, seed: int = 0, vocab: int = 1000, prefix: list[int] | None = None
) -> list[list[int]]:
    """``n`` deterministic token-id prompts of ``length`` tokens (after ``prefix``)."""
    import random

    rng = random.Random(seed)
    pre = list(prefix or [])
    return [pre + [rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def oracle_engine(
    ready: dict[str, str], spec: dict[str, Any], stats_path: str, name: str
) -> VllmEngine:
    """An engine of ``spec`` with the connector on the ``pegaflow-server`` that announced
    ``ready`` (its node found by id), every hit claimed (the cost model is not under
    test) and its engine core in the runner's process, where ``kv_digest`` reads the KV
    cache."""
    connector = {
        "coordinators": ready["coordinator"], "local_node": ready["node"],
        "stats_path": stats_path, "transfer_timeout_s": 10.0, "cost_model": False,
    }  # fmt: skip
    return VllmEngine(
        {**spec, "connector": connector}, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, name=name
    )


def connector_stats(prefix: str) -> dict[str, float]:
    """Cumulative connector counters of an engine (scheduler + all workers), from the
    JSON files the connector writes when ``stats_path`` is set."""
    out: dict[str, float] = {}
    for path in glob.glob(f"{prefix}.*.json"):
        try:
            with open(path) as fh:
                for k, v in json.load(fh).items():
                    out[k] = out.get(k, 0) + v
        except (OSError, ValueError):
            pass
    return out


def wait_saved(prefix: str, blocks: int, timeout: float = 120.0) -> dict[str, float]:
    """Wait until an engine's connector saved (or found present) ``blocks`` blocks."""
    deadline = time.monotonic() + timeout
    while True:
        s = connector_stats(prefix)
        done = s.get("save_blocks", 0) + s.get("save_present_blocks", 0)
        if done >= blocks or time.monotonic() > deadline:
            return s
        time.sleep(0.2)


def vllm_cli() -> list[str]:
    """The ``vllm`` command: the script next to this Python, else its module (vLLM
    installed with ``pip --target``, as on the GPU machine, has no script on the path)."""
    script = Path(sys.executable).parent / "vllm"
    return [str(script)] if script.exists() else [sys.executable, "-m", "vllm.entrypoints.cli.main"]


def tiny_model_with_tokenizer(directory: Path, config: dict[str, Any] | None = None) -> str:
    """The tiny Llama of :data:`TINY_MODEL` (or a model of ``config``, for dummy
    weights) plus a word-level tokenizer (``w3`` ... ``w1023``, one id per word),
    written to ``directory``: what vLLM's OpenAI server needs to take text prompts and
    answer text.  Returns the model path."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    directory.mkdir(parents=True, exist_ok=True)
    max_len = 4096 if config is None else int(config.get("max_position_embeddings", 4096))
    if config is None:
        config = json.loads((Path(TINY_MODEL) / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(config))
    # every id the model can sample decodes to a word (dummy weights sample any id)
    n = int(config.get("vocab_size", 1024))
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, n)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(directory / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "<unk>",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "model_max_length": max_len,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(cfg))
    return str(directory)


def text_prompt(length: int, seed: int = 0) -> str:
    """A deterministic text prompt of exactly ``length`` tokens for
    :func:`tiny_model_with_tokenizer`'s tokenizer."""
    return " ".join(f"w{t}" for t in prompts(1, length, seed=seed)[0])


class ServeProcess:
    """``vllm serve MODEL ARGS...`` as a real process on a free loopback port, in its own
    process group (its engine core dies with it), started at once: :meth:`wait_ready`
    blocks until its ``/health`` answers."""

    def __init__(
        self,
        model: str,
        args: list[str],
        kv_transfer_config: dict[str, Any] | None,
        env: dict[str, str] | None = None,
        name: str = "vllm-serve",
    ) -> None:
        from pegaflow.tools.devcluster import free_port

        self.name = name
        self.model = model
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [
            *vllm_cli(), "serve", model, "--host", "127.0.0.1", "--port", str(self.port), *args,
        ]  # fmt: skip
        if kv_transfer_config is not None:
            argv += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
        self.log: list[str] = []
        self.popen = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            cwd=REPO,
            start_new_session=True,  # its own process group: EngineCore dies with it
        )
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self.log.append(line.rstrip("\n"))
            if len(self.log) > 5000:
                del self.log[:2500]

    def healthy(self) -> bool:
        """Whether ``/health`` answers 200 now."""
        import urllib.request

        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def wait_ready(self, timeout: float) -> None:
        """Block until ``/health`` answers; kill and raise with the log's tail if the
        process exits or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        while not self.healthy():
            if self.popen.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(start_failure(self.name, self.log))
            time.sleep(0.5)

    def tail(self, n: int = 60) -> str:
        """The end of the server's output."""
        return "\n".join(self.log[-n:])

    def terminate(self, timeout: float = 60.0) -> int | None:
        """SIGTERM the server (as systemd or Kubernetes stop it) and wait for it; kill
        whatever of its process group is left.  Returns its exit status (None: killed)."""
        rc: int | None = None
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                rc = self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                rc = None
        else:
            rc = self.popen.returncode
        self.kill()
        return rc

    def kill(self) -> None:
        """SIGKILL the server and every process it started."""
        kill_group(self.popen)


class VllmServe(ServeProcess):
    """``vllm serve`` (vLLM's OpenAI-compatible HTTP server) as a real process, started
    with the CLI exactly as an operator runs it, the tiny test model's settings first;
    talked to over HTTP on loopback.  Returns once it is up."""

    def __init__(
        self,
        model: str,
        kv_transfer_config: dict[str, Any] | None,
        env: dict[str, str] | None = None,
        extra: list[str] | None = None,
        name: str = "vllm-serve",
        start_timeout: float = 900.0,
    ) -> None:
        args = [
            "--load-format", "dummy", "--enforce-eager", "--dtype", "bfloat16",
            "--block-size", "32", "--max-model-len", "2048",
            "--kv-cache-memory-bytes", str(128 << 20), "--seed", "0", *(extra or []),
        ]  # fmt: skip
        super().__init__(model, args, kv_transfer_config, env, name)
        self.wait_ready(start_timeout)

    def complete(self, prompt: str, max_tokens: int = 8, timeout: float = 120.0) -> dict[str, Any]:
        """One greedy ``POST /v1/completions``; the decoded JSON answer."""
        import urllib.error
        import urllib.request

        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
        }
        req = urllib.request.Request(
            self.url + "/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return dict(json.loads(r.read()))
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"{self.name}: HTTP {e.code}: {e.read()!r}\n{self.tail()}") from e

    def metrics(self, timeout: float = 10.0) -> dict[str, float]:
        """``GET /metrics``: every sample's value, summed over its labels, by sample name."""
        import urllib.request

        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(self.url + "/metrics", timeout=timeout) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                out[s.name] = out.get(s.name, 0.0) + s.value
        return out


def cached_tokens(answer: dict[str, Any]) -> int:
    """``usage.prompt_tokens_details.cached_tokens`` of a completion (vLLM fills it with
    ``--enable-prompt-tokens-details``)."""
    details = answer["usage"].get("prompt_tokens_details")
    assert details is not None, f"no prompt_tokens_details in {answer['usage']}"
    return int(details["cached_tokens"])
