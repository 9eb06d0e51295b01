"""An emulated multi-node cluster on one machine: network namespaces, veth pairs, a bridge.

Every node is a network namespace with one interface, ``eth0`` (10.213.0.k+1/24), whose
veth peer sits on a bridge inside a separate "switch" namespace; nothing is added to the
host's own namespace. ``tc tbf`` shapes each node's link in both directions (the node's
``eth0`` egress and its bridge port's egress). Ranks of one node reach each other over that
namespace's loopback (unshaped); traffic between nodes crosses two shaped links.

Not emulated: latency and loss (this kernel has no ``netem``; the veth + bridge path adds
tens of microseconds, measured by every study), and compute: all nodes share the host's
cores. Everything created is removed on exit, on Ctrl-C, and, through a guard process that
outlives the owner, when the owner is killed: the processes inside the namespaces first,
then the namespaces (which takes their veths and the bridge with them).

``python -m studies.scaling.emulated_cluster --guard PID --tag TAG`` is that guard; ``--cleanup``
removes what a previous run of this module left behind.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

PREFIX = "mtrn"  # every namespace this module creates is named PREFIX + tag + role
SUBNET = "10.213.0"  # a private range used only inside those namespaces


class ClusterUnavailable(RuntimeError):
    """Namespaces cannot be made here (not root, no ``ip``/``tc``, or the kernel refuses)."""


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if result.returncode:
        raise ClusterUnavailable(f"ip {' '.join(args)}: {result.stderr.strip()}")


def unavailable_reason() -> str | None:
    """Why namespaces cannot be used on this machine, in one line, or None when they can."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "emulated nodes need root (ip netns); running every point on one node"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"emulated nodes need {' and '.join(missing)} (iproute2); running on one node"
    probe = f"{PREFIX}{uuid.uuid4().hex[:6]}p"
    try:
        _ip("netns", "add", probe)
    except ClusterUnavailable as err:
        return f"network namespaces refused ({err}); running on one node"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def namespaces(prefix: str = PREFIX) -> list[str]:
    """Namespaces whose names start with ``prefix``."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix)]


def _namespace_pids(ns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def teardown(tag: str, grace_s: float = 3.0) -> None:
    """Stop every process in the tag's namespaces (TERM, then KILL), then delete them."""
    spaces = namespaces(PREFIX + tag)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = [p for ns in spaces for p in _namespace_pids(ns)]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace_s
        while pids and time.monotonic() < deadline:
            pids = [p for ns in spaces for p in _namespace_pids(ns)]
            time.sleep(0.1)
        if not pids:
            break
    for ns in spaces:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class EmulatedCluster:
    """``nodes`` namespaces joined by a bridge, links shaped to ``link_mbit`` (None: unshaped).

    Use as a context manager; ``command(k, argv)`` runs ``argv`` inside node ``k``.
    """

    def __init__(self, nodes: int, link_mbit: int | None) -> None:
        if nodes < 1:
            raise ValueError(f"nodes={nodes} must be >= 1")
        self.nodes, self.link_mbit = nodes, link_mbit
        self.tag = uuid.uuid4().hex[:6]
        self.switch = f"{PREFIX}{self.tag}s"
        self.node_ns = [f"{PREFIX}{self.tag}n{k}" for k in range(nodes)]
        self._guard: subprocess.Popen | None = None

    def address(self, node: int) -> str:
        """Node ``node``'s address (on its ``eth0``)."""
        return f"{SUBNET}.{node + 1}"

    def command(self, node: int, argv: list[str]) -> list[str]:
        """``argv`` run inside node ``node``, with gloo bound to the node's link."""
        env = ["env", "GLOO_SOCKET_IFNAME=eth0", "TP_SOCKET_IFNAME=eth0"]
        return ["ip", "netns", "exec", self.node_ns[node], *env, *argv]

    def __enter__(self) -> EmulatedCluster:
        self._start_guard()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _build(self) -> None:
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for k, ns in enumerate(self.node_ns):
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            a, b = f"{PREFIX}{self.tag}a{k}", f"{PREFIX}{self.tag}b{k}"
            _ip("link", "add", a, "type", "veth", "peer", "name", b)
            _ip("link", "set", a, "netns", ns)
            _ip("link", "set", b, "netns", self.switch)
            _ip("-n", ns, "link", "set", a, "name", "eth0")
            _ip("-n", self.switch, "link", "set", b, "name", f"p{k}")
            _ip("-n", ns, "addr", "add", f"{self.address(k)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", self.switch, "link", "set", f"p{k}", "master", "br0")
            _ip("-n", self.switch, "link", "set", f"p{k}", "up")
            if self.link_mbit:
                self._shape(ns, "eth0")
                self._shape(self.switch, f"p{k}")

    def _shape(self, ns: str, dev: str) -> None:
        # A burst of ~4 ms of traffic (at least 64 KiB): small enough to hold the rate over
        # the multi-megabyte messages of gradient all-reduces.
        burst = max(64 * 1024, self.link_mbit * 1_000_000 // 8 // 250)
        cmd = [
            "tc",
            "-n",
            ns,
            "qdisc",
            "add",
            "dev",
            dev,
            "root",
            "tbf",
            "rate",
            f"{self.link_mbit}mbit",
            "burst",
            str(burst),
            "latency",
            "100ms",
        ]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode:
            raise ClusterUnavailable(f"{' '.join(cmd)}: {result.stderr.strip()}")

    def _start_guard(self) -> None:
        root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        self._guard = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "studies.scaling.emulated_cluster",
                "--guard",
                str(os.getpid()),
                "--tag",
                self.tag,
            ],
            env=env,
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def close(self) -> None:
        """Remove everything (idempotent)."""
        teardown(self.tag)
        if self._guard is not None:
            self._guard.terminate()
            self._guard.wait()
            self._guard = None


def _guard(owner: int, tag: str) -> None:
    """Wait for ``owner`` to die, then remove what it left (SIGTERM: remove it now)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        while _alive(owner):
            time.sleep(0.3)
    finally:
        teardown(tag)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--guard", type=int, help="owner pid to watch")
    parser.add_argument("--tag", default="", help="namespaces of this tag only")
    parser.add_argument("--cleanup", action="store_true", help="remove leftovers now")
    args = parser.parse_args(argv)
    if args.guard:
        _guard(args.guard, args.tag)
    elif args.cleanup:
        teardown(args.tag)
    else:
        parser.error("give --guard PID --tag TAG, or --cleanup")


if __name__ == "__main__":
    main()
