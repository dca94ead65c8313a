// The engine's `testing` submodule (nvgroup_tf._engine.testing): pure parts of
// the engine (wire format, fusion planner, coordinator) and fault hooks for
// unit tests, no MPI unless a hook says so.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <mpi.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "algorithms/cross_exchange.h"
#include "algorithms/hierarchical_allreduce.h"
#include "engine/coordinator.h"
#include "engine/engine_control.h"
#include "engine/fusion.h"
#include "engine/init_watchdog.h"
#include "engine/stall_inspector.h"
#include "engine/wire_format.h"
#include "cpu/host_reduce.h"
#include "nvgroup/engine.h"
#include "python/engine_arguments.h"
#include "python/engine_handles.h"
#include "transport/liveness.h"

namespace py = pybind11;

namespace nvgroup {
namespace {

// Decoded strings may be arbitrary bytes (fuzzed input): keep them as str
// with surrogate escapes rather than failing the conversion.
py::str Text(const std::string& s) {
  PyObject* o = PyUnicode_DecodeUTF8(s.data(), static_cast<Py_ssize_t>(s.size()), "surrogateescape");
  if (o == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::str>(o);
}

py::dict RequestToDict(const RequestMessage& q) {
  py::dict d;
  d["name"] = Text(q.name);
  d["type"] = static_cast<int>(q.type);
  d["dtype"] = static_cast<int>(q.dtype);
  d["device_kind"] = static_cast<int>(q.device_kind);
  d["op"] = static_cast<int>(q.op);
  d["prescale"] = q.prescale_factor;
  d["postscale"] = q.postscale_factor;
  d["root"] = q.root_rank;
  d["shape"] = q.shape;
  d["group_id"] = q.group_id;
  d["group_size"] = q.group_size;
  d["splits"] = q.splits;
  d["refused_duplicate"] = Text(q.refused_duplicate);
  return d;
}

RequestMessage RequestFromDict(const py::dict& d) {
  RequestMessage q;
  q.name = d["name"].cast<std::string>();
  q.type = static_cast<CollectiveType>(d["type"].cast<int>());
  q.dtype = static_cast<DataType>(d["dtype"].cast<int>());
  q.device_kind = static_cast<DeviceKind>(d["device_kind"].cast<int>());
  q.op = static_cast<ReduceOp>(d["op"].cast<int>());
  q.prescale_factor = d["prescale"].cast<double>();
  q.postscale_factor = d["postscale"].cast<double>();
  q.root_rank = d["root"].cast<int32_t>();
  q.shape = d["shape"].cast<std::vector<int64_t>>();
  q.group_id = d["group_id"].cast<uint64_t>();
  q.group_size = d["group_size"].cast<uint32_t>();
  if (d.contains("splits")) q.splits = d["splits"].cast<std::vector<int64_t>>();
  if (d.contains("refused_duplicate")) q.refused_duplicate = d["refused_duplicate"].cast<std::string>();
  return q;
}

py::dict ResponseToDict(const ResponseMessage& r) {
  py::dict d;
  d["name"] = Text(r.name);
  d["error_code"] = static_cast<int>(r.error_code);
  d["error_message"] = Text(r.error_message);
  d["type"] = static_cast<int>(r.type);
  d["dtype"] = static_cast<int>(r.dtype);
  d["device_kind"] = static_cast<int>(r.device_kind);
  d["op"] = static_cast<int>(r.op);
  d["prescale"] = r.prescale_factor;
  d["postscale"] = r.postscale_factor;
  d["root"] = r.root_rank;
  d["shape"] = r.shape;
  d["first_dims"] = r.first_dims;
  d["group_id"] = r.group_id;
  d["group_size"] = r.group_size;
  return d;
}

ResponseMessage ResponseFromDict(const py::dict& d) {
  ResponseMessage r;
  r.name = d["name"].cast<std::string>();
  r.error_code = static_cast<StatusCode>(d["error_code"].cast<int>());
  r.error_message = d["error_message"].cast<std::string>();
  r.type = static_cast<CollectiveType>(d["type"].cast<int>());
  r.dtype = static_cast<DataType>(d["dtype"].cast<int>());
  r.device_kind = static_cast<DeviceKind>(d["device_kind"].cast<int>());
  r.op = static_cast<ReduceOp>(d["op"].cast<int>());
  r.prescale_factor = d["prescale"].cast<double>();
  r.postscale_factor = d["postscale"].cast<double>();
  r.root_rank = d["root"].cast<int32_t>();
  r.shape = d["shape"].cast<std::vector<int64_t>>();
  r.first_dims = d["first_dims"].cast<std::vector<int64_t>>();
  r.group_id = d["group_id"].cast<uint64_t>();
  r.group_size = d["group_size"].cast<uint32_t>();
  return r;
}

// One CrossExchange job of `count` float32 elements over MPI_COMM_WORLD (MPI
// initialized by the caller), reduce-scatter + allgather, where rank r's slice
// is r * count + i and `ready` is gated (cc/algorithms/cross_exchange.h):
//  * "late_ready": rank 0's `ready` stays false until the other peers' copies
//    of its part are in `recv` (they post their sends at once), at most
//    `wait_s`; then the job completes on every rank. Returns whether they
//    arrived before rank 0's own slice was ready, and the result.
//  * "ready_fails": every rank's `ready` fails after 50 polls, with the
//    receives of the first round posted and no send posted anywhere; the
//    job's Wait must return that error and the exchange must be destroyed.
// Every rank must call it with the same count and mode (a collective).
py::dict CrossExchangeGated(size_t count, bool use_thread, const std::string& mode, double wait_s) {
  if (mode != "late_ready" && mode != "ready_fails")
    throw EngineError("INVALID_ARGUMENT: cross_exchange_gated mode is late_ready or ready_fails");
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized || finalized)
    throw EngineError(
        "FAILED_PRECONDITION: cross_exchange_gated needs MPI initialized (import mpi4py.MPI first)");
  CrossExchange::Options options;
  options.use_thread = use_thread;
  auto made = CrossExchange::Create(MPI_COMM_WORLD, options);
  ThrowIfError(made.status());
  std::unique_ptr<CrossExchange> x = std::move(made.value());
  const int P = x->peers(), me = x->peer_index();
  std::vector<float> send(count), result(count);
  for (size_t i = 0; i < count; ++i) send[i] = static_cast<float>(me * count + i);
  std::vector<char> recv(x->RecvBytes(count, sizeof(float)));
  std::memset(recv.data(), 0xff, recv.size());  // no copy holds this pattern (a NaN)
  ChunkSlices parts;  // the exchange's parts of the slice (part p: peer p)
  parts.count = count;
  parts.group_size = P;
  parts.element_size = sizeof(float);
  const size_t mine = parts.SliceCount(me), my_offset = parts.SliceOffset(me);
  bool arrived_before_ready = false;
  int polls = 0;
  const auto start = std::chrono::steady_clock::now();
  CrossExchange::Job job;
  job.send = send.data();
  job.recv = recv.data();
  job.result = result.data();
  job.count = count;
  job.element_size = sizeof(float);
  job.fold = HostFold(DataType::kFloat32, ReduceOp::kSum, 1);
  job.ready = [&](bool* ready) {
    ++polls;
    if (mode == "ready_fails") {
      *ready = false;
      return polls >= 50 ? Status::Internal("ready_fails: the slice never arrives") : Status::Ok();
    }
    if (me != 0) {
      *ready = true;
      return Status::Ok();
    }
    bool all = true;  // every other peer's copy of our part, in peer order in recv
    for (int p = 1; p < P && all; ++p) {
      const float* copy = reinterpret_cast<const float*>(recv.data()) + p * mine;
      for (size_t i = 0; i < mine && all; ++i) all = copy[i] == static_cast<float>(p * count + my_offset + i);
    }
    arrived_before_ready = all;
    *ready = all || std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() > wait_s;
    return Status::Ok();
  };
  uint64_t ticket = 0;
  ThrowIfError(x->Start(std::move(job), &ticket));
  Status waited = x->Wait(ticket);
  x.reset();  // completes (or cancels) every request it posted
  py::dict d;
  d["status"] = waited.ok() ? std::string("OK") : waited.ToString();
  d["arrived_before_ready"] = arrived_before_ready;
  d["result"] = py::bytes(reinterpret_cast<const char*>(result.data()), count * sizeof(float));
  return d;
}

}  // namespace

void RegisterEngineTestingBindings(py::module_& t) {
  t.doc() = "Pure engine internals (wire format, fusion planner, coordinator) for unit tests.";
  t.def("encode_request_list", [](const std::vector<py::dict>& requests) {
    std::vector<RequestMessage> qs;
    for (const py::dict& d : requests) qs.push_back(RequestFromDict(d));
    std::vector<uint8_t> b = EncodeRequestList(qs);
    return py::bytes(reinterpret_cast<const char*>(b.data()), b.size());
  });
  t.def("decode_request_list", [](const py::bytes& data) {
    std::string s = data;
    std::vector<RequestMessage> qs;
    ThrowIfError(DecodeRequestList(reinterpret_cast<const uint8_t*>(s.data()), s.size(), &qs));
    py::list out;
    for (const RequestMessage& q : qs) out.append(RequestToDict(q));
    return out;
  });
  t.def("encode_response_list",
        [](const std::vector<py::dict>& responses, int fatal_code, const std::string& fatal_message) {
    ResponseList list;
    list.fatal_code = static_cast<StatusCode>(fatal_code);
    list.fatal_message = fatal_message;
    for (const py::dict& d : responses) list.responses.push_back(ResponseFromDict(d));
    std::vector<uint8_t> b = EncodeResponseList(list);
    return py::bytes(reinterpret_cast<const char*>(b.data()), b.size());
  }, py::arg("responses"), py::arg("fatal_code") = 0, py::arg("fatal_message") = "");
  t.def("decode_response_list", [](const py::bytes& data) {
    std::string s = data;
    ResponseList list;
    ThrowIfError(DecodeResponseList(reinterpret_cast<const uint8_t*>(s.data()), s.size(), &list));
    py::list out;
    for (const ResponseMessage& r : list.responses) out.append(ResponseToDict(r));
    return py::make_tuple(static_cast<int>(list.fatal_code), Text(list.fatal_message), out);
  });
  t.def("plan_fusion", [](const std::vector<py::dict>& responses, size_t threshold) {
    std::vector<ResponseMessage> rs;
    for (const py::dict& d : responses) rs.push_back(ResponseFromDict(d));
    py::list out;
    for (const FusionBucket& b : PlanFusion(rs, threshold)) {
      py::dict d;
      d["responses"] = b.responses;
      d["offsets"] = b.offsets;
      d["bytes"] = b.bytes;
      d["fusable"] = b.fusable;
      out.append(d);
    }
    return out;
  });
  t.def("run_coordinator",
        [](int size, double stall_warning_s, double stall_shutdown_s, const std::vector<py::tuple>& script) {
    // Drives rank 0's Coordinator with a script of steps:
    //   ("add", rank, request_dict, now) | ("forget", name) | ("take",) | ("stalls", now)
    // and returns, for each "take"/"stalls", the released responses as dicts.
    StallInspector stall(size, stall_warning_s, stall_shutdown_s);
    Coordinator coordinator(size, &stall);
    py::list out;
    for (const py::tuple& step : script) {
      const std::string what = step[0].cast<std::string>();
      std::vector<ResponseMessage> released;
      if (what == "add") {
        coordinator.AddRequest(step[1].cast<int>(), RequestFromDict(step[2].cast<py::dict>()),
                               step[3].cast<double>());
        continue;
      } else if (what == "forget") {
        coordinator.Forget(step[1].cast<std::string>());
        continue;
      } else if (what == "take") {
        released = coordinator.TakeReadyResponses();
      } else if (what == "stalls") {
        released = coordinator.TakeStalledResponses(step[1].cast<double>());
      } else {
        throw EngineError("INVALID_ARGUMENT: unknown coordinator step '" + what + "'");
      }
      py::list batch;
      for (const ResponseMessage& r : released) batch.append(ResponseToDict(r));
      out.append(batch);
    }
    return out;
  });
  t.def("abort_engine", [](const std::string& message) {
    py::gil_scoped_release release;
    AbortEngine(Status::Unavailable(message));
  }, "Calls AbortEngine(kUnavailable `message`) as the liveness monitor would.");
  t.def("perturb_state_digest", [] { PerturbStateDigestForTesting(); },
        "Makes this rank's response-cache digest differ from the other ranks' (the next cycle "
        "must fail on every rank).");
  t.def("refuse_output_allocations", [](int count) { RefuseOutputAllocationsForTesting(count); },
        py::arg("count"),
        "The next `count` allgather/reducescatter/alltoall output allocations of this process fail "
        "(the engine then takes part with host scratch memory and fails the request naming it).");
  t.def("host_completion_events",
        [](bool on) {
    SetHostCompletionEventsForTesting(on);
    AnnounceCompletionEventsForTesting(on);
  }, py::arg("on"),
        "From the next init() on, host collectives complete as CUDA ones do: on the finalizer thread, "
        "after a host token per bucket that each request submitted from here (allreduce_async, "
        "grouped_allreduce_async, registered_group_allreduce_async, ...) hears of first through "
        "completion_event_ready. Resets completion_events_heard().");
  t.def("completion_events_heard", [] { return CompletionEventsHeardForTesting(); },
        "(events heard by completion_event_ready since host_completion_events(), "
        "of them heard after the request's done or without an event).");
  t.def("set_liveness_connect_delay", [](double seconds) { SetLivenessConnectDelayForTesting(seconds); },
        py::arg("seconds"),
        "In the next init(), ranks other than 0 wait `seconds` before connecting to rank 0's "
        "dead-rank detection port.");
  t.def("fault_in_init",
        [](const std::string& phase, const std::string& kind) {
    if (kind != "stop" && kind != "kill")
      throw EngineError("INVALID_ARGUMENT: fault_in_init kind must be stop or kill");
    if (!IsInitPhase(phase))
      throw EngineError("INVALID_ARGUMENT: fault_in_init: unknown phase '" + phase +
                        "' (engine/init_watchdog.h lists them)");
    SetInitFaultForTesting(phase, kind);
  }, py::arg("phase"), py::arg("kind"),
        "The next time init() (or add_process_set) enters `phase` (engine/init_watchdog.h lists them), this "
        "process stops (kind 'stop': SIGSTOP) or dies (kind 'kill': SIGKILL) there.");
  t.def("liveness_listen_addresses", [] { return LivenessListenAddressesForTesting(); },
        "Rank 0, while init() is accepting the dead-rank detection connections: [(address, port)].");
  t.def("reduce_fold",
        [](const std::string& dtype_name, const std::string& op_name, const std::vector<py::bytes>& sources,
           int average_divisor, int in_place) {
    const DataType dtype = ParseDataType(dtype_name);
    const ReduceOp op = ParseReduceOp(op_name);
    if (sources.empty() || in_place < -1 || in_place >= static_cast<int>(sources.size()))
      throw EngineError("INVALID_ARGUMENT: reduce_fold needs sources and -1 <= in_place < len(sources)");
    std::vector<std::string> copies;
    for (const py::bytes& b : sources) copies.push_back(b);
    const size_t esize = DataTypeSize(dtype), bytes = copies[0].size();
    for (const std::string& c : copies)
      if (c.size() != bytes || bytes % esize != 0)
        throw EngineError("INVALID_ARGUMENT: reduce_fold sources must be arrays of one length");
    std::vector<const void*> ptrs;
    for (const std::string& c : copies) ptrs.push_back(c.data());
    std::string out(bytes, '\0');
    void* dst = in_place >= 0 ? copies[in_place].data() : out.data();
    ThrowIfError(ReduceFold(dtype, op, ptrs.data(), static_cast<int>(ptrs.size()), dst, bytes / esize,
                            average_divisor));
    return py::bytes(static_cast<const char*>(dst), bytes);
  },
        py::arg("dtype"), py::arg("op"), py::arg("sources"), py::arg("average_divisor") = 1,
        py::arg("in_place") = -1,
        "The host fold (cpu/host_reduce.h ReduceFold) of equal-length byte arrays in order; in_place = k "
        "writes the result over source k (as the in-place collectives do) instead of a separate buffer.");
  t.def("cross_exchange_gated", &CrossExchangeGated, py::arg("count"), py::arg("use_thread"), py::arg("mode"),
        py::arg("wait_s") = 5.0,
        "One cross-group exchange job over MPI_COMM_WORLD with a gated `ready` (mode late_ready or "
        "ready_fails, see CrossExchangeGated in cc/python/engine_testing_bindings.cc).");
  t.def("build_response", [](const std::vector<py::dict>& by_rank) {
    if (by_rank.empty()) throw EngineError("INVALID_ARGUMENT: build_response needs one request per rank");
    std::vector<RequestMessage> qs;
    for (const py::dict& d : by_rank) qs.push_back(RequestFromDict(d));
    return ResponseToDict(BuildResponse(qs));
  });
}

}  // namespace nvgroup
