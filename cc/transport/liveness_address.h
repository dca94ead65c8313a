// Which of rank 0's IPv4 addresses the other ranks try, in which order, for the
// dead-rank connections (cc/transport/liveness.h). On a cluster rank 0 has
// several interfaces (management Ethernet, InfiniBand IPoIB, docker0/virbr0
// bridges only it can reach); other nodes must get one they can reach, first.
//
// Order (a pure function of the interface list and the settings):
//  1. NVGROUP_LIVENESS_ADDR=a.b.c.d: only that address;
//  2. NVGROUP_LIVENESS_IFACE=name: only that interface's addresses;
//  3. otherwise every non-loopback address, best first: on an interface MPI was
//     told to use (Open MPI's btl/oob_tcp_if_include, MPICH's
//     MPIR_CVAR_NEMESIS_TCP_NETWORK_IFACE, Intel's I_MPI_HYDRA_IFACE: names or
//     a.b.c.d/n subnets), then the addresses rank 0's host name resolves to,
//     then the rest, and last container/VM bridges (docker*, virbr*, veth*,
//     br-*, cni*, flannel*, lxc*) and link-local 169.254/16; ties keep the
//     system's interface order.
// Loopback is appended by the caller (ranks on rank 0's host try it first).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "nvgroup/status.h"

namespace nvgroup {

struct Knobs;  // cc/common/env.h

struct NetInterface {
  std::string name;
  uint32_t address = 0;  // IPv4, network byte order
};

struct LivenessAddressSettings {
  std::string address;                  // NVGROUP_LIVENESS_ADDR
  std::string interface;                // NVGROUP_LIVENESS_IFACE
  std::vector<std::string> mpi_interfaces;  // names or subnets MPI was told to use
  std::vector<uint32_t> hostname_addresses;  // what rank 0's host name resolves to
};

// address and interface from the parsed knobs (NVGROUP_LIVENESS_ADDR,
// NVGROUP_LIVENESS_IFACE), mpi_interfaces from MPI's own variables above
// (hostname_addresses is filled by the caller).
LivenessAddressSettings LivenessAddressSettingsFrom(const Knobs& knobs);

// The addresses to publish, best first (see above). kInvalidArgument naming the
// variable when NVGROUP_LIVENESS_ADDR is not an IPv4 address or
// NVGROUP_LIVENESS_IFACE has no IPv4 address.
StatusOr<std::vector<uint32_t>> ChooseLivenessAddresses(const std::vector<NetInterface>& interfaces,
                                                        const LivenessAddressSettings& settings);

}  // namespace nvgroup
