// The parts of tqkv._core, one per concept (module.cpp calls them in order).
#pragma once
#include <string>
#include <vector>

#include <nanobind/nanobind.h>

#include "tqkv/format.h"
#include "tqkv/page_geometry.h"

namespace tqkv::python {

void bind_format(nanobind::module_& m);  // format.cpp: Format, named formats, SlotCodec
void bind_caches(nanobind::module_& m);  // caches.cpp: ContiguousCache, PagedCache, attention
void bind_pool_ops(nanobind::module_& m);  // pool_ops.cpp: the CPU paged ops behind tqkv.torch
void bind_cuda_ops(nanobind::module_& m);  // cuda_ops.cpp: the CUDA ones (TQKV_PY_CUDA builds only)
void bind_spec(nanobind::module_& m);    // spec.cpp: cache specs by name (the engine's resolver)
void bind_model_cache(nanobind::module_& m);  // model_cache.cpp: the engine's CPU cache layer

// A Format from a tqkv.Format or a name; one per layer from a format, a name or a sequence of
// them. Raise tqkv.Error(invalid_argument) for anything else.
Format to_format(nanobind::handle h);
std::vector<Format> to_layer_formats(nanobind::handle h, int n_layers);
// 'slot' or 'page' (page_geometry.h); raises tqkv.Error(invalid_argument) for anything else.
PageLayout parse_layout(const std::string& s);

}  // namespace tqkv::python
