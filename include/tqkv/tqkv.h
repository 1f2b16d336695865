/* tqkv C API: the spec's fa_tq_* functions on raw buffers, usable from plain C (C99+).
 *
 * A state (fa_tq_state) fixes head_dim, the K/V bit pair and the rotation seed; it maps to
 * the format "tq-k<K>v<V>" (Lloyd-Max keys and values on the unit sphere, SRHT rotation,
 * norm correction; docs/FORMAT.md). A cache holds num_layers x num_heads x max_seq_len slots
 * addressed as a ring buffer: position p lives in slot p % max_seq_len, so writing position
 * max_seq_len evicts position 0.
 *
 * Errors: functions returning a pointer return NULL, functions returning int return -1 (or a
 * nonzero fa_tq_status), and void functions return normally; in every case
 * fa_tq_last_error() (per thread) then gives the status of the last call and
 * fa_tq_last_error_message() its text. A call that fails changes nothing: NaN/Inf input,
 * an out-of-range layer, head or position, or a norm beyond fp16 range leave the cache as it
 * was. Every successful call resets the status to FA_TQ_OK.
 *
 * A NULL state, cache, vector or output, and a cache passed with a state other than the one it
 * was created with, are FA_TQ_ERR_INVALID_ARGUMENT (never dereferenced). fa_tq_free(NULL) and
 * fa_tq_cache_free(NULL) do nothing.
 */
#ifndef TQKV_TQKV_H
#define TQKV_TQKV_H

#include <stdbool.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Bit allocation: key_bits and value_bits each in 2..4 (default K4/V2). */
typedef struct {
  int key_bits;
  int value_bits;
} fa_tq_config;

typedef struct fa_tq_state fa_tq_state;
typedef struct fa_tq_cache fa_tq_cache;

typedef enum {
  FA_TQ_OK = 0,
  FA_TQ_ERR_INVALID_ARGUMENT = 1,
  FA_TQ_ERR_NON_FINITE = 2,
  FA_TQ_ERR_OUT_OF_RANGE = 3,
  FA_TQ_ERR_CAPACITY = 4,
  FA_TQ_ERR_OVERFLOW = 5,
  FA_TQ_ERR_DEVICE = 6 /* the device runtime failed (CUDA) */
} fa_tq_status;

fa_tq_config fa_tq_config_default(void);

/* head_dim >= 2 (power-of-two dims use SRHT, others a dense random rotation). NULL on a bad
 * argument. Call once at model load time. */
fa_tq_state* fa_tq_init(int head_dim, fa_tq_config config, uint64_t seed);
void fa_tq_free(fa_tq_state* state);

/* The state must outlive its caches. NULL on a bad argument. */
fa_tq_cache* fa_tq_cache_new(fa_tq_state* state, int num_layers, int num_heads, int max_seq_len);
void fa_tq_cache_free(fa_tq_cache* cache);
void fa_tq_cache_clear(fa_tq_cache* cache);
/* Number of positions written so far (the next position to append); the cache holds the
 * last min(seq_len, max_seq_len) of them, from fa_tq_cache_first_pos(). -1 for NULL. */
int fa_tq_cache_seq_len(fa_tq_cache* cache);

/* Quantizes one K or V vector of all heads, vec: [num_heads * head_dim] floats, into position
 * pos of one layer. pos must be an already-held position or seq_len (append). */
void fa_tq_quantize(fa_tq_state* state, fa_tq_cache* cache, int layer, int pos, const float* vec, bool is_key);

/* Dequantizes positions [start, start + count) of one layer into
 * out: [count * num_heads * head_dim] floats. Returns out, or NULL on error. */
float* fa_tq_dequantize(fa_tq_state* state, fa_tq_cache* cache, int layer, int start, int count, bool is_key,
                        float* out);

/* --- extensions --- */

fa_tq_status fa_tq_last_error(void);
const char* fa_tq_last_error_message(void);

/* First position still held (positions before it were evicted). -1 for NULL. */
int fa_tq_cache_first_pos(fa_tq_cache* cache);
/* Drops the n oldest held positions; 0 on success, -1 on error. */
int fa_tq_cache_evict(fa_tq_cache* cache, int n);
/* Bytes per position (all layers and heads). */
int fa_tq_cache_bytes_per_token(fa_tq_cache* cache);

/* Attention of one query token at position pos (already quantized into the cache) over the
 * held positions <= pos of one layer, computed on the compressed cache in the rotated
 * domain (q rotated once, output rotated back once, no dequantized copy).
 *   q:   [num_q_heads * head_dim], num_q_heads a multiple of num_heads (grouped-query);
 *        query head i uses kv head i / (num_q_heads / num_heads)
 *   out: [num_q_heads * head_dim]
 *   scale: softmax scale; 0 means 1/sqrt(head_dim)
 * Returns 0 on success, -1 on error (out untouched). */
int fa_tq_attention(fa_tq_state* state, fa_tq_cache* cache, int layer, int pos, const float* q, int num_q_heads,
                    float scale, float* out);

#ifdef __cplusplus
}
#endif

#endif /* TQKV_TQKV_H */
