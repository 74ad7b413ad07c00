"""Validation of the UCX worker addresses that peers send us over the network.

Why: :meth:`pegaflow.transport.ucx.UcxWorker.serve` and
:meth:`~pegaflow.transport.ucx.UcxWorker.connect`
exchange UCX worker addresses over TCP and hand the peer's to
``ucp_ep_create``.  UCX (``ucp_address_unpack`` in ``src/ucp/wireup/address.c``) takes
no length: it walks the buffer as its own packer wrote it, trusting every length,
index and flag, and aborts the process on some values (``printf '\\0\\0\\0\\1\\2'`` to a
node's handshake port: ``Assertion `*addr_version == UCP_OBJECT_VERSION_V2'``).  So
nothing from the network reaches UCX before :func:`check_peer_address` accepted it.

What is accepted (:func:`parse_worker_address`, then :class:`AddressPolicy`): what
``ucp_worker_get_address`` of UCX 1.21 (the ``libucx`` wheel this package pins;
``address.c`` is the same on the v1.21.x branch) packs, in either format
(``UCX_ADDRESS_VERSION=v1``, the default, or ``v2``), checked field by field.  That is
stricter than what ``ucp_address_unpack`` walks without asserting: an address it
unpacks can still abort the process later, in lane selection or endpoint configuration
(the fuzz tests found one), so values no packer writes are refused too:

* structure: every length and extension byte lies inside the buffer and nothing
  follows the last device; the encoding is canonical (:func:`pack_worker_address` of
  the parsed address gives the same bytes back); at most 128 transport entries
  (``UCP_MAX_RESOURCES``); md indices below 64 (``UCP_MAX_MDS``: UCX writes
  ``ae_cmpts[md_index]`` into a 64-entry stack array); only defined header, device,
  interface and capability flag bits; no endpoint addresses, client id or "AM only"
  flag (a worker address carries none); path counts 2-255 when given, a known system
  device, a printable worker name;
* interface attributes: finite, non-negative overhead and latency below 1 s, a
  positive bandwidth of at most 1 PB/s (UCX itself only refuses ``bandwidth <= 0``,
  which lets NaN and infinity through into its lane scores); in format v2 no fp8 NaN
  and, on an interface offering active messages, a segment of at least 1 KiB (UCX
  asserts that a rendezvous key fits one: found by the fuzz test, a segment of 0 killed
  the node);
* the format and release: the format (v1/v2) is our worker's and the UCX release the
  peer packed (4 bits) equals ours, which a v1 address carries since UCX 1.16: the
  layout is UCX-internal, so every host of a cluster must run the same UCX with the
  same ``UCX_ADDRESS_VERSION`` (the refusal says so);
* per transport, for every entry whose transport our worker also has (only those
  reach UCT code): the address lengths that transport's reader dereferences.  ``tcp``:
  a 2-byte port and a device address of flags (loopback only) + family (IPv4/IPv6) +
  exactly the in-address or loopback-namespace bytes that flag and family imply; the
  shared-memory family (posix, sysv, cma, knem, xpmem): a device address of at least
  the 8-byte host id; ``self`` and any other transport: the lengths our own worker
  uses.  Entries of transports we lack are never read by UCX and are only bounded.
* host identity: an entry that names *this* host (the same shared-memory host id and
  namespace, our own TCP device address, our ``self`` interface) is taken only over a
  connection from this host (:func:`peer_on_this_host`), and an address with our own
  worker's id only when it is our own address.  Otherwise a remote peer could make
  the node map shared-memory segments or files (posix addresses name
  ``/proc/<pid>/fd/<fd>``), read other processes (cma names a pid) or dial local
  ports chosen by the peer.  Such an entry must also have the address lengths of ours
  (one host, one UCX configuration and namespace set: the readers assume their own).
  Namespaces count as UCX counts them (:func:`same_local_host`): a pod of this kernel
  in its own IPC or network namespace is another host, reached over TCP.

Alternatives considered: comparing only the header and a size bound to our own
address stops the 5-byte packet but not a truncated or bit-flipped real address
(lengths inside it still point past the end); probing each address in a throwaway
subprocess first costs a process start per handshake (measured here: 0.57 s and 50 MB
for a Python that imports UCX, creates a worker and an endpoint; a warm prober still
pays the endpoint, which dials the peer, and its verdict does not carry over: lane
selection in the serving worker also depends on that worker's state and
configuration), is itself a way to exhaust the host, and would still need a parser to
bound its input.  The strict parser costs 30-60 microseconds per handshake and fails
closed.

What it cannot stop: UCX's own transport ports (the TCP interface port in every
address) also receive wire-up messages carrying addresses that UCX unpacks without
any such check, so restrict ``[node] ucx_net_devices`` to a network of trusted hosts.
And a process on this host is trusted as UCX trusts it (it may name this host's
segments and processes, as it could through UCX directly): the handshake itself is not
authenticated.
"""

