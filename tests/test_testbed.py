"""The emulated edge network: shaping, sharing, CPU quotas and cleanup, measured with real processes."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from deepco_bench.testbed import ServerSpec, Testbed, TestbedSpec, kernel_emulation_available, leftovers

from deepco.errors import UserError

needs_kernel = pytest.mark.skipif(kernel_emulation_available() is not None,
                                  reason=f"kernel emulation unavailable: {kernel_emulation_available()}")

SINK = textwrap.dedent("""
    import socket, sys
    srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", 7000)); srv.listen(); print("ready", flush=True)
    conn, _ = srv.accept(); need = int(sys.argv[1])
    while need > 0:
        need -= len(conn.recv(1 << 20))
    conn.sendall(b"k"); conn.close()
""")

SEND = textwrap.dedent("""
    import socket, sys, threading, time
    size = int(sys.argv[1]); hosts = sys.argv[2:]
    def send(host):
        s = socket.create_connection((host, 7000)); s.sendall(b"x" * size); s.recv(1)
    threads = [threading.Thread(target=send, args=(h,)) for h in hosts]
    t0 = time.perf_counter(); [t.start() for t in threads]; [t.join() for t in threads]
    print(time.perf_counter() - t0)
""")


def transfer_seconds(tb: Testbed, size: int, servers: list[tuple[int, int]]) -> float:
    sinks = [tb.spawn([sys.executable, "-c", SINK, str(size)], server=k, stdout=subprocess.PIPE, text=True)
             for k, _ in servers]
    for sink in sinks:
        assert sink.stdout.readline().strip() == "ready"
    out = tb.spawn([sys.executable, "-c", SEND, str(size), *[tb.server_host(k, m) for k, m in servers]],
                   stdout=subprocess.PIPE, text=True)
    seconds = float(out.communicate(timeout=60)[0])
    for sink in sinks:
        sink.wait(timeout=10)
    return seconds


@needs_kernel
def test_antenna_bandwidth_is_enforced_and_shared_by_its_servers():
    spec = TestbedSpec(antenna_mbps=(40.0, 40.0), servers=(ServerSpec("s0"), ServerSpec("s1")))
    size = 2_000_000  # 16 Mbit: 0.4 s at 40 Mbit/s
    with Testbed(spec) as tb:
        assert tb.kernel and "EMULATED" in tb.label
        alone = transfer_seconds(tb, size, [(0, 0)])
        same_antenna = transfer_seconds(tb, size, [(0, 0), (1, 0)])
        two_antennas = transfer_seconds(tb, size, [(0, 0), (1, 1)])
    assert 0.32 < alone < 0.6
    assert 1.6 < same_antenna / alone < 2.4  # one radio link shared
    assert 0.7 < two_antennas / alone < 1.35  # antennas in parallel


@needs_kernel
def test_a_small_transfer_crosses_at_the_antennas_rate_not_at_line_rate():
    """A radio delivers one tick's worth at once, not a burst: 50 KB at 10 Mbit/s takes ~40 ms even after the
    link was idle (a 64 KiB bucket sent it in 0.2 ms, so a split's small bands never felt the radio's rate)."""
    spec = TestbedSpec(antenna_mbps=(10.0,), servers=(ServerSpec("s0"),))
    with Testbed(spec) as tb:
        seconds = transfer_seconds(tb, 50_000, [(0, 0)])
    assert 0.03 < seconds < 0.2

@needs_kernel
@pytest.mark.parametrize("mtu", [1500, 9000])
def test_every_link_has_the_specs_mtu_and_its_packets_fit_a_slow_radios_bucket(mtu):
    """A tbf bucket smaller than a packet drops it: at 10 Mbit/s one tick is 1250 bytes, so the bucket holds a
    whole packet of the links' MTU, and a transfer still crosses at the antenna's rate."""
    spec = TestbedSpec(antenna_mbps=(10.0,), servers=(ServerSpec("s0"),), mtu=mtu)
    with Testbed(spec) as tb:
        link = subprocess.run(["ip", "netns", "exec", tb.server_ns(0), "ip", "-o", "link", "show", "ant0"],
                              capture_output=True, text=True, check=True).stdout
        assert f" mtu {mtu} " in link and f"MTU {mtu}" in tb.label
        seconds = transfer_seconds(tb, 200_000, [(0, 0)])  # 1.6 Mbit: 0.16 s at 10 Mbit/s
    assert 0.13 < seconds < 0.4


@needs_kernel
def test_server_to_server_traffic_crosses_the_peer_links():
    spec = TestbedSpec(antenna_mbps=(100.0,), servers=(ServerSpec("s0"), ServerSpec("s1")), peer_mbps=20.0)
    size = 1_000_000  # 8 Mbit: 0.4 s at 20 Mbit/s
    with Testbed(spec) as tb:
        sink = tb.spawn([sys.executable, "-c", SINK, str(size)], server=1, stdout=subprocess.PIPE, text=True)
        assert sink.stdout.readline().strip() == "ready"
        out = tb.spawn([sys.executable, "-c", SEND, str(size), tb.server_host(1, 0)], server=0,
                       stdout=subprocess.PIPE, text=True)
        seconds = float(out.communicate(timeout=60)[0])
        sink.wait(timeout=10)
        assert "20 Mbit/s per server link" in tb.label
    assert 0.33 < seconds < 0.6


BUSY = "import os, time\nt = time.time()\nwhile time.time() - t < 1.5: pass\nc = os.times()\nprint(c.user + c.system)"


@needs_kernel
def test_cpu_quota_limits_a_server_to_its_share_of_a_core():
    spec = TestbedSpec(antenna_mbps=(100.0,), servers=(ServerSpec("slow", cpu=0.25), ServerSpec("fast")))
    with Testbed(spec) as tb:
        slow = tb.spawn([sys.executable, "-c", BUSY], server=0, stdout=subprocess.PIPE, text=True)
        cpu_slow = float(slow.communicate(timeout=30)[0])
        fast = tb.spawn([sys.executable, "-c", BUSY], server=1, stdout=subprocess.PIPE, text=True)
        cpu_fast = float(fast.communicate(timeout=30)[0])
    assert 0.25 < cpu_slow / 1.5 < 0.4  # python start-up runs under the quota too
    assert cpu_fast / 1.5 > 0.6  # unlimited: most of a core even on a busy machine



@needs_kernel
def test_a_process_on_the_testbed_sees_its_cpu_quota_as_one_in_a_container_does():
    """`ip netns exec` mounts a sysfs without the cgroup hierarchy: a camera on the testbed read 2 cores at a
    0.1-core quota, and its pace never held a search back. The testbed mounts the hierarchy for its processes."""
    spec = TestbedSpec(antenna_mbps=(100.0,), servers=(ServerSpec("slow", cpu=0.3), ServerSpec("fast")),
                       device_cpu=0.2)
    read = "from deepco_device.cpu_share import cpu_budget; print(cpu_budget())"
    with Testbed(spec) as tb:
        budgets = [float(tb.spawn([sys.executable, "-c", read], server=server, stdout=subprocess.PIPE,
                                  text=True).communicate(timeout=60)[0]) for server in (0, 1, None)]
    assert budgets[0] == pytest.approx(0.3) and budgets[2] == pytest.approx(0.2)
    assert budgets[1] == len(os.sched_getaffinity(0))  # no quota: the CPUs

OWNER = textwrap.dedent("""
    import sys, time
    from deepco_bench.testbed import ServerSpec, Testbed, TestbedSpec
    tb = Testbed(TestbedSpec(antenna_mbps=(10.0, 20.0), servers=(ServerSpec("a", cpu=0.5), ServerSpec("b"))))
    tb.__enter__()
    tb.spawn([sys.executable, "-c", "import time; time.sleep(60)"], server=0)
    print(tb.prefix, flush=True)
    time.sleep(60)
