#include "engine/fusion.h"

namespace nvgroup {
namespace {

size_t AlignUp(size_t bytes) {
  return (bytes + kFusionAlignBytes - 1) / kFusionAlignBytes * kFusionAlignBytes;
}

bool Fusable(const ResponseMessage& r) { return r.ok() && r.type == CollectiveType::kAllreduce; }

bool Compatible(const ResponseMessage& a, const ResponseMessage& b) {
  return a.dtype == b.dtype && a.op == b.op && a.prescale_factor == b.prescale_factor &&
         a.postscale_factor == b.postscale_factor && a.device_kind == b.device_kind;
}

}  // namespace

size_t ResponseBytes(const ResponseMessage& response) {
  if (response.type == CollectiveType::kAllgather || response.type == CollectiveType::kAlltoall ||
      response.type == CollectiveType::kJoin)
    return 0;
  return static_cast<size_t>(NumElements(response.shape)) * DataTypeSize(response.dtype);
}

std::vector<FusionBucket> PlanFusion(const std::vector<ResponseMessage>& responses, size_t threshold) {
  std::vector<const ResponseMessage*> pointers;
  pointers.reserve(responses.size());
  for (const ResponseMessage& r : responses) pointers.push_back(&r);
  return PlanFusion(pointers, threshold);
}

std::vector<FusionBucket> PlanFusion(const std::vector<const ResponseMessage*>& list, size_t threshold) {
  auto responses = [&list](size_t i) -> const ResponseMessage& { return *list[i]; };
  std::vector<FusionBucket> buckets;
  std::vector<bool> placed(list.size(), false);
  for (size_t i = 0; i < list.size(); ++i) {
    if (placed[i]) continue;
    placed[i] = true;
    FusionBucket bucket;
    bucket.responses.push_back(i);
    bucket.offsets.push_back(0);
    bucket.bytes = ResponseBytes(responses(i));
    bucket.fusable = Fusable(responses(i));
    if (bucket.fusable && bucket.bytes <= threshold) {
      size_t padded = AlignUp(bucket.bytes);
      for (size_t j = i + 1; j < list.size(); ++j) {
        if (placed[j] || !Fusable(responses(j)) || !Compatible(responses(i), responses(j))) continue;
        size_t bytes = ResponseBytes(responses(j));
        if (padded + bytes > threshold) continue;
        placed[j] = true;
        bucket.responses.push_back(j);
        bucket.offsets.push_back(padded);
        bucket.bytes = padded + bytes;
        padded = AlignUp(bucket.bytes);
      }
    }
    buckets.push_back(std::move(bucket));
  }
  return buckets;
}

}  // namespace nvgroup
