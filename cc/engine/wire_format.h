// Negotiation messages and their binary wire format.
//
// How it works. Each negotiation round (see the loop in engine.cc) every rank
// encodes the requests it has not reported yet as a RequestList and rank 0
// gathers them; rank 0 answers with a ResponseList that every rank decodes. The
// format is hand-written, little-endian and versioned:
//
//   message  := magic:u32 version:u8 kind:u8 body
//   string   := length:u32 bytes          (length <= remaining bytes)
//   vector   := count:u32 element*        (count * min element size <= remaining)
//   double   := IEEE-754 bits as u64
//   request  := name type:u8 dtype:u8 device_kind:u8 op:u8 prescale:double
//               postscale:double root:i32 shape:vector<i64> group_id:u64 group_size:u32
//               splits:vector<i64> refused_duplicate
//   response := name error_code:u8 error_message type:u8 dtype:u8 device_kind:u8 op:u8
//               prescale:double postscale:double root:i32 shape:vector<i64>
//               first_dims:vector<i64> group_id:u64 group_size:u32
//   RequestList  body := vector<request>
//   ResponseList body := fatal_code:u8 fatal_message vector<response>
//
// Decoding checks every length against the bytes left and every enum against
// its range, and requires the message to end exactly where the body ends, so a
// malformed message becomes kInternal "malformed negotiation message: ..." and
// never reads out of bounds or allocates more than the message could describe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "nvgroup/status.h"
#include "nvgroup/types.h"

namespace nvgroup {

// One rank's announcement that the collective `name` is ready, with every
// parameter the ranks must agree on.
struct RequestMessage {
  std::string name;
  CollectiveType type = CollectiveType::kAllreduce;
  DataType dtype = DataType::kFloat32;
  DeviceKind device_kind = DeviceKind::kCpu;  // ranks agree on the kind, not the ordinal
  ReduceOp op = ReduceOp::kSum;
  double prescale_factor = 1.0;
  double postscale_factor = 1.0;
  int32_t root_rank = 0;
  std::vector<int64_t> shape;
  uint64_t group_id = 0;    // 0: not grouped; else a hash of the group's sorted names
  uint32_t group_size = 0;  // members of the group (0 when not grouped)
  std::vector<int64_t> splits;  // alltoall: rows sent to each rank (resolved, never empty)
  // Non-empty: not a collective but this rank's refusal of its collective
  // named `name`, because a collective named `refused_duplicate` (this name,
  // or another member of the refused group) was in flight on this rank; the
  // other fields keep their defaults. Matched across ranks like a request
  // (Note [Refused duplicates] in coordinator.h).
  std::string refused_duplicate;

  bool operator==(const RequestMessage& o) const;
};

// Rank 0's decision for one name, identical on every rank. An error response
// (error_code != kOk) fails the request on every rank that has it. A success
// response carries the agreed parameters (rank 0's request) and, for allgather,
// every rank's first dimension; it is also what the response cache stores.
struct ResponseMessage {
  std::string name;
  StatusCode error_code = StatusCode::kOk;
  std::string error_message;
  CollectiveType type = CollectiveType::kAllreduce;
  DataType dtype = DataType::kFloat32;
  DeviceKind device_kind = DeviceKind::kCpu;
  ReduceOp op = ReduceOp::kSum;
  double prescale_factor = 1.0;
  double postscale_factor = 1.0;
  int32_t root_rank = 0;             // broadcast: the root; join: the last rank to join
  std::vector<int64_t> shape;       // rank 0's shape
  // allgather: first dimension on each rank. alltoall: the size x size matrix
  // of rows sent, row-major (row r = rank r's splits). join: unused.
  std::vector<int64_t> first_dims;
  uint64_t group_id = 0;
  uint32_t group_size = 0;

  bool ok() const { return error_code == StatusCode::kOk; }
  bool operator==(const ResponseMessage& o) const;
};

struct ResponseList {
  // Non-OK: rank 0 could not negotiate (e.g. it received a malformed request
  // list); every rank stops its loop with this status.
  StatusCode fatal_code = StatusCode::kOk;
  std::string fatal_message;
  std::vector<ResponseMessage> responses;
};

std::vector<uint8_t> EncodeRequestList(const std::vector<RequestMessage>& requests);
Status DecodeRequestList(const uint8_t* data, size_t size, std::vector<RequestMessage>* out);

std::vector<uint8_t> EncodeResponseList(const ResponseList& list);
Status DecodeResponseList(const uint8_t* data, size_t size, ResponseList* out);

}  // namespace nvgroup
