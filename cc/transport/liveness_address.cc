// Rank 0's address list for the dead-rank connections (liveness_address.h).
#include "transport/liveness_address.h"

#include <arpa/inet.h>

#include <algorithm>
#include <cstdlib>
#include <sstream>

#include "common/env.h"

namespace nvgroup {
namespace {

std::vector<std::string> SplitList(const char* text) {
  std::vector<std::string> out;
  if (text == nullptr) return out;
  std::string item;
  for (const char* p = text;; ++p) {
    if (*p == ',' || *p == ' ' || *p == ';' || *p == '\0') {
      if (!item.empty()) out.push_back(item);
      item.clear();
      if (*p == '\0') break;
    } else {
      item += *p;
    }
  }
  return out;
}

bool ParseIpv4(const std::string& text, uint32_t* out) {
  in_addr a{};
  if (inet_pton(AF_INET, text.c_str(), &a) != 1) return false;
  *out = a.s_addr;
  return true;
}

// "10.1.0.0/16" contains the address?
bool InSubnet(const std::string& cidr, uint32_t address) {
  const size_t slash = cidr.find('/');
  if (slash == std::string::npos) return false;
  uint32_t net = 0;
  if (!ParseIpv4(cidr.substr(0, slash), &net)) return false;
  const int bits = std::atoi(cidr.c_str() + slash + 1);
  if (bits < 0 || bits > 32) return false;
  const uint32_t mask = bits == 0 ? 0 : ~uint32_t{0} << (32 - bits);
  return (ntohl(net) & mask) == (ntohl(address) & mask);
}

bool IsBridge(const std::string& name) {
  for (const char* p : {"docker", "virbr", "veth", "br-", "cni", "flannel", "lxc"})
    if (name.rfind(p, 0) == 0) return true;
  return false;
}

}  // namespace

LivenessAddressSettings LivenessAddressSettingsFrom(const Knobs& knobs) {
  LivenessAddressSettings s;
  s.address = knobs.liveness_address;
  s.interface = knobs.liveness_interface;
  for (const char* var : {"OMPI_MCA_btl_tcp_if_include", "OMPI_MCA_oob_tcp_if_include",
                          "MPIR_CVAR_NEMESIS_TCP_NETWORK_IFACE", "I_MPI_HYDRA_IFACE"})
    for (std::string& item : SplitList(std::getenv(var))) s.mpi_interfaces.push_back(item);
  return s;
}

StatusOr<std::vector<uint32_t>> ChooseLivenessAddresses(const std::vector<NetInterface>& interfaces,
                                                        const LivenessAddressSettings& settings) {
  using Result = StatusOr<std::vector<uint32_t>>;
  if (!settings.address.empty()) {
    uint32_t a = 0;
    if (!ParseIpv4(settings.address, &a))
      return Result(Status::InvalidArgument("NVGROUP_LIVENESS_ADDR=" + settings.address +
                                            " is not an IPv4 address (a.b.c.d)"));
    return Result(std::vector<uint32_t>{a});
  }
  if (!settings.interface.empty()) {
    std::vector<uint32_t> out;
    std::ostringstream have;
    for (const NetInterface& i : interfaces) {
      if (i.name == settings.interface) out.push_back(i.address);
      have << (have.tellp() > 0 ? ", " : "") << i.name;
    }
    if (out.empty())
      return Result(Status::InvalidArgument("NVGROUP_LIVENESS_IFACE=" + settings.interface +
                                            ": no IPv4 address on that interface (interfaces with "
                                            "one: " +
                                            have.str() + ")"));
    return Result(out);
  }
  auto rank_of = [&](const NetInterface& i) {
    for (const std::string& m : settings.mpi_interfaces)
      if (m == i.name || InSubnet(m, i.address)) return 0;
    if (std::find(settings.hostname_addresses.begin(), settings.hostname_addresses.end(), i.address) !=
        settings.hostname_addresses.end())
      return 1;
    if (IsBridge(i.name) || (ntohl(i.address) >> 16) == ((169u << 8) | 254u)) return 3;
    return 2;
  };
  std::vector<NetInterface> usable;
  for (const NetInterface& i : interfaces)
    if ((ntohl(i.address) >> 24) != 127) usable.push_back(i);
  std::stable_sort(usable.begin(), usable.end(),
                   [&](const NetInterface& a, const NetInterface& b) { return rank_of(a) < rank_of(b); });
  std::vector<uint32_t> out;
  for (const NetInterface& i : usable)
    if (std::find(out.begin(), out.end(), i.address) == out.end()) out.push_back(i.address);
  return Result(out);
}

}  // namespace nvgroup
