#include "engine/timeline.h"

#include <cerrno>
#include <cstring>

#include "common/logging.h"

namespace nvgroup {
namespace {

std::string JsonString(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + "\"";
}

}  // namespace

Status Timeline::Open(const std::string& path, double start_s) {
  Close();
  file_ = std::fopen(path.c_str(), "w");
  if (file_ == nullptr)
    return Status::InvalidArgument("cannot open the timeline file '" + path + "': " + std::strerror(errno));
  path_ = path;
  start_s_ = start_s;
  first_event_ = true;
  rows_.clear();
  Write("[\n");
  return Status::Ok();
}

void Timeline::Write(const std::string& text) {
  if (file_ == nullptr) return;
  if (std::fwrite(text.data(), 1, text.size(), file_) != text.size()) {
    NVG_LOG(kWarning) << "writing the timeline '" << path_ << "' failed (" << std::strerror(errno)
                      << "); timeline disabled";
    std::fclose(file_);
    file_ = nullptr;
  }
}

void Timeline::Event(const std::string& tensor, const char* phase, char kind, double at_s) {
  if (file_ == nullptr) return;
  std::string text;
  auto [it, inserted] = rows_.try_emplace(tensor, static_cast<int>(rows_.size()) + 1);
  const std::string tid = std::to_string(it->second);
  if (inserted) {
    text += std::string(first_event_ ? "" : ",\n") +
            "{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": 0, \"tid\": " + tid +
            ", \"args\": {\"name\": " + JsonString(tensor) + "}}";
    first_event_ = false;
  }
  const long long ts = static_cast<long long>((at_s - start_s_) * 1e6);
  text += std::string(first_event_ ? "" : ",\n") + "{\"name\": \"" + phase + "\", \"ph\": \"" + kind +
          "\", \"ts\": " + std::to_string(ts) + ", \"pid\": 0, \"tid\": " + tid + "}";
  first_event_ = false;
  Write(text);
}

void Timeline::MarkCycle(double at_s) {
  if (file_ == nullptr) return;
  const long long ts = static_cast<long long>((at_s - start_s_) * 1e6);
  Write(std::string(first_event_ ? "" : ",\n") +
        "{\"name\": \"CYCLE_START\", \"ph\": \"i\", \"s\": \"g\", \"ts\": " + std::to_string(ts) +
        ", \"pid\": 0, \"tid\": 0}");
  first_event_ = false;
}

void Timeline::Close() {
  if (file_ == nullptr) return;
  Write("\n]\n");
  if (file_ != nullptr && std::fclose(file_) != 0)
    NVG_LOG(kWarning) << "closing the timeline '" << path_ << "' failed: " << std::strerror(errno);
  file_ = nullptr;
}

}  // namespace nvgroup
