"""vLLM's TurboQuant backend with tqkv's CUDA kernels (imported by vLLM through the registry).

``TqkvTurboQuantBackend`` is vLLM's ``TurboQuantAttentionBackend`` with another impl class: its
name (TURBOQUANT), supported dtypes and block sizes, cache shape (the slot layout), metadata
builder, CUDA-graph support and boundary layers are vLLM's. ``TqkvTurboQuantImpl`` keeps
vLLM's ``forward`` (the split into decodes and prefills, first-chunk prefills on FlashAttention
over the raw K/V) and ``_ensure_on_device`` (the Hadamard, centroids and midpoints) and replaces
what calls Triton:
  _store_kv           tqkv_vllm.store: bytes identical to vLLM's store;
  _decode_attention   tqkv_vllm.decode on vLLM's workspace (no allocation, no host sync);
  _prefill_attention  continuation chunks: tqkv_vllm.decode per query row (short chunks) or
                      tqkv_vllm.dequant then FlashAttention (long chunks), as vLLM splits them.
A layer the kernels do not cover (head dim other than 64/128/256, a GQA group over 16, a GPU
other than sm_90) runs vLLM's own methods.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from vllm.v1.attention.backends import turboquant_attn as _tq
from vllm.v1.worker.workspace import current_workspace_manager, is_workspace_manager_initialized

from . import ops

logger = logging.getLogger("vllm.plugins.tqkv")

# What this subclass overrides or calls of vLLM's impl: a vLLM without them is not one this
# plugin was written against (the version check should have refused it first).
_PARENT_METHODS = ("_store_kv", "_decode_attention", "_prefill_attention", "_ensure_on_device",
                   "_flash_attn_varlen", "forward", "do_kv_cache_update")
_missing = [m for m in _PARENT_METHODS if not hasattr(_tq.TurboQuantAttentionImpl, m)]
if _missing:
    raise ImportError(f"tqkv: vLLM's TurboQuantAttentionImpl lacks {', '.join(_missing)}; "
                      "this vLLM is not one tqkv-vllm supports (TQKV_VLLM=0 turns the plugin off)")

HEAD_DIMS = (64, 128, 256)
MAX_GROUP = 16


def kernels_cover(head_size: int, num_heads: int, num_kv_heads: int, device: torch.device | None = None) -> str | None:
    """None where tqkv's kernels serve a layer of this shape, else why not."""
    if head_size not in HEAD_DIMS:
        return f"head dim {head_size} (tqkv covers {', '.join(map(str, HEAD_DIMS))})"
    group = num_heads // max(1, num_kv_heads)
    if group * num_kv_heads != num_heads or group > MAX_GROUP:
        return f"{num_heads} query heads over {num_kv_heads} kv heads (tqkv covers whole groups of <= {MAX_GROUP})"
    if not torch.cuda.is_available():
        return "no CUDA device"
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        return f"compute capability {major}.{minor} (tqkv's kernels are built for sm_90)"
    return None


