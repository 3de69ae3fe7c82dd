"""Separate hosts on one machine: a Spark standalone cluster whose workers sit behind shaped links.

For tests and benchmarks that need a network which costs something. Needs root and iproute2
(``ip``, ``tc``). The layout, all in 198.18.0.0/15 (RFC 2544's range for network benchmarks;
no other address is ever used)::

    driver + master  198.18.N.1   on bridge  scnbN          (this machine's own namespace)
    host i           198.18.N.(11+i)  in namespace scnNh<i>, linked to the bridge by a veth pair

``N`` is the first subnet no other test bed holds, so two can run at once. A link rate (and
optional delay) is applied in both directions of each host's veth pair (tbf; netem where a
delay is asked for and the kernel has it): the host's
uplink and its downlink are each shaped to ``rate``. The driver reaches the master on its own
address; every executor reaches the driver, the master and the parameter-server service over its
link, because its namespace has nothing else (its loopback is its own).

    with TestBed(hosts=2, rate="100mbit") as bed:
        spark = standalone.session(bed.cluster, "bench")   # driver on bed.driver_host

:meth:`TestBed.stop` (and ``__exit__``, and an exit handler as a last resort) stops the
cluster, kills whatever still runs in a namespace, and deletes the namespaces, links and
bridge, even when a run failed; :func:`leftovers` lists any that remain. A run killed outright
(SIGKILL, a lost session) can clean nothing up, so each bed marks its bridge with its owner
process, and :meth:`TestBed.start` first deletes every bed whose owner is gone
(:func:`reap_orphans`).
"""

from __future__ import annotations

import atexit
import fcntl
import logging
import os
import shutil
import signal
import subprocess

from sparkcnn.testing.standalone import StandaloneCluster

log = logging.getLogger(__name__)

PREFIX = "scn"  # every namespace, link and bridge this module makes is named scn...
NET = "198.18"  # RFC 2544 benchmarking range, 198.18.0.0/15; each bed takes one /24 of it


class TestBedUnavailable(RuntimeError):
    """This machine cannot build a test bed (not root, no iproute2, namespaces refused)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and p.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {p.stderr.strip()}")
    return p


def _netns_names() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _link_names() -> list[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line]


def leftovers() -> dict[str, list[str]]:
    """Namespaces and links of any test bed that still exist (``{}`` entries when none)."""
    if shutil.which("ip") is None:
        return {"netns": [], "links": []}
    return {"netns": sorted(n for n in _netns_names() if n.startswith(PREFIX)),
            "links": sorted(n for n in _link_names() if n.startswith(PREFIX))}


def _process_identity(pid: int) -> str | None:
    """``pid:starttime`` of a live process (the start time tells a reused pid apart); None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f"{pid}:{f.read().rsplit(')', 1)[1].split()[19]}"
    except (OSError, IndexError):
        return None


LOCK = "/run/lock/sparkcnn-testbed.lock" if os.path.isdir("/run/lock") else "/tmp/sparkcnn-testbed.lock"
OWNER = "sparkcnn test bed of "  # a bridge's alias: OWNER + "pid:starttime" of the process that made it


def _owner(bridge: str) -> str | None:
    out = _ip("-o", "link", "show", bridge, check=False).stdout
    return out.split(OWNER, 1)[1].split()[0] if OWNER in out else None


def _delete(made) -> None:
    """Delete ``("netns" | "link", name)`` items in order; a namespace's processes are killed first."""
    for kind, name in made:
        if kind == "netns":
            pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout
            for pid in pids.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            _ip("netns", "del", name, check=False)
        else:
            _ip("link", "del", name, check=False)  # a veth goes with its namespace too


