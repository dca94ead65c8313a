// Python bindings of the Communicator (nvgroup/communicator.h) for tests and
// benchmarks: nvgroup_tf._engine.Communicator. Buffers travel as integer
// addresses (numpy `a.ctypes.data`, cupy `a.data.ptr`, torch `t.data_ptr()`),
// so the same bindings drive CPU and CUDA communicators. Every non-OK Status
// becomes a RuntimeError carrying Status::ToString() in ThrowIfError, the one
// translation point. Collectives release the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <arpa/inet.h>

#include <cctype>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "algorithms/cross_exchange.h"
#include "algorithms/hierarchical_reduce_scatter.h"
#include "common/env.h"
#include "device/peer_access_advice.h"
#include "transport/liveness_address.h"
#include "nvgroup/communicator.h"

namespace py = pybind11;

namespace nvgroup {
namespace {

void ThrowIfError(const Status& status) {
  if (!status.ok()) throw std::runtime_error(status.ToString());
}

std::string Lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

DataType ParseDataType(const std::string& name) {
  const std::string n = Lower(name);
  for (int i = 0; i < kNumDataTypes; ++i) {
    DataType t = static_cast<DataType>(i);
    if (n == DataTypeName(t)) return t;
  }
  ThrowIfError(Status::InvalidArgument("unknown dtype '" + name + "'"));
  return DataType::kFloat32;
}

ReduceOp ParseReduceOp(const std::string& name) {
  const std::string n = Lower(name);
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAverage, ReduceOp::kMin, ReduceOp::kMax, ReduceOp::kProduct})
    if (n == Lower(ReduceOpName(op))) return op;
  ThrowIfError(Status::InvalidArgument("unknown reduce op '" + name +
                                       "' (expected sum, average, min, max or product)"));
  return ReduceOp::kSum;
}

Device ParseDevice(const std::string& name) {
  const std::string n = Lower(name);
  if (n == "cpu") return Device::Cpu();
  if (n.rfind("cuda:", 0) == 0 && n.size() > 5 && n.find_first_not_of("0123456789", 5) == std::string::npos)
    return Device::Cuda(std::stoi(n.substr(5)));
  ThrowIfError(Status::InvalidArgument("unknown device '" + name + "' (expected 'cpu' or 'cuda:N')"));
  return Device::Cpu();
}

void* Ptr(uintptr_t address) { return reinterpret_cast<void*>(address); }

}  // namespace

