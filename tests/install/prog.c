/* A C program built against the installed tqkv through pkg-config (tests/install/run.sh):
 * quantize a few positions, read one back, run attention, and check an error is reported. */
#include <math.h>
#include <stdio.h>

#include <tqkv/tqkv.h>

int main(void) {
  enum { kDim = 64, kHeads = 2, kQHeads = 4, kLen = 8 };
  fa_tq_state* st = fa_tq_init(kDim, fa_tq_config_default(), 7u);
  fa_tq_cache* cache = st ? fa_tq_cache_new(st, 1, kHeads, kLen) : NULL;
  if (!cache) {
    fprintf(stderr, "init failed: %s\n", fa_tq_last_error_message());
    return 1;
  }
  float k[kHeads * kDim], q[kQHeads * kDim], back[kHeads * kDim], out[kQHeads * kDim];
  for (int pos = 0; pos < kLen; ++pos) {
    for (int i = 0; i < kHeads * kDim; ++i) k[i] = sinf(0.1f * (float)(i + 7 * pos));
    fa_tq_quantize(st, cache, 0, pos, k, true);
    fa_tq_quantize(st, cache, 0, pos, k, false);
  }
  for (int i = 0; i < kQHeads * kDim; ++i) q[i] = cosf(0.05f * (float)i);
  if (!fa_tq_dequantize(st, cache, 0, kLen - 1, 1, true, back)) return 2;
  double err = 0, norm = 0;
  for (int i = 0; i < kHeads * kDim; ++i) {
    err += (back[i] - k[i]) * (back[i] - k[i]);
    norm += k[i] * k[i];
  }
  if (fa_tq_attention(st, cache, 0, kLen - 1, q, kQHeads, 0.0f, out) != 0) return 3;
  fa_tq_quantize(st, cache, 3, 0, k, true); /* no layer 3: reported, nothing written */
  if (fa_tq_last_error() != FA_TQ_ERR_OUT_OF_RANGE) return 4;
  printf("tqkv C API: %d bytes/token, relative key error %.3f, out[0] %.4f\n", fa_tq_cache_bytes_per_token(cache),
         sqrt(err / norm), out[0]);
  fa_tq_cache_free(cache);
  fa_tq_free(st);
  return err / norm < 0.05 ? 0 : 5;
}
