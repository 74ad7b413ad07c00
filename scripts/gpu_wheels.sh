#!/usr/bin/env bash
# Lay out, in the git-ignored `.whl/`, what the H200 development machine needs to run
# our code: that machine has torch/CUDA 13 and no package index, so UCX and the few
# packages its image lacks travel as wheels (about 55 MiB, under the 64 MiB a device
# command may carry). Run here, in the repository root; on the device machine, with
# `.whl` carried, `source .whl/setup_dev.sh` installs them and this tree into /tmp/site
# and leaves you in /tmp/w with tests/, scripts/ and pyproject.toml (the repository's
# own `pegaflow/` folder would shadow the installed package, hence the move).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
rm -rf .whl && mkdir -p .whl/dl
plat=""
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
         manylinux_2_17_x86_64 manylinux2014_x86_64 any; do plat="$plat --platform $p"; done
# shellcheck disable=SC2086
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    $plat -d .whl/dl ucxx-cu13 aetcd pytest-asyncio
# The image already has numpy, grpcio, protobuf, pytest, cuda-bindings and friends.
for w in aetcd librmm_cu13 libucx_cu13 libucxx_cu13 rapids_logger rmm_cu13 ucxx_cu13 \
         pytest_asyncio; do
    mv .whl/dl/"$w"-*.whl .whl/
done
rm -rf .whl/dl
cat > .whl/setup_dev.sh <<'SH'
# source me on the device machine, from the repository root, with .whl carried
set -e
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-deps --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/site .
export PYTHONPATH=/tmp/site
rm -rf /tmp/w && mkdir -p /tmp/w && cp -r tests scripts pyproject.toml /tmp/w/
cd /tmp/w
set +e
SH
du -sh .whl
