// Python bindings of registered groups (RegisterGroup, EnqueueRegisteredGroup,
// UnregisterGroup in nvgroup/engine.h), and testing.group_step_times, a C++
// loop of whole steps that times EnqueueGroup against a registered group's
// launch without Python in between (benchmarks/registered_group_bench.py).
//
// Errors: a non-OK Status raises EngineError (cc/python/engine_arguments.h).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "nvgroup/engine.h"
#include "python/engine_arguments.h"
#include "python/engine_handles.h"

namespace py = pybind11;

namespace nvgroup {
namespace {

using Pointers = py::array_t<uint64_t, py::array::c_style | py::array::forcecast>;

// A launch's addresses from Python: integers only (a numpy array of an
// integer dtype, or a list of ints), none negative, as uint64 (read in place
// when they are uint64 already). Floats, bools and other objects are refused
// rather than truncated into addresses.
Pointers AddressesOf(const py::object& given, const char* what) {
  py::array a = py::array::ensure(given);
  const char kind = a ? a.dtype().kind() : '?';
  if (kind != 'i' && kind != 'u')
    throw EngineError(std::string("INVALID_ARGUMENT: ") + what +
                      " must hold integer addresses (a list of ints or an integer numpy array), got " +
                      std::string(a ? py::str(a.dtype()) : py::str(py::type::of(given))));
  if (kind == 'i' && a.size() > 0 && py::module_::import("numpy").attr("min")(a).cast<int64_t>() < 0)
    throw EngineError(std::string("INVALID_ARGUMENT: ") + what + " holds a negative address");
  return Pointers::ensure(a);
}

// The pointer arrays of one launch: `inputs` and `outputs` as uint64 arrays.
GroupLaunch LaunchOf(const Pointers& inputs, const Pointers& outputs, uintptr_t ready_event) {
  if (inputs.ndim() != 1 || outputs.ndim() != 1 || inputs.shape(0) != outputs.shape(0))
    throw EngineError("INVALID_ARGUMENT: in_ptrs and out_ptrs must be 1-d and of one length");
  GroupLaunch launch;
  static_assert(sizeof(uint64_t) == sizeof(void*), "addresses travel as uint64");
  launch.inputs = reinterpret_cast<const void* const*>(inputs.data());
  launch.outputs = reinterpret_cast<void* const*>(outputs.data());
  launch.count = static_cast<size_t>(inputs.shape(0));
  launch.ready_event = reinterpret_cast<void*>(ready_event);
  return launch;
}

// One step of `style` over the gradient buffers, as a framework's adapter
// submits it (cc/tools/engine_perf.cc's requests): "grouped" builds every
// member's request and calls EnqueueGroup, "registered" launches `group`.
// Returns once every member completed (seconds).
struct StepHarness {
  std::mutex mu;
  std::condition_variable cv;
  size_t pending = 0;
  Status first_error;

  void Finished(const Status& s, size_t members) {
    std::lock_guard<std::mutex> lock(mu);
    if (!s.ok() && first_error.ok()) first_error = s;
    pending -= members;
    if (pending == 0) cv.notify_all();
  }
  Status Wait() {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return pending == 0; });
    return first_error;
  }
};

}  // namespace

