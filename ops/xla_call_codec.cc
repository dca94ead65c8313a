// The custom call's codec (xla_ops.h): the attributes the lowering writes
// (XlaAttributes) and the handlers read back, and the handlers' decoding of
// XLA's buffers into engine requests (DecodeCall, DecodeDone).
#include "ops/xla_ops.h"

#include <cinttypes>
#include <climits>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/checks.h"
#include "xla/shape_util.h"


namespace nvgroup {
namespace xla_adapter {

// ---------------------------------------------------------------------------
// Attributes: written at lowering, read by the handlers.

namespace {

// An MLIR string literal: printable ASCII except '"' and '\' as is, every
// other byte as \XX (MLIR's hex escape), so any tensor name round-trips.
std::string MlirString(const std::string& text) {
  std::string out = "\"";
  for (unsigned char c : text) {
    if (c >= 0x20 && c < 0x7f && c != '"' && c != '\\') {
      out += static_cast<char>(c);
    } else {
      char hex[4];
      std::snprintf(hex, sizeof(hex), "\\%02X", c);
      out += hex;
    }
  }
  return out + "\"";
}

// An f64 attribute as its bit pattern (MLIR's hexadecimal float literal):
// exact, whatever the value.
std::string MlirF64(double value) {
  uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(bits));
  char text[40];
  std::snprintf(text, sizeof(text), "0x%016" PRIX64 " : f64", bits);
  return text;
}

std::string MlirI64(int64_t value) { return std::to_string(value) + " : i64"; }

// An i64 array attribute (MLIR's dense array: "array<i64>" when empty).
std::string MlirI64Array(const std::vector<int64_t>& values) {
  std::string out = "array<i64";
  for (size_t i = 0; i < values.size(); ++i) out += (i == 0 ? ": " : ", ") + std::to_string(values[i]);
  return out + ">";
}

}  // namespace

std::string XlaAttributes(const CallAttributes& a) {
  return "{name = " + MlirString(a.name) + ", type = " + MlirI64(static_cast<int64_t>(a.type)) +
         ", grouped = " + MlirI64(a.grouped ? 1 : 0) + ", op = " + MlirI64(static_cast<int64_t>(a.op)) +
         ", prescale = " + MlirF64(a.prescale_factor) + ", postscale = " + MlirF64(a.postscale_factor) +
         ", root = " + MlirI64(a.root_rank) + ", process_set = " + MlirI64(a.process_set_id) +
         ", splits = " + MlirI64Array(a.splits) + ", received = " + MlirI64Array(a.received_splits) + "}";
}

namespace {

// WireAttributes -> CallAttributes, checking what a hand-written HLO could get wrong.
Status DecodeAttributes(const WireAttributes& w, CallAttributes* out) {
  // Join is not lowered (xla_ops.h).
  if (w.type < 0 || w.type > static_cast<int64_t>(CollectiveType::kAlltoall))
    return Status::Internal("nvgroup XLA custom call: unknown collective type " + std::to_string(w.type));
  if (w.op < 0 || w.op > static_cast<int64_t>(ReduceOp::kProduct))
    return Status::Internal("nvgroup XLA custom call: unknown reduce op " + std::to_string(w.op));
  if (w.process_set < 0 || w.process_set > INT32_MAX || w.root < INT32_MIN || w.root > INT32_MAX)
    return Status::Internal("nvgroup XLA custom call: process set " + std::to_string(w.process_set) +
                            " or root " + std::to_string(w.root) + " out of range");
  out->name = std::string(w.name);
  out->type = static_cast<CollectiveType>(w.type);
  out->grouped = w.grouped != 0;
  out->op = static_cast<ReduceOp>(w.op);
  out->prescale_factor = w.prescale;
  out->postscale_factor = w.postscale;
  out->root_rank = static_cast<int>(w.root);
  out->process_set_id = static_cast<int32_t>(w.process_set);
  out->splits.assign(w.splits.begin(), w.splits.end());
  out->received_splits.assign(w.received.begin(), w.received.end());
  return Status::Ok();
}

}  // namespace

// ---------------------------------------------------------------------------
// Run time: XLA buffers -> engine requests.

namespace {

Status ToEngineDataType(ffi::DataType dtype, DataType* out) {
  switch (dtype) {
    case ffi::DataType::U8: *out = DataType::kUint8; return Status::Ok();
    case ffi::DataType::S8: *out = DataType::kInt8; return Status::Ok();
    case ffi::DataType::U16: *out = DataType::kUint16; return Status::Ok();
    case ffi::DataType::S16: *out = DataType::kInt16; return Status::Ok();
    case ffi::DataType::PRED: *out = DataType::kBool; return Status::Ok();
    case ffi::DataType::F16: *out = DataType::kFloat16; return Status::Ok();
    case ffi::DataType::BF16: *out = DataType::kBFloat16; return Status::Ok();
    case ffi::DataType::F32: *out = DataType::kFloat32; return Status::Ok();
    case ffi::DataType::F64: *out = DataType::kFloat64; return Status::Ok();
    case ffi::DataType::S32: *out = DataType::kInt32; return Status::Ok();
    case ffi::DataType::S64: *out = DataType::kInt64; return Status::Ok();
    default:
      return Status::InvalidArgument("nvgroup XLA custom call: unsupported XLA element type " +
                                     std::to_string(static_cast<int>(dtype)));
  }
}

std::vector<int64_t> Dims(const ffi::AnyBuffer& buffer) {
  auto dims = buffer.dimensions();
  return std::vector<int64_t>(dims.begin(), dims.end());
}

// The engine's result shape must be the one XLA compiled (xla_ops.h, "Static
// shapes"); then the result goes straight into XLA's buffer.
AllocateOutputFn IntoCompiledBuffer(const CallAttributes& a, const std::string& name,
                                    const ffi::AnyBuffer& output) {
  const std::vector<int64_t> compiled = Dims(output);
  void* data = output.untyped_data();
  const std::string what = std::string(CollectiveTypeName(a.type)) + " of '" + name + "' under XLA";
  return [compiled, data, what](const std::vector<int64_t>& shape, void** out_ptr) {
    if (shape != compiled)
      return Status::FailedPrecondition(what + ": the result shape is " + ShapeToString(shape) +
                                        " but the XLA program was compiled for " + ShapeToString(compiled) +
                                        " (the ranks' shapes or splits changed after compilation; every rank "
                                        "must recompile with the same shapes)");
    *out_ptr = data;
    return Status::Ok();
  };
}

}  // namespace

Status DecodeCall(const WireAttributes& wire, ffi::RemainingArgs args, ffi::RemainingRets rets,
                  std::vector<CollectiveRequest>* requests) {
  CallAttributes a;
  NVG_RETURN_IF_ERROR(DecodeAttributes(wire, &a));
  // The last operand only orders the call (CollectiveOrder); the data operands
  // pair with the data results (the order token follows them).
  const size_t data = rets.size() >= 1 ? rets.size() - 1 : 0;
  if (args.size() != data + 1 || data == 0)
    return Status::Internal("nvgroup XLA custom call '" + a.name + "': " + std::to_string(args.size()) +
                            " operands for " + std::to_string(data) +
                            " data results (want one operand per result and the ordering operand)");
  requests->clear();
  for (size_t i = 0; i < data; ++i) {
    auto in = args.get<ffi::AnyBuffer>(i);
    auto out = rets.get<ffi::AnyBuffer>(i);
    if (in.has_error() || out.has_error())
      return Status::Internal("nvgroup XLA custom call '" + a.name + "': operand/result " +
                              std::to_string(i) + " is not a buffer");
    const ffi::AnyBuffer input = *in;
    const ffi::AnyBuffer output = **out;
    CollectiveRequest q;
    q.name = a.grouped ? a.name + "[" + std::to_string(i) + "]" : a.name;
    q.type = a.type;
    NVG_RETURN_IF_ERROR(ToEngineDataType(input.element_type(), &q.dtype));
    q.shape = Dims(input);
    q.input = input.untyped_data();
    q.op = a.op;
    q.prescale_factor = a.prescale_factor;
    q.postscale_factor = a.postscale_factor;
    q.root_rank = a.root_rank;
    q.process_set_id = a.process_set_id;
    switch (a.type) {
      case CollectiveType::kAllgather:
      case CollectiveType::kReducescatter: q.allocate_output = IntoCompiledBuffer(a, q.name, output); break;
      case CollectiveType::kAlltoall: {
        q.splits = a.splits;
        // The engine writes the received splits, then allocates: both must be
        // what the program was compiled for (the received splits are a constant
        // of the program, xla_lowering.cc "Alltoall").
        auto received = std::make_shared<std::vector<int64_t>>();
        q.received_splits = received.get();
        AllocateOutputFn into = IntoCompiledBuffer(a, q.name, output);
        const std::vector<int64_t> compiled = a.received_splits;
        const std::string name = q.name;
        q.allocate_output = [received, into, compiled, name](const std::vector<int64_t>& shape,
                                                             void** out_ptr) {
          if (*received != compiled)
            return Status::FailedPrecondition(
                "alltoall of '" + name + "' under XLA: this rank receives " + ShapeToString(*received) +
                " rows from the ranks but the XLA program was compiled for " + ShapeToString(compiled) +
                " (a rank's splits changed after compilation; every rank must recompile)");
          return into(shape, out_ptr);
        };
        break;
      }
      default: q.output = output.untyped_data();
    }
    requests->push_back(std::move(q));
  }
  return Status::Ok();
}

Status DecodeDone(const WireAttributes& wire, ffi::RemainingArgs args, ffi::RemainingRets rets,
                  std::string* name, std::vector<DoneBuffer>* buffers) {
  CallAttributes a;
  NVG_RETURN_IF_ERROR(DecodeAttributes(wire, &a));
  *name = a.name;
  const size_t n = rets.size();
  // Operands past 2n are the done-after tensors (xla_ops.h, "Done after"): order only.
  if (n == 0 || args.size() < 2 * n)
    return Status::Internal("nvgroup XLA done call '" + a.name + "': " + std::to_string(args.size()) +
                            " operands for " + std::to_string(n) +
                            " results (want the start's results, the inputs, then any done-after tensors)");
  buffers->clear();
  for (size_t i = 0; i < n; ++i) {
    auto from = args.get<ffi::AnyBuffer>(i);
    auto to = rets.get<ffi::AnyBuffer>(i);
    if (from.has_error() || to.has_error())
      return Status::Internal("nvgroup XLA done call '" + a.name + "': operand/result " + std::to_string(i) +
                              " is not a buffer");
    const ffi::AnyBuffer f = *from;
    const ffi::AnyBuffer t = **to;
    if (f.size_bytes() != t.size_bytes())
      return Status::Internal("nvgroup XLA done call '" + a.name + "': result " + std::to_string(i) +
                              " has " + std::to_string(t.size_bytes()) + " bytes, its operand " +
                              std::to_string(f.size_bytes()));
    buffers->push_back({f.untyped_data(), t.untyped_data(), t.size_bytes()});
  }
  return Status::Ok();
}

}  // namespace xla_adapter
}  // namespace nvgroup
