// Python bindings of the engine (nvgroup/engine.h): init/shutdown/topology and
// asynchronous collectives on raw addresses (numpy `a.ctypes.data`, cupy
// `a.data.ptr`), returning integer handles that wait()/poll() resolve.
//
// A handle is shared between the engine's `done` callback (background thread,
// no GIL) and wait()/poll() (Python thread). The callback only stores the
// Status and signals a condition variable; wait() releases the GIL while it
// blocks. Allgather outputs are allocated by the binding, off the GIL: host
// memory handed to numpy without a copy at wait(), or cudaMalloc'd memory
// returned as (address, shape) and released with free_cuda().
//
// Errors: a non-OK Status raises EngineError (a RuntimeError) whose text is
// Status::ToString(), e.g. "FAILED_PRECONDITION: Mismatched allreduce ...".
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cctype>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#ifdef NVGROUP_WITH_CUDA
#include <cuda_runtime.h>
#endif

#include "engine/coordinator.h"
#include "engine/engine_control.h"
#include "engine/fusion.h"
#include "engine/init_watchdog.h"
#include "engine/stall_inspector.h"
#include "engine/wire_format.h"
#include "nvgroup/engine.h"
#include "transport/liveness.h"

namespace py = pybind11;

namespace nvgroup {
namespace {

class EngineError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

void ThrowIfError(const Status& status) {
  if (!status.ok()) throw EngineError(status.ToString());
}

template <typename T>
T ValueOrThrow(StatusOr<T> v) {
  ThrowIfError(v.status());
  return v.consume();
}

std::string Lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

bool EqualsIgnoreCase(const std::string& a, const char* b) {
  size_t i = 0;
  for (; i < a.size() && b[i] != '\0'; ++i)
    if (std::tolower(static_cast<unsigned char>(a[i])) != std::tolower(static_cast<unsigned char>(b[i])))
      return false;
  return i == a.size() && b[i] == '\0';
}

// The parsers run for every enqueue: no allocation unless the name is bad.
DataType ParseDataType(const std::string& name) {
  for (int i = 0; i < kNumDataTypes; ++i)  // the usual spelling first: no case folding
    if (name == DataTypeName(static_cast<DataType>(i))) return static_cast<DataType>(i);
  for (int i = 0; i < kNumDataTypes; ++i)
    if (EqualsIgnoreCase(name, DataTypeName(static_cast<DataType>(i)))) return static_cast<DataType>(i);
  throw EngineError("INVALID_ARGUMENT: unknown dtype '" + name + "'");
}

ReduceOp ParseReduceOp(const std::string& name) {
  for (int i = 0; i <= static_cast<int>(ReduceOp::kProduct); ++i)
    if (name == ReduceOpName(static_cast<ReduceOp>(i))) return static_cast<ReduceOp>(i);
  for (int i = 0; i <= static_cast<int>(ReduceOp::kProduct); ++i)
    if (EqualsIgnoreCase(name, ReduceOpName(static_cast<ReduceOp>(i)))) return static_cast<ReduceOp>(i);
  throw EngineError("INVALID_ARGUMENT: unknown reduce op '" + name +
                    "' (expected sum, average, min, max or product)");
}

Device ParseDevice(const std::string& name) {
  if (EqualsIgnoreCase(name, "cpu")) return Device::Cpu();
  const std::string n = Lower(name);
  if (n == "cuda" || n == "gpu") return Device::Cuda(0);
  for (const char* prefix : {"cuda:", "gpu:"}) {
    const size_t p = std::string(prefix).size();
    if (n.rfind(prefix, 0) == 0 && n.size() > p && n.find_first_not_of("0123456789", p) == std::string::npos)
      return Device::Cuda(std::stoi(n.substr(p)));
  }
  throw EngineError("INVALID_ARGUMENT: unknown device '" + name + "' (expected 'cpu' or 'cuda:N')");
}

// --- Handles ---------------------------------------------------------------

// WaitAll's one wake-up for many handles: each handle not yet done when
// wait_all looked counts it down once (under the latch's mutex), and only the
// last one signals, so a step's 214 completions wake the waiting thread once
// instead of up to 214 times (each a context switch on a loaded machine).
struct Latch {
  std::mutex mu;
  std::condition_variable cv;
  size_t remaining = 0;
};

struct Handle {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  Status status;
  std::shared_ptr<Latch> latch;  // set by WaitAll (under mu) while it waits
  // Allgather output (allocated by AllocateOutput on the background thread).
  bool is_allgather = false;
  DataType dtype = DataType::kFloat32;
  Device device;
  std::vector<int64_t> out_shape;
  std::shared_ptr<std::vector<char>> host_out;
  void* cuda_out = nullptr;
  // Alltoall: rows received from each rank (filled before the output is
  // allocated); join: the last rank to join.
  bool is_alltoall = false;
  std::vector<int64_t> received_splits;
  bool is_join = false;
  int32_t join_result = -1;
};

// Objects the caller asked us to keep alive until wait() (its arrays), by
// handle id. A Python dict, touched only with the GIL held (a Handle may die
// on the background thread, so it holds no Python object); leaked on purpose
// so no Python object is destroyed after the interpreter.
py::dict& KeepAlive() {
  static py::dict* d = new py::dict();
  return *d;
}

std::mutex g_handles_mu;
std::unordered_map<int64_t, std::shared_ptr<Handle>> g_handles;
int64_t g_next_handle = 1;

int64_t Register(std::shared_ptr<Handle> h) {
  std::lock_guard<std::mutex> lock(g_handles_mu);
  int64_t id = g_next_handle++;
  g_handles[id] = std::move(h);
  return id;
}

std::shared_ptr<Handle> Lookup(int64_t id) {
  std::lock_guard<std::mutex> lock(g_handles_mu);
  auto it = g_handles.find(id);
  if (it == g_handles.end()) throw EngineError("INVALID_ARGUMENT: unknown or already waited handle " + std::to_string(id));
  return it->second;
}

void Forget(int64_t id) {
  std::lock_guard<std::mutex> lock(g_handles_mu);
  g_handles.erase(id);
}

DoneCallback DoneFor(const std::shared_ptr<Handle>& h) {
  return [h](const Status& s) {
    std::shared_ptr<Latch> latch;
    {
      std::lock_guard<std::mutex> lock(h->mu);
      h->status = s;
      h->done = true;
      latch = std::move(h->latch);
    }
    h->cv.notify_all();  // wait()/poll() (no waiter: no system call)
    if (latch != nullptr) {
      bool last;
      {
        std::lock_guard<std::mutex> lock(latch->mu);
        last = --latch->remaining == 0;
      }
      if (last) latch->cv.notify_all();
    }
  };
}

AllocateOutputFn AllocatorFor(const std::shared_ptr<Handle>& h) {
  return [h](const std::vector<int64_t>& shape, void** out) -> Status {
    const size_t bytes = static_cast<size_t>(NumElements(shape)) * DataTypeSize(h->dtype);
    h->out_shape = shape;
    if (h->device.kind == DeviceKind::kCpu) {
      h->host_out = std::make_shared<std::vector<char>>(std::max<size_t>(bytes, 1));
      *out = h->host_out->data();
      return Status::Ok();
    }
#ifdef NVGROUP_WITH_CUDA
    int previous = 0;
    cudaError_t e = cudaGetDevice(&previous);
    if (e == cudaSuccess) e = cudaSetDevice(h->device.ordinal);
    if (e == cudaSuccess) e = cudaMalloc(&h->cuda_out, std::max<size_t>(bytes, 1));
    cudaSetDevice(previous);
    if (e != cudaSuccess)
      return Status::Internal(std::string("cudaMalloc of the allgather output failed: ") + cudaGetErrorString(e));
    *out = h->cuda_out;
    return Status::Ok();
#else
    return Status::Unimplemented("CUDA allgather needs a CUDA build");
#endif
  };
}

py::object NumpyDtype(DataType dtype) {
  if (dtype == DataType::kBFloat16) {
    try {
      return py::module_::import("ml_dtypes").attr("bfloat16");
    } catch (const py::error_already_set&) {
      return py::dtype("uint16");  // raw bits when ml_dtypes is missing
    }
  }
  return py::dtype(dtype == DataType::kBool ? "bool" : DataTypeName(dtype));
}

py::object AllgatherResult(Handle& h) {
  if (h.device.kind != DeviceKind::kCpu)
    return py::make_tuple(reinterpret_cast<uintptr_t>(h.cuda_out), h.out_shape);
  auto* owner = new std::shared_ptr<std::vector<char>>(h.host_out);
  py::capsule free_when_done(owner, [](void* p) { delete static_cast<std::shared_ptr<std::vector<char>>*>(p); });
  py::dtype dt = py::dtype::from_args(NumpyDtype(h.dtype));
  std::vector<py::ssize_t> shape(h.out_shape.begin(), h.out_shape.end());
  return py::array(dt, shape, h.host_out->data(), free_when_done);
}

// Waits (GIL released); returns None, or the allgather output. Raises on error.
py::object Wait(int64_t id, py::object timeout) {
  std::shared_ptr<Handle> h = Lookup(id);
  const bool forever = timeout.is_none();
  const double seconds = forever ? 0.0 : timeout.cast<double>();
  bool finished;
  {
    py::gil_scoped_release release;
    std::unique_lock<std::mutex> lock(h->mu);
    if (forever) {
      h->cv.wait(lock, [&] { return h->done; });
      finished = true;
    } else {
      finished = h->cv.wait_for(lock, std::chrono::duration<double>(seconds), [&] { return h->done; });
    }
  }
  if (!finished) {
    PyErr_SetString(PyExc_TimeoutError, ("collective handle " + std::to_string(id) + " is still in flight").c_str());
    throw py::error_already_set();
  }
  Forget(id);
  if (KeepAlive().contains(py::int_(id))) KeepAlive().attr("pop")(py::int_(id));
  ThrowIfError(h->status);
  if (h->is_join) return py::int_(h->join_result);
  if (h->is_alltoall) return py::make_tuple(AllgatherResult(*h), h->received_splits);
  if (h->is_allgather) return AllgatherResult(*h);
  return py::none();
}

// Waits for every handle with one release of the GIL (a step's 214 gradients
// cost one call instead of 214), then resolves them in order like wait():
// returns the list of results; the first failure raises after every handle
// was waited for and forgotten (none is left behind).
py::list WaitAll(const std::vector<int64_t>& ids) {
  std::vector<std::shared_ptr<Handle>> hs;
  hs.reserve(ids.size());
  {
    std::lock_guard<std::mutex> lock(g_handles_mu);  // one lock for all handles
    for (int64_t id : ids) {
      auto it = g_handles.find(id);
      if (it == g_handles.end())
        throw EngineError("INVALID_ARGUMENT: unknown or already waited handle " + std::to_string(id));
      hs.push_back(it->second);
    }
  }
  {
    py::gil_scoped_release release;
    auto latch = std::make_shared<Latch>();
    // Counted before any handle can count down: a handle that is not done gets
    // the latch under its own mutex, so its done callback counts it down once.
    latch->remaining = hs.size();
    // A handle listed twice counts once; one another wait_all already waits
    // on is waited for through its own condition variable.
    size_t already = 0;
    std::vector<Handle*> others;
    for (const std::shared_ptr<Handle>& h : hs) {
      std::lock_guard<std::mutex> lock(h->mu);
      if (h->done || h->latch == latch) {
        ++already;
      } else if (h->latch != nullptr) {
        ++already;
        others.push_back(h.get());
      } else {
        h->latch = latch;
      }
    }
    {
      std::unique_lock<std::mutex> lock(latch->mu);
      latch->remaining -= already;
      latch->cv.wait(lock, [&] { return latch->remaining == 0; });
    }
    for (Handle* h : others) {
      std::unique_lock<std::mutex> lock(h->mu);
      h->cv.wait(lock, [&] { return h->done; });
    }
  }
  py::list out;
  Status first_error;
  py::dict& keep = KeepAlive();
  const bool any_kept = keep.size() > 0;
  {
    std::lock_guard<std::mutex> lock(g_handles_mu);
    for (int64_t id : ids) g_handles.erase(id);
  }
  for (size_t i = 0; i < ids.size(); ++i) {
    if (any_kept && keep.contains(py::int_(ids[i]))) keep.attr("pop")(py::int_(ids[i]));
    if (!hs[i]->status.ok()) {
      if (first_error.ok()) first_error = hs[i]->status;
      out.append(py::none());
      continue;
    }
    out.append(hs[i]->is_allgather ? AllgatherResult(*hs[i]) : py::none());
  }
  ThrowIfError(first_error);
  return out;
}

bool Poll(int64_t id) {
  std::shared_ptr<Handle> h = Lookup(id);
  std::lock_guard<std::mutex> lock(h->mu);
  return h->done;
}

CollectiveRequest MakeAllreduce(const std::string& name, uintptr_t in, uintptr_t out,
                                std::vector<int64_t> shape, const std::string& dtype,
                                const std::string& op, double prescale, double postscale,
                                const std::string& device, uintptr_t ready_event) {
  CollectiveRequest q;
  q.name = name;
  q.type = CollectiveType::kAllreduce;
  q.input = reinterpret_cast<const void*>(in);
  q.output = reinterpret_cast<void*>(out);
  q.shape = std::move(shape);
  q.dtype = ParseDataType(dtype);
  q.op = ParseReduceOp(op);
  q.prescale_factor = prescale;
  q.postscale_factor = postscale;
  q.device = ParseDevice(device);
  q.ready_event = reinterpret_cast<void*>(ready_event);
  return q;
}

// A request whose output the engine asks us to allocate (allgather,
// reducescatter, alltoall).
CollectiveRequest MakeAllocated(CollectiveType type, const std::string& name, uintptr_t in,
                                std::vector<int64_t> shape, const std::string& dtype,
                                const std::string& device, uintptr_t ready_event,
                                int32_t process_set, const std::shared_ptr<Handle>& h) {
  h->is_allgather = true;
  h->dtype = ParseDataType(dtype);
  h->device = ParseDevice(device);
  CollectiveRequest q;
  q.name = name;
  q.type = type;
  q.input = reinterpret_cast<const void*>(in);
  q.shape = std::move(shape);
  q.dtype = h->dtype;
  q.device = h->device;
  q.ready_event = reinterpret_cast<void*>(ready_event);
  q.allocate_output = AllocatorFor(h);
  q.process_set_id = process_set;
  return q;
}

std::vector<int64_t> SubmitGroup(std::vector<CollectiveRequest> qs, std::vector<std::shared_ptr<Handle>> hs,
                                 py::object keepalive) {
  for (size_t i = 0; i < qs.size(); ++i) qs[i].done = DoneFor(hs[i]);
  ThrowIfError(EnqueueGroup(std::move(qs)));  // GIL held: see SubmitOne
  std::vector<int64_t> ids;
  ids.reserve(hs.size());
  {
    std::lock_guard<std::mutex> lock(g_handles_mu);  // one lock for the group
    g_handles.reserve(g_handles.size() + hs.size());
    for (auto& h : hs) {
      const int64_t id = g_next_handle++;
      g_handles.emplace(id, std::move(h));
      ids.push_back(id);
    }
  }
  if (!keepalive.is_none())
    for (int64_t id : ids) KeepAlive()[py::int_(id)] = keepalive;
  return ids;
}

int64_t SubmitOne(CollectiveRequest q, std::shared_ptr<Handle> h, py::object keepalive) {
  q.done = DoneFor(h);
  // The GIL stays held: Enqueue only validates and appends under a mutex that
  // no thread holds for long (releasing and retaking the GIL cost more than
  // the call), and done callbacks never take the GIL.
  ThrowIfError(Enqueue(std::move(q)));
  const int64_t id = Register(std::move(h));
  if (!keepalive.is_none()) KeepAlive()[py::int_(id)] = keepalive;
  return id;
}

// --- Testing hooks: pure parts of the engine, no MPI -------------------------

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

void RegisterTestingBindings(py::module_& t) {
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
  t.def("encode_response_list", [](const std::vector<py::dict>& responses, int fatal_code,
                                   const std::string& fatal_message) {
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
  t.def("run_coordinator", [](int size, double stall_warning_s, double stall_shutdown_s,
                              const std::vector<py::tuple>& script) {
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
        coordinator.AddRequest(step[1].cast<int>(), RequestFromDict(step[2].cast<py::dict>()), step[3].cast<double>());
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
  t.def("set_liveness_connect_delay", [](double seconds) { SetLivenessConnectDelayForTesting(seconds); },
        py::arg("seconds"),
        "In the next init(), ranks other than 0 wait `seconds` before connecting to rank 0's "
        "dead-rank detection port.");
  t.def("fault_in_init", [](const std::string& phase, const std::string& kind) {
    if (kind != "stop" && kind != "kill") throw EngineError("INVALID_ARGUMENT: fault_in_init kind must be stop or kill");
    if (!IsInitPhase(phase))
      throw EngineError("INVALID_ARGUMENT: fault_in_init: unknown phase '" + phase +
                        "' (engine/init_watchdog.h lists them)");
    SetInitFaultForTesting(phase, kind);
  }, py::arg("phase"), py::arg("kind"),
        "The next time init() (or add_process_set) enters `phase` (engine/init_watchdog.h lists them), this "
        "process stops (kind 'stop': SIGSTOP) or dies (kind 'kill': SIGKILL) there.");
  t.def("liveness_listen_addresses", [] { return LivenessListenAddressesForTesting(); },
        "Rank 0, while init() is accepting the dead-rank detection connections: [(address, port)].");
  t.def("build_response", [](const std::vector<py::dict>& by_rank) {
    if (by_rank.empty()) throw EngineError("INVALID_ARGUMENT: build_response needs one request per rank");
    std::vector<RequestMessage> qs;
    for (const py::dict& d : by_rank) qs.push_back(RequestFromDict(d));
    return ResponseToDict(BuildResponse(qs));
  });
}

}  // namespace

void RegisterEngineBindings(py::module_& m) {
  py::register_exception<EngineError>(m, "EngineError", PyExc_RuntimeError);

  m.def("init", [](int64_t comm_f) {
    EngineOptions options;
    options.mpi_comm_fortran = comm_f;
    Status s;
    {
      py::gil_scoped_release release;
      s = Init(options);
    }
    ThrowIfError(s);
  }, py::arg("comm_f") = -1, "Collective: starts the engine over the MPI communicator (Fortran handle; -1 = COMM_WORLD).");
  m.def("shutdown", [] {
    Status s;
    {
      py::gil_scoped_release release;
      s = Shutdown();
    }
    ThrowIfError(s);
  });
  m.def("finalize_mpi", [] {
    Status s;
    {
      py::gil_scoped_release release;
      s = FinalizeMpi();
    }
    ThrowIfError(s);
  });
  m.def("is_initialized", &IsInitialized);
  m.def("rank", [] { return ValueOrThrow(Rank()); });
  m.def("size", [] { return ValueOrThrow(Size()); });
  m.def("local_rank", [] { return ValueOrThrow(LocalRank()); });
  m.def("local_size", [] { return ValueOrThrow(LocalSize()); });
  m.def("cross_rank", [] { return ValueOrThrow(CrossRank()); });
  m.def("cross_size", [] { return ValueOrThrow(CrossSize()); });

  m.def("allreduce_async",
        [](const std::string& name, uintptr_t in_ptr, uintptr_t out_ptr, std::vector<int64_t> shape,
           const std::string& dtype, const std::string& op, double prescale, double postscale,
           const std::string& device, uintptr_t ready_event, py::object keepalive, int32_t process_set) {
          auto h = std::make_shared<Handle>();
          CollectiveRequest q = MakeAllreduce(name, in_ptr, out_ptr, std::move(shape), dtype, op, prescale,
                                              postscale, device, ready_event);
          q.process_set_id = process_set;
          return SubmitOne(std::move(q), h, std::move(keepalive));
        },
        py::arg("name"), py::arg("in_ptr"), py::arg("out_ptr"), py::arg("shape"), py::arg("dtype"),
        py::arg("op") = "sum", py::arg("prescale") = 1.0, py::arg("postscale") = 1.0,
        py::arg("device") = "cpu", py::arg("ready_event") = 0, py::arg("keepalive") = py::none(),
        py::arg("process_set") = 0);

  m.def("grouped_allreduce_async",
        [](const std::vector<py::tuple>& items, py::object keepalive, int32_t process_set) {
          // Each item: (name, in_ptr, out_ptr, shape, dtype[, op, prescale, postscale, device, ready_event]).
          std::vector<CollectiveRequest> qs;
          std::vector<std::shared_ptr<Handle>> hs;
          qs.reserve(items.size());
          hs.reserve(items.size());
          for (const py::tuple& t : items) {
            if (t.size() < 5 || t.size() > 10)
              throw EngineError("INVALID_ARGUMENT: grouped_allreduce_async items are (name, in_ptr, out_ptr, "
                                "shape, dtype[, op, prescale, postscale, device, ready_event])");
            auto get_s = [&](size_t i, const char* dflt) { return t.size() > i ? t[i].cast<std::string>() : std::string(dflt); };
            auto get_d = [&](size_t i) { return t.size() > i ? t[i].cast<double>() : 1.0; };
            qs.push_back(MakeAllreduce(t[0].cast<std::string>(), t[1].cast<uintptr_t>(), t[2].cast<uintptr_t>(),
                                       t[3].cast<std::vector<int64_t>>(), t[4].cast<std::string>(),
                                       get_s(5, "sum"), get_d(6), get_d(7), get_s(8, "cpu"),
                                       t.size() > 9 ? t[9].cast<uintptr_t>() : 0));
            hs.push_back(std::make_shared<Handle>());
            qs.back().process_set_id = process_set;
          }
          return SubmitGroup(std::move(qs), std::move(hs), std::move(keepalive));
        },
        py::arg("items"), py::arg("keepalive") = py::none(), py::arg("process_set") = 0);

  m.def("allgather_async",
        [](const std::string& name, uintptr_t in_ptr, std::vector<int64_t> shape, const std::string& dtype,
           const std::string& device, uintptr_t ready_event, py::object keepalive, int32_t process_set) {
          auto h = std::make_shared<Handle>();
          CollectiveRequest q = MakeAllocated(CollectiveType::kAllgather, name, in_ptr, std::move(shape), dtype,
                                              device, ready_event, process_set, h);
          return SubmitOne(std::move(q), h, std::move(keepalive));
        },
        py::arg("name"), py::arg("in_ptr"), py::arg("shape"), py::arg("dtype"), py::arg("device") = "cpu",
        py::arg("ready_event") = 0, py::arg("keepalive") = py::none(), py::arg("process_set") = 0);

  m.def("grouped_allgather_async",
        [](const std::vector<py::tuple>& items, py::object keepalive, int32_t process_set) {
          // Each item: (name, in_ptr, shape, dtype[, device, ready_event]).
          std::vector<CollectiveRequest> qs;
          std::vector<std::shared_ptr<Handle>> hs;
          qs.reserve(items.size());
          hs.reserve(items.size());
          for (const py::tuple& t : items) {
            if (t.size() < 4 || t.size() > 6)
              throw EngineError("INVALID_ARGUMENT: grouped_allgather_async items are (name, in_ptr, shape, dtype"
                                "[, device, ready_event])");
            hs.push_back(std::make_shared<Handle>());
            qs.push_back(MakeAllocated(CollectiveType::kAllgather, t[0].cast<std::string>(), t[1].cast<uintptr_t>(),
                                       t[2].cast<std::vector<int64_t>>(), t[3].cast<std::string>(),
                                       t.size() > 4 ? t[4].cast<std::string>() : std::string("cpu"),
                                       t.size() > 5 ? t[5].cast<uintptr_t>() : 0, process_set, hs.back()));
          }
          return SubmitGroup(std::move(qs), std::move(hs), std::move(keepalive));
        },
        py::arg("items"), py::arg("keepalive") = py::none(), py::arg("process_set") = 0);

  m.def("reducescatter_async",
        [](const std::string& name, uintptr_t in_ptr, std::vector<int64_t> shape, const std::string& dtype,
           const std::string& op, double prescale, double postscale, const std::string& device,
           uintptr_t ready_event, py::object keepalive, int32_t process_set) {
          auto h = std::make_shared<Handle>();
          CollectiveRequest q = MakeAllocated(CollectiveType::kReducescatter, name, in_ptr, std::move(shape), dtype,
                                              device, ready_event, process_set, h);
          q.op = ParseReduceOp(op);
          q.prescale_factor = prescale;
          q.postscale_factor = postscale;
          return SubmitOne(std::move(q), h, std::move(keepalive));
        },
        py::arg("name"), py::arg("in_ptr"), py::arg("shape"), py::arg("dtype"), py::arg("op") = "sum",
        py::arg("prescale") = 1.0, py::arg("postscale") = 1.0, py::arg("device") = "cpu",
        py::arg("ready_event") = 0, py::arg("keepalive") = py::none(), py::arg("process_set") = 0,
        "wait() returns this rank's rows (numpy on the CPU; (address, shape) on CUDA).");

  m.def("grouped_reducescatter_async",
        [](const std::vector<py::tuple>& items, const std::string& op, double prescale, double postscale,
           py::object keepalive, int32_t process_set) {
          // Each item: (name, in_ptr, shape, dtype[, device, ready_event]).
          std::vector<CollectiveRequest> qs;
          std::vector<std::shared_ptr<Handle>> hs;
          qs.reserve(items.size());
          hs.reserve(items.size());
          for (const py::tuple& t : items) {
            if (t.size() < 4 || t.size() > 6)
              throw EngineError("INVALID_ARGUMENT: grouped_reducescatter_async items are (name, in_ptr, shape, "
                                "dtype[, device, ready_event])");
            hs.push_back(std::make_shared<Handle>());
            qs.push_back(MakeAllocated(CollectiveType::kReducescatter, t[0].cast<std::string>(),
                                       t[1].cast<uintptr_t>(), t[2].cast<std::vector<int64_t>>(),
                                       t[3].cast<std::string>(),
                                       t.size() > 4 ? t[4].cast<std::string>() : std::string("cpu"),
                                       t.size() > 5 ? t[5].cast<uintptr_t>() : 0, process_set, hs.back()));
            qs.back().op = ParseReduceOp(op);
            qs.back().prescale_factor = prescale;
            qs.back().postscale_factor = postscale;
          }
          return SubmitGroup(std::move(qs), std::move(hs), std::move(keepalive));
        },
        py::arg("items"), py::arg("op") = "sum", py::arg("prescale") = 1.0, py::arg("postscale") = 1.0,
        py::arg("keepalive") = py::none(), py::arg("process_set") = 0);

  m.def("alltoall_async",
        [](const std::string& name, uintptr_t in_ptr, std::vector<int64_t> shape, const std::string& dtype,
           std::vector<int64_t> splits, const std::string& device, uintptr_t ready_event, py::object keepalive,
           int32_t process_set) {
          auto h = std::make_shared<Handle>();
          CollectiveRequest q = MakeAllocated(CollectiveType::kAlltoall, name, in_ptr, std::move(shape), dtype,
                                              device, ready_event, process_set, h);
          h->is_alltoall = true;
          q.splits = std::move(splits);
          q.received_splits = &h->received_splits;  // h outlives the request (held by its done callback)
          return SubmitOne(std::move(q), h, std::move(keepalive));
        },
        py::arg("name"), py::arg("in_ptr"), py::arg("shape"), py::arg("dtype"),
        py::arg("splits") = std::vector<int64_t>(), py::arg("device") = "cpu", py::arg("ready_event") = 0,
        py::arg("keepalive") = py::none(), py::arg("process_set") = 0,
        "wait() returns (output, received_splits).");

  m.def("join_async",
        [](int32_t process_set) {
          auto h = std::make_shared<Handle>();
          h->is_join = true;
          CollectiveRequest q;
          q.type = CollectiveType::kJoin;
          q.output = &h->join_result;  // h outlives the request (held by its done callback)
          q.process_set_id = process_set;
          return SubmitOne(std::move(q), h, py::none());
        },
        py::arg("process_set") = 0, "wait() returns the last rank to join.");

  m.def("add_process_set", [](const std::vector<int>& ranks) {
    StatusOr<int32_t> id = Status::Ok();
    {
      py::gil_scoped_release release;
      id = AddProcessSet(ranks);
    }
    return ValueOrThrow(std::move(id));
  }, py::arg("ranks"), "Collective over all ranks: registers a process set, returns its id.");
  m.def("remove_process_set", [](int32_t id) {
    Status s;
    {
      py::gil_scoped_release release;
      s = RemoveProcessSet(id);
    }
    ThrowIfError(s);
  }, py::arg("process_set_id"));
  m.def("process_set_ranks", [](int32_t id) { return ValueOrThrow(ProcessSetRanks(id)); });
  m.def("process_set_ids", &ProcessSetIds);
  m.def("process_set_rank", [](int32_t id) { return ValueOrThrow(ProcessSetRank(id)); });
  m.def("process_set_size", [](int32_t id) { return ValueOrThrow(ProcessSetSize(id)); });

  m.def("broadcast_async",
        [](const std::string& name, uintptr_t in_ptr, uintptr_t out_ptr, std::vector<int64_t> shape,
           const std::string& dtype, int root, const std::string& device, uintptr_t ready_event,
           py::object keepalive, int32_t process_set) {
          CollectiveRequest q;
          q.process_set_id = process_set;
          q.name = name;
          q.type = CollectiveType::kBroadcast;
          q.input = reinterpret_cast<const void*>(in_ptr);
          q.output = reinterpret_cast<void*>(out_ptr);
          q.shape = std::move(shape);
          q.dtype = ParseDataType(dtype);
          q.root_rank = root;
          q.device = ParseDevice(device);
          q.ready_event = reinterpret_cast<void*>(ready_event);
          return SubmitOne(std::move(q), std::make_shared<Handle>(), std::move(keepalive));
        },
        py::arg("name"), py::arg("in_ptr"), py::arg("out_ptr"), py::arg("shape"), py::arg("dtype"),
        py::arg("root"), py::arg("device") = "cpu", py::arg("ready_event") = 0,
        py::arg("keepalive") = py::none(), py::arg("process_set") = 0);

  m.def("stats", [] {
    EngineStats st = ValueOrThrow(GetEngineStats());
    py::dict d;
    d["cycles"] = st.cycles;
    d["negotiation_rounds"] = st.negotiation_rounds;
    d["cached_responses"] = st.cached_responses;
    d["negotiated_responses"] = st.negotiated_responses;
    d["plan_launches"] = st.plan_launches;
    d["buckets"] = st.buckets;
    d["bucket_tensors"] = st.bucket_tensors;
    d["ready_event_waits"] = st.ready_event_waits;
    d["agreement_allreduces"] = st.agreement_allreduces;
    d["quick_cycles"] = st.quick_cycles;
    d["queue_entries"] = st.queue_entries;
    d["admitted_entries"] = st.admitted_entries;
    d["cached_group_admissions"] = st.cached_group_admissions;
    d["cached_group_runs"] = st.cached_group_runs;
    d["cached_group_demotions"] = st.cached_group_demotions;
    d["groups_not_batched"] = st.groups_not_batched;
    d["lone_requests_not_batched"] = st.lone_requests_not_batched;
    d["idle_s"] = st.idle_s;
    d["agree_s"] = st.agree_s;
    d["negotiate_s"] = st.negotiate_s;
    d["execute_s"] = st.execute_s;
    d["admit_s"] = st.admit_s;
    d["lookup_s"] = st.lookup_s;
    d["complete_s"] = st.complete_s;
    return d;
  }, "Engine counters since init (nvgroup/engine.h EngineStats) as a dict.");
  m.def("wait", &Wait, py::arg("handle"), py::arg("timeout") = py::none(),
        "Blocks until the collective is done (GIL released). Returns None, or the allgather output "
        "(numpy array on the CPU; (address, shape) on CUDA). Raises EngineError on failure, "
        "TimeoutError if `timeout` seconds pass first (the handle stays valid).");
  m.def("wait_all", &WaitAll, py::arg("handles"),
        "Blocks until every collective is done (one GIL release). Returns the list of wait() results; "
        "raises EngineError for the first failure, after every handle was resolved.");
  m.def("poll", &Poll, py::arg("handle"));
  m.def("free_cuda", [](uintptr_t ptr) {
#ifdef NVGROUP_WITH_CUDA
    cudaError_t e = cudaFree(reinterpret_cast<void*>(ptr));
    if (e != cudaSuccess) throw EngineError(std::string("INTERNAL: cudaFree failed: ") + cudaGetErrorString(e));
#else
    (void)ptr;
    throw EngineError("UNIMPLEMENTED: free_cuda needs a CUDA build");
#endif
  }, py::arg("ptr"), "Frees a CUDA allgather output returned by wait().");

  py::module_ t = m.def_submodule("testing");
  RegisterTestingBindings(t);
}

}  // namespace nvgroup
