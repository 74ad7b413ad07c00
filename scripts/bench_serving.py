#!/usr/bin/env python3
"""Serving benchmark: real ``vllm serve`` replicas sharing one PegaFlow cluster, under load.

A load generator over the replicas' OpenAI HTTP API (streaming ``/v1/completions``,
asyncio + aiohttp).  Per request it records the time to first token (TTFT), the
inter-token times and ``usage.prompt_tokens_details.cached_tokens`` (the replicas run
with ``--enable-prompt-tokens-details``).

Workloads reuse prefixes the way serving does (all three mixed by ``--mix``):

- multi-turn conversations: each turn's prompt is the whole history (earlier prompts and
  answers) plus a new user message; ``--conversations`` of them are active at once;
- long shared documents (``--docs``), each asked many different questions;
- a share of unique prompts.

With ``--conv-docs`` each conversation opens with one of the shared documents (round
robin), so conversations over one document share its prefix.

Requests go to the replicas round robin or at random (``--route``), with no affinity, so
only the shared cache carries a prefix from one replica to another.  Arrivals are Poisson
at each rate of ``--rates`` (requests/s), or at most ``--concurrency`` requests in flight,
or ``--closed-loop`` conversations in flight (conversations only: each turn sent when the
last is answered, to the next replica after the last's; issue 38's workload).  Every
point uses its own content (documents, conversations), so no point warms the next; so
does every run of a point with ``--repeats`` (the replicas are not restarted between
runs), whose measured requests are pooled for the TTFT p50 and p99, each with a 95 %
bootstrap interval, beside each run's own.

Setups compared in one run (``--setups``):

- ``vllm``: the replicas with vLLM's own prefix caching and no connector;
- ``pegaflow``: the replicas with the connector (the README's three keys) and one
  ``pegaflow-server`` started empty;
- ``warm``: the connector after the replicas are restarted (vLLM's caches empty, the
  server's pool holds what ``pegaflow`` saved; the same content is replayed);
- ``nodecline``: as ``pegaflow`` (a fresh server) with the connector's cost model off
  (``PEGAFLOW_CONNECTOR_COST_MODEL=0``): every hit found is loaded, none declined;
- ``pd``: ``--prefill-n`` prefill (``kv_producer``) and ``--decode-n`` decode
  (``kv_consumer``) replicas behind ``pegaflow-router --router-mode pd``, one
  ``pegaflow-server``; also the handoff cost: TTFT of ``--handoff-requests`` fresh
  prompts one at a time through the router against the same on one replica;
- ``rr-hosts`` and ``cache-hosts``: "hosts" are storage nodes with separate pools (etcd,
  a coordinator and one ``pegaflow-node`` per host, ``--hosts-n``, default one per
  replica); each replica's connector has its host's node as ``local_node``; the replicas
  are behind ``pegaflow-router`` in ``rr`` or ``cache`` mode.  Each starts its cluster
  empty.  Reported: hit rate, TTFT, the share of hits served from the same host (vLLM's
  own cache or the host's node, against blocks loaded from another host's node),
  the router's own ``prefix_blocks`` local share (cache mode) and how often a
  conversation's next turn stays on the replica of its last one.

Reported per setup and rate: request throughput, output tokens/s, TTFT mean/p50/p99,
inter-token p50/p99, the hit rate (cached / prompt tokens), the connector's lookups,
loads and saves per second (the replicas' ``/metrics``, ``vllm:pegaflow_*``), the hit
blocks it declined, and the node's CPU seconds per second; with the router, its
counters; per setup the throughput at the TTFT p99 objective (``--slo-ms``: the best
rate point that meets it); the outputs of each setup against the first (``vllm``) on the
first ``--compare`` requests of each point (greedy); per point each setup's TTFT p99,
p50 and throughput over the first's (issue 38's targets: at most 1, at most 0.6, at
least 1.5); for ``pd`` the handoff cost; for ``rr-hosts`` against ``cache-hosts`` their
hit rates, TTFT p99 ratios and same-host shares; a PNG with ``--plot``. The last line of
the output is one JSON object.

Examples::

    # CPU, tiny model (a word-level tokenizer is written for it), a short sweep
    python scripts/bench_serving.py --model tiny --replicas-n 2 --rates 1,2,4 --requests 60

    # H200: four 8B-shaped replicas with dummy weights on one GPU
    python scripts/bench_serving.py --model /models/llama-3.1-8b --replicas-n 4 \\
        --gpu-memory-utilization 0.2 --max-model-len 16384 --doc-tokens 8000 \\
        --first-tokens 2000 --rates 2,4,8,16 --requests 400 --slo-ms 2000 --plot out.png

    # sustained: one rate for 10 minutes, a small pool, the node's RSS every 10 s
    python scripts/bench_serving.py --model tiny --setups pegaflow --rates 2 \\
        --duration 600 --pool-size 32MiB --sample-s 10

    # P/D and cache-aware routing (CPU, tiny): vllm as the reference, 2 replicas each
    # (an odd --conversations: round robin then alternates each conversation's turns)
    python scripts/bench_serving.py --model tiny --setups vllm,pd,rr-hosts,cache-hosts \\
        --mix 1,0,0 --rates 1,2 --requests 28 --conversations 7 --first-tokens 256

    # issue 38: 16 conversations over shared 8k-token documents in flight, each turn to
    # the next of four replicas; the p99's interval from 5 runs; declining on and off
    python scripts/bench_serving.py --model llama-8b --replicas-n 4 --parallel-start \\
        --gpu-memory-utilization 0.2 --max-model-len 16384 --pool-size 40GiB \\
        --setups vllm,pegaflow,nodecline --closed-loop 16 --conv-docs --docs 4 \\
        --doc-tokens 8000 --first-tokens 200 --requests 288 --repeats 5 --out r.jsonl

    # replicas already running (one setup, labelled)
    python scripts/bench_serving.py --replicas http://h:8000,http://h:8001 --label mine
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import json
import math
import os
import random
import re
import shlex
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from pegaflow.connector.metrics import HISTOGRAMS  # noqa: E402
from pegaflow.router.proxy import REPLICA_HEADER  # noqa: E402

from pegaflow.tools.devcluster import (  # noqa: E402
    EtcdServer,
    Proc,
    start,
    start_coordinator,
    start_node,
    start_server,
)
from scripts._common import proc_cpu_seconds, proc_rss_bytes, trap_signals  # noqa: E402
from tests.support.vllm_engine import ServeProcess  # noqa: E402

#: The README's ``--kv-transfer-config``.
THREE_KEYS: dict[str, Any] = {
    "kv_connector": "PegaKVConnector",
    "kv_role": "kv_both",
    "kv_connector_module_path": "pegaflow.connector",
}
#: ``vllm serve`` arguments of the CPU preset ``--model tiny`` (as tests/support/vllm_engine.py).
TINY_ARGS = [
    "--load-format", "dummy", "--enforce-eager", "--dtype", "bfloat16",
    "--block-size", "32", "--max-model-len", "2048",
    "--kv-cache-memory-bytes", str(128 << 20),
]  # fmt: skip
#: Connector counters reported per second (keys of ``connector.metrics.COUNTERS``).  A
#: request vLLM keeps waiting is looked up again (``lookups_local`` where this host's node
#: holds every block), a lookup past its deadline is an error and no hit, and a hit found
#: is loaded unless the cost model declines it.  ``copy_seconds`` per second is how busy
#: the replicas' save threads (and their other copies) were.
RATE_COUNTERS = (
    "lookups", "lookups_local", "lookup_errors", "lookup_skipped", "lookup_hit_blocks",
    "cost_declined_blocks", "unreachable_declined_blocks", "load_blocks", "local_load_blocks",
    "save_blocks", "save_dropped_blocks", "copy_seconds",
)  # fmt: skip
#: Of those, the ones the timeline (``--sample-s``) shows per sample.
TIMELINE_COUNTERS = ("lookup_hit_blocks", "cost_declined_blocks", "load_blocks", "save_blocks")
#: Of those, the hit blocks the connector found and did not load (the cost model's, which
#: ``nodecline`` turns off, and those of an unreachable node): each point's totals.
DECLINED = ("cost_declined_blocks", "unreachable_declined_blocks")
_PEGA = re.compile(r"^vllm:pegaflow_(?:connector_)?(\w+?)(?:_total)?$")
#: Setups ``--setups`` knows; those behind ``pegaflow-router`` start it themselves.
SETUPS = ("vllm", "pegaflow", "warm", "nodecline", "pd", "rr-hosts", "cache-hosts")
#: Cache-aware routing's target: the share of a multi-turn workload's hits served from
#: the same host (issue 16).
SAME_HOST_TARGET = 0.9


# ---------------------------------------------------------------- workload


def words(rng: random.Random, n: int) -> str:
    """``n`` random words ``w3`` ... ``w1023``: one token each for the tiny model's
    word-level tokenizer, a few each for a BPE tokenizer (see ``tokens_per_word``)."""
    return " ".join(f"w{rng.randrange(3, 1024)}" for _ in range(max(1, n)))


@dataclass
class WorkloadSpec:
    """Shape of a workload; lengths in tokens (turned into words by ``tokens_per_word``)."""

    conversations: int = 8
    turns: int = 4
    first_tokens: int = 512
    turn_tokens: int = 64
    docs: int = 4
    doc_tokens: int = 1024
    question_tokens: int = 32
    unique_tokens: int = 256
    mix: tuple[float, float, float] = (1.0, 1.0, 0.2)  # conversation, document, unique
    output_tokens: int = 16
    tokens_per_word: float = 1.0
    seed: int = 0
    vary_turns: bool = False
    """each conversation's length drawn from 1 .. 2 * ``turns`` - 1 (mean ``turns``);
    else all have ``turns``, and the conversations, issued round robin over their slots,
    end together and start again together: a wave of cold first turns every ``turns``
    rounds"""
    conv_docs: bool = False
    """each conversation opens with one of the shared documents (round robin over them),
    then its own ``first_tokens``: conversations over one document share its prefix"""

    def nwords(self, tokens: int) -> int:
        return max(1, round(tokens / self.tokens_per_word))


class Conversation:
    """One multi-turn conversation; ``history`` is the next turn's whole prompt."""

    def __init__(self, cid: int, spec: WorkloadSpec, prefix: str = "") -> None:
        self.cid = cid
        self._rng = random.Random(f"{spec.seed}-conv-{cid}")
        self.turns = spec.turns
        if spec.vary_turns and spec.turns > 1:
            self.turns = self._rng.randint(1, 2 * spec.turns - 1)
        self._turn_words = spec.nwords(spec.turn_tokens)
        own = words(self._rng, spec.nwords(spec.first_tokens))
        self.history = f"{prefix} {own}" if prefix else own
        self.issued = 0
        self.last_done: asyncio.Event | None = None

    def advance(self, answer: str) -> None:
        """The answer to the current prompt arrived: the next prompt is the history, the
        answer and a new user message."""
        self.history = f"{self.history} {answer.strip()} {words(self._rng, self._turn_words)}"
        self.history = re.sub(r"\s+", " ", self.history).strip()