def reap_orphans() -> list[int]:
    """Delete every test bed whose owning process is gone (killed before it could clean up);
    return their subnets. A bed whose owner lives is left alone."""
    if shutil.which("ip") is None:
        return []
    links, reaped = _link_names(), []
    for bridge in links:
        subnet = bridge[len(PREFIX) + 1:]
        if not (bridge.startswith(f"{PREFIX}b") and subnet.isdigit()):
            continue
        owner = _owner(bridge)
        if owner is not None and _process_identity(int(owner.split(":")[0])) == owner:
            continue
        _delete([*(("netns", n) for n in _netns_names() if n.startswith(f"{PREFIX}{subnet}h")),
                 *(("link", n) for n in links if n.startswith(f"{PREFIX}{subnet}v")), ("link", bridge)])
        log.warning("test bed: deleted the bed on 198.18.%s.0/24 left by a process that is gone (%s)", subnet,
                    owner or "no owner recorded")
        reaped.append(int(subnet))
    return reaped


def unavailable_reason() -> str | None:
    """Why no test bed can be built here, in one line; None when one can."""
    if os.name != "posix" or os.geteuid() != 0:
        return "the test bed needs root (network namespaces)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the test bed needs iproute2's {tool!r}"
    probe = f"{PREFIX}probe{os.getpid()}"[:15]
    p = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if p.returncode != 0:
        return f"network namespaces are refused here: {p.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def parse_rate(rate: str | None) -> float | None:
    """``"100mbit"`` → bits/s (tc's units: kbit, mbit, gbit); None unshaped."""
    if rate is None:
        return None
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1.0}
    for unit, scale in units.items():
        if rate.lower().endswith(unit):
            return float(rate[: -len(unit)]) * scale
    raise ValueError(f"link rate {rate!r}: give a number and one of {', '.join(units)}, e.g. 100mbit")