class TqkvTurboQuantImpl(_tq.TurboQuantAttentionImpl):
    """vLLM's TurboQuant impl with tqkv's store, decode and continuation kernels."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        cfg = self.tq_config
        self._key_bits = 8 if cfg.key_fp8 else cfg.key_mse_bits
        self._value_bits = cfg.effective_value_quant_bits
        self._norm_correction = bool(cfg.norm_correction)
        self._kernel = ops.kernel_from_env()
        why = kernels_cover(self.head_size, self.num_heads, self.num_kv_heads)
        self._tqkv = why is None
        if why is not None:
            logger.warning("tqkv: this layer keeps vLLM's Triton kernels: %s", why)

    # -- store ------------------------------------------------------------------------------
    def _store_kv(self, key, value, kv_cache, slot_mapping, layer):
        if not self._tqkv:
            return super()._store_kv(key, value, kv_cache, slot_mapping, layer)
        ops.store(key, value, kv_cache, slot_mapping, self._key_bits, self._value_bits,
                  None if self._key_bits == 8 else layer._tq_PiT,
                  None if self._key_bits == 8 else layer._tq_midpoints)

    # -- decode -----------------------------------------------------------------------------
    def _decode_into(self, query, kv_cache, block_table, seq_lens, centroids, out, workspace, splits):
        return ops.decode(query, kv_cache, block_table, seq_lens, None if self._key_bits == 8 else centroids,
                          out, workspace, self._key_bits, self._value_bits, self._norm_correction, self.scale,
                          splits, self._kernel)

    def _decode_attention(self, query, kv_cache, attn_metadata, Pi, centroids, PiT=None, layer=None):
        if not self._tqkv:
            return super()._decode_attention(query, kv_cache, attn_metadata, Pi, centroids, PiT, layer)
        b, hq, d = query.shape
        splits = ops.num_splits(b, self.num_kv_heads, query.device, self.max_num_kv_splits)
        if is_workspace_manager_initialized():
            # Within what vLLM's metadata builder reserves for its own decode (no growth, so
            # CUDA-graph capture and the locked workspace are safe).
            workspace, out = current_workspace_manager().get_simultaneous(
                ((b, hq, splits, d + 1), torch.float32), ((b, hq, d), query.dtype))
        else:
            workspace = torch.empty(b, hq, splits, d + 1, dtype=torch.float32, device=query.device)
            out = torch.empty(b, hq, d, dtype=query.dtype, device=query.device)
        return self._decode_into(query, kv_cache, attn_metadata.block_table, attn_metadata.seq_lens, centroids,
                                 out, workspace, splits)

    # -- prefill ----------------------------------------------------------------------------
    def _attend_raw(self, q, k, v, q_len: int, k_len: int) -> torch.Tensor:
        """Causal attention of q_len queries at the end of k_len keys (one request)."""
        if _tq._HAS_FLASH_ATTN:
            cu = getattr(self, "_tqkv_cu", None)
            if cu is None or cu.device != q.device:
                cu = self._tqkv_cu = torch.zeros(2, 2, dtype=torch.int32, device=q.device)
            cu[0, 1:2] = q_len  # fills on the device: no host sync
            cu[1, 1:2] = k_len
            return self._flash_attn_varlen(q=q, k=k, v=v, cu_seqlens_q=cu[0], cu_seqlens_k=cu[1], max_seqlen_q=q_len,
                                           max_seqlen_k=k_len)
        qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        qpos = torch.arange(q_len, device=q.device).unsqueeze(1) + (k_len - q_len)
        mask = torch.arange(k_len, device=q.device).unsqueeze(0) <= qpos
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=self.scale,
                                             enable_gqa=k.shape[1] < q.shape[1])
        return out[0].transpose(0, 1)

    def _continuation(self, q, k, v, kv_cache, block_row, cached: int, seq_len: int, centroids) -> torch.Tensor:
        """A chunk of q_len queries whose first `cached` keys are in the cache (the chunk's own
        keys were stored before attention, as vLLM's update runs first)."""
        q_len, hq, d = q.shape
        if q_len <= _tq._CONTINUATION_DECODE_THRESHOLD:
            # Each query row is a decode at its own position: lengths cached + 1 .. seq_len over
            # one block-table row (stride 0).
            lens = torch.arange(cached + 1, seq_len + 1, dtype=torch.int32, device=q.device)
            splits = ops.num_splits(q_len, self.num_kv_heads, q.device, self.max_num_kv_splits)
            workspace = torch.empty(q_len, hq, splits, d + 1, dtype=torch.float32, device=q.device)
            out = torch.empty_like(q)
            return self._decode_into(q, kv_cache, block_row.expand(q_len, -1), lens, centroids, out, workspace,
                                     splits)
        hk = k.shape[1]
        k_full = torch.empty(seq_len, hk, d, dtype=q.dtype, device=q.device)
        v_full = torch.empty_like(k_full)
        ops.dequant(kv_cache, block_row[0], None if self._key_bits == 8 else centroids, k_full, v_full, cached,
                    self._key_bits, self._value_bits, self._norm_correction)
        k_full[cached:] = k
        v_full[cached:] = v
        return self._attend_raw(q, k_full, v_full, q_len, seq_len)

    def _prefill_attention(self, query, key, value, kv_cache, attn_metadata, Pi, centroids, PiT=None, layer=None):
        md = attn_metadata
        if not self._tqkv or (_tq._HAS_FLASH_ATTN and md.max_query_len == md.max_seq_len):
            # First chunks only: vLLM's FlashAttention over the raw K/V, no TurboQuant kernel.
            return super()._prefill_attention(query, key, value, kv_cache, md, Pi, centroids, PiT, layer=layer)
        # CPU copies where the builder made them (no device-to-host sync).
        starts = (md.query_start_loc_cpu if md.query_start_loc_cpu is not None else md.query_start_loc).tolist()
        lens = (md.seq_lens_cpu if md.seq_lens_cpu is not None else md.seq_lens).tolist()
        output = torch.zeros_like(query)
        for i in range(len(starts) - 1):
            lo, hi = starts[i], starts[i + 1]
            q_len = hi - lo
            if q_len <= 0:
                continue
            seq_len = lens[i]
            q, k, v = query[lo:hi], key[lo:hi], value[lo:hi]
            if q_len == seq_len:
                out = self._attend_raw(q, k, v, q_len, q_len)
            else:
                out = self._continuation(q, k, v, kv_cache, md.block_table[i:i + 1], seq_len - q_len, seq_len,
                                         centroids)
            output[lo:hi] = out.to(query.dtype)
        return output


class TqkvTurboQuantBackend(_tq.TurboQuantAttentionBackend):
    """vLLM's TurboQuant backend (same name, spec, layout, builder) with tqkv's impl."""

    @staticmethod
    def get_impl_cls() -> type[TqkvTurboQuantImpl]:
        return TqkvTurboQuantImpl
