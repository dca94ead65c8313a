// Value types shared by every layer: element types, reduction ops, collective
// kinds and devices. Plain enums with fixed integer values: they travel inside
// negotiation messages (cc/engine/wire_format), so never renumber them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "nvgroup/status.h"

namespace nvgroup {

enum class DataType : uint8_t {
  kUint8 = 0,
  kInt8 = 1,
  kBool = 2,
  kFloat16 = 3,
  kBFloat16 = 4,
  kFloat32 = 5,
  kFloat64 = 6,
  kInt32 = 7,
  kInt64 = 8,
};
constexpr int kNumDataTypes = 9;

size_t DataTypeSize(DataType dtype);
const char* DataTypeName(DataType dtype);
bool IsFloatingPoint(DataType dtype);  // float16, bfloat16, float32, float64
// Allreduce is defined for numeric types; uint8/int8/bool only travel through
// broadcast and allgather.
bool SupportsReduction(DataType dtype);

// kAverage is Sum followed by a division by the number of ranks that took part
// (in the final write, so no extra pass). Integers divide with truncation toward
// zero, like C++ and TF's integer division of the sum.
enum class ReduceOp : uint8_t { kSum = 0, kAverage = 1, kMin = 2, kMax = 3, kProduct = 4 };
const char* ReduceOpName(ReduceOp op);

enum class CollectiveType : uint8_t { kAllreduce = 0, kAllgather = 1, kBroadcast = 2 };
const char* CollectiveTypeName(CollectiveType type);

enum class DeviceKind : uint8_t { kCpu = 0, kCuda = 1 };

struct Device {
  DeviceKind kind = DeviceKind::kCpu;
  int ordinal = -1;  // CUDA device ordinal; -1 for the CPU
  static Device Cpu() { return {DeviceKind::kCpu, -1}; }
  static Device Cuda(int ordinal) { return {DeviceKind::kCuda, ordinal}; }
  bool operator==(const Device& o) const { return kind == o.kind && ordinal == o.ordinal; }
  bool operator!=(const Device& o) const { return !(*this == o); }
  std::string ToString() const;
};

// Number of elements of a shape (1 for a scalar, 0 if any dimension is 0).
int64_t NumElements(const std::vector<int64_t>& shape);
std::string ShapeToString(const std::vector<int64_t>& shape);

}  // namespace nvgroup