@dataclass
class Item:
    """One request of a workload.  A conversation turn's prompt is known only once the
    previous turn (``prev``) is answered; ``done`` is set when this one is."""

    idx: int
    kind: str  # "conv", "doc" or "unique"
    stream: str
    turn: int = 0
    prompt: str | None = None
    conv: Conversation | None = None
    prev: asyncio.Event | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)

    async def ready_prompt(self) -> str:
        """The prompt, after the previous turn of its conversation is answered."""
        if self.prev is not None:
            await self.prev.wait()
        if self.conv is not None:
            return self.conv.history
        assert self.prompt is not None
        return self.prompt

    def finish(self, answer: str) -> None:
        if self.conv is not None:
            self.conv.advance(answer)
        self.done.set()


class Workload:
    """An endless, deterministic (per seed) sequence of :class:`Item`."""

    def __init__(self, spec: WorkloadSpec) -> None:
        self.spec = spec
        self._rng = random.Random(f"{spec.seed}-mix")
        self._docs = [
            words(random.Random(f"{spec.seed}-doc-{d}"), spec.nwords(spec.doc_tokens))
            for d in range(spec.docs)
        ]
        self._slots: list[Conversation | None] = [None] * max(1, spec.conversations)
        self._next_conv = 0
        self._conv_items = 0

    def items(self) -> Iterator[Item]:
        s = self.spec
        weights = [s.mix[0] if s.conversations else 0, s.mix[1] if s.docs else 0, s.mix[2]]
        if sum(weights) <= 0:
            raise ValueError("the workload mix has no kind of request")
        for idx in range(10**12):
            kind = self._rng.choices(("conv", "doc", "unique"), weights)[0]
            if kind == "conv":
                yield self._conv_item(idx)
            elif kind == "doc":
                d = self._rng.randrange(len(self._docs))
                q = words(self._rng, s.nwords(s.question_tokens))
                yield Item(idx, "doc", f"d{d}", prompt=f"{self._docs[d]} {q}")
            else:
                yield Item(
                    idx, "unique", f"u{idx}", prompt=words(self._rng, s.nwords(s.unique_tokens))
                )

    def conversation(self) -> Conversation:
        """The next new conversation (with ``conv_docs``, over the next document)."""
        cid = self._next_conv
        self._next_conv += 1
        doc = self._docs[cid % len(self._docs)] if self.spec.conv_docs and self._docs else ""
        return Conversation(cid, self.spec, doc)

    def _conv_item(self, idx: int) -> Item:
        slot = self._conv_items % len(self._slots)
        self._conv_items += 1
        conv = self._slots[slot]
        if conv is None or conv.issued >= conv.turns:
            conv = self._slots[slot] = self.conversation()
        item = Item(idx, "conv", f"c{conv.cid}", turn=conv.issued, conv=conv, prev=conv.last_done)
        conv.last_done = item.done
        conv.issued += 1
        return item


def conversation_turns(workload: Workload, replicas: int) -> Iterator[tuple[Item, int]]:
    """One closed-loop worker's requests and their replicas: conversations one after
    another, each turn on the next replica after its previous turn's (the first turns
    spread round robin over conversations).  Take the next only once the last is
    answered (its prompt holds that answer)."""
    while True:
        conv = workload.conversation()
        for turn in range(conv.turns):
            item = Item(-1, "conv", f"c{conv.cid}", turn=turn, conv=conv)
            yield item, (conv.cid + turn) % replicas


# ---------------------------------------------------------------- client


@dataclass
class Result:
    """One request's measurements (times in seconds)."""

    idx: int
    kind: str
    stream: str
    turn: int
    replica: int
    repeat: int = 0
    """which run of its load point (``--repeats``)"""
    t_send: float = 0.0
    ttft: float = math.nan
    e2e: float = math.nan
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    text: str = ""
    prompt_sha: str = ""
    served_by: str = ""
    """the replica that answered (the router's ``X-PegaFlow-Replica``; empty without)"""
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error


async def complete(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    prompt: str,
    max_tokens: int,
    timeout: float = 600.0,
    result: Result | None = None,
) -> Result:
    """One greedy streaming ``POST /v1/completions``; TTFT, inter-token times, usage."""
    r = result or Result(-1, "", "", 0, -1)
    r.prompt_sha = hashlib.sha1(prompt.encode()).hexdigest()[:16]
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    parts: list[str] = []
    t0 = time.perf_counter()
    r.t_send = time.time()
    last = t0
    try:
        async with session.post(
            url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=timeout)
        ) as resp:
            r.served_by = resp.headers.get(REPLICA_HEADER, "")
            if resp.status != 200:
                r.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return r
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    r.error = f"stream error: {chunk['error']}"
                    return r
                for choice in chunk.get("choices") or []:
                    if choice.get("text"):
                        now = time.perf_counter()
                        if not parts:
                            r.ttft = now - t0
                        else:
                            r.itl.append(now - last)
                        last = now
                        parts.append(choice["text"])
                usage = chunk.get("usage")
                if usage:
                    r.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    r.output_tokens = int(usage.get("completion_tokens") or 0)
                    details = usage.get("prompt_tokens_details") or {}
                    r.cached_tokens = int(details.get("cached_tokens") or 0)
    except (TimeoutError, aiohttp.ClientError, ValueError) as e:
        r.error = f"{type(e).__name__}: {e}"
        return r
    r.e2e = time.perf_counter() - t0
    r.text = "".join(parts)
    if not parts:
        r.error = "no tokens in the answer"
    return r


Sample = tuple[str, dict[str, str], float]


async def scrape_samples(
    session: aiohttp.ClientSession, url: str, timeout: float = 10.0
) -> list[Sample]:
    """``GET url`` (a Prometheus ``/metrics``): its samples (name, labels, value);
    empty if it cannot be read."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            text = await resp.text()
    except (TimeoutError, aiohttp.ClientError):
        return []
    return [
        (s.name, dict(s.labels), s.value)
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    ]


async def scrape(
    session: aiohttp.ClientSession, url: str, timeout: float = 10.0
) -> dict[str, float]:
    """``GET url`` (a Prometheus ``/metrics``): each sample's value, summed over its
    labels, by sample name; empty if it cannot be read."""
    out: dict[str, float] = {}
    for name, _, value in await scrape_samples(session, url, timeout):
        out[name] = out.get(name, 0.0) + value
    return out


def router_counters(samples: Sequence[Sample]) -> dict[str, float]:
    """A router's ``/metrics`` samples as counters: ``prefix_local`` and
    ``prefix_elsewhere`` (``pegaflow_router_prefix_blocks_total`` by ``where``) and one
    per routing decision (``pegaflow_router_routes_total`` by ``decision``)."""
    out: dict[str, float] = {}
    for name, labels, value in samples:
        if name == "pegaflow_router_prefix_blocks_total":
            key = "prefix_" + labels.get("where", "")
        elif name == "pegaflow_router_routes_total":
            key = labels.get("decision", "")
        else:
            continue
        out[key] = out.get(key, 0.0) + value
    return out


def router_local_share(counters: dict[str, float]) -> float | None:
    """Of the stored prefix blocks of the prompts the router routed (cache mode), the
    share that were on the chosen replica's own host; None when none were stored."""
    local = counters.get("prefix_local", 0.0)
    total = local + counters.get("prefix_elsewhere", 0.0)
    return round(local / total, 4) if total else None


def same_host_share(
    cached_tokens: float, load_blocks: float, local_load_blocks: float, block_size: int
) -> float:
    """Of the replicas' hit tokens (``cached_tokens``: vLLM's own cache and PegaFlow
    loads), the share not loaded from another host's node (``load_blocks`` less
    ``local_load_blocks``, the connector's counters); NaN without hits."""
    if cached_tokens <= 0:
        return math.nan
    remote = max(0.0, load_blocks - local_load_blocks) * block_size
    return round(max(0.0, 1.0 - remote / cached_tokens), 4)


def stickiness(results: Sequence[Result]) -> float | None:
    """Of the answered conversation turns after the first, the share served by the same
    replica as the turn before (the router's header, else the replica index); None
    when there are none."""
    last: dict[tuple[int, str], str] = {}
    same = total = 0
    for r in sorted(results, key=lambda r: (r.repeat, r.stream, r.turn)):
        if r.kind != "conv" or not r.ok:
            continue
        where = r.served_by or str(r.replica)
        key = (r.repeat, r.stream)
        if key in last:
            total += 1
            same += last[key] == where
        last[key] = where
    return same / total if total else None


def connector_counters(metrics: dict[str, float]) -> dict[str, float]:
    """The connector's counters (``vllm:pegaflow_*``) of a replica's ``/metrics``, with
    each latency histogram's ``<name>_count``."""
    out: dict[str, float] = {}
    for name, v in metrics.items():
        m = _PEGA.match(name)
        if m and not name.endswith(("_created", "_bucket", "_sum")):
            out[m.group(1)] = out.get(m.group(1), 0.0) + v
    return out


#: The connector's save latencies a point and its timeline report as means, in ms: the
#: wait until the save thread starts a job, the hold of the GPU blocks (same host) and
#: the time until the node stored them, each from when the step that filled the blocks
#: was queued.
SAVE_LATENCIES = ("save_wait", "save_hold", "save_publish")


def latency_ms(
    before: dict[str, float], after: dict[str, float], name: str = "save_publish"
) -> float | None:
    """Mean ms of the connector's ``<name>_seconds`` over the operations done between two
    readings of :func:`connector_counters` (the count of its histogram, as
    ``connector.metrics.HISTOGRAMS`` names it; None: none done)."""
    total = f"{name}_seconds"
    count = HISTOGRAMS[total][0] + "_count"
    n = after.get(count, 0.0) - before.get(count, 0.0)
    if n <= 0:
        return None
    s = after.get(total, 0.0) - before.get(total, 0.0)
    return round(s / n * 1e3, 1)