class TestBed:
    """``hosts`` namespaces of one Spark worker each (``cores`` cores), a master and the driver's
    address on a bridge; links shaped to ``rate`` (tc units, e.g. ``"1gbit"``; None: unshaped)
    with ``delay_ms`` one-way delay. ``worker_env`` goes to every worker daemon (and so its
    executors)."""

    __test__ = False  # not a pytest class

    def __init__(self, hosts: int = 2, cores: int = 1, memory: str = "2g", rate: str | None = None,
                 delay_ms: float = 0.0, worker_env: dict | None = None):
        if not 1 <= hosts <= 200:
            raise ValueError(f"hosts must be 1..200, got {hosts}")
        self.hosts, self.cores, self.memory = hosts, cores, memory
        parse_rate(rate)  # a bad rate is refused before anything is built
        self.rate, self.delay_ms = rate, float(delay_ms)
        self.worker_env = dict(worker_env or {})
        self.subnet: int | None = None
        self.cluster: StandaloneCluster | None = None
        self._made: list[tuple[str, str]] = []  # ("netns" | "link", name), in creation order

    # -- names and addresses -----------------------------------------------------------------
    @property
    def bridge(self) -> str:
        return f"{PREFIX}b{self.subnet}"

    def netns(self, i: int) -> str:
        return f"{PREFIX}{self.subnet}h{i}"

    def veth(self, i: int) -> str:
        return f"{PREFIX}{self.subnet}v{i}"

    @property
    def driver_host(self) -> str:
        return f"{NET}.{self.subnet}.1"

    def host_address(self, i: int) -> str:
        return f"{NET}.{self.subnet}.{11 + i}"

    @property
    def host_addresses(self) -> list[str]:
        return [self.host_address(i) for i in range(self.hosts)]

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self, timeout: float = 180) -> TestBed:
        why = unavailable_reason()
        if why:
            raise TestBedUnavailable(why)
        atexit.register(self.stop)
        try:
            self._claim()
            self._network()
            self.cluster = StandaloneCluster(
                workers=self.hosts, cores_per_worker=self.cores, memory=self.memory,
                worker_env=self.worker_env,
                host=self.driver_host, worker_hosts=self.host_addresses,
                worker_prefix={i: ["ip", "netns", "exec", self.netns(i)] for i in range(self.hosts)})
            self.cluster.start(timeout=timeout)
        except BaseException:
            self.stop()
            raise
        log.info("test bed: driver %s, %d hosts %s, links %s%s", self.driver_host, self.hosts,
                 self.host_addresses, self.rate or "unshaped",
                 f" +{self.delay_ms:g} ms" if self.delay_ms else "")
        return self

    def _claim(self) -> None:
        """Delete orphaned beds, take the first free subnet and mark its bridge as this process's."""
        with open(LOCK, "a") as lock:  # one bed at a time reaps and claims
            fcntl.flock(lock, fcntl.LOCK_EX)
            reap_orphans()
            taken = set(_link_names())
            self.subnet = next((n for n in range(1, 255) if f"{PREFIX}b{n}" not in taken), None)
            if self.subnet is None:
                raise RuntimeError("no free test-bed subnet in 198.18.1-254.0/24")
            _ip("link", "add", self.bridge, "type", "bridge")
            self._made.append(("link", self.bridge))
            _ip("link", "set", self.bridge, "alias", OWNER + _process_identity(os.getpid()))

    def _network(self) -> None:
        _ip("addr", "add", f"{self.driver_host}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i in range(self.hosts):
            ns, veth = self.netns(i), self.veth(i)
            _ip("netns", "add", ns)
            self._made.append(("netns", ns))
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            self._made.append(("link", veth))
            _ip("link", "set", veth, "master", self.bridge, "up")
            _ip("-n", ns, "addr", "add", f"{self.host_address(i)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            self.shape(i, self.rate, self.delay_ms)

    def shape(self, i: int, rate: str | None, delay_ms: float = 0.0) -> None:
        """Set host ``i``'s link (both directions) to ``rate`` and ``delay_ms``; None: unshaped."""
        for where in ([], ["ip", "netns", "exec", self.netns(i)]):
            dev = "eth0" if where else self.veth(i)
            subprocess.run([*where, "tc", "qdisc", "del", "dev", dev, "root"], capture_output=True)
            if rate is None and not delay_ms:
                continue
            if delay_ms:  # netem is the only qdisc that delays; tbf alone shapes the rate
                qdisc = ["netem", "delay", f"{delay_ms}ms", *(["rate", rate] if rate else [])]
            else:
                # a bucket of ~1 ms at the rate (>= 32 KiB) and a queue of 50 ms
                burst = max(32 * 1024, int(parse_rate(rate) / 8 / 1000))
                qdisc = ["tbf", "rate", rate, "burst", str(burst), "latency", "50ms"]
            p = subprocess.run([*where, "tc", "qdisc", "add", "dev", dev, "root", *qdisc],
                               capture_output=True, text=True)
            if p.returncode != 0 and delay_ms and "unknown" in p.stderr:
                raise TestBedUnavailable("a link delay needs the kernel's netem qdisc, which this kernel "
                                         f"lacks ({p.stderr.strip()}); shape the rate alone")
            if p.returncode != 0:
                raise RuntimeError(f"tc on {dev} ({self.netns(i)}): {p.stderr.strip()}")

    def reshape(self, rate: str | None, delay_ms: float = 0.0) -> None:
        """Every host's link to ``rate`` and ``delay_ms``, with the cluster running."""
        for i in range(self.hosts):
            self.shape(i, rate, delay_ms)
        self.rate, self.delay_ms = rate, float(delay_ms)

    def stop(self) -> None:
        """Stop the cluster, kill what still runs in a namespace, delete namespaces, links, bridge."""
        if self.cluster is not None:
            cluster, self.cluster = self.cluster, None
            try:
                cluster.stop()
            except Exception as e:  # the namespaces go below whatever happened here
                log.warning("test bed: cluster stop: %s", e)
        _delete(reversed(self._made))
        self._made = []
        atexit.unregister(self.stop)

    def __enter__(self) -> TestBed:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def describe(self) -> dict:
        """What a result records of the network it ran on."""
        return {"hosts": self.hosts, "cores_per_host": self.cores, "driver": self.driver_host,
                "host_addresses": self.host_addresses, "link_rate": self.rate or "unshaped",
                "link_delay_ms": self.delay_ms,
                "shaping": f"{'netem' if self.delay_ms else 'tbf'}, each direction of each host's link"}
