"""Graph breaks of one decoding step on the real SmolLM2 (`torch._dynamo.explain`), unpatched, under ReRoPE,
leaky ReRoPE, Self-Extend and DCA (each + logn) and under a SinkCache: `python benchmarks/graph_breaks.py` (fetches the checkpoint on first use)."""

import torch
import transformers

import hf_attnscale as hfa

torch.set_num_threads(2)
path = str(hfa.fetch("smollm2-135m"))


def step_breaks(options, cache_of):
    """Graph breaks in one decoding step after a 300-token prefill, with ``options`` patched (None: unpatched)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if options is not None:
        hfa.patch(model, **options)
    ids = torch.randint(0, 1000, (1, 300), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache = cache_of(model)
        model(input_ids=ids, past_key_values=cache)
        explained = torch._dynamo.explain(model)(input_ids=ids[:, :1], past_key_values=cache)
    return explained.graph_break_count


rows = {
    "unpatched, DynamicCache": (None, lambda m: transformers.DynamicCache(config=m.config)),
    "ReRoPE w128 + logn, DynamicCache": (
        dict(rerope_window=128, scale="logn", train_length=8192),
        lambda m: transformers.DynamicCache(config=m.config),
    ),
    "leaky ReRoPE w128 k16 + logn, DynamicCache": (
        dict(rerope_window=128, rerope_leak=16, scale="logn", train_length=8192),
        lambda m: transformers.DynamicCache(config=m.config),
    ),
    "Self-Extend G4 w128 + logn, DynamicCache": (  # 300 tokens: the far, grouped keys are reached
        dict(self_extend_group=4, self_extend_window=128, scale="logn", train_length=8192),
        lambda m: transformers.DynamicCache(config=m.config),
    ),
    "DCA s160 l32 + logn, DynamicCache": (  # chunks of 128: the step meets its own, the previous and older ones
        dict(dual_chunk_size=160, dual_chunk_local=32, scale="logn", train_length=8192),
        lambda m: transformers.DynamicCache(config=m.config),
    ),
    "logn + zero_kv, SinkCache(4, 252)": (
        dict(scale="logn", train_length=8192, zero_kv=True),
        lambda m: hfa.SinkCache(4, 252),
    ),
}
for name, (options, cache_of) in rows.items():
    print(f"{name}: {step_breaks(options, cache_of)} graph breaks", flush=True)
