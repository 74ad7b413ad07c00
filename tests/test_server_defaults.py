"""``pegaflow-server``'s default pool: sized for the host, printed at start, and PegaFlow's
own ``--pool-size`` spelling accepted."""

from __future__ import annotations

from pegaflow.devcluster import start_server
from pegaflow.server import AUTO_POOL_CAP, HostMemory, _aliases, auto_pool_bytes

GiB = 1 << 30
SLAB = 64 << 20


def test_a_gpu_host_gets_the_cap() -> None:
    host = HostMemory(mem_total=2048 * GiB, mem_available=1900 * GiB, shm_total=1024 * GiB,
                      shm_free=1000 * GiB)  # fmt: skip
    size, why = auto_pool_bytes(host, SLAB)
    assert size == AUTO_POOL_CAP == 64 * GiB
    assert "25% of 2048.0 GiB memory" in why and "64.0 GiB" in why


def test_smaller_hosts_get_a_share_in_whole_slabs() -> None:
    host = HostMemory(mem_total=30 * GiB, mem_available=28 * GiB, shm_total=16 * GiB,
                      shm_free=16 * GiB)  # fmt: skip
    assert auto_pool_bytes(host, SLAB)[0] == 7 * GiB + 512 * (1 << 20)  # 25% of 30 GiB
    host = HostMemory(mem_total=64 * GiB, mem_available=60 * GiB, shm_total=8 * GiB,
                      shm_free=8 * GiB)  # fmt: skip
    assert auto_pool_bytes(host, SLAB)[0] == 4 * GiB  # half of shm_dir


def test_never_more_than_half_of_what_is_there_now() -> None:
    host = HostMemory(mem_total=64 * GiB, mem_available=6 * GiB, shm_total=32 * GiB,
                      shm_free=30 * GiB)  # fmt: skip
    size, why = auto_pool_bytes(host, SLAB)
    assert size == 3 * GiB and "cut to half of what is available now" in why
    docker = HostMemory(mem_total=64 * GiB, mem_available=60 * GiB, shm_total=64 << 20,
                        shm_free=64 << 20)  # fmt: skip
    assert auto_pool_bytes(docker, SLAB)[0] == 0  # not one slab: the server says so and exits
    assert auto_pool_bytes(docker, 16 << 20)[0] == 32 << 20


def test_pool_size_is_an_alias_of_the_pool_option() -> None:
    assert _aliases(["--pool-size", "40gb", "-x"]) == ["--node-pool-bytes", "40gb", "-x"]
    assert _aliases(["--pool-size=auto"]) == ["--node-pool-bytes", "0"]
    assert _aliases(["--node-pool-bytes", "AUTO"]) == ["--node-pool-bytes", "0"]
    assert _aliases(["--node-slab-bytes", "4MiB"]) == ["--node-slab-bytes", "4MiB"]


def test_the_server_takes_pool_size_and_prints_its_capacity() -> None:
    p = start_server(extra=["--pool-size", "48MiB", "--node-slab-bytes", "4MiB"])
    try:
        assert p.ready["pool"] == str(48 << 20)
        assert any("pool of 48 MiB (given)" in line for line in p.log), p.log
    finally:
        p.terminate()
