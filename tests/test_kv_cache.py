"""Incremental decoding with a KV cache (scalebook.llama.KVCache, generate(use_cache=True)).

Claims: cached decoding yields the same tokens as decoding without a cache and as Hugging Face's generate with
its cache on the same weights; the cache holds exactly accounting.kv_cache_bytes; the published GQA savings
of Llama 3 follow from the formula.
"""

import pytest
import torch

from scalebook import accounting, configs
from scalebook.generate import generate
from scalebook.llama import LlamaConfig, LlamaLM
from scalebook.model import GPT, GPTConfig

CFG = LlamaConfig(vocab_size=96, block_size=48, n_layer=2, n_head=4, n_kv_head=2, n_embd=64, d_ff=176)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return LlamaLM(CFG).eval()


def test_cached_logits_equal_the_full_forward_pass(model):
    """Prefill 5 tokens, then a chunk of 3 (its own causal mask over the cache), then one token at a time."""
    idx = torch.randint(0, CFG.vocab_size, (2, 20))
    with torch.no_grad():
        full, _ = model(idx)
        cache = model.new_cache(2, 20)
        pieces = [model(idx[:, :5], cache=cache)[0], model(idx[:, 5:8], cache=cache)[0]]
        pieces += [model(idx[:, t : t + 1], cache=cache)[0] for t in range(8, 20)]
    assert cache.length == 20
    # fp32: a query attends to the same keys in both, but over a key length of 8 to 20 rather than 20 positions,
    # so the kernel may sum in another order: ~1e-7 relative.
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-5, atol=1e-6)


def test_greedy_decoding_with_cache_equals_without_and_hugging_face(model):
    prompt = torch.randint(0, CFG.vocab_size, (2, 6))
    cached = generate(model, prompt, 40, temperature=0, use_cache=True)
    uncached = generate(model, prompt, 40, temperature=0)
    theirs = model.to_hf().generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                    use_cache=True, max_new_tokens=40)  # fmt: skip
    assert torch.equal(cached, uncached)
    assert torch.equal(cached, theirs)


def test_sampling_with_cache_draws_the_same_tokens_as_hugging_face(model):
    prompt = torch.randint(0, CFG.vocab_size, (1, 4))
    hf_model = model.to_hf()  # built first: its initialisation draws from the global generator
    torch.manual_seed(3)
    ours = generate(model, prompt, 30, temperature=0.9, top_k=20, top_p=0.9, use_cache=True)
    torch.manual_seed(3)
    theirs = hf_model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=True, temperature=0.9,
                               top_k=20, top_p=0.9, use_cache=True, max_new_tokens=30)  # fmt: skip
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_holds_kv_cache_bytes(model, dtype):
    batch, positions = 3, 40
    cache = model.to(dtype).new_cache(batch, positions)
    model.float()
    assert cache.layers[0].k.shape == (batch, CFG.n_kv_head, positions, CFG.head_dim)
    assert cache.nbytes == accounting.kv_cache_bytes(CFG.to_model_config(), seq_len=positions, batch=batch,
                                                     dtype_bytes=dtype.itemsize)  # fmt: skip


def test_llama3_kv_cache_sizes():
    """Llama 3 8B: 2 x 32 layers x 8 kv heads x 128 x 2 bytes = 128 KiB per token in bf16, 1 GiB at 8k; MHA
    (32 kv heads) would be 4 times that, MQA one eighth."""
    llama = configs.get_model("llama-3-8b")
    gqa = accounting.kv_cache_bytes(llama, seq_len=8192)
    assert gqa == 2**30
    assert accounting.kv_cache_bytes(llama, seq_len=8192, n_kv_heads=llama.n_heads) == 4 * gqa
    assert accounting.kv_cache_bytes(llama, seq_len=8192, n_kv_heads=1) * 8 == gqa
    assert accounting.kv_cache_bytes(llama, seq_len=8192, dtype_bytes=1) * 2 == gqa
    with pytest.raises(ValueError, match="must divide n_heads"):
        accounting.kv_cache_bytes(llama, seq_len=8192, n_kv_heads=3)


def test_cache_errors_say_what_to_change(model):
    prompt = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="use_cache=False"):
        generate(GPT(GPTConfig(block_size=16)), prompt, 2, use_cache=True)
    with pytest.raises(ValueError, match="exceeds block_size"):
        generate(model, prompt, CFG.block_size, temperature=0, use_cache=True)
    cache = model.new_cache(1, 4)
    with pytest.raises(ValueError, match="holds 4 positions"):
        model(torch.zeros(1, 5, dtype=torch.long), cache=cache)
