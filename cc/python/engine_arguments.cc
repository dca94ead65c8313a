#include "python/engine_arguments.h"

#include <cctype>
#include <string>
#include <utility>

namespace nvgroup {
namespace {

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

}  // namespace

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

CollectiveRequest AllreduceRequest(std::string name, uintptr_t in, uintptr_t out, std::vector<int64_t> shape,
                                   DataType dtype, ReduceOp op, double prescale, double postscale,
                                   Device device, uintptr_t ready_event) {
  CollectiveRequest q;
  q.name = std::move(name);
  q.type = CollectiveType::kAllreduce;
  q.input = reinterpret_cast<const void*>(in);
  q.output = reinterpret_cast<void*>(out);
  q.shape = std::move(shape);
  q.dtype = dtype;
  q.op = op;
  q.prescale_factor = prescale;
  q.postscale_factor = postscale;
  q.device = device;
  q.ready_event = reinterpret_cast<void*>(ready_event);
  return q;
}

CollectiveRequest MakeAllreduce(const std::string& name, uintptr_t in, uintptr_t out,
                                std::vector<int64_t> shape, const std::string& dtype, const std::string& op,
                                double prescale, double postscale, const std::string& device,
                                uintptr_t ready_event) {
  // Parsed one after the other (the order of a call's arguments is
  // unspecified): a request with several bad names is refused for the first
  // of dtype, op, device, the order the property tests expect
  // (tests/reliability/workers/engine_validation_props.py).
  const DataType parsed_dtype = ParseDataType(dtype);
  const ReduceOp parsed_op = ParseReduceOp(op);
  const Device parsed_device = ParseDevice(device);
  return AllreduceRequest(name, in, out, std::move(shape), parsed_dtype, parsed_op, prescale, postscale,
                          parsed_device, ready_event);
}

}  // namespace nvgroup
