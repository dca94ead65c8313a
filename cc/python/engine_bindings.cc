// Python bindings of the engine (nvgroup/engine.h): init/shutdown/topology,
// the asynchronous collectives on raw addresses (numpy `a.ctypes.data`, cupy
// `a.data.ptr`) returning the handles of cc/python/engine_handles.h, process
// sets, statistics, and the `testing` submodule
// (cc/python/engine_testing_bindings.cc).
//
// Errors: a non-OK Status raises EngineError (cc/python/engine_arguments.h).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#ifdef NVGROUP_WITH_CUDA
#include <cuda_runtime.h>
#endif

#include "nvgroup/engine.h"
#include "python/engine_arguments.h"
#include "python/engine_handles.h"

namespace py = pybind11;

namespace nvgroup {

void RegisterEngineTestingBindings(py::module_& t);  // cc/python/engine_testing_bindings.cc
// cc/python/registered_group_bindings.cc
void RegisterRegisteredGroupBindings(py::module_& m, py::module_& t);

namespace {

// Note [A group item's common form]
// grouped_allreduce_async's items are nearly always (name: str, in_ptr: int,
// out_ptr: int, shape: list or tuple of ints, dtype: str), and converting them
// through pybind11's generic casters (an accessor and a reference count per
// field, a std::string per text field, then parsing the defaults "sum" and
// "cpu") cost about 1 us per item on the 2-core VM: a third of a ResNet-50
// step's engine overhead (214 items). Such an item is read here straight from
// the tuple with the defaults of the generic path; false (and no Python error
// left set) for anything else, which then goes through the generic casters,
// so every other form, and every error, is what it was. allreduce_async's
// call of the same five arguments, positional, goes the same way (Note [A
// call's common form] below).
bool ReadCommonAllreduceFields(PyObject* name, PyObject* in, PyObject* out, PyObject* shape, PyObject* dtype,
                               CollectiveRequest* q) {
  if (!PyUnicode_CheckExact(name) || !PyLong_CheckExact(in) || !PyLong_CheckExact(out) ||
      !PyUnicode_CheckExact(dtype) || !(PyList_CheckExact(shape) || PyTuple_CheckExact(shape)))
    return false;
  Py_ssize_t name_len = 0, dtype_len = 0;
  const char* name_chars = PyUnicode_AsUTF8AndSize(name, &name_len);
  const char* dtype_chars = name_chars == nullptr ? nullptr : PyUnicode_AsUTF8AndSize(dtype, &dtype_len);
  const unsigned long long in_ptr = PyLong_AsUnsignedLongLong(in);
  const unsigned long long out_ptr = PyErr_Occurred() ? 0 : PyLong_AsUnsignedLongLong(out);
  if (name_chars == nullptr || dtype_chars == nullptr || PyErr_Occurred()) {
    PyErr_Clear();
    return false;
  }
  const Py_ssize_t rank = PySequence_Fast_GET_SIZE(shape);  // a list or a tuple: no copy
  PyObject** dims = PySequence_Fast_ITEMS(shape);
  std::vector<int64_t> dims_out(static_cast<size_t>(rank));
  for (Py_ssize_t i = 0; i < rank; ++i) {
    if (!PyLong_CheckExact(dims[i])) return false;
    dims_out[i] = PyLong_AsLongLong(dims[i]);
  }
  if (PyErr_Occurred()) {
    PyErr_Clear();
    return false;
  }
  *q = AllreduceRequest(std::string(name_chars, static_cast<size_t>(name_len)),
                        static_cast<uintptr_t>(in_ptr), static_cast<uintptr_t>(out_ptr), std::move(dims_out),
                        ParseDataType(std::string(dtype_chars, static_cast<size_t>(dtype_len))),
                        ReduceOp::kSum, 1.0, 1.0, Device::Cpu(), 0);
  return true;
}

bool ReadCommonAllreduceItem(const py::tuple& t, CollectiveRequest* q) {
  PyObject* item = t.ptr();
  if (PyTuple_GET_SIZE(item) != 5) return false;
  return ReadCommonAllreduceFields(PyTuple_GET_ITEM(item, 0), PyTuple_GET_ITEM(item, 1),
                                   PyTuple_GET_ITEM(item, 2), PyTuple_GET_ITEM(item, 3),
                                   PyTuple_GET_ITEM(item, 4), q);
}

}  // namespace

void RegisterEngineBindings(py::module_& m) {
  py::register_exception<EngineError>(m, "EngineError", PyExc_RuntimeError);

  m.def("init",
        [](int64_t comm_f) {
    EngineOptions options;
    options.mpi_comm_fortran = comm_f;
    Status s;
    {
      py::gil_scoped_release release;
      s = Init(options);
    }
    ThrowIfError(s);
  }, py::arg("comm_f") = -1,
        "Collective: starts the engine over the MPI communicator (Fortran handle; -1 = COMM_WORLD).");
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

  // Note [A call's common form]
  // A per-tensor caller submits one allreduce_async per gradient, nearly
  // always with the five positional arguments (name, in_ptr, out_ptr, shape,
  // dtype). The first overload takes exactly that form: pybind11 hands over
  // the five objects without converting them (a type check each), and the
  // request is read as a group item's (Note [A group item's common form]);
  // the generic casters of the twelve parameters and the parsing of the
  // defaults "sum" and "cpu" cost 0.5-1 us per call on the 2-core VM. Any
  // other call (keywords, more arguments, a tuple shape) goes to the second
  // overload, as before; a five-argument call whose fields are not the
  // common types (a dimension that is not an int) is converted by the
  // generic casters in the first, which raise as a grouped item's do.
  m.def("allreduce_async",
        [](const py::str& name, const py::int_& in_ptr, const py::int_& out_ptr, const py::list& shape,
           const py::str& dtype) {
    auto h = std::make_shared<Handle>();
    CollectiveRequest q;
    if (!ReadCommonAllreduceFields(name.ptr(), in_ptr.ptr(), out_ptr.ptr(), shape.ptr(), dtype.ptr(), &q))
      q = MakeAllreduce(name.cast<std::string>(), in_ptr.cast<uintptr_t>(), out_ptr.cast<uintptr_t>(),
                        shape.cast<std::vector<int64_t>>(), dtype.cast<std::string>(), "sum", 1.0, 1.0, "cpu",
                        0);
    return SubmitOne(std::move(q), h, py::none());
  },
        py::arg("name"), py::arg("in_ptr"), py::arg("out_ptr"), py::arg("shape"), py::arg("dtype"));
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
        throw EngineError(
            "INVALID_ARGUMENT: grouped_allreduce_async items are (name, in_ptr, out_ptr, "
            "shape, dtype[, op, prescale, postscale, device, ready_event])");
      hs.push_back(std::make_shared<Handle>());
      if (ReadCommonAllreduceItem(t, &qs.emplace_back())) {  // Note [A group item's common form]
        qs.back().process_set_id = process_set;
        continue;
      }
      qs.pop_back();
      auto get_s = [&](size_t i, const char* dflt) {
        return t.size() > i ? t[i].cast<std::string>() : std::string(dflt);
      };
      auto get_d = [&](size_t i) { return t.size() > i ? t[i].cast<double>() : 1.0; };
      qs.push_back(MakeAllreduce(t[0].cast<std::string>(), t[1].cast<uintptr_t>(), t[2].cast<uintptr_t>(),
                                 t[3].cast<std::vector<int64_t>>(), t[4].cast<std::string>(), get_s(5, "sum"),
                                 get_d(6), get_d(7), get_s(8, "cpu"),
                                 t.size() > 9 ? t[9].cast<uintptr_t>() : 0));
      qs.back().process_set_id = process_set;
    }
    return SubmitGroup(std::move(qs), std::move(hs), std::move(keepalive));
  }, py::arg("items"), py::arg("keepalive") = py::none(), py::arg("process_set") = 0);

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
        throw EngineError(
            "INVALID_ARGUMENT: grouped_allgather_async items are (name, in_ptr, shape, dtype"
            "[, device, ready_event])");
      hs.push_back(std::make_shared<Handle>());
      qs.push_back(MakeAllocated(CollectiveType::kAllgather, t[0].cast<std::string>(), t[1].cast<uintptr_t>(),
                                 t[2].cast<std::vector<int64_t>>(), t[3].cast<std::string>(),
                                 t.size() > 4 ? t[4].cast<std::string>() : std::string("cpu"),
                                 t.size() > 5 ? t[5].cast<uintptr_t>() : 0, process_set, hs.back()));
    }
    return SubmitGroup(std::move(qs), std::move(hs), std::move(keepalive));
  }, py::arg("items"), py::arg("keepalive") = py::none(), py::arg("process_set") = 0);

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
        throw EngineError(
            "INVALID_ARGUMENT: grouped_reducescatter_async items are (name, in_ptr, shape, "
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
           std::vector<int64_t> splits, const std::string& device, uintptr_t ready_event,
           py::object keepalive, int32_t process_set) {
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

  m.def("join_async", [](int32_t process_set) {
    auto h = std::make_shared<Handle>();
    h->is_join = true;
    CollectiveRequest q;
    q.type = CollectiveType::kJoin;
    q.output = &h->join_result;  // h outlives the request (held by its done callback)
    q.process_set_id = process_set;
    return SubmitOne(std::move(q), h, py::none());
  }, py::arg("process_set") = 0, "wait() returns the last rank to join.");

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
    d["bursts_ended_at_size"] = st.bursts_ended_at_size;
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
    if (e != cudaSuccess)
      throw EngineError(std::string("INTERNAL: cudaFree failed: ") + cudaGetErrorString(e));
#else
    (void)ptr;
    throw EngineError("UNIMPLEMENTED: free_cuda needs a CUDA build");
#endif
  }, py::arg("ptr"), "Frees a CUDA allgather output returned by wait().");

  py::module_ t = m.def_submodule("testing");
  RegisterEngineTestingBindings(t);
  RegisterRegisteredGroupBindings(m, t);
}

}  // namespace nvgroup
