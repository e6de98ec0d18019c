"""Nothing of a replica is reachable beyond this user: the control plane's ZeroMQ sockets are
ipc:// files in a private 0700 run folder, the start gate's shared memory is 0600, the only
TCP sockets (gloo between TP ranks) are on loopback, and everything is gone after shutdown.
The monitor's "auto" endpoint is an ipc:// socket in a 0700 folder; the HTTP server listens
on loopback unless told otherwise (its --api-key is checked in test_bad_input.py).
"""

from __future__ import annotations

import ipaddress
import os
import re
import stat
from pathlib import Path

import pytest
from ipc_helpers import replica_config

from deltaserve.http.serve import build_parser
from deltaserve.ipc.controller import ReplicaController

TCP_LISTEN = "0A"


def socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            m = re.fullmatch(r"socket:\[(\d+)\]", os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            continue
        if m:
            inodes.add(m.group(1))
    return inodes


def _address(hex_addr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    host = bytes.fromhex(hex_addr.split(":")[0])
    if len(host) == 4:
        return ipaddress.IPv4Address(host[::-1])
    # /proc prints IPv6 as four little-endian 32-bit words
    return ipaddress.IPv6Address(b"".join(host[i : i + 4][::-1] for i in range(0, 16, 4)))


def inet_sockets(pid: int) -> list[tuple[str, ipaddress.IPv4Address | ipaddress.IPv6Address, str]]:
    """(table, local address, state) of every TCP/UDP socket `pid` holds."""
    mine = socket_inodes(pid)
    found = []
    for table in ("tcp", "tcp6", "udp", "udp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            f = line.split()
            if f[9] in mine:
                found.append((table, _address(f[1]), f[3]))
    return found


def unix_socket_paths(pid: int) -> list[str]:
    mine = socket_inodes(pid)
    paths = []
    for line in Path(f"/proc/{pid}/net/unix").read_text().splitlines()[1:]:
        f = line.split()
        if f[6] in mine and len(f) > 7:
            paths.append(f[7])
    return paths


def is_loopback(addr) -> bool:
    mapped = getattr(addr, "ipv4_mapped", None)
    return addr.is_loopback or (mapped is not None and mapped.is_loopback)


def private_folder(path: Path) -> None:
    info = path.lstat()
    assert stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid(), path
    assert stat.S_IMODE(info.st_mode) == 0o700, (path, oct(info.st_mode))


async def test_replica_is_private_to_this_user(tiny_model_dir):
    controller = await ReplicaController.start(replica_config(tiny_model_dir, tp_size=2))
    try:
        run_dir = Path(controller.run_dir)
        private_folder(run_dir)
        sockets = {p.name for p in run_dir.iterdir() if stat.S_ISSOCK(p.lstat().st_mode)}
        assert sockets == {"cmd0", "cmd1", "reply"}, sockets
        gate = Path("/dev/shm") / controller.gate_name
        info = gate.lstat()
        assert stat.S_IMODE(info.st_mode) == 0o600 and info.st_uid == os.getuid()
        pids = [os.getpid(), *controller.rank_pids]
        for pid in pids:
            for path in unix_socket_paths(pid):  # named unix sockets: only the run folder's
                assert Path(path).parent == run_dir, (pid, path)
        for pid in controller.rank_pids:  # gloo: TCP between the ranks, loopback only
            found = inet_sockets(pid)
            assert any(state == TCP_LISTEN for _, _, state in found), found
            for table, addr, state in found:
                assert is_loopback(addr), (pid, table, addr, state)
    finally:
        await controller.shutdown()
    assert not run_dir.exists() and not gate.exists()


def test_http_listens_on_loopback_by_default():
    assert build_parser().parse_args([]).host == "127.0.0.1"


async def test_monitor_auto_endpoint_is_private():
    monitor = pytest.importorskip("deltaserve.engine.monitor")
    endpoint = monitor.resolve_endpoint(monitor.AUTO)
    assert endpoint.startswith("ipc://"), endpoint
    folder = Path(endpoint[len("ipc://") :]).parent
    private_folder(folder)
    publisher = monitor.MonitorPublisher(monitor.AUTO)
    try:
        path = Path(publisher.endpoint[len("ipc://") :])
        assert path.parent == folder and stat.S_ISSOCK(path.lstat().st_mode)
    finally:
        await publisher.aclose()
