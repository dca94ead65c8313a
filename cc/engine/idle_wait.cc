// Thread naming for the engine's threads (see idle_wait.h).
#include "engine/idle_wait.h"

#ifdef __linux__
#include <pthread.h>
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

}  // namespace nvgroup
