#!/usr/bin/env bash
# Lay out, in the git-ignored `.gpust/`, everything the GPU development machine needs to
# run real vLLM with our package: the vLLM wheel and its dependencies
# (../shared/gpu-vllm/fetch.sh) and UCX and friends (scripts/gpu_wheels.sh), in one tar
# split into pieces that fit a device command beside the working tree (64 MiB in all).
# Run here, in the repository root, after both of those scripts. On the device machine,
# command k (00, 01, ...) carries `.gpust/k`; the commands follow each other without a
# pause (the machine goes back 30 s after a command ends):
#   all but the last: mkdir -p /root/stage && cp .gpust/k/* /root/stage/
#   the last:         cp .gpust/k/* /root/stage/ && bash .gpust/k/install.sh && export
#                     PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 && cd /tmp/w && ...
set -euo pipefail
cd "$(dirname "$0")/.."
[ -d .gpuw/deps ] && [ -d .whl ] || { echo "run ../shared/gpu-vllm/fetch.sh and scripts/gpu_wheels.sh first" >&2; exit 1; }
grep -qx '/.gpust/' .git/info/exclude 2>/dev/null || echo '/.gpust/' >> .git/info/exclude
tree_mib=$(( $(git ls-files -z | du -c --files0-from=- -b | tail -1 | cut -f1) >> 20 ))
piece=$(( 62 - tree_mib ))
rm -rf .gpust && mkdir -p .gpust/all
# the vLLM wheel's pieces are .gpuw/1 ... .gpuw/5 (the deps folder holds a wheel whose
# name also starts with "part")
cat .gpuw/[0-9]*/part* > .gpust/all/vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl
cp .gpuw/deps/*.whl .whl/*.whl .gpust/all/
tar cf .gpust/all.tar -C .gpust/all . && rm -rf .gpust/all
(cd .gpust && split -b "${piece}M" -d all.tar p && rm all.tar)
last=""
for p in .gpust/p*; do k=${p#.gpust/p}; mkdir -p ".gpust/$k" && mv "$p" ".gpust/$k/"; last=$k; done
cat > ".gpust/$last/install.sh" <<'SH'
# on the device machine, from the repository root: join the pieces, install into
# /tmp/site, copy tests/ scripts/ pyproject.toml to /tmp/w (where the repository's own
# pegaflow/ does not shadow the installed package)
set -e
mkdir -p /root/wh && cat /root/stage/p* | tar xf - -C /root/wh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site /root/wh/*.whl
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target /tmp/site .
rm -rf /tmp/w && mkdir -p /tmp/w && cp -r tests scripts pyproject.toml /tmp/w/
echo "installed; now: export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0; cd /tmp/w"
SH
du -sh .gpust/*