from __future__ import annotations

import functools
import ipaddress
import math
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

MAX_ADDRESS_BYTES = 64 << 10
"""the largest peer address read at all (a real one is a few hundred bytes)"""

UCX_RELEASE = "1.21"
"""the UCX release whose address format this module follows"""

FORMAT_V1 = 0
FORMAT_V2 = 1

# header flags (address.c, UCP_ADDRESS_HEADER_FLAG_*)
_H_DEBUG_INFO = 0x1
_H_WORKER_UUID = 0x2
_H_CLIENT_ID = 0x4
_H_AM_ONLY = 0x8
_H_ALL = 0xF

_MD_EMPTY = 0x80
_MD_MASK = 0x7F
_DEV_LAST = 0x80
_DEV_NUM_PATHS = 0x40
_DEV_SYS_DEVICE = 0x20
_DEV_LEN_MASK = 0x1F
_IF_LAST = 0x80
_IF_HAS_EP = 0x40
_IF_LEN_MASK = 0x3F
_NULL_RESOURCE = 0xFF
_SYS_DEVICE_UNKNOWN = 0xFF

MAX_TRANSPORTS = 128  # UCP_MAX_RESOURCES
MAX_MDS = 64  # UCP_MAX_MDS

_V1_ATTR = struct.Struct("<fffI")  # overhead, bandwidth, lat_ovh, prio_cap_flags
_V2_ATTR = struct.Struct("<BBBBHH")  # fp8 overhead, bandwidth, latency; prio; seg; flags
# v1 prio_cap_flags: 8 bits priority, 13 capability + 1 event flag from bit 8, atomics
_V1_CAP_MASK = 0xFF | (((1 << 14) - 1) << 8) | (1 << 30) | (1 << 31)
_V2_FLAGS_MASK = (1 << 10) - 1  # UCP_ADDR_IFACE_FLAG_CONNECT_TO_IFACE ... ATOMIC64
_V2_AM_SYNC = 1 << 1  # UCP_ADDR_IFACE_FLAG_AM_SYNC: may carry the active-message lane
_V2_SEG_UNIT = 64  # UCP_ADDRESS_IFACE_SEG_SIZE_FACTOR
_MIN_AM_SEGMENT = 1024
_FP8_EXP_NAN = 0xF
_MAX_SECONDS = 1.0
_MAX_BANDWIDTH = 1e15

_U16 = struct.Struct("<H")
_U64 = struct.Struct("<Q")

_LOCAL_ID_NS = 1 << 63  # UCT_IFACE_LOCAL_ADDR_FLAG_NS
_TCP_LOOPBACK = 0x1  # UCT_TCP_DEVICE_ADDR_FLAG_LOOPBACK
_AF_INET = 2
_AF_INET6 = 10
_NS_ADDR_BYTES = 16  # uct_iface_local_addr_ns_t
_HOST_ID_BYTES = 8  # uct_iface_local_addr_base_t


def tl_name_csum(name: str) -> int:
    """UCX's checksum of a transport name (``ucs_crc16_string``, CRC-16-CCITT)."""
    crc = 0xFFFF
    for b in name.encode():
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (0x8408 if crc & 1 else 0)
    return ~crc & 0xFFFF


TCP = tl_name_csum("tcp")
SELF = tl_name_csum("self")
SHARED_MEMORY = frozenset(map(tl_name_csum, ("posix", "sysv", "cma", "knem", "xpmem")))


class InvalidWorkerAddress(ValueError):
    """A peer's UCX worker address that UCX must not see."""


@dataclass(frozen=True)
class Transport:
    """One transport entry (``ucp_address_entry_t``) as packed."""

    tl_csum: int
    attrs: bytes
    """the packed interface attributes (16 bytes in format v1, 8 in v2)"""
    iface_addr: bytes


@dataclass(frozen=True)
class Device:
    """A device of the address and its transports."""

    md_index: int
    dev_addr: bytes
    num_paths: int
    sys_dev: int
    transports: tuple[Transport, ...]


