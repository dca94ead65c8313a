// nvgroup_tf._engine: the engine's pybind11 module. Each area registers its
// bindings here.
#include <pybind11/pybind11.h>

namespace nvgroup {
void RegisterCommunicatorBindings(pybind11::module_& m);
void RegisterEngineBindings(pybind11::module_& m);
void RegisterSettingsBindings(pybind11::module_& m);
}  // namespace nvgroup

PYBIND11_MODULE(_engine, m) {
  m.doc() = "nvgroup_tf native engine";
  nvgroup::RegisterCommunicatorBindings(m);
  nvgroup::RegisterEngineBindings(m);
  nvgroup::RegisterSettingsBindings(m);
}
