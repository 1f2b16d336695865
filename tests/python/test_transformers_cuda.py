"""TQCache on a GPU (tqkv.torch's paged cache and CUDA kernels): the same greedy tokens as on the
CPU for a small randomly initialised Llama, the cache kept on the device, and the spec errors.
Skipped without a CUDA device or a module built with the CUDA ops (a failure for a missing torch
or transformers when TQKV_REQUIRE_TORCH=1, as in the other transformers tests)."""
import inspect

import pytest

from conftest import require_module

torch = require_module("torch")
transformers = require_module("transformers")

import tqkv.torch as tq  # noqa: E402
import tqkv.transformers as tt  # noqa: E402

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and tq.has_cuda),
                                reason="needs a CUDA device and tqkv built with the CUDA ops")


def tiny_llama(head_dim=64):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=4 * head_dim, intermediate_size=512,
                                   num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=head_dim, max_position_embeddings=256, initializer_range=0.2,
                                   attn_implementation="tqkv")
    return transformers.LlamaForCausalLM(cfg).eval()


def greedy(model, ids, cache, n=8):
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.no_grad():
        out = model.generate(ids, **{kw: cache}, max_new_tokens=n, do_sample=False)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("spec", ["f16", "k8v8+skip0", "turboquant_4bit_nc+skip0"])
def test_greedy_tokens_on_cuda_equal_the_cpu(spec):
    model = tiny_llama()
    ids = torch.randint(0, 512, (1, 24), generator=torch.Generator().manual_seed(1))
    want = greedy(model, ids, tt.TQCache(model.config, spec=spec, max_cache_len=64))
    model = model.cuda()
    cache = tt.TQCache(model.config, spec=spec, max_cache_len=64)
    got = greedy(model, ids.cuda(), cache)
    assert got == want
    assert cache._cuda is not None and all(c.is_cuda for c in cache._cuda.caches)  # stayed on the GPU
    assert cache.layers[0].decoded().is_cuda


def test_cuda_decode_equals_float_attention_over_the_decoded_history():
    """Decode steps on the GPU: the kernel's output equals softmax attention over what the
    cache decodes (bf16 model, batch 3)."""
    model = tiny_llama().cuda().to(torch.bfloat16)
    cache = tt.TQCache(model.config, spec="k4v4+skip0", max_cache_len=64)
    worst = []
    on_codes = tt.TQLayer.attention

    def checked(layer, query, start, scale, window, pending=None):
        out = on_codes(layer, query, start, scale, window, pending)
        if query.shape[2] == 1:
            group = query.shape[1] // layer.n_kv_heads
            k = layer.decoded(keys=True).repeat_interleave(group, 1).float()
            v = layer.decoded(keys=False).repeat_interleave(group, 1).float()
            want = torch.softmax((query.float() @ k.transpose(-1, -2)) * scale, -1) @ v
            worst.append(((out.float() - want.transpose(1, 2)).abs().max() / want.abs().max()).item())
        return out

    ids = torch.randint(0, 512, (3, 16), device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    tt.TQLayer.attention = checked
    try:
        greedy(model, ids, cache, n=4)
    finally:
        tt.TQLayer.attention = on_codes
    assert len(worst) == 3 * 4 and max(worst) < 3e-2  # bf16 queries, keys and outputs


def test_cuda_spec_errors_raise():
    model = tiny_llama().cuda()
    cache = tt.TQCache(model.config, spec="k4v4+skip0+sink2+w8", max_cache_len=64)  # fine on the CPU
    k = torch.randn(1, 2, 3, 64, device="cuda")
    with pytest.raises(ValueError, match="CPU only"):
        cache.update(k, k, 0)
    cache = tt.TQCache(model.config, spec="k4v4+skip0", max_cache_len=8)
    with pytest.raises(ValueError, match="capacity 8"):
        cache.update(torch.randn(1, 2, 9, 64, device="cuda"), torch.randn(1, 2, 9, 64, device="cuda"), 0)
    with pytest.raises(ValueError, match="head_dim=64"):
        cache.update(torch.randn(1, 2, 3, 32, device="cuda"), torch.randn(1, 2, 3, 32, device="cuda"), 0)
    cache.update(k, k, 0)
    with pytest.raises(ValueError, match="batch 2"):
        cache.update(torch.randn(2, 2, 1, 64, device="cuda"), torch.randn(2, 2, 1, 64, device="cuda"), 0)