@dataclass(frozen=True)
class WorkerAddress:
    """A parsed UCX worker address (see :func:`parse_worker_address`)."""

    fmt: int
    """FORMAT_V1 or FORMAT_V2"""
    release: int
    """the packer's UCX minor release modulo 16"""
    flags: int
    uuid: int
    name: bytes | None
    devices: tuple[Device, ...]

    def transports(self) -> Iterable[tuple[Device, Transport]]:
        """Every transport entry with its device."""
        for d in self.devices:
            for t in d.transports:
                yield d, t


def _bad(msg: str) -> InvalidWorkerAddress:
    return InvalidWorkerAddress(f"not a UCX {UCX_RELEASE} worker address: {msg}")


class _Reader:
    __slots__ = ("buf", "pos")

    def __init__(self, buf: bytes) -> None:
        self.buf = buf
        self.pos = 0

    def take(self, n: int, what: str) -> bytes:
        end = self.pos + n
        if end > len(self.buf):
            raise _bad(f"{what} ({n} bytes at offset {self.pos}) runs past the end")
        out = self.buf[self.pos : end]
        self.pos = end
        return out

    def u8(self, what: str) -> int:
        if self.pos >= len(self.buf):
            raise _bad(f"{what} at offset {self.pos} is past the end")
        b = self.buf[self.pos]
        self.pos += 1
        return b

    def extended(self, first: int, mask: int, fmt: int, what: str) -> int:
        """A value packed by ``ucp_address_pack_byte_extended`` (``first`` already read)."""
        value = first & mask
        if fmt != FORMAT_V1 and value == mask:
            value = self.u8(what)
            if value < mask:
                raise _bad(f"{what} {value} needlessly extended")
        return value


def _check_attrs(fmt: int, attrs: bytes, where: str) -> None:
    if fmt == FORMAT_V1:
        overhead, bandwidth, lat_ovh, caps = _V1_ATTR.unpack(attrs)
        if caps & ~_V1_CAP_MASK:
            raise _bad(f"{where}: undefined capability bits {caps & ~_V1_CAP_MASK:#x}")
        for name, v in (("overhead", overhead), ("latency", lat_ovh)):
            if not (math.isfinite(v) and 0.0 <= v < _MAX_SECONDS):
                raise _bad(f"{where}: {name} {v!r} s out of range")
        if not (math.isfinite(bandwidth) and 0.0 < bandwidth <= _MAX_BANDWIDTH):
            raise _bad(f"{where}: bandwidth {bandwidth!r} B/s out of range")
        return
    overhead8, bandwidth8, latency8, _prio, seg, flags = _V2_ATTR.unpack(attrs)
    if flags & ~_V2_FLAGS_MASK:
        raise _bad(f"{where}: undefined interface flag bits {flags & ~_V2_FLAGS_MASK:#x}")
    if flags & _V2_AM_SYNC and seg * _V2_SEG_UNIT < _MIN_AM_SEGMENT:
        # UCX sizes its active-message fragments (rendezvous keys included) by it
        raise _bad(f"{where}: active-message segment of {seg * _V2_SEG_UNIT} bytes")
    for name, v in (("overhead", overhead8), ("bandwidth", bandwidth8), ("latency", latency8)):
        exp = v & 0xF
        if exp == _FP8_EXP_NAN or (exp == 0 and (v != 0 or name == "bandwidth")):
            raise _bad(f"{where}: {name} fp8 {v:#04x} is not a value UCX packs")


