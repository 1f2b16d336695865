"""torch.ops.tqkv_vllm over vLLM's TurboQuant cache tensor, with fake implementations.

The cache argument is the view vLLM's backend hands its Triton kernels,
``kv_cache.transpose(1, 2)``: uint8 ``[num_blocks, block_size, num_kv_heads, slot_bytes]``
with the strides of vLLM's allocation. Key bits are 3 or 4 (MSE keys) or 8 (FP8 keys); value
bits 3 or 4 (vLLM's presets). Every op runs on its tensors' device and torch's current stream
and allocates nothing on the device, except ``store``'s MSE-key pre-processing (torch
operations, the same as vLLM's, so that the bytes are vLLM's).
"""

from __future__ import annotations

import math
import os

import torch

from . import _C  # noqa: F401  (registers torch.ops.tqkv_vllm)

MAX_SPLITS: int = torch.ops.tqkv_vllm.max_splits()
# The decode kernels (csrc/ops.h, DecodeKernel): auto takes the tensor-core kernel for GQA groups
# of up to 8 query heads and the CUDA-core one above.
KERNELS = {"auto": 0, "scalar": 1, "mma": 2}


def kernel_from_env() -> int:
    """TQKV_VLLM_DECODE: auto (default), scalar (CUDA cores) or mma (tensor cores)."""
    name = os.environ.get("TQKV_VLLM_DECODE", "auto").strip().lower()
    if name not in KERNELS:
        raise ValueError(f"TQKV_VLLM_DECODE={name!r}: one of {', '.join(KERNELS)}")
    return KERNELS[name]
# CTAs per SM the split count aims at: splits = ceil(this * SMs / (batch * kv heads)).
_CTAS_PER_SM = 4


@torch.library.register_fake("tqkv_vllm::store")
def _store_fake(key, value, kv_cache, slot_mapping, y, norms, midpoints, key_bits, value_bits):
    return None


@torch.library.register_fake("tqkv_vllm::decode")
def _decode_fake(query, kv_cache, block_table, seq_lens, centroids, out, workspace, key_bits, value_bits,
                 norm_correction, scale, num_splits, kernel=0):
    return None


@torch.library.register_fake("tqkv_vllm::dequant")
def _dequant_fake(kv_cache, block_table, centroids, k_out, v_out, n_tokens, key_bits, value_bits, norm_correction):
    return None


def num_splits(batch: int, n_kv_heads: int, device: torch.device, cap: int = MAX_SPLITS) -> int:
    """KV splits per (sequence, kv head): a function of the batch shape alone, so a CUDA graph
    captured for a batch size stays right for every sequence length."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = math.ceil(_CTAS_PER_SM * sms / max(1, batch * n_kv_heads))
    return max(1, min(want, cap, MAX_SPLITS))


def store(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
          key_bits: int, value_bits: int, rotation: torch.Tensor | None = None,
          midpoints: torch.Tensor | None = None) -> None:
    """Write key, value [n_tokens, n_kv_heads, head_dim] into the slots of slot_mapping.

    MSE keys: ``rotation`` is vLLM's Hadamard [D, D] float32 (``layer._tq_PiT``) and ``midpoints``
    its bucket bounds (``layer._tq_midpoints``); the keys are normalised and rotated with the
    torch operations vLLM's store uses, then bucketed and packed by the kernel."""
    n = slot_mapping.shape[0]
    if n == 0:
        return
    if key_bits == 8:
        torch.ops.tqkv_vllm.store(key, value, kv_cache, slot_mapping, None, None, None, key_bits, value_bits)
        return
    d = key.shape[-1]
    k = key[:n].float().reshape(-1, d)
    norms = k.norm(dim=1, keepdim=True)
    y = (k / (norms + 1e-8)) @ rotation
    torch.ops.tqkv_vllm.store(key, value, kv_cache, slot_mapping, y, norms.squeeze(1), midpoints, key_bits,
                              value_bits)


def decode(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
           centroids: torch.Tensor | None, out: torch.Tensor, workspace: torch.Tensor, key_bits: int,
           value_bits: int, norm_correction: bool, scale: float, splits: int, kernel: int = 0) -> torch.Tensor:
    """Attention of query [batch, n_q_heads, head_dim] (row b at position seq_lens[b] - 1) over
    the cached keys [0, seq_lens[b]) of block_table's row b, into out [batch, n_q_heads,
    head_dim]. workspace: float32, at least batch * n_q_heads * splits * (head_dim + 1). kernel: KERNELS."""
    torch.ops.tqkv_vllm.decode(query, kv_cache, block_table, seq_lens, centroids, out, workspace, key_bits,
                               value_bits, norm_correction, float(scale), int(splits), int(kernel))
    return out


def dequant(kv_cache: torch.Tensor, block_table: torch.Tensor, centroids: torch.Tensor | None,
            k_out: torch.Tensor, v_out: torch.Tensor, n_tokens: int, key_bits: int, value_bits: int,
            norm_correction: bool) -> None:
    """Tokens [0, n_tokens) of one sequence (block_table: its pages) into k_out, v_out
    [>= n_tokens, n_kv_heads, head_dim], keys in the original (unrotated) domain."""
    torch.ops.tqkv_vllm.dequant(kv_cache, block_table, centroids, k_out, v_out, n_tokens, key_bits, value_bits,
                                norm_correction)
