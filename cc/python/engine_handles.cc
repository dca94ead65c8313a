#include "python/engine_handles.h"

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <unordered_map>
#include <utility>

#ifdef NVGROUP_WITH_CUDA
#include <cuda_runtime.h>
#endif

#include "python/engine_arguments.h"

namespace py = pybind11;

namespace nvgroup {
namespace {

// Objects the caller asked us to keep alive until wait() (its arrays), by
// handle id. A Python dict, touched only with the GIL held (a Handle may die
// on the background thread, so it holds no Python object); leaked on purpose
// so no Python object is destroyed after the interpreter.
py::dict& KeepAlive() {
  static py::dict* d = new py::dict();
  return *d;
}

std::atomic<int> g_refused_allocations{0};  // RefuseOutputAllocationsForTesting
// AnnounceCompletionEventsForTesting: whether requests carry a
// completion_event_ready, and what it heard.
std::atomic<bool> g_announce_events{false};
std::atomic<int64_t> g_events_heard{0};
std::atomic<int64_t> g_events_after_done{0};

// completion_event_ready for handle `h` when announcing: counts the event, and
// counts it as out of order if `done` already ran (the engine announces the
// event before it runs `done`).
std::function<void(void*)> EventListenerFor(const std::shared_ptr<Handle>& h) {
  if (!g_announce_events.load(std::memory_order_relaxed)) return nullptr;
  return [h](void* event) {
    bool after_done;
    {
      std::lock_guard<std::mutex> lock(h->mu);
      after_done = h->done;
    }
    if (event == nullptr || after_done) g_events_after_done.fetch_add(1, std::memory_order_relaxed);
    g_events_heard.fetch_add(1, std::memory_order_relaxed);
  };
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
  if (it == g_handles.end())
    throw EngineError("INVALID_ARGUMENT: unknown or already waited handle " + std::to_string(id));
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
    int refused = g_refused_allocations.load(std::memory_order_relaxed);
    while (refused > 0 && !g_refused_allocations.compare_exchange_weak(refused, refused - 1)) {
    }
    if (refused > 0)
      return Status::Internal("the output allocation was refused (testing.refuse_output_allocations)");
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
      return Status::Internal(std::string("cudaMalloc of the allgather output failed: ") +
                              cudaGetErrorString(e));
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
  py::capsule free_when_done(owner,
                             [](void* p) { delete static_cast<std::shared_ptr<std::vector<char>>*>(p); });
  py::dtype dt = py::dtype::from_args(NumpyDtype(h.dtype));
  std::vector<py::ssize_t> shape(h.out_shape.begin(), h.out_shape.end());
  return py::array(dt, shape, h.host_out->data(), free_when_done);
}

}  // namespace

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
    PyErr_SetString(PyExc_TimeoutError,
                    ("collective handle " + std::to_string(id) + " is still in flight").c_str());
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

// One release of the GIL for all handles (a step's 214 gradients cost one
// call instead of 214), then resolved in order like wait():
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
CollectiveRequest MakeAllocated(CollectiveType type, const std::string& name, uintptr_t in,
                                std::vector<int64_t> shape, const std::string& dtype,
                                const std::string& device, uintptr_t ready_event, int32_t process_set,
                                const std::shared_ptr<Handle>& h) {
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
  for (size_t i = 0; i < qs.size(); ++i) {
    qs[i].done = DoneFor(hs[i]);
    qs[i].completion_event_ready = EventListenerFor(hs[i]);
  }
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
  q.completion_event_ready = EventListenerFor(h);
  // The GIL stays held: Enqueue only validates and appends under a mutex that
  // no thread holds for long (releasing and retaking the GIL cost more than
  // the call), and done callbacks never take the GIL.
  ThrowIfError(Enqueue(std::move(q)));
  const int64_t id = Register(std::move(h));
  if (!keepalive.is_none()) KeepAlive()[py::int_(id)] = keepalive;
  return id;
}

int64_t SubmitRegistered(uint64_t group, GroupLaunch launch, py::object keepalive) {
  auto h = std::make_shared<Handle>();
  launch.done = DoneFor(h);
  launch.completion_event_ready = EventListenerFor(h);
  ThrowIfError(EnqueueRegisteredGroup(group, std::move(launch)));  // GIL held: see SubmitOne
  const int64_t id = Register(std::move(h));
  if (!keepalive.is_none()) KeepAlive()[py::int_(id)] = keepalive;
  return id;
}

void RefuseOutputAllocationsForTesting(int count) {
  g_refused_allocations.store(count > 0 ? count : 0, std::memory_order_relaxed);
}

void AnnounceCompletionEventsForTesting(bool on) {
  g_announce_events.store(on, std::memory_order_relaxed);
  g_events_heard.store(0, std::memory_order_relaxed);
  g_events_after_done.store(0, std::memory_order_relaxed);
}

std::pair<int64_t, int64_t> CompletionEventsHeardForTesting() {
  return {g_events_heard.load(std::memory_order_relaxed),
          g_events_after_done.load(std::memory_order_relaxed)};
}

}  // namespace nvgroup
