// Logging: one line per message on stderr, "[nvgroup rank N] LEVEL: text".
//
// The level comes from NVGROUP_LOG_LEVEL (parsed with the other knobs in
// cc/common/env.h, applied by the engine's Init); until then only warnings and
// errors print. The rank is set by Init; before it the prefix says "rank ?".
// Each message is written with one fwrite so lines from threads and ranks do not
// interleave mid-line.
#pragma once

#include <sstream>
#include <string>

namespace nvgroup {

// Same order as Knobs::log_level.
enum class LogLevel : int { kTrace = 0, kDebug = 1, kInfo = 2, kWarning = 3, kError = 4 };

void SetLogLevel(LogLevel level);
void SetLogRank(int rank);  // -1: unknown
int LogRank();              // the rank SetLogRank set, -1 before
bool LogEnabled(LogLevel level);
void LogMessage(LogLevel level, const std::string& text);

// Collects one message; writes it when destroyed. Use through NVG_LOG.
class LogLine {
 public:
  explicit LogLine(LogLevel level) : level_(level) {}
  ~LogLine() { LogMessage(level_, stream_.str()); }
  std::ostringstream& stream() { return stream_; }

 private:
  LogLevel level_;
  std::ostringstream stream_;
};

// Turns the streamed expression into void so NVG_LOG works as one expression
// (no dangling else); `&` binds looser than `<<`.
struct LogVoidify {
  void operator&(std::ostream&) {}
};

}  // namespace nvgroup

// NVG_LOG(kWarning) << "text";  The arguments are not evaluated when the level is off.
#define NVG_LOG(level)                               \
  !::nvgroup::LogEnabled(::nvgroup::LogLevel::level) \
      ? (void)0                                      \
      : ::nvgroup::LogVoidify() & ::nvgroup::LogLine(::nvgroup::LogLevel::level).stream()