void RegisterCommunicatorBindings(py::module_& m) {
  py::class_<Communicator, std::unique_ptr<Communicator>>(m, "Communicator")
      .def(py::init([](int64_t comm_f, const std::string& device, int group_size, size_t registered_bytes,
                       size_t pipeline_chunk, double timeout) {
             // The environment's settings, with the arguments given (0: as
             // there) over them; the timeout argument always applies.
    StatusOr<Knobs> parsed = ParseKnobsFromEnvironment();
    ThrowIfError(parsed.status());
    Knobs knobs = parsed.value();
    if (group_size != 0) knobs.group_size = group_size;
    if (pipeline_chunk > 0) knobs.pipeline_chunk = pipeline_chunk;
    knobs.peer_timeout_s = timeout;
    CommunicatorOptions options;
    options.registered_bytes = registered_bytes;
    Device dev = ParseDevice(device);
    StatusOr<std::unique_ptr<Communicator>> c = [&] {
      py::gil_scoped_release release;
      return CreateCommunicator(comm_f, dev, knobs, options);
    }();
    ThrowIfError(c.status());
    return c.consume();
  }),
           py::arg("comm_f"), py::arg("device") = "cpu", py::arg("group_size") = 0,
           py::arg("registered_bytes") = 0, py::arg("pipeline_chunk") = 0, py::arg("timeout") = 30.0)
      .def("allreduce",
           [](Communicator& c, uintptr_t in, uintptr_t out, size_t count, const std::string& dtype,
              const std::string& op, uintptr_t stream) {
    DataType t = ParseDataType(dtype);
    ReduceOp o = ParseReduceOp(op);
    py::gil_scoped_release release;
    ThrowIfError(c.Allreduce(Ptr(in), Ptr(out), count, t, o, Ptr(stream)));
  },
           py::arg("in_ptr"), py::arg("out_ptr"), py::arg("count"), py::arg("dtype"), py::arg("op"),
           py::arg("stream") = 0)
      .def("allgatherv",
           [](Communicator& c, uintptr_t in, uintptr_t out, const std::vector<size_t>& bytes,
              uintptr_t stream) {
    py::gil_scoped_release release;
    ThrowIfError(c.Allgatherv(Ptr(in), Ptr(out), bytes, Ptr(stream)));
  },
           py::arg("in_ptr"), py::arg("out_ptr"), py::arg("bytes_per_rank"), py::arg("stream") = 0)
      .def("broadcast",
           [](Communicator& c, uintptr_t ptr, size_t nbytes, int root, uintptr_t stream) {
    py::gil_scoped_release release;
    ThrowIfError(c.Broadcast(Ptr(ptr), nbytes, root, Ptr(stream)));
  }, py::arg("ptr"), py::arg("nbytes"), py::arg("root"), py::arg("stream") = 0)
      .def("reduce_scatter",
           [](Communicator& c, uintptr_t in, uintptr_t out, const std::vector<size_t>& counts,
              const std::string& dtype, const std::string& op, uintptr_t stream) {
    DataType t = ParseDataType(dtype);
    ReduceOp o = ParseReduceOp(op);
    py::gil_scoped_release release;
    ThrowIfError(c.ReduceScatter(Ptr(in), Ptr(out), counts, t, o, Ptr(stream)));
  },
           py::arg("in_ptr"), py::arg("out_ptr"), py::arg("counts"), py::arg("dtype"), py::arg("op"),
           py::arg("stream") = 0)
      .def("alltoallv",
           [](Communicator& c, uintptr_t in, const std::vector<size_t>& send_bytes, uintptr_t out,
              const std::vector<size_t>& recv_bytes, uintptr_t stream) {
    py::gil_scoped_release release;
    ThrowIfError(c.Alltoallv(Ptr(in), send_bytes, Ptr(out), recv_bytes, Ptr(stream)));
  },
           py::arg("in_ptr"), py::arg("send_bytes"), py::arg("out_ptr"), py::arg("recv_bytes"),
           py::arg("stream") = 0)
      .def("synchronize",
           [](Communicator& c, uintptr_t stream) {
    py::gil_scoped_release release;
    ThrowIfError(c.Synchronize(Ptr(stream)));
  }, py::arg("stream") = 0)
      .def("abort", [](Communicator& c) { c.Abort(); })
      .def("topology",
           [](const Communicator& c) {
    const Topology& t = c.topology();
    py::dict d;
    d["rank"] = t.rank;
    d["size"] = t.size;
    d["local_rank"] = t.local_rank;
    d["local_size"] = t.local_size;
    d["node_index"] = t.node_index;
    d["node_count"] = t.node_count;
    d["group_index"] = t.group_index;
    d["group_count"] = t.group_count;
    d["group_rank"] = t.group_rank;
    d["group_size"] = t.group_size;
    return d;
  })
      .def("device", [](const Communicator& c) { return c.device().ToString(); })
      .def("registered_buffer", [](Communicator& c) {
    return reinterpret_cast<uintptr_t>(c.registered_buffer());
  }).def("registered_capacity", &Communicator::registered_capacity);
  // Bytes this process posted to other ranks in cross-group exchanges
  // (cc/algorithms/cross_exchange.h), for tests of the traffic volume.
  m.def("cross_bytes_sent", [] { return CrossExchange::BytesSent(); });
  // Cross-group jobs this process started as allgather + fold
  // (CrossExchange::VariantFor), for tests of the variant choice.
  m.def("cross_allgather_jobs", [] { return CrossExchange::AllgatherJobs(); });
  // The hierarchical reduce-scatter's plan for the rank (group_index,
  // group_rank), pure geometry (cc/algorithms/hierarchical_reduce_scatter.h),
  // for tests of placements one machine cannot produce (groups of ranks that
  // are not consecutive, as under jsrun): rank_of[j * group_size + l] = the
  // rank with group_index j, group_rank l. Returns one (piece_begin,
  // piece_count, k, K, [(part_begin, part_count) per group]) per chunk.
  m.def("_row_scatter_plan", [](const std::vector<size_t>& counts, const std::vector<int>& rank_of,
                                int group_size, int group_count, int group_rank, int group_index,
                                size_t piece, size_t send_capacity, size_t recv_capacity) {
    RowOwners owners;
    owners.group_size = group_size;
    owners.group_count = group_count;
    owners.rank_of = rank_of;
    RowScatterPlan plan;
    ThrowIfError(plan.Build(counts, owners, group_rank, group_index, piece, send_capacity, recv_capacity));
    py::list chunks;
    for (size_t c = 0; c < plan.num_chunks(); ++c) {
      const RowChunk ch = plan.Chunk(c);
      py::list parts;
      for (int j = 0; j < group_count; ++j)
        parts.append(py::make_tuple(plan.PartBegin(ch, j), plan.PartCount(ch, j)));
      chunks.append(py::make_tuple(ch.piece_begin, ch.piece_count, ch.k, ch.K, parts));
    }
    return chunks;
  });
  // Rank 0's liveness addresses, best first (cc/transport/liveness_address.h):
  // interfaces as [(name, "a.b.c.d")], the settings spelled out.
  m.def("choose_liveness_addresses",
        [](const std::vector<std::pair<std::string, std::string>>& interfaces, const std::string& address,
           const std::string& interface, const std::vector<std::string>& mpi_interfaces,
           const std::vector<std::string>& hostname_addresses) {
    auto ip = [](const std::string& t) {
      in_addr a{};
      if (inet_pton(AF_INET, t.c_str(), &a) != 1) throw std::invalid_argument("bad IPv4 " + t);
      return a.s_addr;
    };
    std::vector<NetInterface> ifs;
    for (const auto& i : interfaces) ifs.push_back({i.first, ip(i.second)});
    LivenessAddressSettings s;
    s.address = address;
    s.interface = interface;
    s.mpi_interfaces = mpi_interfaces;
    for (const std::string& h : hostname_addresses) s.hostname_addresses.push_back(ip(h));
    StatusOr<std::vector<uint32_t>> chosen = ChooseLivenessAddresses(ifs, s);
    ThrowIfError(chosen.status());
    std::vector<std::string> out;
    for (uint32_t a : chosen.value()) {
      char buf[INET_ADDRSTRLEN] = {};
      in_addr x{};
      x.s_addr = a;
      inet_ntop(AF_INET, &x, buf, sizeof(buf));
      out.push_back(buf);
    }
    return out;
  });
  // The CUDA communicator's no-peer-access warning (cc/device/peer_access_advice.h).
  m.def("no_peer_access_warning",
        [](int node, const std::vector<int>& visible, const std::vector<std::string>& bus_ids,
           py::object cuda_visible_devices) {
    std::string v = cuda_visible_devices.is_none() ? "" : py::str(cuda_visible_devices);
    return NoPeerAccessWarning(node, visible, bus_ids, cuda_visible_devices.is_none() ? nullptr : v.c_str());
  });
}

}  // namespace nvgroup
