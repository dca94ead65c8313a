"""Which of rank 0's addresses the other nodes try for the dead-rank connections
(cc/transport/liveness_address.cc), on fake interface lists of cluster nodes."""
import pytest

engine = pytest.importorskip("nvgroup_tf._engine")

# A Summit-like login/compute node: docker bridge first in the system's order,
# management Ethernet, InfiniBand (IPoIB), a link-local address.
NODE = [("lo", "127.0.0.1"), ("docker0", "172.17.0.1"), ("eth0", "10.1.2.3"), ("ib0", "10.41.2.3"),
        ("enp1s0", "169.254.3.1"), ("virbr0", "192.168.122.1")]


def choose(interfaces=NODE, address="", interface="", mpi=(), hostname=()):
    return engine.choose_liveness_addresses(interfaces, address, interface, list(mpi), list(hostname))


def test_default_order_prefers_the_host_name_and_puts_bridges_last():
    # No MPI hint: the host name's address first, then normal interfaces, then
    # bridges and link-local; loopback is never published here.
    assert choose(hostname=["10.41.2.3"]) == ["10.41.2.3", "10.1.2.3", "172.17.0.1", "169.254.3.1",
                                             "192.168.122.1"]
    assert choose()[:2] == ["10.1.2.3", "10.41.2.3"]


def test_the_interface_mpi_uses_comes_first():
    # OMPI_MCA_btl_tcp_if_include=ib0 (a name) or a subnet.
    assert choose(mpi=["ib0"], hostname=["10.1.2.3"])[:2] == ["10.41.2.3", "10.1.2.3"]
    assert choose(mpi=["10.41.0.0/16"])[0] == "10.41.2.3"
    assert choose(mpi=["lo"])[0] == "10.1.2.3"  # loopback stays out even when MPI uses it


def test_knobs_pin_the_address_or_the_interface():
    assert choose(address="10.9.9.9", mpi=["ib0"]) == ["10.9.9.9"]
    assert choose(interface="eth0", mpi=["ib0"]) == ["10.1.2.3"]
    with pytest.raises(RuntimeError, match=r"NVGROUP_LIVENESS_ADDR=ib0 is not an IPv4 address"):
        choose(address="ib0")
    with pytest.raises(RuntimeError, match=r"NVGROUP_LIVENESS_IFACE=ib9: no IPv4 address.*eth0, ib0"):
        choose(interface="ib9")
