"""An emulated cluster on one Linux host: one network namespace per node, joined by shaped
virtual Ethernet links.

::

    node j's namespace                 the bridge's namespace
    ┌──────────────────────┐           ┌───────────────────────────┐
    │ ranks jR .. jR+R−1   │           │                           │
    │ eth0 198.18.0.(j+1)  │═══veth════│ p<j> ── br0 ── p<k> ...   │
    │ tbf rate B (egress)  │           │ tbf rate B (egress to j)  │
    └──────────────────────┘           └───────────────────────────┘

A node holds ``ranks_per_node`` (R) ranks; by default one, so a node is a rank. The ranks of
a node share its namespace and its address and reach each other through the namespace's
own loopback, unshaped (the fast network inside a node); traffic between nodes crosses the
node's one link. Every link is shaped in both directions by a token-bucket filter
(``tc qdisc add dev … root tbf rate B burst … latency L``): a node sends and receives at
most ``B`` bit/s, like a node with one NIC of that rate on a switch. ``L`` bounds the
queue (``limit = R·L + B``); it is not a propagation delay (that needs ``netem``, which the
kernels we run on lack), so the per-message latency is the veth's own (tens of µs).

Rules the emulation keeps: every address is taken from the benchmarking range
198.18.0.0/15 and lives on an interface inside a namespace this run created; the
namespaces have no route to any other interface of the host (there is none to route to);
the host's own interfaces, its loopback included, are never touched. Names start with a
per-run prefix (``gf8-<pid>-<random>``) so a leftover is recognisable, and
:meth:`Cluster.down` removes everything, also after a failure (use it as a context
manager). Needs root and the ``ip`` and ``tc`` commands (iproute2).

``python -m geofp8.tools.netem sink|source`` (or this file run by path) is the bounded bulk
TCP transfer that :func:`measure_throughput` runs between two namespaces.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

__all__ = ["PREFIX", "Cluster", "ClusterUnavailable", "Shaping", "leftovers",
           "measure_throughput", "parse_rate", "require_tools", "wait_all"]

PREFIX = "gf8-"
NETWORK = ipaddress.ip_network("198.18.0.0/24")  # inside the benchmarking range 198.18.0.0/15
MAX_RANKS = 8
IFACE = "eth0"  # the rank's link, inside its own namespace (GLOO_SOCKET_IFNAME)
COMMAND_TIMEOUT = 20.0  # seconds for one ip/tc command


class ClusterUnavailable(RuntimeError):
    """The emulation cannot run here (not root, or ``ip``/``tc`` missing)."""


def require_tools() -> None:
    """Raise :class:`ClusterUnavailable` naming everything that is missing."""
    missing = []
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        missing.append("root privileges (network namespaces and tc need CAP_NET_ADMIN)")
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2")):
        if shutil.which(tool) is None:
            missing.append(f"the '{tool}' command ({package})")
    if not os.path.exists("/proc/self/ns/net"):
        missing.append("network namespace support in the kernel (/proc/self/ns/net)")
    if missing:
        raise ClusterUnavailable("the emulated cluster needs " + "; ".join(missing))


def parse_rate(text: str) -> float:
    """``"1"``/``"1g"``/``"1gbit"`` → 1e9, ``"500m"`` → 5e8 (bit/s; a bare number is Gbit/s)."""
    t = text.strip().lower().removesuffix("bit").removesuffix("b")
    scale = {"k": 1e3, "m": 1e6, "g": 1e9}.get(t[-1:], None)
    try:
        value = float(t[:-1]) * scale if scale else float(t) * 1e9
    except ValueError:
        raise ValueError(f"cannot read the rate {text!r} (examples: 1, 10g, 500mbit)") from None
    if not value > 0:
        raise ValueError(f"rate must be > 0, got {text!r}")
    return value


def _run(argv: list[str], check: bool = True) -> subprocess.CompletedProcess:
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"{' '.join(argv)}: no answer within {COMMAND_TIMEOUT:.0f} s") from e
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {p.stderr.strip() or p.stdout.strip()}")
    return p


def _namespaces() -> list[str]:
    out = _run(["ip", "netns", "list"]).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def leftovers(prefix: str = PREFIX) -> list[str]:
    """Namespaces whose name starts with ``prefix`` (those of runs that did not clean up)."""
    return [ns for ns in _namespaces() if ns.startswith(prefix)]


@dataclass(frozen=True)
class Shaping:
    """A token bucket: ``rate`` bit/s, ``burst`` bytes, queue bound ``latency`` s."""

    rate: float
    burst: int
    latency: float

    @classmethod
    def for_rate(cls, rate: float, latency: float = 0.02, burst: int | None = None) -> Shaping:
        # ≥ 1 ms of traffic (a timer tick) and ≥ one 64 KiB GSO segment, or tbf throttles below
        # its rate (the bucket cannot refill between ticks) or drops the segment outright.
        # Not more: a burst is a head start after every idle gap (at 1 Gbit/s a 4 ms burst
        # would be 10-20 % of fp8's link time a step, flattering small messages). The price:
        # when the host under a VM leaves the bucket unserviced for over 1 ms, tokens are
        # lost (1 Gbit/s measured 0.75-0.87 of the rate in a noisy hour, 0.96 in a quiet one)
        return cls(rate, burst or max(65536 * 2, int(rate / 8 * 1e-3)), latency)

    def tc_args(self) -> list[str]:
        return ["tbf", "rate", f"{int(self.rate)}bit", "burst", str(self.burst),
                "latency", f"{self.latency * 1e3:.3f}ms"]


class Cluster:
    """``n`` ranks on ``n / ranks_per_node`` nodes, a namespace each, joined by a bridge; each
    node's link shaped to ``rate`` bit/s (``None``: unshaped). ``with Cluster(4, 1e9) as c:``;
    :meth:`popen` starts a process in rank ``i``'s node, :meth:`down` kills what is left
    there and removes everything."""

    def __init__(self, n: int, rate: float | None, latency: float = 0.02,
                 burst: int | None = None, mtu: int = 1500, ranks_per_node: int = 1) -> None:
        if not 2 <= n <= MAX_RANKS:
            raise ValueError(f"ranks must be in 2..{MAX_RANKS}, got {n}")
        if ranks_per_node < 1 or n % ranks_per_node or n // ranks_per_node < 2:
            raise ValueError(f"ranks per node must divide the {n} ranks into at least 2 "
                             f"nodes, got {ranks_per_node}")
        if not 576 <= mtu <= 65535:
            raise ValueError(f"mtu must be in 576..65535, got {mtu}")
        require_tools()
        self.n, self.mtu, self.ranks_per_node = n, mtu, ranks_per_node
        self.nodes = n // ranks_per_node
        self.shaping = Shaping.for_rate(rate, latency, burst) if rate else None
        self.prefix = f"{PREFIX}{os.getpid():x}-{secrets.token_hex(3)}-"
        self.bridge_ns = self.prefix + "br"
        self.namespaces = [f"{self.prefix}r{j}" for j in range(self.nodes)]  # one per node
        self._created: list[str] = []
        self._procs: list[subprocess.Popen] = []

    def address(self, i: int) -> str:
        """Rank ``i``'s address: its node's (198.18.0.1 for the node of rank 0)."""
        return self.node_address(i // self.ranks_per_node)

    def node_address(self, j: int) -> str:
        return str(NETWORK.network_address + j + 1)

    # -- set-up and teardown -----------------------------------------------------------------

    def up(self) -> Cluster:
        try:
            self._add_namespace(self.bridge_ns)
            br = ["ip", "-n", self.bridge_ns]
            _run([*br, "link", "add", "br0", "type", "bridge"])
            _run([*br, "link", "set", "br0", "mtu", str(self.mtu), "up"])
            for i, ns in enumerate(self.namespaces):
                self._add_namespace(ns)
                port = f"p{i}"
                _run([*br, "link", "add", port, "mtu", str(self.mtu), "type", "veth", "peer",
                      "name", IFACE, "mtu", str(self.mtu), "netns", ns])
                _run([*br, "link", "set", port, "master", "br0", "up"])
                _run(["ip", "-n", ns, "addr", "add",
                      f"{self.node_address(i)}/{NETWORK.prefixlen}",
                      "dev", IFACE])
                _run(["ip", "-n", ns, "link", "set", IFACE, "up"])
                _run(["ip", "-n", ns, "link", "set", "lo", "up"])  # the namespace's own lo
                if self.shaping is not None:
                    for where, dev in ((ns, IFACE), (self.bridge_ns, port)):
                        _run(["tc", "-n", where, "qdisc", "add", "dev", dev, "root",
                              *self.shaping.tc_args()])
        except BaseException:
            self.down()
            raise
        return self

    def _add_namespace(self, ns: str) -> None:
        _run(["ip", "netns", "add", ns])
        self._created.append(ns)

    def down(self) -> None:
        """Stop this cluster's processes, then delete its namespaces (with them every veth,
        the bridge and the qdiscs). Safe to call twice; raises only if something stays."""
        for p in self._procs:
            _stop(p)
        self._procs.clear()
        for ns in reversed(self._created):
            pids = _run(["ip", "netns", "pids", ns], check=False).stdout.split()
            for pid in pids:  # started inside a namespace only this run created
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            _run(["ip", "netns", "del", ns], check=False)
        left = [ns for ns in self._created if ns in _namespaces()]
        self._created = left
        if left:
            raise RuntimeError(f"could not remove the namespaces {left}")

    def __enter__(self) -> Cluster:
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    # -- processes ---------------------------------------------------------------------------

    def popen(self, i: int, argv: list[str], env: dict[str, str] | None = None,
              **kwargs) -> subprocess.Popen:
        """Start ``argv`` inside rank ``i``'s node namespace (its own session, so
        :meth:`down` can stop it with everything it started)."""
        node = self.namespaces[i // self.ranks_per_node]
        p = subprocess.Popen(["ip", "netns", "exec", node, *argv], env=env,
                             start_new_session=True, **kwargs)
        self._procs.append(p)
        return p


def _stop(p: subprocess.Popen, grace: float = 5.0) -> None:
    if p.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, grace)):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            return
        try:
            p.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def wait_all(procs: list[subprocess.Popen], timeout: float) -> list[int]:
    """Wait for every process; when one fails or ``timeout`` s pass, stop the others.
    Exit statuses in order (124: stopped at the timeout, negative: killed by a signal)."""
    deadline = time.monotonic() + timeout
    while None in [p.poll() for p in procs]:  # a list: poll every process each round
        failed = any(p.returncode not in (None, 0) for p in procs)
        if failed or time.monotonic() > deadline:
            for p in procs:
                _stop(p)
            if not failed:
                return [124 if p.returncode is None or p.returncode < 0 else p.returncode
                        for p in procs]
            break
        time.sleep(0.05)
    return [p.returncode for p in procs]


def measure_throughput(cluster: Cluster, src: int = 1, dst: int = 0, nbytes: int = 32 << 20,
                       timeout: float = 30.0) -> float:
    """Send ``nbytes`` over one TCP connection from rank ``src`` to rank ``dst`` and return
    the goodput the receiver measured (bit/s, from the first to the last byte). Both ends
    stop after ``timeout`` s whatever happens."""
    if not 0 < nbytes <= 1 << 30:
        raise ValueError("nbytes must be in (0, 1 GiB]")
    host, port = cluster.address(dst), 5201
    # run by path (-P: its folder not on sys.path): the standard library only; `-m` would
    # import the geofp8 package, and torch with it, ~3 s a process on a small machine
    me = [sys.executable, "-P", os.path.abspath(__file__)]
    sink = cluster.popen(dst, [*me, "sink", host, str(port), str(nbytes), str(timeout)],
                         env=os.environ.copy(), stdout=subprocess.PIPE, text=True)
    source = cluster.popen(src, [*me, "source", host, str(port), str(nbytes), str(timeout)],
                           env=os.environ.copy())
    codes = wait_all([sink, source], timeout + 10)
    if codes != [0, 0]:
        raise RuntimeError(f"bulk transfer failed (sink, source exit {codes})")
    result = json.loads(sink.stdout.read())
    return 8 * result["bytes"] / result["seconds"]


# -- the two ends of the bulk transfer ------------------------------------------------------


def _sink(host: str, port: int, nbytes: int, timeout: float) -> None:
    with socket.create_server((host, port)) as server:
        server.settimeout(timeout)
        conn, _ = server.accept()
        with conn:
            conn.settimeout(timeout)
            buf = bytearray(1 << 20)
            got = conn.recv_into(buf)
            t0 = time.perf_counter()  # from the first byte: connection set-up not counted
            first = got
            while got < nbytes:
                n = conn.recv_into(buf)
                if n == 0:
                    raise ConnectionError(f"sender closed after {got} of {nbytes} bytes")
                got += n
            dt = time.perf_counter() - t0
    print(json.dumps({"bytes": got - first, "seconds": dt}))


def _source(host: str, port: int, nbytes: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:  # the sink may not be listening yet
        try:
            conn = socket.create_connection((host, port), timeout=timeout)
            break
        except (ConnectionRefusedError, OSError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    with conn:
        chunk = memoryview(bytes(1 << 20))
        sent = 0
        while sent < nbytes:
            sent += conn.send(chunk[: min(len(chunk), nbytes - sent)])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m geofp8.tools.netem",
                                description="one end of a bounded bulk TCP transfer")
    p.add_argument("role", choices=["sink", "source"])
    p.add_argument("host")
    p.add_argument("port", type=int)
    p.add_argument("nbytes", type=int)
    p.add_argument("timeout", type=float)
    a = p.parse_args(argv)
    if not 0 < a.nbytes <= 1 << 30 or not 0 < a.timeout <= 600:
        p.error("nbytes must be in (0, 1 GiB] and timeout in (0, 600] s")
    signal.alarm(int(a.timeout) + 1)  # stops by itself, whatever blocks
    (_sink if a.role == "sink" else _source)(a.host, a.port, a.nbytes, a.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