""")


def nothing_left(prefix: str, within: float) -> dict:
    deadline = time.monotonic() + within
    while True:
        left = leftovers(prefix)
        if not any(left.values()) or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


@needs_kernel
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_nothing_is_left_behind_when_the_owner_is_stopped_or_killed(sig):
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True)
    prefix = owner.stdout.readline().strip()
    assert prefix.startswith("dc")
    made = leftovers(prefix)
    assert len(made["netns"]) == 5 and len(made["cgroups"]) == 3  # netns: device, 2 antennas, 2 servers
    os.kill(owner.pid, sig)
    owner.wait(timeout=20)
    assert nothing_left(prefix, within=10) == {"netns": [], "links": [], "cgroups": []}


@needs_kernel
def test_nothing_is_left_behind_after_a_normal_run():
    spec = TestbedSpec(antenna_mbps=(10.0,), servers=(ServerSpec("a", cpu=0.3),))
    with Testbed(spec) as tb:
        tb.spawn([sys.executable, "-c", "import time; time.sleep(30)"], server=0)
        prefix = tb.prefix
        assert any(leftovers(prefix).values())
    assert leftovers(prefix) == {"netns": [], "links": [], "cgroups": []}


def test_fallback_says_so_and_runs_on_loopback():
    spec = TestbedSpec(antenna_mbps=(10.0,), servers=(ServerSpec("a", cpu=0.3),))
    with Testbed(spec, force_fallback=True) as tb:
        assert not tb.kernel and "fallback" in tb.label and "app-level pacing" in tb.label
        assert tb.server_host(0) == "127.0.0.1"
        out = tb.spawn([sys.executable, "-c", "import os; print(os.nice(0))"], server=0,
                       stdout=subprocess.PIPE, text=True)
        assert int(out.communicate(timeout=20)[0]) > 0  # a weaker server runs at a lower priority


def test_bad_specs_are_refused_with_a_clear_message():
    with pytest.raises(UserError, match="CPU share"):
        TestbedSpec(antenna_mbps=(10.0,), servers=(ServerSpec("a", cpu=-1),))
    with pytest.raises(UserError, match="positive bandwidth"):
        TestbedSpec(antenna_mbps=(0.0,), servers=())
    with pytest.raises(UserError, match="MTU 100 is outside"):
        TestbedSpec(antenna_mbps=(10.0,), servers=(), mtu=100)
