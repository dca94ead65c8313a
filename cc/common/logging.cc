#include "common/logging.h"

#include <atomic>
#include <cstdio>

namespace nvgroup {
namespace {

std::atomic<int> g_level{static_cast<int>(LogLevel::kWarning)};
std::atomic<int> g_rank{-1};

const char* LevelName(LogLevel level) {
  switch (level) {
    case LogLevel::kTrace: return "TRACE";
    case LogLevel::kDebug: return "DEBUG";
    case LogLevel::kInfo: return "INFO";
    case LogLevel::kWarning: return "WARNING";
    case LogLevel::kError: return "ERROR";
  }
  return "?";
}

}  // namespace

void SetLogLevel(LogLevel level) { g_level.store(static_cast<int>(level)); }
void SetLogRank(int rank) { g_rank.store(rank); }
int LogRank() { return g_rank.load(); }
bool LogEnabled(LogLevel level) { return static_cast<int>(level) >= g_level.load(); }

void LogMessage(LogLevel level, const std::string& text) {
  int rank = g_rank.load();
  std::string line = "[nvgroup rank " + (rank < 0 ? std::string("?") : std::to_string(rank)) + "] " +
                     LevelName(level) + ": " + text + "\n";
  std::fwrite(line.data(), 1, line.size(), stderr);
  std::fflush(stderr);
}

}  // namespace nvgroup