def parse_worker_address(buf: bytes) -> WorkerAddress:
    """Parse ``buf`` strictly (see the module docstring); raises InvalidWorkerAddress."""
    if not isinstance(buf, bytes):
        raise TypeError("a worker address is bytes")
    if not 0 < len(buf) <= MAX_ADDRESS_BYTES:
        raise _bad(f"{len(buf)} bytes")
    r = _Reader(buf)
    head = r.u8("header")
    fmt = head & 0xF
    if fmt == FORMAT_V1:
        flags = head >> 4
        release = -1
    elif fmt == FORMAT_V2:
        release = head >> 4
        flags = r.u8("header flags")
        if flags & ~_H_ALL:
            raise _bad(f"undefined header flags {flags:#x}")
    else:
        raise _bad(f"unknown address format {fmt}")
    if not flags & _H_WORKER_UUID:
        raise _bad("no worker id")
    if flags & (_H_CLIENT_ID | _H_AM_ONLY):
        raise _bad(f"header flags {flags:#x} of a client-server address")
    (uuid,) = _U64.unpack(r.take(8, "worker id"))
    name = None
    if flags & _H_DEBUG_INFO:
        name = r.take(r.u8("worker name length"), "worker name")
        if any(not 0x20 <= c < 0x7F for c in name):
            raise _bad("worker name is not printable")
    if r.pos < len(buf) and buf[r.pos] == _NULL_RESOURCE:
        raise _bad("no transports")
    devices: list[Device] = []
    count = 0
    while True:
        where = f"device {len(devices)}"
        md_byte = r.u8(f"{where} md index")
        empty = md_byte & _MD_EMPTY
        md_index = r.extended(md_byte, _MD_MASK, fmt, f"{where} md index")
        dev_byte = r.u8(f"{where} address length")
        last = dev_byte & _DEV_LAST
        dev_len = r.extended(dev_byte, _DEV_LEN_MASK, fmt, f"{where} address length")
        num_paths = 1
        if dev_byte & _DEV_NUM_PATHS:
            num_paths = r.u8(f"{where} path count")
            if num_paths < 2:
                raise _bad(f"{where}: path count {num_paths}")
        sys_dev = _SYS_DEVICE_UNKNOWN
        if dev_byte & _DEV_SYS_DEVICE:
            sys_dev = r.u8(f"{where} system device")
            if sys_dev == _SYS_DEVICE_UNKNOWN:
                raise _bad(f"{where}: unknown system device packed")
        dev_addr = r.take(dev_len, f"{where} address")
        if empty:
            # v1: the last, empty device carries the packer's release (UCX >= 1.16)
            if fmt != FORMAT_V1 or not last or md_index > 0xF or dev_byte != _DEV_LAST:
                raise _bad(f"{where}: unexpected empty device")
            release = md_index
            break
        if md_index >= MAX_MDS:
            raise _bad(f"{where}: md index {md_index} >= {MAX_MDS}")
        transports: list[Transport] = []
        attr_size = _V1_ATTR.size if fmt == FORMAT_V1 else _V2_ATTR.size
        while True:
            if count >= MAX_TRANSPORTS:
                raise _bad(f"more than {MAX_TRANSPORTS} transports")
            twhere = f"transport {count}"
            (csum,) = _U16.unpack(r.take(2, f"{twhere} name checksum"))
            attrs = r.take(attr_size, f"{twhere} attributes")
            _check_attrs(fmt, attrs, twhere)
            len_byte = r.u8(f"{twhere} address length")
            if len_byte & _IF_HAS_EP:
                raise _bad(f"{twhere}: endpoint addresses in a worker address")
            if_len = r.extended(len_byte, _IF_LEN_MASK, fmt, f"{twhere} address length")
            iface = r.take(if_len, f"{twhere} address")
            transports.append(Transport(csum, attrs, iface))
            count += 1
            if len_byte & _IF_LAST:
                break
        devices.append(Device(md_index, dev_addr, num_paths, sys_dev, tuple(transports)))
        if last:
            if fmt == FORMAT_V1:
                raise _bad("no release version (a UCX older than 1.16?)")
            break
    if r.pos != len(buf):
        raise _bad(f"{len(buf) - r.pos} bytes after the last device")
    addr = WorkerAddress(fmt, release, flags, uuid, name, tuple(devices))
    if pack_worker_address(addr) != buf:
        raise _bad("not in the canonical encoding")
    return addr


def _extended(value: int, mask: int, fmt: int) -> bytes:
    if fmt != FORMAT_V1 and value >= mask:
        return bytes((mask, value))
    return bytes((value,))


