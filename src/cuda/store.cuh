// Fused store kernel (see store.cu): tqkv::cuda::store in include/tqkv/cuda.h is its entry.
#pragma once
#include "tqkv/cuda.h"
