/* Compiled as plain C: proves tqkv.h is a usable C header. Returns 0 on success, else the
 * number of the failed check. */
#include <math.h>
#include <stdlib.h>

#include "tqkv/tqkv.h"

int tqkv_c_smoke(void) {
  fa_tq_config cfg = fa_tq_config_default();
  if (cfg.key_bits != 4 || cfg.value_bits != 2) return 1;
  fa_tq_state* st = fa_tq_init(64, cfg, 42u);
  if (!st) return 2;
  fa_tq_cache* cache = fa_tq_cache_new(st, 2, 3, 16);
  if (!cache) return 3;
  float vec[3 * 64], out[3 * 64], q[6 * 64], att[6 * 64];
  for (int i = 0; i < 3 * 64; ++i) vec[i] = sinf((float)i);
  for (int i = 0; i < 6 * 64; ++i) q[i] = cosf((float)i);
  for (int pos = 0; pos < 4; ++pos)
    for (int layer = 0; layer < 2; ++layer) {
      fa_tq_quantize(st, cache, layer, pos, vec, true);
      fa_tq_quantize(st, cache, layer, pos, vec, false);
      if (fa_tq_last_error() != FA_TQ_OK) return 4;
    }
  if (fa_tq_cache_seq_len(cache) != 4) return 5;
  if (fa_tq_dequantize(st, cache, 1, 0, 1, true, out) != out) return 6;
  if (fa_tq_attention(st, cache, 0, 3, q, 6, 0.0f, att) != 0) return 7;
  /* Out-of-range layer: reported, nothing written. */
  fa_tq_quantize(st, cache, 5, 4, vec, true);
  if (fa_tq_last_error() != FA_TQ_ERR_OUT_OF_RANGE) return 8;
  if (fa_tq_cache_seq_len(cache) != 4) return 9;
  fa_tq_cache_clear(cache);
  if (fa_tq_cache_seq_len(cache) != 0) return 10;
  fa_tq_cache_free(cache);
  fa_tq_free(st);
  return 0;
}
