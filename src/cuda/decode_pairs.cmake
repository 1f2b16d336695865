# The decode kernels that are compiled, generated from data (included by src/cuda/CMakeLists.txt).
#
# Pairs (split-KV decode kernel, cuda::run_decode), as "D;key kind;value kind" in the kinds of
# decode_kernel.cuh (kmse(b), vmse(b), vuni(b), K_FP8, ...):
#  - at every head dim (64, 128, 256): f16, bf16, fp8, vLLM's presets (turboquant_k8v4,
#    _4bit_nc, _k3v4_nc, _3bit_nc) and the spec's named pairs tq-k<K>v<V> (K, V in 2..4);
#  - at the head dim of each recipe file (recipes/*.json, "model": {"head_dim"}): every pair its
#    specs name (the base k<K>v<V>, every L...=k<K>v<V> override, +vu for uniform values) and
#    its recent window's copies (wq<B>: k<B>v<B>).
# Fused quadruples (the three-part decode of a layer with copies in one launch,
# cuda::run_fused_decode), as "D;middle key;middle value;window key;window value": for each
# recipe spec with sinks or a window, each of its pairs with the spec's window kind (wq<B>, else
# f16), at the recipe's head dim; and k5v3 with an f16 window at d = 64 (below).
# Any other pair attends through the generic path of engine::CudaKvCache (the layer dequantized
# into an f16 page pool, then the f16 kernel); any other quadruple through three launches.
#
# Output: ${_gen}/decode_pairs.h (the lists as X-macros for decode.cu) and translation units of
# one head dim each, at most TQKV_DECODE_PER_TU decode (TQKV_FUSED_PER_TU fused) kernels a unit;
# _decode_sources lists the units, fused first (the longest compiles start first).
set(TQKV_DECODE_PER_TU 8 CACHE STRING "At most this many decode kernels per generated translation unit")
set(TQKV_FUSED_PER_TU 5 CACHE STRING "At most this many fused decode kernels per generated translation unit")
set(_gen ${CMAKE_CURRENT_BINARY_DIR}/generated)
set(_pairs "")
foreach(_d 64 128 256)
  foreach(_p "K_F16,V_F16" "K_BF16,V_BF16" "K_FP8,V_FP8" "K_FP8,vuni(4)" "kmse(4),vuni(4)" "kmse(3),vuni(4)"
             "kmse(3),vuni(3)")
    list(APPEND _pairs "${_d},${_p}")
  endforeach()
  foreach(_k RANGE 2 4)
    foreach(_v RANGE 2 4)
      list(APPEND _pairs "${_d},kmse(${_k}),vmse(${_v})")
    endforeach()
  endforeach()
