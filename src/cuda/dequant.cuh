// Dequantize kernel (see dequant.cu): tqkv::cuda::dequantize in include/tqkv/cuda.h is its entry.
#pragma once
#include "tqkv/cuda.h"
