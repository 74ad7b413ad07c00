# syntax=docker/dockerfile:1
#
# PegaFlow cluster: one image for every service (pegaflow-coordinator, pegaflow-node,
# pegaflow-server, pegaflow-router and the pegaflow CLI). The vLLM engines use their own
# image, vLLM plus this project: configs/k8s/Dockerfile.vllm.
#
# Build, from the repository root (BuildKit, the default since Docker 23; podman and
# buildah build it too):
#   docker build -t registry.example.com/pegaflow-cluster:0.1.0 .
#   docker build --build-arg EXTRAS=cu13 -t ... .      # UCX of CUDA 13 (default: cu12)
#   docker build --build-arg EXTRAS=cu12,otlp -t ... . # with OpenTelemetry (OTLP) export
# EXTRAS: the extras installed with the wheel; a UCX one (cu12 or cu13) for the node and
# pegaflow-server, none needed for an image that runs only the coordinator or router.
#
# Run (host networking: the UCX data plane must be reachable at the host's address;
# every option is also a PEGAFLOW_<TABLE>_<OPTION> variable or a --config FILE entry):
#   coordinator:  docker run -d --network host -e PEGAFLOW_SECURITY_TOKEN=... IMAGE \
#                   pegaflow-coordinator --etcd-endpoints 10.0.0.1:2379 \
#                   --coordinator-host 0.0.0.0 --coordinator-http-host 0.0.0.0
#   node:         docker run -d --network host --ulimit memlock=-1 -v /dev/shm:/dev/shm \
#                   -e PEGAFLOW_SECURITY_TOKEN=... IMAGE \
#                   pegaflow-node --etcd-endpoints 10.0.0.1:2379 --node-host 10.0.0.2 \
#                   --node-id gpu-a --node-pool-bytes 64GiB
#   server:       docker run -d --network host -v /dev/shm:/dev/shm IMAGE pegaflow-server
#                   (one host, no etcd: listens on 127.0.0.1:7700, where vLLM looks)
#   router:       docker run -d --network host IMAGE pegaflow-router --router-host 0.0.0.0 \
#                   --client-coordinators 10.0.0.1:7700 --router-replicas http://gpu-a:8000
#   status:       docker run --rm --network host IMAGE pegaflow status --coordinators 10.0.0.1:7700
# Kubernetes: configs/k8s (docs/operations.md, "Kubernetes and containers").
#
# User: the image runs as root by default, for pegaflow-node (and pegaflow-server): the
# pool lives in the host's /dev/shm (a hostPath), the engines that open it run as root
# in the stock vLLM images, and an added capability (IPC_LOCK, for UCX memory
# registration) is only effective for root in Kubernetes. The stateless services need
# none of that: the user `pegaflow` (uid/gid 10001) exists for them, and the coordinator
# Deployment runs as it (runAsUser: 10001).
#
# UCX: the libucx wheel (a dependency of ucxx-cu12 or ucxx-cu13) brings TCP, shared
# memory, CMA and CUDA transports, built without verbs/rdmacm. For RDMA, install a UCX built with
# rdma-core in a derived image and set RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY=true.

ARG PYTHON_IMAGE=python:3.11-slim

# ---- build: the project's wheel, from the sources only ----
FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY pegaflow/ pegaflow/
COPY coordinator/ coordinator/
COPY storage_node/ storage_node/
COPY client/ client/
COPY connector/ connector/
COPY router/ router/
RUN pip wheel --no-cache-dir --disable-pip-version-check --no-deps -w /dist .

# ---- the image: the wheel and its dependencies, no sources, no build tools ----
FROM ${PYTHON_IMAGE}
ARG EXTRAS="cu12"
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="pegaflow-cluster" \
      org.opencontainers.image.description="PegaFlow cluster: external KV cache for vLLM (coordinator, storage node, all-in-one server, router)" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="docker.io/library/python:3.11-slim"
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore
RUN --mount=type=bind,from=build,source=/dist,target=/dist \
    pip install --no-cache-dir "$(echo /dist/pegaflow_cluster-*.whl)${EXTRAS:+[$EXTRAS]}" \
    && groupadd --system --gid 10001 pegaflow \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin pegaflow \
    && pegaflow --help >/dev/null
WORKDIR /tmp
# coordinator control / HTTP, router HTTP, node UCX handshake / HTTP
# (pegaflow-server: 7700, 7780 and 7800)
EXPOSE 7700 7780 7790 7800 7880
CMD ["pegaflow", "--help"]
