// tqkv._core: the core library on NumPy arrays (formats, slot codecs, the contiguous and
// paged caches, attention on them) and the internal functions behind tqkv.torch's ops. tqkv/__init__.py re-exports it; python/tqkv/_core.pyi is
// generated from these signatures and docstrings (nanobind's stubgen).
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <stdexcept>
#include <string>

#include "bindings.h"
#include "tqkv/error.h"
#include "tqkv/options.h"
#include "tqkv/simd.h"
#include "tqkv/threads.h"

namespace nb = nanobind;

namespace {

const char* error_code_name(tqkv::ErrorCode c) {
  switch (c) {
    case tqkv::ErrorCode::Ok: return "ok";
    case tqkv::ErrorCode::InvalidArgument: return "invalid_argument";
    case tqkv::ErrorCode::NonFinite: return "non_finite";
    case tqkv::ErrorCode::OutOfRange: return "out_of_range";
    case tqkv::ErrorCode::Capacity: return "capacity";
    case tqkv::ErrorCode::Overflow: return "overflow";
    case tqkv::ErrorCode::Format: return "format";
    case tqkv::ErrorCode::Busy: return "busy";
    case tqkv::ErrorCode::Device: return "device";
  }
  return "unknown";
}

}  // namespace

NB_MODULE(_core, m) {
  m.doc() = "tqkv core: compressed KV-cache formats, caches and attention on NumPy arrays.";

  // tqkv::Error -> tqkv.Error(ValueError) with the C++ message and .code (its ErrorCode name).
  static nb::object error_type = nb::exception<tqkv::Error>(m, "Error", PyExc_ValueError);
  error_type.attr("__doc__") =
      "Bad input anywhere in tqkv (the C++ tqkv::Error): the message is the C++ one, .code names the "
      "kind (invalid_argument, non_finite, out_of_range, capacity, overflow, format, busy, device). The call changed nothing.";
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const tqkv::Error& e) {
      nb::object exc = error_type(nb::str(e.what()));
      exc.attr("code") = nb::str(error_code_name(e.code()));
      PyErr_SetObject(error_type.ptr(), exc.ptr());
    }
  });

  m.def("num_threads", &tqkv::num_threads, "Threads a parallel call uses (TQKV_THREADS, else all hardware threads).");
  m.def("set_num_threads", &tqkv::set_num_threads, nb::arg("n"),
        "Sets the thread count for the whole process; n <= 0 restores the default.");
  m.def(
      "simd_level", [] { return std::string(tqkv::simd_level_name(tqkv::active_simd_level())); },
      "The CPU kernel level in use: 'scalar', 'avx2' or 'avx512' (TQKV_SIMD forces one).");
  m.def(
      "set_simd_level", [](const std::string& name) { tqkv::set_simd_level(tqkv::parse_simd_level(name)); },
      nb::arg("name"), "Forces a CPU kernel level ('scalar', 'avx2', 'avx512'); raises Error if the CPU lacks it.");

  m.def(
      "env",
      [](const std::string& name) -> nb::object {
        const tqkv::OptionInfo& o = tqkv::option_info(name);
        const char* n = o.name;
        try {  // each reader's strict parse; a default worked out at run time is std::logic_error here
          switch (o.kind) {
            case tqkv::OptionKind::Bool: return nb::bool_(tqkv::env_bool(n));
            case tqkv::OptionKind::Count: return nb::int_(tqkv::env_count(n));
            case tqkv::OptionKind::Choice: return nb::str(tqkv::env_choice(n).c_str());
            case tqkv::OptionKind::Path:
            case tqkv::OptionKind::Text: return nb::str(tqkv::env_text(n).c_str());
          }
        } catch (const std::logic_error&) {
        }
        return nb::none();
      },
      nb::arg("name"),
      "The value of the TQKV_* variable `name` as tqkv reads it (bool, int or str; a path or text '' where "
      "unset; None where the default is worked out at run time); raises Error for a malformed value or a "
      "name tqkv does not read. `tqkv env` lists them all.");

  tqkv::python::bind_format(m);
  tqkv::python::bind_caches(m);
  tqkv::python::bind_spec(m);
  tqkv::python::bind_model_cache(m);
  tqkv::python::bind_pool_ops(m);
#ifdef TQKV_PY_CUDA
  tqkv::python::bind_cuda_ops(m);
  m.attr("has_cuda") = true;
#else
  m.attr("has_cuda") = false;
#endif
}
