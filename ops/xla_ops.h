// XLA lowerings of the collectives: the part shared by the lowering
// (xla_lowering.cc), the custom call's codec (xla_call_codec.cc) and the host
// (xla_host_handlers.cc) and CUDA (xla_ops_gpu.cc) custom-call handlers
// (what both handlers share: xla_handler_common.cc).
//
// How it works. When TensorFlow compiles a function with XLA (jit_compile=True,
// Keras' jit_compile), each Nvgroup* op below is lowered by a tf2xla kernel
// (xla_lowering.cc) into one XLA custom call, API_VERSION_TYPED_FFI, target
// kXlaTarget, with side effects (never removed, merged or duplicated). Its
// operands are the op's data inputs (and the ordering operand, "Order"
// below), its results the op's data outputs (a tuple for the grouped ops);
// XLA chooses the buffers. The call's attributes
// (an MLIR dictionary in backend_config, built by XlaAttributes) carry
// everything the TF kernel reads from its attrs: the engine name (the same name
// the non-XLA kernel uses, so negotiation by name, the response cache and
// fusion work as without XLA), the collective kind, the reduce op, the scale
// factors, the broadcast root, the process set, alltoall's splits.
//
// Note [Start and done]
// A collective lowers to one custom call (kXlaTarget) or to a pair, as
// NVGROUP_XLA_START_DONE says (auto, the default: the pair in a program
// compiled for a GPU, one call on the CPU; Note [The pair on a GPU]):
//   start = custom-call(inputs..., order) -> (results..., token u8[1])
//           target kXlaStartTarget, SCHEDULE_EARLIEST, side effect
//   done  = custom-call(start.results..., inputs...) -> results
//           target kXlaDoneTarget, SCHEDULE_LATEST, result i aliasing operand i
// XLA's GPU scheduler puts a SCHEDULE_EARLIEST call as soon as its operands
// exist and a SCHEDULE_LATEST call just before its first user (XLA's
// gpu_hlo_schedule.cc; its test GpuHloScheduleTest.AsyncCustomCall), so the
// independent work of the program -- the rest of backprop, for a gradient
// bucket -- lands between them. The start submits the requests to the engine
// and returns at once; the done returns once the result is (CUDA: will be,
// in stream order) in the results. Why this is correct:
//  * Buffers. The engine reads the inputs and writes the results while XLA
//    runs other work. Both stay allocated until the done ran: the results are
//    the start's, handed to the done, which returns them in place; the
//    inputs are operands of the done too, which only keeps them live (XLA
//    reuses a buffer only after its last user). No other instruction uses the
//    start's results.
//  * Pairing. The start files its state under the collective's engine name
//    (PairCalls); the done takes it back. One name is in flight once (the
//    engine refuses a second request of a name in flight), so the name finds
//    the one start.
//  * Order. Starts never wait for other ranks; a done waits only for its own
//    collective. The starts of one XLA computation are chained (the "Order"
//    below, through the start's token), so every rank submits them in one
//    order, and a done is never scheduled before its own start. A done that
//    waits for collective k waits for ranks to *start* k; a rank that has not
//    started k is at an earlier point of the same chain of starts, waiting in
//    a done of an earlier collective j < k (or running), whose start every
//    rank that started k has made: the lowest collective anyone waits for has
//    been started everywhere and completes, so the ranks never wait for each
//    other in a cycle. The single-call lowering is a start and its done at
//    one place of the same chain, so both lowerings mix.
//  * Errors. An error known before the done returns (a mismatch, a dead peer,
//    a failed enqueue) fails the done on every rank, as the single call
//    does. A start the engine refuses fails at once.
//
// Note [The pair on a GPU]
// The pair is the default on a GPU (NVGROUP_XLA_START_DONE=auto). What has
// run on a GPU (logs under benchmarks/results/):
//  * With a zero-element order token (u8[0], op library of 5073c64, one
//    H200, device_checks_h200x1_28ebcca/) the chain of starts did not exist
//    in the compiled program: XLA's ZeroSizedHloElimination replaces every
//    side-effect-free instruction of zero-element shape -- the
//    get-tuple-element of a start's token -- by a constant, so every start
//    took the same constant and XLA ordered the starts as it liked, by rank
//    where the HLO differs by rank. tests/tf/workers/xla.py then stalled at
//    2 ranks (rank 0 had submitted only 'g.ag.xla/grad_sizes', rank 1
//    'g.ar.xla' and 'g.ag.xla'). Hence the one-element token ("Order" below)
//    and the worker's check of the chain in the optimized HLO.
//  * With the one-element token (f0fe6e2, one H100,
//    device_checks_h100x1_f0fe6e2/) the worker passes at 2 ranks sharing the
//    GPU, and Keras ResNet-50 224x224 on one rank overlaps: with a simulated
//    link of 2000 us per bucket the pair exposed 0.22 (fp32) and 0.20 (mixed)
//    of the added link time, the single call 1.0.
//  * As the default (f248d3f, one H100, device_checks_h100x1_f248d3f/): the
//    worker's collectives, errors and fit at 2 ranks as groups of 1 (231
//    checks each, 0 failures); ResNet-50 224x224 at 2 ranks under MPS as one
//    NV-group, which with the u8[0] token had failed in its first steps with
//    "NV-group barrier timed out" on both ranks, trains (exposed 0.08 of a
//    simulated 2000 us per bucket, the single call 0.90); on one rank 0.19 in
//    fp32 and in mixed precision, the single call 1.11 / 0.95.
//
// Done after. SCHEDULE_LATEST puts a done just before its first user, and
// XLA's memory scheduler puts the optimizer update of a bucket's variables
// right after that bucket's gradients (it frees them): measured on one H200
// (benchmarks/xla_overlap_bench.py, Keras ResNet-50), every done sat right
// after its start with only the results' get-tuple-elements between, so
// nothing overlapped. The gradient path therefore lowers through
// NvgroupXlaGroupedAllreduce (ops/nvgroup_ops.cc), whose trailing
// `done_after` inputs are operands of the done only (the handlers skip
// them): nvgroup_tf/gradient_reducer.py passes every other bucket's
// gradients, so no done can run before the last gradient of backprop exists
// and the backprop work after a bucket's gradients lies between its start and
// done. The single call ignores them (as operands they would hold it back).
//
// Order. Each single-call handler blocks its XLA thread at least until every
// rank has submitted its collective (the host handler until it completed; the
// CUDA handler until the engine enqueued it, xla_ops_gpu.cc), and a done waits
// for its collective (Note [Start and done]), so the ranks must submit their
// collectives in one order. XLA
// orders independent side-effecting calls as it likes, and the HLO may differ
// by rank (the allgather gradient slices at a rank-dependent offset): two ranks
// could enter two collectives in opposite orders and wait for each other for
// ever. So every collective call and every start returns, as its last result,
// an *order token* (u8[kOrderTokenElements], never written or read), and
// takes, as an extra last operand that the handlers skip, the order token of
// the previous collective call lowered into the same XLA computation
// (xla_lowering.cc CollectiveOrder; an empty u8[0] constant for the first): a
// data dependency XLA must respect. The token has an element because XLA
// removes zero-element values that have no side effect (ZeroSizedHloElimination
// turns them into constants), which cut the chain of an earlier u8[0] token
// (Note [The pair on a GPU]); a result of the call itself would not do
// either, as a collective's result may be empty. tf2xla lowers a graph's ops
// in a topological order broken by node names (graph_compiler.cc,
// GetReversePostOrder with NodeComparatorName), the same on every rank, so
// every rank's chain is the same sequence of collectives.
//
// Lowered: NvgroupAllreduce, NvgroupGroupedAllreduce, NvgroupAllgather,
// NvgroupGroupedAllgather, NvgroupBroadcast (and so broadcast_, which assigns
// its result), NvgroupReducescatter, NvgroupGroupedReducescatter,
// NvgroupAlltoall (splits a compile-time constant). Not lowered (TF then fails
// the jit_compile=True function naming the op): NvgroupJoin.
//
// At run time XLA calls the handler registered for its platform ("Host",
// "CUDA") with the buffers; the handler turns them into engine requests
// (DecodeCall) and waits for them (host: EnqueueAndWait, nvgroup/engine.h;
// CUDA: until XLA's stream waits on the engine's completion event, or with
// NVGROUP_XLA_CUDA_WAIT=host until done, xla_ops_gpu.cc). The engine bounds
// that wait (NVGROUP_TIMEOUT, dead-rank detection), and every
// engine error returns from the handler as an ffi::Error with the same code, so
// XLA's program fails with TensorFlow's usual error class (UnavailableError for
// a dead peer, FailedPreconditionError for a cross-rank mismatch) on every rank.
//
// Static shapes. XLA needs every result shape at compile time:
//  * reducescatter: this rank's rows of Horovod's split (ReducescatterRows)
//    of the input's first dimension, from this rank's place in the process set;
//  * allgather: the sum of the ranks' first dimensions, which the tf2xla
//    kernel allgathers once, when the program is compiled (a collective named
//    "<name>/xla_rows", grouped: "<name>[i]/xla_rows");
//  * alltoall: the rows every rank sends here, which the tf2xla kernel learns
//    by allgathering every rank's splits at compile time ("<name>/xla_splits");
//    the splits must therefore be a compile-time constant.
// At run time the engine's negotiated result shape (and alltoall's received
// splits) is checked against the compiled one, so a rank whose input changed
// after the others compiled fails on every rank instead of writing past the
// buffer.
#pragma once

