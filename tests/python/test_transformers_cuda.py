"""TQCache on a GPU (tqkv.torch's paged cache and CUDA kernels): the same greedy tokens as on the
CPU for a small randomly initialised Llama, the cache kept on the device, and the spec errors.
Skipped without a CUDA device or a module built with the CUDA ops (a failure then when
TQKV_REQUIRE_CUDA=1; a failure for a missing torch or transformers when TQKV_REQUIRE_TORCH=1, as
in the other transformers tests)."""
import inspect

import pytest

from conftest import needs_cuda, require_module

torch = require_module("torch", cuda=True)
transformers = require_module("transformers", cuda=True)

import tqkv.torch as tq  # noqa: E402
import tqkv.transformers as tt  # noqa: E402
import copies_check  # noqa: E402

pytestmark = needs_cuda(torch, tq)


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

    def checked(layer, query, start, scale, window, pending=None, fresh=None):
        out = on_codes(layer, query, start, scale, window, pending, fresh)
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
    k = torch.randn(1, 2, 3, 64, device="cuda")
    cache = tt.TQCache(model.config, spec="k4v4+skip0", max_cache_len=8)
    with pytest.raises(ValueError, match="capacity 8"):
        cache.update(torch.randn(1, 2, 9, 64, device="cuda"), torch.randn(1, 2, 9, 64, device="cuda"), 0)
    with pytest.raises(ValueError, match="head_dim=64"):
        cache.update(torch.randn(1, 2, 3, 32, device="cuda"), torch.randn(1, 2, 3, 32, device="cuda"), 0)
    cache.update(k, k, 0)
    with pytest.raises(ValueError, match="batch 2"):
        cache.update(torch.randn(2, 2, 1, 64, device="cuda"), torch.randn(2, 2, 1, 64, device="cuda"), 0)


@pytest.mark.parametrize("spec", ["tq-4.375", "tq-3.375"])
def test_sinks_and_window_on_cuda_equal_the_cpu(spec):
    """SmolLM2's recipes (+sink1+wq6+fill<B>: an f16 sink, a 6-bit recent window of 7 positions at
    capacity 512) on a random Llama of SmolLM2's shape: on the GPU (sinks as f16 tensors, the window
    in a paged 6-bit ring, SDPA over [sinks | compressed | window]) the greedy tokens of the CPU
    cache layer (tqkv.ModelCache) over 32 steps, teacher-forced along the CPU's tokens so that a
    near tie flipped by the GPU's rounding (or a code flip of its store kernel) does not derail the
    rest; the logits within 2 % of their largest; one layer's attention on the same inputs within
    2 % too (f32 model; the GPU's and the CPU's encoders may round a code differently)."""
    model = copies_check.smol_shaped_llama()
    ids = copies_check.prompt()
    cpu = tt.TQCache(model.config, spec=spec, max_cache_len=copies_check.CAPACITY)
    want = copies_check.greedy_logits(model, ids, cpu, 32)
    want_layer = copies_check.layer_outputs(model.config, spec, "cpu")
    model = model.cuda()
    cache = tt.TQCache(model.config, spec=spec, max_cache_len=copies_check.CAPACITY)
    got = copies_check.greedy_logits(model, ids.cuda(), cache, 32, forced=want[0])
    copies_check.check_greedy(want, got, margin=1e-2, rel=2e-2)
    st = cache._cuda
    assert (st.sinks, st.window) == (1, 7) and all(r.is_cuda for r in st.rings if r is not None)
    assert cache.bytes() == cpu.bytes()
    for a, b in zip(want_layer, copies_check.layer_outputs(model.config, spec, "cuda")):
        assert ((b - a).abs().max() / a.abs().max()).item() < 2e-2