endforeach()
set(_quads "")
file(GLOB _recipes CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/recipes/*.json)
list(SORT _recipes)
foreach(_r IN LISTS _recipes)
  file(READ ${_r} _json)
  string(JSON _d ERROR_VARIABLE _err GET "${_json}" model head_dim)
  if(_err)
    message(FATAL_ERROR "${_r}: no model.head_dim (${_err}); src/cuda/decode_pairs.cmake reads it")
  endif()
  string(JSON _n LENGTH "${_json}" recipes)
  math(EXPR _last "${_n} - 1")
  foreach(_i RANGE ${_last})
    string(JSON _spec GET "${_json}" recipes ${_i} spec)
    string(REPLACE "+" ";" _opts "${_spec}")
    list(GET _opts 0 _base)
    if(NOT _base MATCHES "^k[1-8]v[1-8]$")
      message(FATAL_ERROR "${_r}: spec '${_spec}' starts with '${_base}', not k<K>v<V>: teach src/cuda/decode_pairs.cmake its kinds")
    endif()
    set(_vclass vmse)
    set(_wk K_F16)
    set(_wv V_F16)
    set(_copies FALSE)
    set(_specpairs "")
    foreach(_o IN LISTS _opts)
      if(_o STREQUAL "vu")
        set(_vclass vuni)
      elseif(_o MATCHES "^wq([2-8])$")
        set(_wk "kmse(${CMAKE_MATCH_1})")
        set(_wv "vmse(${CMAKE_MATCH_1})")
        list(APPEND _pairs "${_d},kmse(${CMAKE_MATCH_1}),vmse(${CMAKE_MATCH_1})")
      elseif(_o MATCHES "^(sink|fill)[0-9]" OR _o MATCHES "^w[0-9]")
        set(_copies TRUE)
      endif()
      if(_o MATCHES "^(L[0-9.]+=)?k([2-8])v([2-8])$")
        list(APPEND _specpairs "${CMAKE_MATCH_2}:${CMAKE_MATCH_3}")
      elseif(_o MATCHES "k[0-9]+v[0-9]+")
        message(FATAL_ERROR "${_r}: '${_o}' in '${_spec}': 1-bit or unknown codes (src/cuda/decode_pairs.cmake)")
      endif()
    endforeach()
    foreach(_kv IN LISTS _specpairs)
      string(REPLACE ":" ";" _kv "${_kv}")
      list(GET _kv 0 _k)
      list(GET _kv 1 _v)
      list(APPEND _pairs "${_d},kmse(${_k}),${_vclass}(${_v})")
      if(_copies)
        list(APPEND _quads "${_d},kmse(${_k}),${_vclass}(${_v}),${_wk},${_wv}")
      endif()
    endforeach()
  endforeach()
endforeach()
list(REMOVE_DUPLICATES _pairs)
list(REMOVE_DUPLICATES _quads)
list(SORT _pairs COMPARE NATURAL)
list(SORT _quads COMPARE NATURAL)

# Emits the X-macro `macro` over `items` (sorted by head dim, largest first) and units
# `prefix`_d<D>_<n>.cu instantiating `fn` for them: each head dim's items split evenly into units
# of at most `per_unit`, so that a parallel build spreads them (the fatbins are compressed for
# size: src/cuda/CMakeLists.txt, TQKV_CUDA_COMPRESS).
function(_tqkv_emit items macro fn prefix per_unit out_sources out_text)
  set(_text "#define ${macro}(X) \\\n")
  set(_srcs "")
  foreach(_d 256 128 64)
    set(_mine "")
    foreach(_it IN LISTS items)
      if(_it MATCHES "^${_d},")
        list(APPEND _mine "${_it}")
      endif()
    endforeach()
    list(LENGTH _mine _count)
    if(_count EQUAL 0)
      continue()
    endif()
    math(EXPR _units "(${_count} + ${per_unit} - 1) / ${per_unit}")
    math(EXPR _size "(${_count} + ${_units} - 1) / ${_units}")
    set(_body "")
    set(_in 0)
    set(_unit 0)
    set(_seen 0)
    foreach(_it IN LISTS _mine)
      string(REGEX REPLACE "^[0-9]+," "" _args "${_it}")
      string(REPLACE "," ", " _args "${_args}")
      string(APPEND _text "  X(${_d}, ${_args}) \\\n")
      string(APPEND _body "template ${fn}<${_d}, ${_args}>();\n")
      math(EXPR _in "${_in} + 1")
      math(EXPR _seen "${_seen} + 1")
      if(_in EQUAL _size OR _seen EQUAL _count)
        set(_file ${_gen}/${prefix}_d${_d}_${_unit}.cu)
        file(CONFIGURE OUTPUT ${_file} @ONLY CONTENT
"// Generated by src/cuda/decode_pairs.cmake: explicit instantiations (see decode_pairs.h here).
#include \"decode_kernel.cuh\"

namespace tqkv::cuda::detail {
${_body}}  // namespace tqkv::cuda::detail
")
        list(APPEND _srcs ${_file})
        set(_body "")
        set(_in 0)
        math(EXPR _unit "${_unit} + 1")
      endif()
    endforeach()
  endforeach()
  string(APPEND _text "\n")
  set(${out_sources} ${_srcs} PARENT_SCOPE)
  set(${out_text} "${_text}" PARENT_SCOPE)
endfunction()

# One fused kernel with an f16 window (w<N> without wq<B>; sinks alone), which no recipe uses,
# so that form of the kernel stays compiled and tested (tests/engine/test_cuda_engine.cpp).
list(APPEND _quads "64,kmse(5),vmse(3),K_F16,V_F16")
_tqkv_emit("${_pairs}" TQKV_DECODE_PAIRS "Kernel make_kernel" decode_pairs ${TQKV_DECODE_PER_TU} _pair_sources
           _pair_text)
_tqkv_emit("${_quads}" TQKV_FUSED_QUADS "FusedKernel make_fused_kernel" decode_fused ${TQKV_FUSED_PER_TU} _quad_sources
           _quad_text)
set(_pairs_sorted ${_pairs})
set(_quads_sorted ${_quads})
list(LENGTH _pairs_sorted _n_pairs)
list(LENGTH _quads_sorted _n_quads)
file(CONFIGURE OUTPUT ${_gen}/decode_pairs.h @ONLY CONTENT
"// Generated by src/cuda/decode_pairs.cmake from recipes/*.json and the named formats:
// ${_n_pairs} decode kernels X(head dim, key kind, value kind) and ${_n_quads} fused ones
// X(head dim, middle key kind, middle value kind, window key kind, window value kind).
#pragma once

${_pair_text}${_quad_text}")
set(_decode_sources ${_quad_sources} ${_pair_sources})
list(LENGTH _decode_sources _n_units)
message(STATUS "tqkv: ${_n_pairs} decode kernels and ${_n_quads} fused decode kernels in ${_n_units} units (recipes/*.json)")
