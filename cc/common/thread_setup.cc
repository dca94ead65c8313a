// Thread naming and timer slack for the engine's threads (thread_setup.h).
#include "common/thread_setup.h"

#ifdef __linux__
#include <pthread.h>
#include <sys/prctl.h>
#endif

namespace nvgroup {

void NameThisThread(const char* name) {
#ifdef __linux__
  // Fails only for names over 15 characters (ERANGE); a thread without a
  // name is harmless, so the result is not an error.
  (void)pthread_setname_np(pthread_self(), name);
#else
  (void)name;
#endif
}

void WakeOnTime() {
#ifdef __linux__
  (void)prctl(PR_SET_TIMERSLACK, 1UL, 0UL, 0UL, 0UL);  // 1 ns: cannot fail for the calling thread
#endif
}

}  // namespace nvgroup
