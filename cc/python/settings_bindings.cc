// Python bindings of the settings table (cc/common/env.h) for the docs
// generator (scripts/settings_doc.py) and the tests: nvgroup_tf._engine
// .settings_table(), .setting_value(name), .agreed_knobs(),
// .liveness_address_settings(). Malformed values
// raise ValueError carrying the table's error text.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <utility>
#include <vector>

#include "common/env.h"
#include "transport/liveness_address.h"

namespace py = pybind11;

namespace nvgroup {

void RegisterSettingsBindings(py::module_& m) {
  m.def("settings_table", [] {
    py::list rows;
    for (const Setting& s : Settings()) {
      py::dict row;
      row["name"] = s.name;
      row["scope"] = SettingScopeName(s.scope);
      row["type"] = s.type;
      row["default"] = s.default_value;
      row["read_by"] = s.read_by;
      row["launcher_flag"] = s.launcher_flag;
      row["help"] = s.help;
      row["parsed"] = s.parse != nullptr;
      rows.append(row);
    }
    return rows;
  }, "Every NVGROUP_* variable, one dict per row of cc/common/env.h, in table order.");
  m.def("setting_value",
        [](const std::string& name) {
    StatusOr<std::string> v = SettingValueFromEnvironment(name);
    if (!v.ok()) throw py::value_error(v.status().message());
    return v.value();
  }, py::arg("name"),
        "The variable's value parsed from the environment now (its default when unset), normalized.");
  m.def("agreed_knobs", [] {
    StatusOr<Knobs> k = ParseKnobsFromEnvironment();
    if (!k.ok()) throw py::value_error(k.status().message());
    return AgreedKnobs(k.value());
  }, "The (variable, normalized value) pairs Init compares across ranks, parsed from the environment now.");
  m.def("liveness_address_settings", [] {
    StatusOr<Knobs> k = ParseKnobsFromEnvironment();
    if (!k.ok()) throw py::value_error(k.status().message());
    LivenessAddressSettings s = LivenessAddressSettingsFrom(k.value());
    return py::make_tuple(s.address, s.interface, s.mpi_interfaces);
  }, "(address, interface, MPI's interfaces) as the dead-rank connections read them from the environment.");
}

}  // namespace nvgroup