void RegisterRegisteredGroupBindings(py::module_& m, py::module_& t) {
  m.def("register_allreduce_group",
        [](const std::vector<py::tuple>& items, int32_t process_set) {
    // Each item: (name, shape, dtype[, op, prescale, postscale, device]).
    std::vector<CollectiveRequest> members;
    members.reserve(items.size());
    for (const py::tuple& item : items) {
      if (item.size() < 3 || item.size() > 7)
        throw EngineError(
            "INVALID_ARGUMENT: register_allreduce_group items are (name, shape, dtype[, op, "
            "prescale, postscale, device])");
      auto text = [&](size_t i, const char* dflt) {
        return item.size() > i ? item[i].cast<std::string>() : std::string(dflt);
      };
      auto number = [&](size_t i) { return item.size() > i ? item[i].cast<double>() : 1.0; };
      members.push_back(MakeAllreduce(item[0].cast<std::string>(), 0, 0, item[1].cast<std::vector<int64_t>>(),
                                      item[2].cast<std::string>(), text(3, "sum"), number(4), number(5),
                                      text(6, "cpu"), 0));
      members.back().process_set_id = process_set;
    }
    return ValueOrThrow(RegisterGroup(std::move(members)));
  }, py::arg("items"), py::arg("process_set") = 0,
        "Registers a grouped allreduce (pointers come with each launch); returns the group's handle.");
  m.def("registered_group_allreduce_async",
        [](uint64_t group, const py::object& in_ptrs, const py::object& out_ptrs, uintptr_t ready_event,
           py::object keepalive) {
    const Pointers in = AddressesOf(in_ptrs, "in_ptrs"), out = AddressesOf(out_ptrs, "out_ptrs");
    return SubmitRegistered(group, LaunchOf(in, out, ready_event), std::move(keepalive));
  },
        py::arg("group"), py::arg("in_ptrs"), py::arg("out_ptrs"), py::arg("ready_event") = 0,
        py::arg("keepalive") = py::none(),
        "One launch of a registered group: one pointer per member (uint64 arrays or lists), in "
        "registration order. Returns one handle for the whole group.");
  m.def("unregister_group", [](uint64_t group) { ThrowIfError(UnregisterGroup(group)); }, py::arg("group"));

  t.def("group_step_times",
        [](const std::string& style, const Pointers& in_ptrs, const Pointers& out_ptrs,
           const std::vector<int64_t>& counts, const std::string& prefix, uint64_t group, int steps) {
    // Average allreduces of float32 host buffers named prefix + index,
    // submitted in reverse order (as backprop produces them), like
    // cc/tools/engine_perf.cc. `group`: the registered group of the same
    // members in that order (style "registered").
    const bool registered = style == "registered";
    if (!registered && style != "grouped")
      throw EngineError("INVALID_ARGUMENT: group_step_times style is grouped or registered");
    const size_t n = counts.size();
    GroupLaunch shape_check = LaunchOf(in_ptrs, out_ptrs, 0);
    if (shape_check.count != n) throw EngineError("INVALID_ARGUMENT: one pointer per count");
    const uint64_t* in = in_ptrs.data();
    const uint64_t* out = out_ptrs.data();
    std::vector<double> times;
    StepHarness h;
    {
      py::gil_scoped_release release;
      std::vector<const void*> launch_in(n);
      std::vector<void*> launch_out(n);
      for (size_t k = 0; k < n; ++k) {  // the registered order: reverse
        launch_in[k] = reinterpret_cast<const void*>(in[n - 1 - k]);
        launch_out[k] = reinterpret_cast<void*>(out[n - 1 - k]);
      }
      for (int i = 0; i < steps; ++i) {
        const auto t0 = std::chrono::steady_clock::now();
        h.pending = n;
        Status s;
        if (registered) {
          GroupLaunch launch;
          launch.inputs = launch_in.data();
          launch.outputs = launch_out.data();
          launch.count = n;
          launch.done = [&h, n](const Status& st) { h.Finished(st, n); };
          s = EnqueueRegisteredGroup(group, std::move(launch));
        } else {
          std::vector<CollectiveRequest> qs;
          qs.reserve(n);
          for (size_t k = n; k-- > 0;) {
            CollectiveRequest q;
            q.name = prefix + std::to_string(k);
            q.type = CollectiveType::kAllreduce;
            q.dtype = DataType::kFloat32;
            q.shape = {counts[k]};
            q.input = reinterpret_cast<const void*>(in[k]);
            q.output = reinterpret_cast<void*>(out[k]);
            q.op = ReduceOp::kAverage;
            q.done = [&h](const Status& st) { h.Finished(st, 1); };
            qs.push_back(std::move(q));
          }
          s = EnqueueGroup(std::move(qs));
        }
        if (s.ok()) s = h.Wait();
        if (!s.ok()) {
          py::gil_scoped_acquire acquire;
          ThrowIfError(s);
        }
        times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      }
    }
    return times;
  },
        py::arg("style"), py::arg("in_ptrs"), py::arg("out_ptrs"), py::arg("counts"), py::arg("prefix"),
        py::arg("group") = 0, py::arg("steps") = 1,
        "Seconds per step of `steps` whole steps (submit -> every member done) of Average float32 "
        "allreduces named prefix+index, one EnqueueGroup (`grouped`) or one launch of `group` "
        "(`registered`).");
}

}  // namespace nvgroup