#: vLLM's own gauges a timeline sample shows, summed over the replicas: requests queued
#: and running.  With the fullest replica's KV cache use, they tell whether requests
#: wait for compute or for KV cache blocks.
VLLM_GAUGES = {"vllm:num_requests_waiting": "waiting", "vllm:num_requests_running": "running"}
#: vLLM's KV cache use gauge (0-1), by its name in vLLM >= 0.10 and before.
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")


def vllm_gauges(metrics: Sequence[dict[str, float]]) -> dict[str, float]:
    """:data:`VLLM_GAUGES` summed over the replicas' ``/metrics``, and ``kv_usage_max``:
    the highest KV cache use among them."""
    out = {key: sum(m.get(name, 0.0) for m in metrics) for name, key in VLLM_GAUGES.items()}
    usage = [next((m[k] for k in KV_USAGE if k in m), 0.0) for m in metrics]
    out["kv_usage_max"] = round(max(usage, default=0.0), 3)
    return out


def summed(counters: Sequence[dict[str, float]]) -> dict[str, float]:
    """Replicas' :func:`connector_counters` added up."""
    out: dict[str, float] = {}
    for c in counters:
        for k, v in c.items():
            out[k] = out.get(k, 0.0) + v
    return out


@dataclass
class Node:
    """Where to read the PegaFlow node's figures: its ``/metrics`` and/or its pid."""

    metrics_url: str | None = None
    pid: int | None = None

    async def sample(self, session: aiohttp.ClientSession) -> dict[str, float]:
        m = await scrape(session, self.metrics_url) if self.metrics_url else {}
        out = {
            k: m[k]
            for k in ("pegaflow_node_evictions", "pegaflow_node_used_bytes", "pegaflow_node_blocks")
            if k in m
        }
        cpu = m.get("process_cpu_seconds_total", math.nan)
        if math.isnan(cpu) and self.pid:
            cpu = proc_cpu_seconds(self.pid)
        out["cpu_seconds"] = cpu
        out["rss_bytes"] = (
            proc_rss_bytes(self.pid)
            if self.pid
            else m.get("process_resident_memory_bytes", math.nan)
        )
        return out


class NodeGroup:
    """Several nodes (one per host) read as one: their figures summed."""

    def __init__(self, nodes: Sequence[Node]) -> None:
        self.nodes = list(nodes)

    async def sample(self, session: aiohttp.ClientSession) -> dict[str, float]:
        out: dict[str, float] = {}
        for n in self.nodes:
            for k, v in (await n.sample(session)).items():
                out[k] = out.get(k, 0.0) + v
        return out


# ---------------------------------------------------------------- load


class Progress:
    """tqdm if installed, else one line on stderr now and then."""

    def __init__(self, total: int | None, desc: str) -> None:
        self.n = 0
        self.total = total
        self.desc = desc
        self._last = 0.0
        try:
            from tqdm import tqdm

            self._bar: Any = tqdm(total=total, desc=desc, unit="req", file=sys.stderr)
        except ImportError:
            self._bar = None

    def update(self, failed: int) -> None:
        self.n += 1
        if self._bar is not None:
            self._bar.update(1)
            if failed:
                self._bar.set_postfix(failed=failed)
        elif time.monotonic() - self._last > 2 or self.n == self.total:
            self._last = time.monotonic()
            print(f"\r{self.desc}: {self.n}/{self.total or '?'} failed={failed}", end="",
                  file=sys.stderr, flush=True)  # fmt: skip

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        else:
            print(file=sys.stderr)


async def run_point(
    urls: Sequence[str],
    model: str,
    spec: WorkloadSpec,
    *,
    rate: float | None = None,
    concurrency: int | None = None,
    closed_loop: int | None = None,
    repeat: int = 0,
    requests: int | None = None,
    duration: float | None = None,
    route: str = "rr",
    timeout: float = 600.0,
    desc: str = "",
    node: Node | NodeGroup | None = None,
    sample_s: float = 0.0,
    metrics_urls: Sequence[str] | None = None,
    router: str | None = None,
) -> dict[str, Any]:
    """Drive one load point: Poisson arrivals at ``rate`` requests/s (``inf``: all at
    once), at most ``concurrency`` of the workload's requests in flight, or
    ``closed_loop`` conversation workers (:func:`conversation_turns`: conversations only,
    each turn sent when the previous is answered, on the next replica), until
    ``requests`` were sent or ``duration`` seconds passed.  Returns the results (marked
    with ``repeat``), the wall time, the counters' deltas and (``sample_s`` > 0) a
    timeline sampled every ``sample_s`` seconds.

    The connector's counters are read from ``metrics_urls`` (default: ``urls``, the
    replicas; behind a router, the replicas behind it), the router's from ``router``."""
    if sum(x is not None for x in (rate, concurrency, closed_loop)) != 1:
        raise ValueError("give exactly one of rate, concurrency and closed_loop")
    if requests is None and duration is None:
        raise ValueError("give requests or duration")
    rng = random.Random(f"{spec.seed}-arrivals")
    results: list[Result] = []
    failed = 0
    bar = Progress(requests, desc)
    tasks: set[asyncio.Task[None]] = set()
    sem = asyncio.Semaphore(concurrency or 1)
    murls = list(metrics_urls or urls)
    # idle connections closed before the replica's own keep-alive ends (vLLM's uvicorn:
    # 5 s): a request sent on one the server is closing fails with "Server disconnected"
    keep = aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0)
    async with aiohttp.ClientSession(connector=keep) as session:

        async def routed() -> dict[str, float]:
            if router is None:
                return {}
            return router_counters(await scrape_samples(session, router + "/metrics"))

        before = [connector_counters(await scrape(session, u + "/metrics")) for u in murls]
        node_before = await node.sample(session) if node else {}
        router_before = await routed()

        async def one(item: Item, replica: int) -> None:
            nonlocal failed
            r = Result(item.idx, item.kind, item.stream, item.turn, replica, repeat)
            try:
                prompt = await item.ready_prompt()
                await complete(session, urls[replica], model, prompt, spec.output_tokens,
                               timeout, r)  # fmt: skip
            finally:
                item.finish(r.text)
                if concurrency is not None:
                    sem.release()
            results.append(r)
            failed += not r.ok
            bar.update(failed)

        timeline: list[dict[str, Any]] = []
        t_start = time.perf_counter()

        async def sampler() -> None:
            seen = 0
            last = summed(before)
            while True:
                await asyncio.sleep(sample_s)
                window = results[seen:]
                seen = len(results)
                prompt = sum(r.prompt_tokens for r in window if r.ok)
                row: dict[str, Any] = {
                    "t_s": round(time.perf_counter() - t_start, 1),
                    "done": len(results),
                    "failed": failed,
                    "hit_rate": round(sum(r.cached_tokens for r in window if r.ok) / prompt, 4)
                    if prompt
                    else None,
                }
                if node:
                    row.update(await node.sample(session))
                scraped = [await scrape(session, u + "/metrics") for u in murls]
                row.update(vllm_gauges(scraped))
                now_c = [connector_counters(m) for m in scraped]
                for k in TIMELINE_COUNTERS:
                    pairs = zip(before, now_c, strict=True)
                    row[k] = sum(c.get(k, 0.0) - b.get(k, 0.0) for b, c in pairs)
                now_sum = summed(now_c)
                for name in SAVE_LATENCIES:  # this sample's saves
                    row[f"{name}_ms"] = latency_ms(last, now_sum, name)
                last = now_sum
                timeline.append(row)

        sampling = asyncio.create_task(sampler()) if sample_s > 0 else None

        def more(n: int) -> bool:
            """Whether the ``n``-th request (from 0) is still to be sent."""
            if requests is not None and n >= requests:
                return False
            return duration is None or time.perf_counter() - t_start < duration

        workload = Workload(spec)
        sent = 0

        async def worker() -> None:
            nonlocal sent
            for item, replica in conversation_turns(workload, len(urls)):
                if not more(sent):
                    return
                item.idx = sent
                sent += 1
                await one(item, replica)

        async def arrivals() -> None:
            next_at = t_start
            for n, item in enumerate(workload.items()):
                if not more(n):
                    break
                now = time.perf_counter()
                if concurrency is not None:
                    await sem.acquire()
                else:
                    assert rate is not None
                    if math.isfinite(rate):
                        next_at += rng.expovariate(rate)
                        if next_at > now:
                            await asyncio.sleep(next_at - now)
                replica = n % len(urls) if route == "rr" else rng.randrange(len(urls))
                t = asyncio.create_task(one(item, replica))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
            if tasks:
                await asyncio.gather(*tasks)

        if closed_loop is not None:
            await asyncio.gather(*(worker() for _ in range(closed_loop)))
        else:
            await arrivals()
        wall = time.perf_counter() - t_start
        if sampling is not None:
            sampling.cancel()
        after = [connector_counters(await scrape(session, u + "/metrics")) for u in murls]
        node_after = await node.sample(session) if node else {}
        router_after = await routed()
    bar.close()
    deltas: dict[str, float] = {}
    for b, a in zip(before, after, strict=True):
        for k, v in a.items():
            deltas[k] = deltas.get(k, 0.0) + v - b.get(k, 0.0)
    node_delta = {k: node_after[k] - node_before.get(k, math.nan) for k in node_after}
    results.sort(key=lambda r: r.idx)
    return {
        "results": results,
        "wall_s": wall,
        "connector": deltas,
        "node": node_delta,
        "node_after": node_after,
        "timeline": timeline,
        "router": {k: v - router_before.get(k, 0.0) for k, v in router_after.items()},
    }