def pack_worker_address(addr: WorkerAddress) -> bytes:
    """The bytes ``ucp_address_pack`` writes for ``addr`` (the inverse of
    :func:`parse_worker_address`; values are not checked)."""
    fmt = addr.fmt
    out = bytearray()
    if fmt == FORMAT_V1:
        out.append(fmt | (addr.flags << 4))
    else:
        out += bytes((fmt | (addr.release << 4), addr.flags))
    out += _U64.pack(addr.uuid)
    if addr.flags & _H_DEBUG_INFO:
        name = addr.name or b""
        out.append(len(name))
        out += name
    for i, d in enumerate(addr.devices):
        out += _extended(d.md_index, _MD_MASK, fmt)
        dev_at = len(out)
        out += _extended(len(d.dev_addr), _DEV_LEN_MASK, fmt)
        if d.num_paths > 1:
            out[dev_at] |= _DEV_NUM_PATHS
            out.append(d.num_paths)
        if d.sys_dev != _SYS_DEVICE_UNKNOWN:
            out[dev_at] |= _DEV_SYS_DEVICE
            out.append(d.sys_dev)
        if fmt != FORMAT_V1 and i == len(addr.devices) - 1:
            out[dev_at] |= _DEV_LAST
        out += d.dev_addr
        for j, t in enumerate(d.transports):
            out += _U16.pack(t.tl_csum)
            out += t.attrs
            len_at = len(out)
            out += _extended(len(t.iface_addr), _IF_LEN_MASK, fmt)
            if j == len(d.transports) - 1:
                out[len_at] |= _IF_LAST
            out += t.iface_addr
    if fmt == FORMAT_V1:
        out += bytes((_MD_EMPTY | addr.release, _DEV_LAST))
    return bytes(out)


def _tcp_dev_len(dev_addr: bytes) -> int | None:
    """The length a TCP device address with these flags and family has, or None."""
    if len(dev_addr) < 2 or dev_addr[0] & ~_TCP_LOOPBACK:
        return None
    family = dev_addr[1]
    if family not in (_AF_INET, _AF_INET6):
        return None
    if dev_addr[0] & _TCP_LOOPBACK:
        return 2 + _NS_ADDR_BYTES
    return 2 + (4 if family == _AF_INET else 16)


def _shm_dev_len(dev_addr: bytes) -> int:
    """The length of a shared-memory device address with this host id's flags."""
    if len(dev_addr) < _HOST_ID_BYTES:
        return _HOST_ID_BYTES
    (host_id,) = _U64.unpack_from(dev_addr)
    return _NS_ADDR_BYTES if host_id & _LOCAL_ID_NS else _HOST_ID_BYTES


def same_local_host(a: bytes, b: bytes) -> bool:
    """Whether two UCX local addresses (``uct_iface_local_addr_ns_t``: an 8-byte host id
    whose top bit flags a namespace other than the host's own, then that namespace's
    8-byte id) name the same host *and namespace*, as ``uct_iface_local_is_reachable``
    decides for shared memory (IPC namespace) and TCP loopback (network namespace).

    The host id derives from the boot id, so every container of one kernel has the
    same one: a pod in its own IPC or network namespace differs only in the namespace
    part, and UCX never reaches it through this host's shared memory or loopback.
    Comparing the host id alone took such a pod for this host and refused it."""
    if len(a) < _HOST_ID_BYTES or a[:_HOST_ID_BYTES] != b[:_HOST_ID_BYTES]:
        return False
    (host_id,) = _U64.unpack_from(a)
    if not host_id & _LOCAL_ID_NS:
        return True  # both in the host's own namespace
    ns = slice(_HOST_ID_BYTES, _NS_ADDR_BYTES)
    return len(a) >= _NS_ADDR_BYTES and len(b) >= _NS_ADDR_BYTES and a[ns] == b[ns]


