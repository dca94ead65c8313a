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
  kUint16 = 9,
  kInt16 = 10,
};
constexpr int kNumDataTypes = 11;

size_t DataTypeSize(DataType dtype);
const char* DataTypeName(DataType dtype);
bool IsFloatingPoint(DataType dtype);  // float16, bfloat16, float32, float64
// Reductions (allreduce, reducescatter) are defined for every numeric type;
// bool only travels through broadcast, allgather and alltoall (as Horovod).
// The CUDA kernels cover float16/bfloat16/float32/float64/int32/int64; other
// dtypes on CUDA fail with kUnimplemented naming the dtype.
bool SupportsReduction(DataType dtype);

// kAverage is Sum followed by a division by the number of ranks that took part
// (in the final write, so no extra pass). Integers divide with truncation toward
// zero, like C++ and TF's integer division of the sum.
enum class ReduceOp : uint8_t { kSum = 0, kAverage = 1, kMin = 2, kMax = 3, kProduct = 4 };
const char* ReduceOpName(ReduceOp op);

// kReducescatter: the reduction of every rank's tensor, dimension 0 split
// across ranks as Horovod splits it (ranks below dim0 % size get one more row).
// kAlltoall: each rank sends rows [sum(splits[:r]), sum(splits[:r+1])) of its
// tensor to rank r and receives the concatenation in rank order.
// kJoin: this rank has run out of data (Horovod's join; see engine.h).
enum class CollectiveType : uint8_t {
  kAllreduce = 0,
  kAllgather = 1,
  kBroadcast = 2,
  kReducescatter = 3,
  kAlltoall = 4,
  kJoin = 5,
};
constexpr int kNumCollectiveTypes = 6;
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