def pct(xs: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``xs``, linearly interpolated; NaN if empty."""
    s = sorted(x for x in xs if not math.isnan(x))
    if not s:
        return math.nan
    k = (len(s) - 1) * q / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def bootstrap_ci(
    xs: Sequence[float], q: float, resamples: int = 2000, level: float = 0.95, seed: int = 0
) -> tuple[float, float]:
    """The ``level`` confidence interval of the ``q``-th percentile (:func:`pct`) of
    ``xs`` by the percentile bootstrap: ``resamples`` samples of ``len(xs)`` drawn with
    replacement, from a fixed ``seed`` (the same data give the same interval); NaNs
    when ``xs`` is empty."""
    data = [x for x in xs if not math.isnan(x)]
    if not data:
        return math.nan, math.nan
    rng = random.Random(seed)
    stats = [pct(rng.choices(data, k=len(data)), q) for _ in range(resamples)]
    tail = 100 * (1 - level) / 2
    return pct(stats, tail), pct(stats, 100 - tail)


def ttft_stats(runs: Sequence[Sequence[float]]) -> dict[str, Any]:
    """TTFT p50 and p99 (ms) of a load point's repeats: over every run's measured
    requests pooled, their 95 % bootstrap interval (:func:`bootstrap_ci`) and each run's
    own (``runs``: each run's TTFTs in ms)."""
    pooled = [x for run in runs for x in run]
    out: dict[str, Any] = {}
    for q in (50, 99):
        out[f"ttft_p{q}_ms"] = round(pct(pooled, q), 1)
        out[f"ttft_p{q}_ci95_ms"] = [round(x, 1) for x in bootstrap_ci(pooled, q)]
        out[f"ttft_p{q}_runs_ms"] = [round(pct(run, q), 1) for run in runs]
    return out


def pool_runs(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """A load point's repeats (:func:`run_point`'s answers) as one point: every run's
    requests, the wall times added up (each kept: ``wall_runs``), the counters' deltas
    added up, the timelines one after another and the last run's node reading."""
    return {
        "results": [r for p in runs for r in p["results"]],
        "wall_s": sum(p["wall_s"] for p in runs),
        "wall_runs": [p["wall_s"] for p in runs],
        "connector": summed([p["connector"] for p in runs]),
        "node": summed([p["node"] for p in runs]),
        "node_after": runs[-1]["node_after"],
        "timeline": [row for p in runs for row in p["timeline"]],
        "router": summed([p["router"] for p in runs]),
    }


def repeat_spec(spec: WorkloadSpec, repeat: int, repeats: int) -> WorkloadSpec:
    """The workload of run ``repeat`` of ``repeats`` of a load point: its own seed, so
    that no run replays (and warms) another's documents and conversations; the same
    seed as ``spec`` when there is one run."""
    return dataclasses.replace(spec, seed=spec.seed * repeats + repeat)


def by_kind(results: Sequence[Result]) -> dict[str, dict[str, float]]:
    """TTFT (ms) and hit rate per kind of request (``conv``, ``doc``, ``unique``): the
    multi-turn and the document workloads of a mixed run, each on its own."""
    out: dict[str, dict[str, float]] = {}
    for kind in ("conv", "doc", "unique"):
        rs = [r for r in results if r.kind == kind]
        if not rs:
            continue
        ttft = [r.ttft * 1e3 for r in rs]
        prompt = sum(r.prompt_tokens for r in rs)
        out[kind] = {
            "requests": len(rs),
            "ttft_mean_ms": round(sum(ttft) / len(ttft), 1),
            "ttft_p50_ms": round(pct(ttft, 50), 1),
            "ttft_p99_ms": round(pct(ttft, 99), 1),
            "hit_rate": round(sum(r.cached_tokens for r in rs) / prompt, 4) if prompt else 0.0,
        }
    return out


def turn_misses(
    results: Sequence[Result], counted: Sequence[Result], soon_s: float = 1.0
) -> dict[str, int]:
    """Conversation turns of ``counted`` that got under half of their previous turn's
    prompt from a cache (that prompt is their prefix: a miss of the cache), and how many
    of those were sent within ``soon_s`` of their previous turn's end (their prefix may
    not have been stored yet); ``results``: every answered request, for the pairing."""
    prev: dict[tuple[int, str, int], Result] = {
        (r.repeat, r.stream, r.turn): r for r in results if r.kind == "conv" and r.ok
    }
    later = missed = soon = 0
    for r in counted:
        p = prev.get((r.repeat, r.stream, r.turn - 1)) if r.kind == "conv" else None
        if p is None:
            continue
        later += 1
        if r.cached_tokens < p.prompt_tokens / 2:
            missed += 1
            soon += r.t_send - (p.t_send + p.e2e) < soon_s
    return {"later_turns": later, "missed": missed, "missed_sent_within_1s": soon}


def summarize(point: dict[str, Any], block_size: int = 0, warmup_s: float = 0.0) -> dict[str, Any]:
    """A load point's figures (times in ms); with ``block_size``, the share of hits
    served from the same host.  Latencies and the hit rate count only the requests sent
    ``warmup_s`` or more after their run's first (the steady state: a run starts with
    every conversation and document cold at once); throughput counts them all.  A point
    of several runs (:func:`pool_runs`) pools their measured requests; its ``*_runs``
    figures are each run's own."""
    rs: list[Result] = point["results"]
    ok = [r for r in rs if r.ok]
    wall = point["wall_s"] or math.nan
    t_first: dict[int, float] = {}
    for r in rs:
        t_first[r.repeat] = min(t_first.get(r.repeat, r.t_send), r.t_send)
    steady = [r for r in ok if r.t_send - t_first[r.repeat] >= warmup_s]
    ttft = [r.ttft * 1e3 for r in steady]
    walls = point.get("wall_runs") or [wall]
    repeats = list(range(len(walls))) if "wall_runs" in point else sorted(t_first)
    per_s = [
        round(sum(r.ok and r.repeat == k for r in rs) / (w or math.nan), 3)
        for k, w in zip(repeats, walls, strict=False)
    ]
    itl = [x * 1e3 for r in steady for x in r.itl]
    prompt = sum(r.prompt_tokens for r in steady)
    out: dict[str, Any] = {
        "requests": len(rs),
        "failed": len(rs) - len(ok),
        "errors": sorted({r.error[:120] for r in rs if not r.ok})[:5],
        "wall_s": round(wall, 2),
        "req_per_s": round(len(ok) / wall, 3),
        "req_per_s_runs": per_s,
        "req_per_s_mean": round(sum(per_s) / len(per_s), 3) if per_s else math.nan,
        "output_tok_per_s": round(sum(r.output_tokens for r in ok) / wall, 1),
        "ttft_mean_ms": round(sum(ttft) / len(ttft), 1) if ttft else math.nan,
        **ttft_stats([[r.ttft * 1e3 for r in steady if r.repeat == k] for k in repeats]),
        "itl_p50_ms": round(pct(itl, 50), 2),
        "itl_p99_ms": round(pct(itl, 99), 2),
        "prompt_tokens_mean": round(prompt / len(steady), 1) if steady else 0,
        "hit_rate": round(sum(r.cached_tokens for r in steady) / prompt, 4) if prompt else 0.0,
    }
    if warmup_s:
        out["measured_after_s"] = warmup_s
        out["measured"] = len(steady)
    out["by_kind"] = by_kind(steady)
    out["turn_misses"] = turn_misses(ok, steady)
    c = point["connector"]
    out["connector_per_s"] = {k: round(c.get(k, 0.0) / wall, 2) for k in RATE_COUNTERS}
    for name in SAVE_LATENCIES:
        out[f"{name}_ms_mean"] = latency_ms({}, c, name)
    out["load_failed_blocks"] = c.get("load_failed_blocks", 0.0)
    out["declined_blocks"] = {k: c.get(k, 0.0) for k in DECLINED}
    if block_size:
        cached = sum(r.cached_tokens for r in ok)
        out["same_host_share"] = same_host_share(
            cached, c.get("load_blocks", 0.0), c.get("local_load_blocks", 0.0), block_size
        )
    if c.get("handoffs"):
        out["handoffs"] = c["handoffs"]
    sticky = stickiness(ok)
    out["conv_stickiness"] = None if sticky is None else round(sticky, 4)
    routed = point.get("router") or {}
    if routed:
        out["router"] = {k: v for k, v in routed.items() if v}
        out["router_local_share"] = router_local_share(routed)
    node = point["node"]
    if "cpu_seconds" in node:
        out["node_cpu_s_per_s"] = round(node["cpu_seconds"] / wall, 3)
    if "pegaflow_node_evictions" in node:
        out["node_evictions"] = node["pegaflow_node_evictions"]
    tl = point["timeline"]
    if tl:
        rss = [
            row["rss_bytes"] / 2**20 for row in tl if not math.isnan(row.get("rss_bytes", math.nan))
        ]
        if rss:
            out["node_rss_mib"] = {
                "first": round(rss[0], 1), "last": round(rss[-1], 1),
                "min": round(min(rss), 1), "max": round(max(rss), 1),
            }  # fmt: skip
        out["timeline"] = tl
    return out


def compare_outputs(base: list[Result], other: list[Result], first: int) -> dict[str, Any]:
    """Greedy outputs of the same prompts (by hash) in the first ``first`` requests."""
    texts = {r.prompt_sha: r.text for r in base[:first] if r.ok}
    same = diff = 0
    examples: list[int] = []
    for r in other[:first]:
        if r.ok and r.prompt_sha in texts:
            if texts[r.prompt_sha] == r.text:
                same += 1
            else:
                diff += 1
                examples.append(r.idx)
    return {"compared": same + diff, "equal": same, "differ": diff, "differ_idx": examples[:5]}


# ---------------------------------------------------------------- replicas


class Replica(ServeProcess):
    """One replica: ``vllm serve`` reporting ``cached_tokens`` in its usage."""

    def __init__(
        self,
        model: str,
        args: Sequence[str],
        kv_transfer_config: dict[str, Any] | None,
        env: dict[str, str] | None = None,
        name: str = "replica",
    ) -> None:
        self.args = list(args)
        self.kv_transfer_config = kv_transfer_config
        self.env = env
        super().__init__(
            model, ["--enable-prompt-tokens-details", *args], kv_transfer_config, env, name
        )

    def again(self) -> Replica:
        """This replica started anew, on another free port."""
        return Replica(self.model, self.args, self.kv_transfer_config, self.env, name=self.name)


_MEMORY_RACES = (
    "larger than the available KV cache memory",
    "Error in memory profiling",  # another replica freed memory while this one profiled
    "No available memory for the cache blocks",
)
"""vLLM's start failures when replicas starting together on one GPU measured each
other's memory as taken, or as freed (its memory profile, which a fixed
``--kv-cache-memory-bytes`` skips)"""


def start_replicas(
    n: int,
    model: str,
    args: Sequence[str],
    kv_transfer_config: dict[str, Any] | None,
    env: dict[str, str] | None = None,
    *,
    gpus: Sequence[str] = (),
    parallel: bool = True,
    timeout: float = 600.0,
    name: str = "replica",
    envs: Sequence[dict[str, str]] = (),
    kv_configs: Sequence[dict[str, Any] | None] = (),
    more_args: Sequence[Sequence[str]] = (),
) -> list[Replica]:
    """``n`` replicas, started together (``parallel``) or one after another (safer when
    they share a GPU and size their memory from what is free); all or none (those
    started are stopped on any failure or interruption).  Replica ``i`` adds
    ``envs[i]`` to ``env`` and ``more_args[i]`` to ``args``, and has ``kv_configs[i]``
    instead of ``kv_transfer_config`` where given."""
    out: list[Replica] = []
    # replicas sharing a GPU that size their KV cache from its free memory race each
    # other's memory checks: the first starts alone, the others with its size, together
    sizing = parallel and n > 1 and len(set(gpus)) < n and "--kv-cache-memory-bytes" not in args
    try:
        for i in range(n):
            e = {**(env or {}), **(envs[i] if i < len(envs) else {})}
            if gpus:
                e["CUDA_VISIBLE_DEVICES"] = gpus[i % len(gpus)]
            kv = kv_configs[i] if i < len(kv_configs) else kv_transfer_config
            own = [*args, *(more_args[i] if i < len(more_args) else ())]
            out.append(Replica(model, own, kv, e, name=f"{name}{i}"))
            if not parallel or (sizing and i == 0):
                out[-1] = _ready(out[-1], timeout)
            if sizing and i == 0 and (size := kv_cache_bytes(out[0].log)):
                args = [*args, "--kv-cache-memory-bytes", str(size)]
                print(f"{out[0].name}: KV cache of {size} bytes; the others start together "
                      "with it", file=sys.stderr)  # fmt: skip
        raced: list[int] = []
        for i, r in enumerate(out):
            try:
                out[i] = _ready(r, timeout)
            except RuntimeError:
                tail = r.tail(200)
                if not parallel or not any(m in tail for m in _MEMORY_RACES):
                    raise
                raced.append(i)
        for i in raced:  # alone now: it sizes its KV cache from what the others left
            r = out[i]
            r.kill()
            print(
                f"{r.name}: its GPU memory check raced the others' start; starting it alone "
                "(with --kv-cache-memory-bytes in --vllm-args vLLM skips that check, and "
                "replicas sharing a GPU start together)",
                file=sys.stderr,
            )
            out[i] = r.again()  # in ``out`` before the wait: stopped with the others
            out[i] = _ready(out[i], timeout)
    except BaseException:
        for r in out:
            r.kill()
        raise
    return out


_KV_MEMORY = re.compile(r"Available KV cache memory: ([0-9.]+) GiB")


def kv_cache_bytes(log: Sequence[str]) -> int:
    """The KV cache size a started vLLM engine logged for itself (0: not found)."""
    for line in reversed(log):
        if m := _KV_MEMORY.search(line):
            return int(float(m.group(1)) * (1 << 30))
    return 0


def _ready(r: Replica, timeout: float, attempts: int = 3) -> Replica:
    """``r`` once it serves; started again on another free port when the one it was
    given was taken before it bound it (another process on a shared machine)."""
    for attempt in range(attempts):
        try:
            r.wait_ready(timeout)
            return r
        except RuntimeError:
            if attempt + 1 == attempts or "Address already in use" not in r.tail(200):
                raise
            print(f"{r.name}: port {r.port} was taken, starting it again", file=sys.stderr)
            r = r.again()
    return r


def router_replicas(
    urls: Sequence[str],
    *,
    nodes: Sequence[str] | None = None,
    roles: Sequence[str] | None = None,
) -> str:
    """``--router-replicas``: each URL with its ``node=`` and/or ``role=`` (docs/router.md)."""
    for extra in (nodes, roles):
        if extra is not None and len(extra) != len(urls):
            raise ValueError(f"{len(urls)} replicas but {len(extra)} nodes or roles")
    specs = []
    for i, url in enumerate(urls):
        spec = url
        if roles is not None:
            spec += f";role={roles[i]}"
        if nodes is not None:
            spec += f";node={nodes[i]}"
        specs.append(spec)
    return ",".join(specs)


_NAMESPACE = re.compile(r"PegaFlow namespace (\S+) for")


def namespace_in(log: Sequence[str]) -> str:
    """The PegaFlow namespace an engine logged (at its first request); empty if none."""
    for line in log:
        m = _NAMESPACE.search(line)
        if m:
            return m.group(1)
    return ""


def block_size_of(args: Sequence[str]) -> int:
    """The ``--block-size`` of ``vllm serve`` arguments (vLLM's default 16 without)."""
    for i, arg in enumerate(args):
        if arg == "--block-size" and i + 1 < len(args):
            return int(args[i + 1])
        if arg.startswith("--block-size="):
            return int(arg.split("=", 1)[1])
    return 16


def handoff_summary(single_ms: Sequence[float], pd_ms: Sequence[float]) -> dict[str, Any]:
    """TTFTs (ms) of fresh prompts, one at a time, on one replica and through P/D: the
    handoff cost is the difference."""
    s50, p50 = pct(single_ms, 50), pct(pd_ms, 50)
    return {
        "requests": min(len(single_ms), len(pd_ms)),
        "single_ttft_p50_ms": round(s50, 1),
        "single_ttft_mean_ms": round(sum(single_ms) / len(single_ms), 1) if single_ms else None,
        "pd_ttft_p50_ms": round(p50, 1),
        "pd_ttft_mean_ms": round(sum(pd_ms) / len(pd_ms), 1) if pd_ms else None,
        "handoff_p50_ms": round(p50 - s50, 1),
        "pd_over_single_p50": round(p50 / s50, 3) if s50 else None,
    }


def hosts_comparison(
    rr: dict[str, Any], cache: dict[str, Any], target: float = SAME_HOST_TARGET
) -> dict[str, Any]:
    """Cache-aware routing against round robin over the same hosts, point by point:
    (rr, cache) hit rates and same-host shares, rr's TTFT p99 over cache's, and whether
    every cache-aware point serves at least ``target`` of its hits from the same host."""
    pairs = list(zip(rr["points"], cache["points"], strict=True))
    shares = [p.get("same_host_share") for _, p in pairs]
    return {
        "hit_rate": [(a["hit_rate"], b["hit_rate"]) for a, b in pairs],
        "ttft_p99_ratio": [
            round(a["ttft_p99_ms"] / b["ttft_p99_ms"], 2) if b["ttft_p99_ms"] else None
            for a, b in pairs
        ],
        "same_host_share": [(a.get("same_host_share"), b.get("same_host_share")) for a, b in pairs],
        "target": target,
        "meets_target": all(x is not None and not math.isnan(x) and x >= target for x in shares),
    }


def preset_model(name: str, directory: Path) -> str:
    """A model directory for a preset name (dummy weights, a word-level tokenizer),
    written to ``directory``; any other name is a model path or id, returned as is.

    - ``tiny``: the tests' tiny Llama (CPU);
    - ``llama-8b``: Llama-3.1-8B's public shape (GPU).
    """
    from tests.support.vllm_engine import tiny_model_with_tokenizer

    if name == "tiny":
        return tiny_model_with_tokenizer(directory)
    if name == "llama-8b":
        from scripts._models import LLAMA_31_8B

        return tiny_model_with_tokenizer(directory, LLAMA_31_8B)
    return name


def tokens_per_word(url: str, model: str) -> float:
    """How many tokens one workload word is for the replica's tokenizer (``/tokenize``)."""
    sample = words(random.Random(0), 500)
    req = urllib.request.Request(
        url + "/tokenize",
        data=json.dumps({"model": model, "prompt": sample, "add_special_tokens": False}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        return float(json.loads(r.read())["count"]) / 500


def served_model(url: str) -> str:
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as r:
        return str(json.loads(r.read())["data"][0]["id"])


# ---------------------------------------------------------------- router setups

#: ``--kv-transfer-config`` of P/D replicas (docs/connector.md "Prefill/decode roles").
PRODUCER: dict[str, Any] = {**THREE_KEYS, "kv_role": "kv_producer"}
CONSUMER: dict[str, Any] = {
    **THREE_KEYS,
    "kv_role": "kv_consumer",
    "kv_load_failure_policy": "recompute",
    "kv_connector_extra_config": {"handoff_wait_s": 2.0},
}


def replica_env() -> dict[str, str]:
    """What every replica (and the router) shares: one hash seed (the README: vLLM <
    0.29 seeds its block hashes per process without it)."""
    return {"PYTHONHASHSEED": os.environ.get("PYTHONHASHSEED", "0")}


def start_router(
    mode: str, replicas: str, extra: Sequence[str] = (), timeout: float = 120.0
) -> tuple[Proc, str]:
    """A ``pegaflow-router`` in ``mode`` on a free loopback port; its base URL."""
    argv = ["pegaflow.router.main", "--router-port", "0", "--router-mode", mode,
            "--router-replicas", replicas, *extra]  # fmt: skip
    proc = start("pegaflow-router", argv, env=replica_env(), timeout=timeout)
    print(f"pegaflow-router ({mode}): {proc.ready}", file=sys.stderr)
    return proc, "http://" + proc.ready["address"]


def engine_namespace(replicas: Sequence[Replica], model: str, timeout: float = 60.0) -> str:
    """Send one short request to each replica (the connector logs its namespace at its
    first) and return the namespace they logged; SystemExit if they disagree or log none."""
    prompt = words(random.Random("namespace"), 8)
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 1}).encode()
    for r in replicas:
        req = urllib.request.Request(
            r.url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            resp.read()
    deadline = time.monotonic() + timeout
    while True:
        found = {r.name: namespace_in(r.log) for r in replicas}
        if all(found.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    if not all(found.values()) or len(set(found.values())) != 1:
        raise SystemExit(f"the replicas logged no single PegaFlow namespace: {found}")
    return next(iter(found.values()))


async def measure_handoff(
    router: str, single: str, model: str, spec: WorkloadSpec, n: int, timeout: float
) -> dict[str, Any]:
    """The handoff cost: ``n`` fresh prompts of ``spec.first_tokens``, one at a time,
    alternately on one replica (``single``) and through the P/D ``router``; their TTFTs."""
    single_ms: list[float] = []
    pd_ms: list[float] = []
    errors: list[str] = []
    async with aiohttp.ClientSession() as session:
        for i in range(n):
            for url, out in ((single, single_ms), (router, pd_ms)):
                rng = random.Random(f"{spec.seed}-handoff-{url}-{i}")
                prompt = words(rng, spec.nwords(spec.first_tokens))
                r = await complete(session, url, model, prompt, spec.output_tokens, timeout)
                if r.ok:
                    out.append(r.ttft * 1e3)
                else:
                    errors.append(r.error[:120])
    return {**handoff_summary(single_ms, pd_ms), "errors": sorted(set(errors))[:5]}


def pd_setup(
    model: str,
    args: Sequence[str],
    get_specs: Callable[[str], list[WorkloadSpec]],
    loads: list[tuple[str, float]],
    a: argparse.Namespace,
) -> tuple[list[dict[str, Any]], list[list[Result]], dict[str, Any]]:
    """``pd``: ``--prefill-n`` producers and ``--decode-n`` consumers sharing one fresh
    ``pegaflow-server``, behind the router in pd mode.  The load points through the
    router, then the handoff cost."""
    procs: list[Proc] = []
    replicas: list[Replica] = []
    try:
        extra = ["--pool-size", a.pool_size] if a.pool_size else []
        server = start_server(extra=[*extra, *shlex.split(a.server_args)])
        procs.append(server)
        http = server.ready.get("http", "-1")
        node = Node(f"http://127.0.0.1:{http}/metrics" if http != "-1" else None, server.pid)
        env = {**replica_env(), "PEGAFLOW_CLIENT_COORDINATORS": server.ready["coordinator"]}
        roles = ["prefill"] * a.prefill_n + ["decode"] * a.decode_n
        print(f"starting {a.prefill_n} prefill + {a.decode_n} decode replicas for pd ...",
              file=sys.stderr)  # fmt: skip
        replicas = start_replicas(
            len(roles), model, args, None, env, gpus=[g for g in a.gpus.split(",") if g],
            parallel=a.parallel_start, timeout=a.start_timeout, name="pd-",
            kv_configs=[PRODUCER if r == "prefill" else CONSUMER for r in roles],
        )  # fmt: skip
        urls = [r.url for r in replicas]
        specs = get_specs(urls[0])
        proc, url = start_router(
            "pd", router_replicas(urls, roles=roles), shlex.split(a.router_args)
        )
        procs.append(proc)
        points, raw = run_setup(
            "pd", [url], model, specs, loads, a, node, metrics_urls=urls, router=url
        )
        handoff = asyncio.run(
            measure_handoff(url, urls[0], model, specs[0], a.handoff_requests, a.request_timeout)
        )
        print(f"       pd handoff: {handoff}", flush=True)
        return points, raw, {"handoff": handoff}
    finally:
        stop_all(replicas, procs)


def hosts_setup(
    name: str,
    mode: str,
    model: str,
    args: Sequence[str],
    get_specs: Callable[[str], list[WorkloadSpec]],
    loads: list[tuple[str, float]],
    a: argparse.Namespace,
    workdir: Path,
) -> tuple[list[dict[str, Any]], list[list[Result]], dict[str, Any]]:
    """``rr-hosts`` / ``cache-hosts``: ``--hosts-n`` hosts, each a storage node with its
    own pool (one etcd, one coordinator, all started empty); replica ``i`` on host
    ``i % hosts`` (its connector's ``local_node``); the replicas behind the router in
    ``mode`` (rr or cache)."""
    n_hosts = a.hosts_n or a.replicas_n
    etcd = EtcdServer(workdir / f"{name}-etcd")
    procs: list[Proc] = []
    replicas: list[Replica] = []
    try:
        etcd.start()
        prefix = f"/pegaflow/bench-{name}-{os.getpid()}"
        hosts = [f"host{i}" for i in range(n_hosts)]
        pool = a.pool_size or "256MiB"
        for h in hosts:
            procs.append(start_node(h, etcd=etcd.endpoint, prefix=prefix, pool=pool))
        coord = start_coordinator(etcd=etcd.endpoint, prefix=prefix)
        procs.append(coord)
        node = NodeGroup([
            Node(f"http://127.0.0.1:{p.ready['http']}/metrics" if p.ready.get("http") else None,
                 p.pid)
            for p in procs[:n_hosts]
        ])  # fmt: skip
        env = {**replica_env(), "PEGAFLOW_CLIENT_COORDINATORS": coord.ready["address"]}
        homes = [hosts[i % n_hosts] for i in range(a.replicas_n)]
        print(f"starting {a.replicas_n} replicas on {n_hosts} hosts for {name} ...",
              file=sys.stderr)  # fmt: skip
        replicas = start_replicas(
            a.replicas_n, model, args, THREE_KEYS, env,
            gpus=[g for g in a.gpus.split(",") if g], parallel=a.parallel_start,
            timeout=a.start_timeout, name=f"{name}-",
            envs=[{"PEGAFLOW_CONNECTOR_LOCAL_NODE": h} for h in homes],
        )  # fmt: skip
        urls = [r.url for r in replicas]
        specs = get_specs(urls[0])
        extra = shlex.split(a.router_args)
        if mode == "cache":
            ns = engine_namespace(replicas, model)
            extra = [
                "--router-namespace", ns, "--router-tokenizer", model,
                "--router-block-size", str(block_size_of(args)),
                "--client-coordinators", coord.ready["address"], *extra,
            ]  # fmt: skip
        else:
            engine_namespace(replicas, model)  # the same first request as in cache mode
        proc, url = start_router(mode, router_replicas(urls, nodes=homes), extra)
        procs.append(proc)
        points, raw = run_setup(
            name, [url], model, specs, loads, a, node,
            metrics_urls=urls, router=url, block_size=block_size_of(args),
        )  # fmt: skip
        return points, raw, {"hosts": n_hosts}
    finally:
        try:
            stop_all(replicas, procs)
        finally:
            etcd.stop()


CACHE_LINE = "PegaFlow cache (last"
"""the connector's periodic line in a replica's log (what its cache did, and the cost
model's estimates when it declined hits)"""


def stop_replicas(replicas: Sequence[Replica]) -> None:
    """SIGTERM each replica (its saves drain), saying which one did not exit; then print
    each one's cache lines (stderr)."""
    for r in replicas:
        if r.terminate(120.0) is None:
            print(f"{r.name} did not exit on SIGTERM:\n{r.tail(20)}", file=sys.stderr)
    for r in replicas:
        for line in [x for x in r.log if CACHE_LINE in x][-60:]:
            print(f"{r.name}: {line}", file=sys.stderr)


def stop_all(replicas: Sequence[Replica], procs: Sequence[Proc]) -> None:
    """Stop the replicas, then the cluster's processes (last started first), every one
    of them even when stopping another is interrupted (Ctrl-C)."""
    try:
        stop_replicas(replicas)
    finally:
        for p in reversed(procs):
            try:
                p.terminate()
            except BaseException:  # interrupted while waiting: kill what is left, at once
                for q in procs:
                    q.kill()
                raise


# ---------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    g = ap.add_argument_group("replicas")
    g.add_argument(
        "--model",
        default="tiny",
        help="model path or name; presets (dummy weights): 'tiny' (CPU), 'llama-8b' (GPU)",
    )
    g.add_argument("--replicas-n", type=int, default=2, help="replicas to start (default 2)")
    g.add_argument("--replicas", default="", help="URL,URL: replicas already running")
    g.add_argument("--label", default="external", help="the setup's name with --replicas")
    g.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="per replica (several share a GPU: e.g. 0.2 each for four)",
    )
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--real-weights", action="store_true", help="load weights (default dummy)")
    g.add_argument("--vllm-args", default="", help="more `vllm serve` arguments (one string)")
    g.add_argument("--gpus", default="", help="CUDA_VISIBLE_DEVICES per replica, round robin")
    g.add_argument(
        "--parallel-start",
        action="store_true",
        help="start replicas together (on one GPU give them --kv-cache-memory-bytes in "
        "--vllm-args: vLLM's memory profile races otherwise, and a replica that lost the "
        "race starts again alone)",
    )
    g.add_argument("--start-timeout", type=float, default=900.0)
    g.add_argument("--setups", default="vllm,pegaflow,warm", help="of " + ",".join(SETUPS))
    g.add_argument("--pool-size", default="", help="pegaflow-server --pool-size (default auto)")
    g.add_argument("--server-args", default="", help="more pegaflow-server arguments")
    g.add_argument("--node-metrics", default="", help="with --replicas: the node's /metrics URL")
    g.add_argument("--node-pid", type=int, default=0, help="with --replicas: the node's pid")
    g.add_argument("--prefill-n", type=int, default=1, help="pd: prefill replicas")
    g.add_argument("--decode-n", type=int, default=1, help="pd: decode replicas")
    g.add_argument("--handoff-requests", type=int, default=8, help="pd: prompts timed alone")
    g.add_argument("--hosts-n", type=int, default=0, help="*-hosts: hosts (0: one per replica)")
    g.add_argument("--router-args", default="", help="more pegaflow-router arguments")
    w = ap.add_argument_group("workload (lengths in tokens)")
    w.add_argument("--conversations", type=int, default=8, help="active at once")
    w.add_argument("--turns", type=int, default=4, help="turns per conversation, mean")
    w.add_argument(
        "--fixed-turns",
        action="store_true",
        help="every conversation has --turns turns (default: 1 .. 2 x --turns - 1, so that "
        "conversations do not all start again at once)",
    )
    w.add_argument("--first-tokens", type=int, default=512)
    w.add_argument("--turn-tokens", type=int, default=64)
    w.add_argument("--docs", type=int, default=4)
    over = "each conversation opens with a shared document (round robin), then --first-tokens"
    w.add_argument("--conv-docs", action="store_true", help=over)
    w.add_argument("--doc-tokens", type=int, default=1024)
    w.add_argument("--question-tokens", type=int, default=32)
    w.add_argument("--unique-tokens", type=int, default=256)
    w.add_argument("--mix", default="1,1,0.2", help="weights: conversation,document,unique")
    w.add_argument("--output-tokens", type=int, default=16)
    w.add_argument("--seed", type=int, default=0)
    lo = ap.add_argument_group("load")
    lo.add_argument("--rates", default="2", help="Poisson rates, req/s, comma separated (inf ok)")
    lo.add_argument(
        "--concurrency", default="", help="instead: requests of the mix in flight, comma separated"
    )
    closed = ("instead: conversations in flight, comma separated (conversations only, each "
              "turn sent when the last is answered, to the next replica)")  # fmt: skip
    lo.add_argument("--closed-loop", default="", help=closed)
    lo.add_argument("--repeats", type=int, default=1, help="runs per point, own content each")
    lo.add_argument("--requests", type=int, default=100, help="requests per point")
    lo.add_argument("--duration", type=float, default=0.0, help="seconds per point instead")
    lo.add_argument("--route", choices=("rr", "random"), default="rr")
    lo.add_argument("--request-timeout", type=float, default=600.0)
    lo.add_argument("--slo-ms", type=float, default=1000.0, help="TTFT p99 objective")
    steady = "latencies count requests sent this long after a point starts (steady state)"
    lo.add_argument("--warmup-s", type=float, default=0.0, help=steady)
    lo.add_argument("--sample-s", type=float, default=0.0, help="timeline every N s (0: off)")
    lo.add_argument("--compare", type=int, default=32, help="requests per point compared")
    lo.add_argument("--plot", default="", help="PNG path")
    lo.add_argument("--out", default="", help="JSONL file of every request")
    m = ap.add_argument_group("merge (no run)")
    m.add_argument(
        "--merge", default="", help="FILE,FILE: earlier runs' outputs, reported as one (--plot)"
    )
    m.add_argument("--merge-requests", default="", help="FILE,FILE: their --out files")
    return ap.parse_args(argv)


def replica_args(a: argparse.Namespace) -> list[str]:
    args: list[str] = ["--seed", "0"]
    if a.model == "tiny":
        args += TINY_ARGS
    elif not a.real_weights:
        args += ["--load-format", "dummy"]
    if a.gpu_memory_utilization is not None:
        args += ["--gpu-memory-utilization", str(a.gpu_memory_utilization)]
    if a.max_model_len is not None:
        args += ["--max-model-len", str(a.max_model_len)]
    return args + shlex.split(a.vllm_args)


def plot(path: str, setups: dict[str, list[dict[str, Any]]], slo_ms: float) -> None:
    """TTFT p99 and throughput against the offered rate, one curve per setup."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot: matplotlib is not installed, no plot written", file=sys.stderr)
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, points in setups.items():
        xs = [p["offered"] for p in points]
        ax1.plot(xs, [p["ttft_p99_ms"] for p in points], marker="o", label=name)
        ax2.plot(xs, [p["req_per_s"] for p in points], marker="o", label=name)
    ax1.axhline(slo_ms, color="grey", linestyle="--", linewidth=1, label="objective")
    ax1.set(xlabel="offered load", ylabel="TTFT p99 (ms)", yscale="log", title="TTFT p99")
    ax2.set(xlabel="offered load", ylabel="requests/s", title="throughput")
    ax1.legend()
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}", file=sys.stderr)


def run_setup(
    name: str,
    urls: list[str],
    model: str,
    specs: list[WorkloadSpec],
    loads: list[tuple[str, float]],
    a: argparse.Namespace,
    node: Node | NodeGroup | None,
    *,
    metrics_urls: Sequence[str] | None = None,
    router: str | None = None,
    block_size: int = 0,
) -> tuple[list[dict[str, Any]], list[list[Result]]]:
    """Every load point of one setup on running replicas (``urls``: where requests go,
    the router's URL for a setup behind it; see :func:`run_point` for the rest), each
    ``--repeats`` times (:func:`repeat_spec`), their runs pooled (:func:`pool_runs`)."""
    points: list[dict[str, Any]] = []
    raw: list[list[Result]] = []
    for spec, (mode, value) in zip(specs, loads, strict=True):
        runs = [
            asyncio.run(
                run_point(
                    urls, model, repeat_spec(spec, k, a.repeats),
                    rate=value if mode == "rate" else None,
                    concurrency=int(value) if mode == "concurrency" else None,
                    closed_loop=int(value) if mode == "closed_loop" else None, repeat=k,
                    requests=None if a.duration else a.requests,
                    duration=a.duration or None,
                    route=a.route, timeout=a.request_timeout,
                    desc=f"{name} {mode}={value:g} run {k + 1}/{a.repeats}", node=node,
                    sample_s=a.sample_s, metrics_urls=metrics_urls, router=router,
                )
            )
            for k in range(a.repeats)
        ]  # fmt: skip
        point = pool_runs(runs)
        figures = summarize(point, block_size, a.warmup_s)
        s = {"setup": name, mode: value, "offered": value, "repeats": a.repeats, **figures}
        points.append(s)
        raw.append(point["results"])
        print(
            f"{name:>9} {mode}={value:<6g} {s['req_per_s']:7.2f} req/s "
            f"{s['output_tok_per_s']:8.1f} tok/s  TTFT mean/p50/p99 {s['ttft_mean_ms']:.0f}/"
            f"{s['ttft_p50_ms']:.0f}/{s['ttft_p99_ms']:.0f} ms (p99 95% CI "
            f"{s['ttft_p99_ci95_ms']}, runs {s['ttft_p99_runs_ms']})  hit {s['hit_rate']:.2f}  "
            f"failed {s['failed']}  declined {s['declined_blocks']}  "
            f"connector/s {s['connector_per_s']}"
            + (f"  same-host {s['same_host_share']}" if "same_host_share" in s else "")
            + (
                f"  saves after their step: started {s['save_wait_ms_mean']}, blocks "
                f"reusable {s['save_hold_ms_mean']}, stored {s['save_publish_ms_mean']} ms"
                if s.get("save_publish_ms_mean") is not None
                else ""
            )
            + (f"  router {s['router']}" if s.get("router") else ""),
            flush=True,
        )
        if a.out:
            with open(a.out, "a") as fh:
                for r in point["results"]:
                    row = {"setup": name, mode: value, "offered": value, **asdict(r)}
                    fh.write(json.dumps(row) + "\n")
    return points, raw


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    trap_signals()  # killed by timeout or a signal: the replicas and the server stop too
    if a.merge:
        return merge(a)
    mix = tuple(float(x) for x in a.mix.split(","))
    if len(mix) != 3:
        raise SystemExit("--mix takes three weights: conversation,document,unique")
    if a.repeats < 1:
        raise SystemExit("--repeats takes 1 or more")
    if a.closed_loop:
        loads = [("closed_loop", float(x)) for x in a.closed_loop.split(",")]
    elif a.concurrency:
        loads = [("concurrency", float(x)) for x in a.concurrency.split(",")]
    else:
        loads = [("rate", float(x)) for x in a.rates.split(",")]
    base = WorkloadSpec(
        conversations=a.conversations, turns=a.turns, first_tokens=a.first_tokens,
        turn_tokens=a.turn_tokens, docs=a.docs, doc_tokens=a.doc_tokens,
        question_tokens=a.question_tokens, unique_tokens=a.unique_tokens,
        mix=mix,  # type: ignore[arg-type]
        output_tokens=a.output_tokens, seed=a.seed, vary_turns=not a.fixed_turns,
        conv_docs=a.conv_docs,
    )  # fmt: skip
    results: dict[str, list[dict[str, Any]]] = {}
    raws: dict[str, list[list[Result]]] = {}
    extras: dict[str, dict[str, Any]] = {}
    server: Proc | None = None
    replicas: list[Replica] = []

    def specs_for(url: str, model: str) -> list[WorkloadSpec]:
        tpw = tokens_per_word(url, model)
        return [
            WorkloadSpec(**{**asdict(base), "tokens_per_word": tpw, "seed": a.seed * 1000 + i})
            for i in range(len(loads))
        ]

    try:
        if a.replicas:
            urls = [u.rstrip("/") for u in a.replicas.split(",")]
            model = served_model(urls[0])
            node = Node(a.node_metrics or None, a.node_pid or None)
            specs = specs_for(urls[0], model)
            results[a.label], raws[a.label] = run_setup(a.label, urls, model, specs, loads, a, node)
        else:
            tmp = Path(tempfile.mkdtemp(prefix="bench-serving-"))
            model = preset_model(a.model, tmp / "model")
            args = replica_args(a)
            gpus = [g for g in a.gpus.split(",") if g]
            setups = [s for s in a.setups.split(",") if s]
            unknown = set(setups) - set(SETUPS)
            if unknown:
                raise SystemExit(f"unknown setups {sorted(unknown)}: use {','.join(SETUPS)}")
            node = None
            specs: list[WorkloadSpec] = []
            for name in setups:
                if name in ("pd", "rr-hosts", "cache-hosts"):

                    def get_specs(url: str) -> list[WorkloadSpec]:
                        if not specs:
                            specs.extend(specs_for(url, model))
                        return specs

                    if name == "pd":
                        got = pd_setup(model, args, get_specs, loads, a)
                    else:
                        got = hosts_setup(name, name.split("-")[0], model, args, get_specs,
                                          loads, a, tmp)  # fmt: skip
                    results[name], raws[name], extras[name] = got
                    continue
                kv: dict[str, Any] | None = None
                env = replica_env()
                if name in ("pegaflow", "warm", "nodecline"):
                    if server is None or name != "warm":  # warm: the pool pegaflow filled
                        if server is not None:
                            server.terminate()
                        extra = ["--pool-size", a.pool_size] if a.pool_size else []
                        server = start_server(extra=[*extra, *shlex.split(a.server_args)])
                        http = server.ready.get("http", "-1")
                        node = Node(
                            f"http://127.0.0.1:{http}/metrics" if http != "-1" else None,
                            server.pid,
                        )
                        print(f"pegaflow-server: {server.ready}", file=sys.stderr)
                    kv = THREE_KEYS
                    env["PEGAFLOW_CLIENT_COORDINATORS"] = server.ready["coordinator"]
                    if name == "nodecline":
                        env["PEGAFLOW_CONNECTOR_COST_MODEL"] = "0"
                print(f"starting {a.replicas_n} replicas for {name} ...", file=sys.stderr)
                t0 = time.monotonic()
                replicas = start_replicas(
                    a.replicas_n, model, args, kv, env, gpus=gpus,
                    parallel=a.parallel_start, timeout=a.start_timeout, name=f"{name}-",
                )  # fmt: skip
                started = round(time.monotonic() - t0, 1)
                extras.setdefault(name, {})["replicas_start_s"] = started
                print(f"{name}: replicas ready in {started} s", file=sys.stderr, flush=True)
                urls = [r.url for r in replicas]
                if not specs:
                    specs.extend(specs_for(urls[0], model))
                results[name], raws[name] = run_setup(
                    name, urls, model, specs, loads, a, node if kv else None
                )
                stop_replicas(replicas)
                replicas = []
    finally:
        for r in replicas:
            r.kill()
        if server is not None:
            server.terminate()

    summary: dict[str, Any] = {"setups": {}, "config": {**vars(a), "mix": list(mix)}}
    first = next(iter(raws))
    for name, points in results.items():
        entry: dict[str, Any] = {"points": points}
        if name != first:
            entry["outputs_vs_" + first] = [
                compare_outputs(b, o, a.compare)
                for b, o in zip(raws[first], raws[name], strict=True)
            ]
        entry.update(extras.get(name, {}))
        summary["setups"][name] = entry
    return report(summary, a)


#: Issue 38's targets for a setup against the first (vLLM alone), by :func:`ratios` key:
#: TTFT p99 no higher, p50 at most 0.6 of it, throughput at least 1.5 times.
TARGETS = {"p99_ratio": (None, 1.0), "p50_ratio": (None, 0.6), "throughput_ratio": (1.5, None)}


def ratios(base: dict[str, Any], point: dict[str, Any]) -> dict[str, Any]:
    """``point``'s TTFT p99, p50 and throughput over ``base``'s (the first setup at the
    same load), and whether they meet :data:`TARGETS` (None: a figure is missing)."""
    out: dict[str, Any] = {"offered": point["offered"]}
    for key, field_ in (("p99_ratio", "ttft_p99_ms"), ("p50_ratio", "ttft_p50_ms"),
                        ("throughput_ratio", "req_per_s")):  # fmt: skip
        b, v = base.get(field_), point.get(field_)
        ok = b is not None and v is not None and math.isfinite(b) and math.isfinite(v) and b
        out[key] = round(v / b, 3) if ok else None
    got = [(out[k], lo, hi) for k, (lo, hi) in TARGETS.items()]
    out["meets_targets"] = (
        None
        if any(x is None for x, _, _ in got)
        else all((lo is None or x >= lo) and (hi is None or x <= hi) for x, lo, hi in got)
    )
    return out


def against_first(setups: dict[str, dict[str, Any]], slo_ms: float) -> None:
    """Each setup's throughput at the TTFT p99 objective (the most requests/s served
    at a point that met it with no failure); every other setup against the first:
    that throughput's ratio and, at each offered load both measured, the first's TTFT
    p99 over its own (``ttft_p99_ratio``, in its points' order) and its own figures over
    the first's (``ratios_vs_<first>``: :func:`ratios`)."""
    for entry in setups.values():
        ok = [p for p in entry["points"] if p["failed"] == 0 and p["ttft_p99_ms"] <= slo_ms]
        entry["throughput_at_slo"] = max((p["req_per_s"] for p in ok), default=0.0)
    names = list(setups)
    if len(names) < 2:
        return
    b = setups[names[0]]
    p99 = {p["offered"]: p["ttft_p99_ms"] for p in b["points"]}
    for name in names[1:]:
        entry = setups[name]
        entry["throughput_at_slo_ratio"] = (
            round(entry["throughput_at_slo"] / b["throughput_at_slo"], 3)
            if b["throughput_at_slo"]
            else None
        )
        entry["ttft_p99_ratio"] = [
            round(p99[p["offered"]] / p["ttft_p99_ms"], 2)
            if p["offered"] in p99 and p["ttft_p99_ms"]
            else None
            for p in entry["points"]
        ]
        first = {p["offered"]: p for p in b["points"]}
        entry["ratios_vs_" + names[0]] = [
            ratios(first[p["offered"]], p) for p in entry["points"] if p["offered"] in first
        ]


def _ms(x: Any) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:,.0f}"


def comparison_table(setups: dict[str, dict[str, Any]]) -> list[str]:
    """Per load point and setup: TTFT p50, p99 with its 95 % interval, requests/s, and
    against the first setup (after :func:`against_first`) the p99, p50 and throughput
    ratios (the targets: <= 1, <= 0.6, >= 1.5)."""
    names = list(setups)
    if not names:
        return []
    first = names[0]
    lines = [
        f"{'load':>6} {'setup':>10} {'p50 ms':>8} {'p99 ms':>8} {'p99 95% CI':>17} "
        f"{'req/s':>7} {'runs':>4} | vs {first}: {'p99':>6} {'p50':>6} {'req/s':>6}"
    ]
    offered = sorted({p["offered"] for e in setups.values() for p in e["points"]})
    for load in offered:
        for name in names:
            entry = setups[name]
            p = next((x for x in entry["points"] if x["offered"] == load), None)
            if p is None:
                continue
            lo, hi = p.get("ttft_p99_ci95_ms") or (None, None)
            ci = f"[{_ms(lo)}, {_ms(hi)}]"
            r = next((x for x in entry.get("ratios_vs_" + first, []) if x["offered"] == load),
                     None)  # fmt: skip
            vs = (
                " ".join(f"{'-' if r[k] is None else f'{r[k]:.2f}':>6}" for k in TARGETS)
                if r
                else ""
            )
            lines.append(
                f"{load:>6g} {name:>10} {_ms(p.get('ttft_p50_ms')):>8} "
                f"{_ms(p.get('ttft_p99_ms')):>8} {ci:>17} {p.get('req_per_s') or 0:>7.2f} "
                f"{p.get('repeats', 1):>4} | {'':>{len(first) + 4}} {vs}"
            )
    return lines


def report(summary: dict[str, Any], a: argparse.Namespace) -> int:
    """Compare the setups of ``summary`` (:func:`against_first`), plot them with
    ``--plot``, and print the throughputs and, last, the summary as one JSON line."""
    setups = summary["setups"]
    against_first(setups, a.slo_ms)
    if "rr-hosts" in setups and "cache-hosts" in setups:
        summary["cache_vs_rr_hosts"] = hosts_comparison(setups["rr-hosts"], setups["cache-hosts"])
    if a.plot:
        plot(a.plot, {name: e["points"] for name, e in setups.items()}, a.slo_ms)
    for name, entry in setups.items():
        print(f"{name}: throughput at TTFT p99 <= {a.slo_ms:g} ms: "
              f"{entry['throughput_at_slo']:.2f} req/s", flush=True)  # fmt: skip
    print("\n".join(comparison_table(setups)), flush=True)
    print(json.dumps(_json_safe(summary), default=str), flush=True)
    return 0


def merge(a: argparse.Namespace) -> int:
    """``--merge``: one report of setups measured by separate runs of this script (a
    device's time limit per command, say).  Each file is a run's output, whose last line
    is its summary; the first file's first setup is the reference.  A setup measured by
    several runs (rates split over commands) is reported with all their points, by
    offered rate.  With ``--out``
    files of those runs (``--merge-requests``), the outputs of each other setup are
    compared with the reference's by prompt (greedy: equal engines give equal text),
    and a point measured by several runs (repeats split over commands) becomes one
    (:func:`merge_repeats`)."""
    summary: dict[str, Any] = {"setups": {}, "merged": a.merge.split(",")}
    for path in a.merge.split(","):
        lines = [x for x in Path(path).read_text().splitlines() if x.startswith("{")]
        got = json.loads(lines[-1])
        summary.setdefault("config", got.get("config", {}))
        for name, entry in got["setups"].items():
            summary["setups"].setdefault(name, {"points": []})["points"].extend(entry["points"])
    rows: dict[tuple[str, float], list[dict[str, Any]]] = {}
    texts: dict[str, dict[str, str]] = {}
    for i, path in enumerate(a.merge_requests.split(",") if a.merge_requests else []):
        for line in Path(path).read_text().splitlines():
            r = json.loads(line)
            r["run"] = (i, r.get("repeat", 0))
            load = r.get("offered", r.get("rate", r.get("concurrency")))
            rows.setdefault((r["setup"], load), []).append(r)
            if not r.get("error") and r.get("prompt_sha"):
                texts.setdefault(r["setup"], {})[r["prompt_sha"]] = r["text"]
    warmup_s = float(summary.get("config", {}).get("warmup_s") or 0.0)
    for name, entry in summary["setups"].items():
        by_load: dict[float, list[dict[str, Any]]] = {}
        for point in entry["points"]:
            by_load.setdefault(point.get("offered") or 0.0, []).append(point)
        entry["points"] = []
        for load, ps in sorted(by_load.items()):
            if len(ps) > 1 and (name, load) in rows:
                entry["points"].append(merge_repeats(ps, rows[(name, load)], warmup_s))
            else:
                entry["points"].extend(ps)
    if a.merge_requests:
        first = next(iter(summary["setups"]))
        ref = texts.get(first, {})
        for name, entry in summary["setups"].items():
            if name == first:
                continue
            common = set(ref) & set(texts.get(name, {}))
            equal = sum(ref[k] == texts[name][k] for k in common)
            entry["outputs_vs_" + first] = {"compared": len(common), "equal": equal}
    return report(summary, a)


def merge_repeats(
    points: Sequence[dict[str, Any]], rows: Sequence[dict[str, Any]], warmup_s: float
) -> dict[str, Any]:
    """One load point of one setup measured by several runs of this script, as one:
    the first's figures, each run's throughput, and the TTFT figures (:func:`ttft_stats`)
    of every run's requests (``rows``: their ``--out`` rows, each with its ``run``)
    sent ``warmup_s`` or more after their run's first."""
    t_first: dict[Any, float] = {}
    for r in rows:
        t_first[r["run"]] = min(t_first.get(r["run"], r["t_send"]), r["t_send"])
    ttft: dict[Any, list[float]] = {run: [] for run in sorted(t_first)}
    for r in rows:
        if not r.get("error") and r["t_send"] - t_first[r["run"]] >= warmup_s:
            ttft[r["run"]].append(r["ttft"] * 1e3)
    per_s = [x for p in points for x in p.get("req_per_s_runs") or [p["req_per_s"]]]
    wall = sum(p["wall_s"] for p in points)
    return {
        **points[0],
        "repeats": len(ttft),
        "wall_s": round(wall, 2),
        "req_per_s": round(sum(p["req_per_s"] * p["wall_s"] for p in points) / wall, 3),
        "req_per_s_runs": per_s,
        "req_per_s_mean": round(sum(per_s) / len(per_s), 3),
        "requests": sum(p["requests"] for p in points),
        "failed": sum(p["failed"] for p in points),
        **ttft_stats(list(ttft.values())),
        "merged_points": len(points),
    }  # fmt: skip


def _json_safe(x: Any) -> Any:
    """``x`` with NaN and infinities as ``null`` (strict JSON)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_json_safe(v) for v in x]
    return x


if __name__ == "__main__":
    sys.exit(main())
