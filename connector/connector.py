"""``PegaKVConnector``: vLLM's KV connector API on top of the PegaFlow cluster.

A thin facade: vLLM builds one instance per role, in the scheduler process
(``KVConnectorRole.SCHEDULER``) and in every worker (``KVConnectorRole.WORKER``).
Each hook below forwards to :class:`~.scheduler.side.SchedulerSide` or
:class:`~.worker.side.WorkerSide`; version differences live in :mod:`.compat`.

Guarantees, whatever the cluster does:

* a lookup never takes longer than ``lookup_timeout_s``; any failure is a miss and
  serving goes on (a circuit breaker stops asking a dead cluster for a while);
* loaded blocks are checksum-verified before they are written into the KV cache;
  a block that cannot be loaded is reported through
  :meth:`PegaKVConnector.get_block_ids_with_load_errors` and vLLM recomputes it (the
  scheduler's connector sets ``kv_load_failure_policy="recompute"``, vLLM's default
  being ``"fail"``, which ends the request with an error; setting
  ``recompute_failed_loads`` off keeps vLLM's);
* saves never stall the forward pass and never read a block after vLLM reused it.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, replace
from typing import TYPE_CHECKING, Any

from pegaflow.auth import cluster_token
from pegaflow.tls import client_context, describe

from . import sameprocess
from .compat import (
    HIT_SOURCE,
    VLLM_VERSION,
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorStats,
    KVConnectorWorkerMetadata,
    PegaConnectorMetadata,
    PegaWorkerMetadata,
    SupportsHMA,
    TransferResults,
    block_ids_of,
    cuda_graph_tokens,
    defers_block_frees,
    device_type,
    engine_geometry,
    first_steps_min_tokens,
    hash_info,
    kv_load_failure_policy,
    model_support,
    parallel_ranks,
    recompute_load_failures,
)
from .loadcheck import defer_possible
from .logsetup import setup_logging
from .metadata import StepPlan
from .metrics import Counters
from .namespace import (
    NamespaceFactors,
    ShardLayout,
    hash_stability,
    kv_scales_digest,
    make_namespace,
    model_identity,
)
from .report import WORKER_COUNTERS, CacheReport, format_line
from .scheduler.hybrid import GroupLayout
from .scheduler.nsdiag import factor_strings
from .scheduler.side import SchedulerSide
from .settings import ConnectorSettings
from .stats import PegaConnectorStats, PegaPromMetrics

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("pegaflow.connector")


class PegaKVConnector(KVConnectorBase_V1, SupportsHMA):
    """External, shared KV cache for vLLM backed by a PegaFlow cluster.

    Enable with::

        --kv-transfer-config '{"kv_connector": "PegaKVConnector", "kv_role": "kv_both",
          "kv_connector_module_path": "pegaflow.connector",
          "kv_load_failure_policy": "recompute"}'

    Settings come from ``kv_connector_extra_config`` and ``PEGAFLOW_*`` variables (see
    :class:`~.settings.ConnectorSettings`).

    Args:
        vllm_config: the engine's configuration.
        role: scheduler or worker.
        kv_cache_config: the engine's KV cache configuration.
    """

    if HIT_SOURCE is not None:
        _cache_hit_source = HIT_SOURCE

    def __init__(
        self,
        vllm_config: Any,
        role: KVConnectorRole,
        kv_cache_config: Any = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        kv_role = getattr(self._kv_transfer_config, "kv_role", None)
        settings = ConnectorSettings.load(extra, kv_role=kv_role)
        setup_logging(settings.log_level)
        self.geometry = engine_geometry(vllm_config, kv_cache_config)
        is_worker = role == KVConnectorRole.WORKER
        tp_rank, tp_size, pp_rank, pp_size = parallel_ranks(vllm_config, is_worker)
        self.support = model_support(self.geometry, tp_size, pp_size)
        if self.support.level == "off" and settings.mode != "off":
            logger.error("%s", self.support.line())
            settings = replace(settings, mode="off")
        elif not is_worker:
            logger.info("%s", self.support.line())
        self.settings = settings
        self.layout = ShardLayout(tp_size, pp_size, replicated=self.geometry.mla)
        self.rank = self.layout.rank(tp_rank, pp_rank)
        self.shard = self.layout.shard(tp_rank, pp_rank)
        self.counters = Counters(
            "worker" if is_worker else "scheduler", self.rank, self.settings.stats_path
        )
        self.policy = kv_load_failure_policy(vllm_config)
        # the same decision in every process: a worker of its own process must not retry
        # loads the scheduler has vLLM recompute
        policy_set = (
            self.policy != "recompute"
            and self.settings.recompute_failed_loads
            and self.settings.can_load
            and recompute_load_failures(vllm_config)
        )
        if policy_set:
            self.policy = "recompute"  # read by vLLM's scheduler right after this
        self._scheduler: SchedulerSide | None = None
        self._ns_factors: dict[str, str] = {}
        """the namespace's factors, once computed (see :mod:`.scheduler.nsdiag`)"""
        self._worker: Any = None
        self._report: CacheReport | None = None
        if is_worker:
            from .worker.side import WorkerSide  # torch-heavy; workers only

            self._worker = WorkerSide(
                self.settings,
                self.shard,
                self.counters,
                self._make_client,
                saves=self.layout.saves(tp_rank),
                retry_failed_loads=self.policy == "fail",
                defer_checks=defer_possible(vllm_config),
                graph_tokens=cuda_graph_tokens(vllm_config) if device_type() == "cuda" else 0,
                new_blocks_may_be_busy=not defers_block_frees(),
                failed_as_requests=self.geometry.hybrid,
            )
        else:
            g = self.geometry
            self._scheduler = SchedulerSide(
                self.settings,
                g.block_size,
                self.layout.shards,
                namespace=self._compute_namespace,
                counters=self.counters,
                client_factory=self._make_client,
                device=device_type(),
                block_bytes=g.page_bytes * g.num_layers // g.groups,
                first_steps_min_tokens=first_steps_min_tokens(vllm_config, g),
                factors=lambda: self._ns_factors,
                layout=(
                    GroupLayout.of(g.windows, g.block_size, self.settings.window_anchor_tokens,
                                   g.states)
                    if g.hybrid else None
                ),
            )  # fmt: skip
            self._scheduler.start_warm_up()
            if self.settings.report_interval_s > 0 and self.settings.mode != "off":
                self._report = CacheReport(
                    self.counters,
                    self.settings.report_interval_s,
                    estimates=self._scheduler.costs.explain,
                    worker_totals=sameprocess.worker_totals,
                    miss_details=self._scheduler.lookups.misses.details,
                    on_tick=self._scheduler.miss_report.send,
                )
                self._report.start()
            fate = "is recomputed" if self.policy == "recompute" else "fails its request"
            if policy_set:
                fate += (
                    " (the connector set vLLM's kv_load_failure_policy; inside a "
                    "MultiConnector, give it at the top level)"
                )
            logger.info(
                "PegaFlow connector (vLLM %s): mode=%s coordinators=%s local_node=%s; "
                "a block that cannot be loaded %s",
                VLLM_VERSION,
                self.settings.mode,
                ",".join(self.settings.coordinators),
                self.settings.local_node or "(the node on this host, found by itself)",
                fate,
            )
            logger.info("PegaFlow connector %s", describe(self.settings.security()))
            if self.settings.can_load and self.policy != "recompute":
                logger.warning(
                    "PegaFlow: kv_load_failure_policy=%r: a block that cannot be loaded from "
                    "the cluster (node lost, evicted, corrupt) FAILS its request instead of "
                    "being recomputed (recompute_failed_loads is off, or this vLLM's config "
                    'refused the change). To recompute, set "kv_load_failure_policy": '
                    '"recompute" in --kv-transfer-config.',
                    self.policy,
                )

    # ---- plumbing ------------------------------------------------------------------

    def _make_client(self) -> Any:
        from pegaflow.client import SyncPegaClient

        from pegaflow.observability import telemetry

        telemetry.setup(service="pegaflow-connector")  # exports only if configured
        sec = self.settings.security()
        return SyncPegaClient(
            self.settings.client_config(), token=cluster_token(sec), tls=client_context(sec)
        )

    def _compute_namespace(self) -> str | None:
        hi = hash_info(self._vllm_config)
        if hi.root_fingerprint == "unset":
            return None
        stab = hash_stability(hi.algo, hi.pythonhashseed, hi.fixed_default_seed)
        if not stab.stable:
            logger.warning(
                "\n%s\nPegaFlow: BLOCK HASHES OF THIS ENGINE ARE NOT STABLE ACROSS PROCESSES.\n"
                "%s\n%s",
                "!" * 78,
                stab.reason,
                "!" * 78,
            )
        vc = self._vllm_config
        mc = vc.model_config
        weights = []
        load_format = str(getattr(vc.load_config, "load_format", ""))
        dummy = "dummy" in load_format
        if dummy:
            weights.append(f"dummy:seed={getattr(mc, 'seed', None)}")
        for attr in ("revision", "quantization", "tokenizer_revision"):
            v = getattr(mc, attr, None)
            if v:
                weights.append(f"{attr}={v}")
        served = getattr(mc, "served_model_name", None) or ""
        if isinstance(served, list | tuple):  # several names: the first, as vLLM does
            served = served[0] if served else ""
        ident = model_identity(str(mc.model), self.settings.model_id, str(served), dummy)
        g = self.geometry
        kv_dtype = f"{g.kv_dtype}/{g.cache_dtype}"
        if g.cache_dtype != "auto" and not dummy:
            try:
                scales = kv_scales_digest(str(mc.model))
            except OSError:  # unreadable: the model's identity says so in the log
                scales = ""
            if scales:  # changes no namespace of a cache without checkpoint scales
                kv_dtype += f"/scales:{scales}"
        f = NamespaceFactors(
            model=ident.identity,
            dtype=str(getattr(mc, "dtype", "")).replace("torch.", ""),
            kv_dtype=kv_dtype,
            device=device_type(),
            layout=g.layout_factor,
            block_size=g.block_size,
            num_layers=g.num_layers,
            num_kv_heads=g.num_kv_heads,
            head_size=g.head_size,
            tp_size=self.layout.tp_factor(dummy),
            pp_size=self.layout.pp_size,
            page_bytes=g.page_bytes,
            hash_algo=hi.algo,
            hash_seed_fingerprint=hi.root_fingerprint,
            weights=";".join(weights),
            extra=self.settings.namespace_extra,
            label=ident.name,
        )
        ns = make_namespace(f)
        self._ns_factors = factor_strings(asdict(f))
        # one line with every factor: two engines that share nothing compare theirs
        logger.info(
            "PegaFlow namespace %s for model identity %s (from %s; set model_id to override), %s",
            ns,
            ident.identity,
            ident.source,
            f,
        )
        return ns

    def _plan(self, meta: KVConnectorMetadata | None = None) -> StepPlan:
        meta = meta if meta is not None else self._connector_metadata
        if isinstance(meta, PegaConnectorMetadata):
            return meta.plan
        return StepPlan()

    @property
    def requires_kv_delivery(self) -> bool:
        """False: a best-effort cache; a dropped save is only a future miss."""
        return False

    # ==============================
    # Worker-side methods
    # ==============================

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Take this step's plan (vLLM calls this right before the forward pass, which
        the worker times for the cost model).

        Args:
            connector_metadata: this step's metadata.
        """
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            self._worker.begin_forward(self._plan(connector_metadata))

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Adopt the engine's per-layer KV cache tensors (whole-block copies, any layout).

        Args:
            kv_caches: layer name -> KV cache tensor of that layer.
        """
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches, self.geometry.num_blocks)
        io = self._worker.io
        if io is not None and self._worker.defer_checks:  # the scheduler shares this process
            sameprocess.register(self._worker)
        if io is not None and self.geometry.page_bytes:
            per_layer = {layer.tile_bytes for layer in io.layers}
            if per_layer != {self.geometry.page_bytes}:
                logger.warning(
                    "PegaFlow: KV tiles of %s bytes, vLLM pages of %d bytes",
                    sorted(per_layer),
                    self.geometry.page_bytes,
                )

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Before preempted requests' blocks are reused: finish copying them out.

        Args:
            kv_connector_metadata: this step's metadata (lists the preempted requests).
        """
        if self._worker is None:
            return
        plan = self._plan(kv_connector_metadata)
        if plan.preempted:
            self._worker.wait_for_copies(plan.preempted)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Start this step's loads.

        Asynchronous loads (requests waiting for remote KV) run in the background and
        their requests are not scheduled until :meth:`get_finished` reports them.
        Layer-wise loads (hits held by this host's node; their requests run in this
        very step) are queued on the connector's CUDA stream here, one event per layer,
        and checked before :meth:`get_block_ids_with_load_errors` answers.

        Args:
            forward_context: vLLM's forward context (unused).
            **kwargs: unused.
        """
        if self._worker is not None:
            idle = getattr(forward_context, "attn_metadata", None) is None
            self._worker.start_step(self._plan(), idle=idle)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Make this layer wait for its blocks of the step's layer-wise loads.

        Layer-wise loads (hits held by the node on this host) are copied during the
        forward pass; the layer's attention stream waits on the device for an event
        recorded after that layer's copies, so the CPU never blocks here.  Asynchronous
        loads were finished before vLLM scheduled their requests: nothing to wait for.

        Args:
            layer_name: the layer about to run.
        """
        if self._worker is not None:
            self._worker.wait_layer(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """No-op: blocks are saved whole (every layer) after the forward pass.

        Args:
            layer_name: the layer that ran.
            kv_layer: its paged KV cache.
            attn_metadata: attention metadata of the step.
            **kwargs: unused.
        """
        return

    def wait_for_save(self) -> None:
        """Queue the copy-out of the blocks this step filled; returns without waiting.

        vLLM keeps the blocks of a finished request until :meth:`get_finished` reports
        it (see :meth:`request_finished`), and preemptions wait in
        :meth:`handle_preemptions`, so the copy can run behind the next steps.
        """
        if self._worker is not None:
            self._worker.end_forward()
            self._worker.submit_saves(self._plan())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose async transfers completed.

        Args:
            finished_req_ids: requests that finished generating this step.

        Returns:
            (requests whose blocks are copied out and may be freed, requests whose
            loads finished, successfully or not).
        """
        if self._worker is None:
            return None, None
        return self._worker.get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """vLLM 0.32's :meth:`get_finished`, with the requests whose load failed where
        their blocks cannot be named (a model of several KV cache groups): vLLM
        recomputes them whole."""
        sending, recving = self.get_finished(finished_req_ids)
        failed = self._worker.take_failed_requests() if self._worker is not None else set()
        return TransferResults(
            finished_sending=set(sending or ()),
            finished_recving=set(recving or ()) | failed,
            failed_recving=failed,
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks that could not be loaded (node gone, evicted, checksum mismatch).

        Reported no later than the step in which their request is reported finished
        receiving; vLLM recomputes from the first failed block of each request.
        """
        if self._worker is None:
            return set()
        return self._worker.take_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """Failed saves and loads, so the scheduler side stops assuming they are stored."""
        if self._worker is None:
            return None
        rep = self._worker.take_report()
        return PegaWorkerMetadata(rep) if rep is not None else None

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """Counters and operation durations since the last call (see :mod:`.metrics`),
        or None when idle."""
        delta = self.counters.take_delta()
        return PegaConnectorStats(data=delta) if delta else None

    def shutdown(self) -> None:
        """Drain queued copies, give pending puts a moment, close the client."""
        if self._worker is not None:
            self._worker.shutdown()
            if self._scheduler is None and sameprocess.worker_totals() is None:
                self._log_untold()
        if self._scheduler is not None:
            self._scheduler.close()
            self.counters.maybe_write(force=True)
        if self._report is not None:
            self._report.close()

    def _log_untold(self) -> None:
        """A worker of a process of its own: its counters reach the scheduler's cache
        line only with a step's output, so what no step carried (saves that finished
        after the engine's last step) is logged here, in a line of its own."""
        untold = {k: v for k, v in self.counters.take_delta().items() if k in WORKER_COUNTERS}
        title = f"PegaFlow cache (rank {self.rank}, after the last step)"
        line = format_line(untold, 0.0, title=title)
        if line is not None:
            logger.info("%s", line)

    # ==============================
    # Scheduler-side methods
    # ==============================

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` stored in the cluster (all shards).

        One lookup with a hard deadline; any failure is 0 hits.  Hits are loaded
        asynchronously, so the answer is ``(hit_tokens, True)`` or ``(0, False)``.

        Args:
            request: the request.
            num_computed_tokens: tokens already in vLLM's own prefix cache.
        """
        assert self._scheduler is not None
        try:
            return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)
        except Exception:
            logger.exception("PegaFlow: lookup bookkeeping failed; treating as a miss")
            return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Plan the load into the blocks vLLM allocated for the external hit; a worker
        in this process may start it now (:meth:`~.worker.side.WorkerSide.prestart_job`).

        Args:
            request: the request.
            blocks: all of the request's blocks.
            num_external_tokens: tokens to load (0: nothing to do).
        """
        assert self._scheduler is not None
        job = self._scheduler.update_state_after_alloc(
            request, block_ids_of(blocks), num_external_tokens
        )
        worker = sameprocess.worker()
        if job is not None and worker is not None:
            worker.prestart_job(job, self._scheduler.namespace)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        """This step's loads, saves, preemptions and delayed frees for the workers; a
        worker in this process starts the step's layer-wise loads now (:mod:`.sameprocess`).

        Args:
            scheduler_output: the step's scheduler output (not modified).
        """
        assert self._scheduler is not None
        plan = self._scheduler.build_plan(scheduler_output)
        worker = sameprocess.worker()
        if worker is not None:
            worker.prestart(plan)
        return PegaConnectorMetadata(plan)

    def update_connector_output(self, connector_output: Any) -> None:
        """Learn the workers' failed saves / loads (they may be saved again).

        Args:
            connector_output: aggregated worker output of the step.
        """
        if self._scheduler is None:
            return
        stats = getattr(connector_output, "kv_connector_stats", None)
        data = getattr(stats, "data", None)
        if self._report is not None and isinstance(data, dict):
            self._report.add_workers(data)
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, PegaWorkerMetadata):
            self._scheduler.update_connector_output(meta.report)

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Keep a finished request's blocks while their copy-out is pending.

        Args:
            request: the finished request.
            block_ids: its blocks.

        Returns:
            (True when vLLM must wait for :meth:`get_finished` before freeing the
            blocks; on a ``kv_producer``, the handoff a ``kv_consumer`` loads the
            request's blocks by, as vLLM's ``kv_transfer_params`` (see
            :mod:`.handoff`), else None).
        """
        assert self._scheduler is not None
        delay = self._scheduler.request_finished(request)
        try:
            params = self._scheduler.handoff_params(request)
        except Exception:
            logger.exception("PegaFlow: cannot build the handoff of %s", request.request_id)
            params = None
        return delay, params

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """:meth:`request_finished` under vLLM's hybrid KV cache manager (``SupportsHMA``):
        the same decision for every KV cache group's blocks."""
        return self.request_finished(request, block_ids[0] if block_ids else [])

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Whether vLLM must capture piecewise CUDA graphs only (its default captures
        full graphs for steps whose requests each compute one token).

        Yes unless ``layerwise`` is off: a step's same-host hits load layer by layer,
        each layer's attention waiting in :meth:`wait_for_layer_load`, which the replay
        of a full graph skips; it would read the blocks before their copies land.  A
        hit of all but a prompt's last token makes such a step.

        Args:
            extra_config: ``kv_connector_extra_config``.
        """
        try:
            return ConnectorSettings.load(extra_config).layerwise
        except ValueError:  # reported when the connector starts; stay safe meanwhile
            return True

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        """Rebuild stats sent from another process.

        Args:
            data: the counters.
        """
        return PegaConnectorStats(data=dict(data or {}))

    build_prom_metrics = staticmethod(PegaPromMetrics)
    """``vllm:pegaflow_*`` counters and latency histograms on vLLM's ``/metrics`` (names:
    docs/metrics.md): vLLM calls it with :class:`~.stats.PegaPromMetrics`' arguments."""