class AddressPolicy:
    """What a peer's worker address must be for our worker (``own``: its address) to
    take it; raises InvalidWorkerAddress when our own address is not understood."""

    def __init__(self, own: bytes) -> None:
        if os.environ.get("UCX_UNIFIED_MODE", "").lower() in ("y", "yes", "on", "1"):
            raise InvalidWorkerAddress(
                "UCX_UNIFIED_MODE packs addresses this build cannot validate; unset it"
            )
        try:
            self.own = parse_worker_address(own)
        except InvalidWorkerAddress as e:
            raise InvalidWorkerAddress(
                f"our own UCX worker address is not understood ({e}): this build "
                f"validates UCX {UCX_RELEASE} addresses only"
            ) from None
        self.own_bytes = own
        # per transport: the (device, interface) address lengths and bytes we use
        self._lens: dict[int, set[tuple[int, int]]] = {}
        self._ours: dict[int, set[tuple[bytes, bytes]]] = {}
        for d, t in self.own.transports():
            self._lens.setdefault(t.tl_csum, set()).add((len(d.dev_addr), len(t.iface_addr)))
            self._ours.setdefault(t.tl_csum, set()).add((d.dev_addr, t.iface_addr))

    def names_this_host(self, t: Transport, dev_addr: bytes) -> bool:
        """Whether our worker would take entry ``t`` (on a device of address
        ``dev_addr``) for one on this host: the same shared-memory host id and
        namespace, TCP loopback namespace or device address, or ``self`` interface."""
        ours = self._ours.get(t.tl_csum, ())
        if t.tl_csum == SELF:
            return any(t.iface_addr == i for _, i in ours)
        if t.tl_csum in SHARED_MEMORY:
            return any(same_local_host(dev_addr, d) for d, _ in ours)
        if t.tl_csum == TCP and dev_addr[:1] and dev_addr[0] & _TCP_LOOPBACK:
            return any(
                d[0] & _TCP_LOOPBACK and same_local_host(dev_addr[2:], d[2:]) for d, _ in ours
            )
        return bool(dev_addr) and any(dev_addr == d for d, _ in ours)

    def check(self, peer: bytes, *, from_this_host: bool) -> WorkerAddress:
        """The parsed ``peer`` address, or InvalidWorkerAddress saying why not.

        ``from_this_host``: whether it came over a connection from this host (only
        then may it name this host's shared memory, loopback or our own worker)."""
        addr = parse_worker_address(peer)
        if addr.fmt != self.own.fmt:
            raise InvalidWorkerAddress(
                f"the peer packs UCX address format v{addr.fmt + 1}, ours is "
                f"v{self.own.fmt + 1}: set the same UCX_ADDRESS_VERSION on every host"
            )
        if addr.release != self.own.release:
            raise InvalidWorkerAddress(
                f"the peer runs another UCX release (minor version {addr.release} mod 16, "
                f"ours {self.own.release}): every host must run the same UCX"
            )
        if addr.uuid == self.own.uuid and peer != self.own_bytes:
            raise InvalidWorkerAddress("the address has our own worker's id but is not ours")
        for i, (d, t) in enumerate(addr.transports()):
            lens = self._lens.get(t.tl_csum)
            if lens is None:
                continue  # a transport we lack: UCX never reads its addresses
            where = f"transport {i} ({t.tl_csum:#06x})"
            dev_len, if_len = len(d.dev_addr), len(t.iface_addr)
            if t.tl_csum == TCP:
                ok = if_len == 2 and _tcp_dev_len(d.dev_addr) == dev_len
            elif t.tl_csum in SHARED_MEMORY:
                ok = dev_len >= _shm_dev_len(d.dev_addr)
            else:
                ok = (dev_len, if_len) in lens
            if not ok:
                raise InvalidWorkerAddress(
                    f"{where}: device/interface address of {dev_len}/{if_len} bytes is "
                    f"malformed for this transport (ours: {sorted(lens)})"
                )
            if self.names_this_host(t, d.dev_addr):
                if not from_this_host:
                    raise InvalidWorkerAddress(
                        f"{where} names this host, but the connection came from another "
                        "one (a same-host client must connect from this host)"
                    )
                if (dev_len, if_len) not in lens:
                    raise InvalidWorkerAddress(
                        f"{where} names this host with {dev_len}/{if_len}-byte addresses, "
                        f"ours are {sorted(lens)} (a different UCX configuration?)"
                    )
        return addr


@functools.lru_cache(maxsize=8)
def policy_for(own: bytes) -> AddressPolicy:
    """The (cached) policy of the worker whose address is ``own``."""
    return AddressPolicy(own)


def check_peer_address(peer: bytes, own: bytes, *, from_this_host: bool) -> bytes:
    """``peer`` when the worker whose address is ``own`` may take it; otherwise
    InvalidWorkerAddress (a ValueError) saying why."""
    policy_for(own).check(peer, from_this_host=from_this_host)
    return peer


def _ip(sockaddr: object) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    if not isinstance(sockaddr, tuple) or not sockaddr or not isinstance(sockaddr[0], str):
        return None
    try:
        ip = ipaddress.ip_address(sockaddr[0].split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


class _Connection(Protocol):
    def get_extra_info(self, name: str, default: Any = None) -> Any: ...


def peer_on_this_host(conn: _Connection) -> bool:
    """Whether the peer of this TCP connection (a stream writer or transport) is on this
    host: it comes from a loopback address or from the very address it reached us on
    (Linux drops packets from outside that claim a local source address)."""
    peer = _ip(conn.get_extra_info("peername"))
    if peer is None:
        return False
    return peer.is_loopback or peer == _ip(conn.get_extra_info("sockname"))