#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "nvgroup/engine.h"
#include "nvgroup/status.h"
#include "nvgroup/types.h"
#include "xla/ffi/api/ffi.h"

namespace nvgroup {
namespace xla_adapter {

namespace ffi = ::xla::ffi;

// The one custom-call target; the handler for each platform is registered
// under this name.
constexpr const char* kXlaTarget = "nvgroup_collective";
// Host only: the asynchronous handler (xla_host_handlers.cc), used when NVGROUP_XLA_ASYNC=1
// at compile time. The CUDA handler is registered under both names.
constexpr const char* kXlaAsyncTarget = "nvgroup_collective_async";
// The pair (Note [Start and done]), for every platform.
constexpr const char* kXlaStartTarget = "nvgroup_collective_start";
constexpr const char* kXlaDoneTarget = "nvgroup_collective_done";
// Elements of the order token ("Order" above): not zero, or XLA folds it away.
constexpr int64_t kOrderTokenElements = 1;

// What the custom call's attributes say (XlaAttributes writes them at
// lowering; the handlers get them back through DecodeCall).
struct CallAttributes {
  std::string name;  // engine name (grouped: member i is "<name>[i]")
  CollectiveType type = CollectiveType::kAllreduce;
  bool grouped = false;  // one request per operand, "<name>[i]"
  ReduceOp op = ReduceOp::kSum;
  double prescale_factor = 1.0;
  double postscale_factor = 1.0;
  int root_rank = 0;
  int32_t process_set_id = 0;
  // Alltoall only: the splits as the op got them (empty = even split), and the
  // rows this rank receives from each rank, agreed when the program was
  // compiled (xla_lowering.cc, "Alltoall"); the run checks the engine's against them.
  std::vector<int64_t> splits;
  std::vector<int64_t> received_splits;
};

// The attributes as the custom call carries them: XLA's FFI decodes the call's
// attribute dictionary into this struct (XLA_FFI_REGISTER_STRUCT_ATTR_DECODING
// below), for every handler alike; DecodeCall checks and converts it.
struct WireAttributes {
  std::string_view name;
  int64_t type;
  int64_t grouped;
  int64_t op;
  double prescale;
  double postscale;
  int64_t root;
  int64_t process_set;
  ffi::Span<const int64_t> splits;
  ffi::Span<const int64_t> received;
};

// The MLIR dictionary text of `attributes` (backend_config of the custom call).
std::string XlaAttributes(const CallAttributes& attributes);

// The handlers' shared first step: decodes `wire` and builds one engine
// request per (argument, result) pair; device and ready_event are left to the
// caller. The last result is the order token (not data; "Order" above).
// Fails on attributes or buffers the engine cannot take.
Status DecodeCall(const WireAttributes& wire, ffi::RemainingArgs args, ffi::RemainingRets rets,
                  std::vector<CollectiveRequest>* requests);

// A done's buffers: operand i (the start's result i) and result i, which XLA
// normally makes the same buffer (the alias the lowering asks for); where it
// did not, the done copies `from` into `to`.
struct DoneBuffer {
  const void* from;
  void* to;
  size_t bytes;
};
// Decodes a done call: its collective's engine name (the pairing key) and its
// buffers. Operands: n results of the start, then the n inputs; n results.
Status DecodeDone(const WireAttributes& wire, ffi::RemainingArgs args, ffi::RemainingRets rets,
                  std::string* name, std::vector<DoneBuffer>* buffers);

// What a start leaves for its done (each platform's state derives from it).
struct PairCall {
  virtual ~PairCall() = default;
  // Every engine request of the call has completed (its `done` ran).
  virtual bool Finished() = 0;
};

// The starts whose done has not run, by engine name (Note [Start and done]).
class PairCalls {
 public:
  // Files `call` under `name`. A call left under that name by a program that
  // failed between its start and done is replaced once its requests finished;
  // one still running makes this kFailedPrecondition (two collectives of one
  // name in flight).
  static Status Put(const std::string& name, std::shared_ptr<PairCall> call);
  // Takes the call filed under `name`, or nullptr.
  static std::shared_ptr<PairCall> Take(const std::string& name);
};

// Note [Calls launch registered groups]
// An XLA program makes the same custom calls at every step: the same
// attributes, the same buffer shapes; only the buffers move. So a grouped
// allreduce call (several members, the gradient buckets) registers its
// members with the engine at its first call (RegisterGroup) and launches
// that registration afterwards (EnqueueRegisteredGroup) with the step's
// buffers, one readiness event and one done, as the TF kernels do
// (ops/adapter.h, Note [Grouped kernels launch a registered group]). The
// registration is kept per call site: the call's engine name (a program
// names each collective once, "Order" above) and device. A call whose
// members differ from the site's registration (new shapes, another program
// with the same names) registers again, replacing the old one; when that
// cannot be done (a launch of it in flight) or registering fails (a name
// held by another registration), the call submits by name (EnqueueGroup,
// which the engine accepts while the names are only lent, Note [Registered
// names] in cc/engine/tensor_queue.h), and the site registers no more
// until its members change. A launch is EnqueueGroup of the same requests,
// bit for bit and on the wire. NVGROUP_TF_REGISTERED_GROUPS=0 turns it off.
class CallRegistrations {
 public:
  // The registration to launch for `requests` (device set, pointers
  // ignored) at call site `site`, registering it when needed; 0: submit
  // them by name. Fails only for a malformed NVGROUP_TF_REGISTERED_GROUPS.
  static StatusOr<uint64_t> For(const std::string& site, const std::vector<CollectiveRequest>& requests);
};
// Launches registered group `group` with the pointers of `requests` (the
// members in order), `ready_event`, and one `done` / `completion_event_ready`.
Status LaunchCall(uint64_t group, const std::vector<CollectiveRequest>& requests, void* ready_event,
                  DoneCallback done, std::function<void(void*)> completion_event_ready);

// How the lowering emits the collectives of a program compiled for a GPU
// (`for_gpu`) or the CPU: the pair (Note [Start and done]) or one call
// (NVGROUP_XLA_START_DONE, parsed once per process; auto: the pair on a GPU).
StatusOr<bool> LowerToStartDone(bool for_gpu);

// Engine status -> the XLA FFI error with the same code (the handlers' one
// conversion point).
ffi::Error ToFfiError(const Status& status);

// Registers `handler` for `target` on XLA platform `platform` ("Host",
// "CUDA") in the FFI registry inside TensorFlow's library; prints a failure.
bool RegisterHandler(const char* target, const char* platform, XLA_FFI_Handler* handler);

// The binding every handler shares: all operands, all results, the attributes
// as one WireAttributes. A platform adds its context first (the CUDA stream).
template <typename Binding>
auto BindCall(Binding binding) {
  return std::move(binding).RemainingArgs().RemainingRets().template Attrs<WireAttributes>();
}

}  // namespace xla_adapter
}  // namespace nvgroup

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(::nvgroup::xla_adapter::WireAttributes,
                                      ::xla::ffi::StructMember<std::string_view>("name"),
                                      ::xla::ffi::StructMember<int64_t>("type"),
                                      ::xla::ffi::StructMember<int64_t>("grouped"),
                                      ::xla::ffi::StructMember<int64_t>("op"),
                                      ::xla::ffi::StructMember<double>("prescale"),
                                      ::xla::ffi::StructMember<double>("postscale"),
                                      ::xla::ffi::StructMember<int64_t>("root"),
                                      ::xla::ffi::StructMember<int64_t>("process_set"),
                                      ::xla::ffi::StructMember<::xla::ffi::Span<const int64_t>>("splits"),
                                      ::xla::ffi::StructMember<::xla::ffi::Span<const int64_t>>("received"));
