"""The GPU suite: every feature on a device against the eager reference, in fp32 and bf16, forward and backward;
the exit through sdpa in fp32, bf16 and fp16 at head dims 64 / 128 / 256 (one-token decoding with GQA, a
prompt after a cache, padding), under autocast, with a learnable mask bias and beside a family's own sinks;
streaming in chunks against token by token; batched generate with left padding; unpatch; bf16 at 32k tokens;
ReRoPE, Self-Extend and DCA (on CUDA under sdpa the flex key parts, with their check; else key parts on side-by-side channels) forward,
backward, generate and at 32k tokens, and a RoPE rescaling against the checkpoint loaded with it.

    python -m pytest -m gpu                  # on CUDA (every test skips where there is none)
    python -m pytest -m gpu --device cpu     # the same tests on the CPU: checks this suite without a GPU

Backends: sdpa and eager everywhere; flex_attention where it runs (its exit needs CUDA: transformers' own
limit); flash_attention_2 in bf16 on CUDA where the flash-attn package is installed.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import (
    FEATURES,
    GREEDY,
    SHARP_VOCAB,
    VOCAB,
    count_flex_bands,
    model_output,
    patched_and_reference,
    patched_beside_reference,
    sample_inputs,
    sharp_inputs,
    sharp_model,
    stream_logits,
    tiny_model,
)
from model_zoo import reference_of, zoo_model
from reference import reference_attention
from tiny import sharpen
from transformers import AutoModelForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.utils import is_flash_attn_2_available

import hf_attnscale as hfa
from hf_attnscale.core.call import exit
from hf_attnscale.core.options.methods import dual_chunk, rerope, self_extend
from hf_attnscale.core.parts import flex_parts

pytestmark = pytest.mark.gpu

BACKENDS = ["sdpa", "eager", "flex_attention", "flash_attention_2"]
HEADS = {"head_dim": 16}
"""The tiny llama's heads, widened: flex_attention's CUDA kernel takes no head narrower than 16."""
DEVICE_FEATURES = [
    "logn",
    "ssmax",
    "gradmax",
    "zero_kv",
    "sink_learnable",
    "logn+zero_kv",
    "ssmax+sink_learnable",
]


def skip_unless_runs(attn: str, device: torch.device, dtype: torch.dtype, options: dict) -> None:
    """Skip the combinations that cannot run here, saying why."""
    if attn == "flash_attention_2" and (device.type != "cuda" or dtype == torch.float32):
        pytest.skip("flash_attention_2 runs on CUDA in half precision only")
    if attn == "flash_attention_2" and not is_flash_attn_2_available():
        pytest.skip("the flash-attn package is not installed")
    if (
        attn == "flex_attention"
        and device.type != "cuda"
        and (options.get("zero_kv") or options.get("sink_logit"))
    ):
        pytest.skip("an exit under flex_attention needs CUDA")


def sharpen_alike(*models: torch.nn.Module) -> None:
    """`sharpen` every model with the same seed: the same wide weights in each."""
    for model in models:
        sharpen(model, 0, embeddings=True)


def on(device: torch.device, inputs: dict) -> dict:
    return {name: tensor.to(device) for name, tensor in inputs.items()}


@pytest.mark.parametrize("feature", DEVICE_FEATURES)
@pytest.mark.parametrize("attn", BACKENDS)
def test_fp32_matches_reference(device, attn, feature):
    options = FEATURES[feature]
    skip_unless_runs(attn, device, torch.float32, options)
    patched, reference, _, _ = patched_and_reference(
        "llama", attn, options, **HEADS
    )  # GQA: 4 query heads, 2 KV heads
    plain = tiny_model("llama", "sdpa", **HEADS)
    sharpen_alike(patched, reference, plain)
    patched, reference, plain = patched.to(device), reference.to(device), plain.to(device)
    inputs = on(device, sample_inputs("llama"))
    rows = inputs["attention_mask"].bool()
    with torch.no_grad():
        got, want = model_output(patched, **inputs), model_output(reference, **inputs)
        unpatched = model_output(plain, **inputs)
    torch.testing.assert_close(got[rows], want[rows], atol=1e-5, rtol=1e-5)
    assert (got[rows] - unpatched[rows]).abs().max() > 0.5, "the patch barely changed the logits"


@pytest.mark.parametrize("feature", DEVICE_FEATURES)
@pytest.mark.parametrize("attn", BACKENDS)
def test_bf16_error_is_bf16s_own(device, attn, feature):
    """In bf16 the patched model may differ from the fp32 reference by bf16's rounding, and no more.

    The tolerance is measured, not chosen: the unpatched model in bf16 against itself in fp32 gives bf16's own
    error on these logits (its 8-bit mantissa through two layers). The laws multiply logits that bf16 has
    already rounded, by up to log_2(11) = 3.5 here, so the patched model may carry up to ~3.5x that error: the
    bound is 4x. Every patch moves the logits by several times the bound, so a missing or wrong one fails.
    """
    options = FEATURES[feature]
    skip_unless_runs(attn, device, torch.bfloat16, options)
    patched, reference, _, _ = patched_and_reference("llama", attn, options, **HEADS)
    plain = tiny_model("llama", "sdpa", **HEADS)
    sharpen_alike(patched, reference, plain)
    patched, reference, plain = patched.to(device, torch.bfloat16), reference.to(device), plain.to(device)
    plain_half = copy.deepcopy(plain).to(torch.bfloat16)
    plain_half.set_attn_implementation(attn)
    inputs = on(device, sample_inputs("llama"))
    rows = inputs["attention_mask"].bool()
    with torch.no_grad():
        want = model_output(reference, **inputs)[rows]
        error = (model_output(patched, **inputs)[rows].float() - want).abs().max()
        unpatched = model_output(plain, **inputs)[rows]
        own = (model_output(plain_half, **inputs)[rows].float() - unpatched).abs().max()
    bound = 4 * own
    assert own > 0 and error <= bound, f"patched bf16 error {error:.3f}, bound {bound:.3f} (4x bf16's own)"
    assert (want - unpatched).abs().max() > 3 * bound, "the patch moves the logits too little to be tested"


@pytest.mark.parametrize("attn", ["sdpa", "eager", "flex_attention"])
def test_fp32_gradients_match_reference(device, attn):
    options = {"scale": "ssmax", "train_length": 2, "sink_logit": "learnable"}
    skip_unless_runs(attn, device, torch.float32, options)
    patched, reference, states, refs = patched_and_reference("llama", attn, options, **HEADS)
    sharpen_alike(patched, reference)
    patched, reference = patched.to(device), reference.to(device)
    inputs = on(device, sample_inputs("llama"))
    rows = inputs["attention_mask"].bool()
    weight = torch.randn((*rows.shape, VOCAB), device=device)
    for model in (patched, reference):
        model.train()
        (model_output(model, **inputs)[rows] * weight[rows]).sum().backward()
    want = dict(reference.named_parameters())
    for name, p in patched.named_parameters():
        if ".hfa." not in name:
            scale = want[name].grad.abs().max()
            torch.testing.assert_close(p.grad, want[name].grad, atol=1e-5 * scale, rtol=1e-4, msg=name)
    # The sink and slope gradients sum every row of every batch (sizes 3-35 here): fp32's own rounding of that
    # sum is ~1e-6 of its size (the reference's own error against float64 is as large as ours), so the
    # tolerance is relative to the size, as for every other gradient.
    for state, ref in zip(states, refs, strict=True):  # the reference's parameters live on the CPU
        assert state.sink.grad.abs().max() > 0 and state.ssmax.grad.abs().max() > 0
        for mine, theirs in ((state.sink.grad, ref.sink.grad), (state.ssmax.grad, ref.slope.grad)):
            atol = 1e-5 * theirs.abs().max()
            torch.testing.assert_close(mine.cpu(), theirs, atol=atol, rtol=1e-4)


@pytest.mark.parametrize("options", [{}, {"scale": "logn", "train_length": 16, "zero_kv": True}])
def test_streaming_in_chunks_equals_token_by_token(device, options):
    model = hfa.patch(sharp_model("llama"), **options).to(device)
    ids = torch.randint(2, SHARP_VOCAB, (1, 400), device=device)
    with torch.no_grad():
        token_by_token = stream_logits(model, ids, hfa.SinkCache(4, 60), [1])
        chunked = stream_logits(model, ids, hfa.SinkCache(4, 60), [64, 7, 1, 100])
        nll = hfa.perplexity(model, ids[0], cache=hfa.SinkCache(4, 60), chunk_size=128).nll
    torch.testing.assert_close(chunked, token_by_token, atol=1e-4, rtol=0)
    want = torch.nn.functional.cross_entropy(token_by_token[0, :-1].float(), ids[0, 1:], reduction="none")
    torch.testing.assert_close(nll.to(device), want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("feature", ["logn+zero_kv", "ssmax+sink_learnable"])
def test_batched_generate_with_left_padding(device, attn, feature):
    patched, reference, _, _ = patched_and_reference("llama", attn, FEATURES[feature])
    patched, reference = patched.to(device), reference.to(device)
    inputs = on(device, sample_inputs("llama", length=7))
    kwargs = {"max_new_tokens": 6, "do_sample": False, "output_logits": True, "return_dict_in_generate": True}
    got = patched.generate(**inputs, **kwargs, pad_token_id=0)
    want = reference.generate(**inputs, **kwargs, pad_token_id=0)
    assert got.sequences.shape == (3, 13) and torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unpatch_is_bitwise_identical(device, dtype):
    model = tiny_model("llama").to(device, dtype)
    pristine = copy.deepcopy(model)
    inputs = on(device, sample_inputs("llama"))
    hfa.patch(model, scale="ssmax", train_length=4, sink_logit="learnable")
    hfa.patch(model, scale="logn", train_length=4, zero_kv=True)
    with torch.no_grad():
        assert not torch.equal(model_output(model, **inputs), model_output(pristine, **inputs))
        hfa.unpatch(model)
        assert torch.equal(model_output(model, **inputs), model_output(pristine, **inputs))


@pytest.mark.parametrize(
    "options", [{"scale": "logn", "train_length": 64}, {"scale": "logn", "zero_kv": True}]
)
def test_bf16_at_32k_tokens_is_finite(device, options):
    model = tiny_model("llama", num_hidden_layers=1).to(device, torch.bfloat16)
    hfa.patch(model, **{"train_length": 64, **options})
    ids = torch.randint(3, VOCAB, (1, 32768), device=device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, 32768, VOCAB) and torch.isfinite(logits).all()


# (q_len, k_len, mask): one-token decoding without and with a padding mask, a square causal prefill without and
# with one, and a prompt of 5 after a cache of 32 (non-square, with the mask a model passes then).
EXIT_SHAPES = {
    "decode": (1, 37, False),
    "decode, padded": (1, 37, True),
    "prefill": (37, 37, False),
    "prefill, padded": (37, 37, True),
    "prompt after a cache": (5, 37, True),
}


@pytest.mark.parametrize("shape", EXIT_SHAPES)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_exit_through_sdpa_on_the_device(device, dtype, head_dim, shape):
    """The exit as the sdpa backend runs it on the device (transformers' sdpa wrapper, whichever kernel it picks,
    GQA 4:2), forward and backward, against the fp32 reference on the CPU; the length 37 is not a multiple of
    any kernel's block. Half precision keeps 8 (bf16) or 11 (fp16) significant bits: the kernel rounds the
    probabilities and the output, each to 2^-9 of their size at worst, so the bound is 2^-7 of the largest
    output (2^-6 of the largest gradient)."""
    q_len, k_len, padded = EXIT_SHAPES[shape]
    generator = torch.Generator().manual_seed(head_dim + q_len)
    q = torch.randn(2, 4, q_len, head_dim, generator=generator) * 2
    k, v = (torch.randn(2, 2, k_len, head_dim, generator=generator) for _ in range(2))
    visible = (
        torch.ones(q_len, k_len, dtype=torch.bool).tril(k_len - q_len).expand(2, 1, q_len, k_len).clone()
    )
    if padded:
        visible[1, :, :, :5] = (
            False  # row 1 left-padded by 5: in a square prefill its first queries see nothing
        )
    inputs = [t.to(device, dtype).requires_grad_() for t in (q, k, v)]
    sinks = torch.tensor([0.0, 1.5, -1.0, 3.0], device=device, requires_grad=True)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 2, True
    mask = visible.to(device) if padded else None
    call = exit.ExitCall(
        sdpa_attention_forward, module, *inputs, mask, sinks, True, {"scaling": head_dim**-0.5}
    )
    got = exit.sdpa_exit_attention(call).transpose(1, 2)
    leaves = [t.detach().float().cpu().requires_grad_() for t in (*inputs, sinks)]
    want = reference_attention(*leaves[:3], visible, head_dim**-0.5, sink=leaves[3])
    grad = torch.randn(want.shape, generator=generator)
    got.backward(grad.to(device, dtype))
    want.backward(grad)
    exact = dtype == torch.float32
    torch.testing.assert_close(
        got.float().cpu(), want, rtol=0, atol=1e-5 if exact else 2**-7 * want.abs().max().item()
    )
    if padded and q_len == k_len:
        assert bool((got[1, :, :5] == 0).all()), "a query that sees no key must give zero"
    for mine, theirs in zip((*inputs, sinks), leaves, strict=True):
        size = theirs.grad.abs().max().item()
        atol = 1e-5 * size if exact else 2**-6 * size
        torch.testing.assert_close(
            mine.grad.float().cpu(), theirs.grad, rtol=0 if not exact else 1e-4, atol=atol
        )


def test_exit_under_autocast(device):
    """A float32 model under bf16 autocast: the exit is built in bf16 (as the kernel sees it), within bf16's
    error of the fp32 model (the bound of `test_bf16_error_is_bf16s_own`, measured the same way)."""
    options = FEATURES["ssmax+sink_learnable"]
    patched, reference, _, _ = patched_and_reference("llama", "sdpa", options)
    plain = tiny_model("llama", "sdpa")
    sharpen_alike(patched, reference, plain)
    patched, reference, plain = patched.to(device), reference.to(device), plain.to(device)
    inputs = on(device, sample_inputs("llama"))
    rows = inputs["attention_mask"].bool()
    with torch.no_grad():
        want, unpatched = model_output(reference, **inputs)[rows], model_output(plain, **inputs)[rows]
        with torch.autocast(device.type, dtype=torch.bfloat16):
            got = model_output(patched, **inputs)[rows].float()
            own = (model_output(plain, **inputs)[rows].float() - unpatched).abs().max()
    error, bound = (got - want).abs().max(), 4 * own
    assert own > 0 and error <= bound, f"patched autocast error {error:.3f}, bound {bound:.3f}"
    assert (want - unpatched).abs().max() > 3 * bound, "the patch moves the logits too little to be tested"


def test_a_learnable_mask_bias_gets_its_gradient_on_the_device(device):
    """Inkling's relative position bias (a projection folded into the mask) under sdpa with a learnable sink:
    every gradient equals the reference's, fp32."""
    options = {"scale": "logn", "train_length": 2, "sink_logit": "learnable"}
    plain = zoo_model("inkling_text", "sdpa")
    patched = hfa.patch(copy.deepcopy(plain), **options).to(device)
    reference = reference_of(plain, "sdpa", **options).to(device)
    ids = torch.randint(3, 100, (2, 10), generator=torch.Generator().manual_seed(0)).to(device)
    for model in (patched, reference):
        model.train()
        model(input_ids=ids).logits.square().mean().backward()
    want = dict(reference.named_parameters())
    for name, p in patched.named_parameters():
        if ".hfa." not in name:
            scale = want[name].grad.abs().max()
            torch.testing.assert_close(p.grad, want[name].grad, atol=1e-5 * scale, rtol=1e-4, msg=name)


@pytest.mark.parametrize("attn", ["eager", "flash_attention_2"])
def test_a_family_with_sinks_of_its_own_on_the_device(device, attn):
    """granite_swa (learned sinks of its own) with the patch's exit beside them: eager against the reference in
    fp32; flash_attention_2 (one row of sinks, logaddexp of both) against eager in bf16."""
    dtype = torch.float32 if attn == "eager" else torch.bfloat16
    skip_unless_runs(attn, device, dtype, {})
    plain = zoo_model("granite_swa", "eager")
    with torch.no_grad():
        for module in plain.modules():
            if hasattr(module, "sinks"):
                module.sinks.copy_(torch.linspace(-1.0, 2.0, module.sinks.numel()))
    patched = hfa.patch(copy.deepcopy(plain), sink_logit=1.5).to(device)
    reference = reference_of(plain, "eager", sink_logit=1.5).to(device)
    ids = torch.randint(3, 100, (2, 12), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        want = reference(input_ids=ids).logits
        if attn == "eager":
            torch.testing.assert_close(patched(input_ids=ids).logits, want, atol=1e-5, rtol=1e-5)
            return
        patched.to(dtype).set_attn_implementation(attn)
        got = patched(input_ids=ids).logits.float()
    torch.testing.assert_close(got, want, atol=2**-5 * want.abs().max().item(), rtol=0)


RE_ROPE = {  # window 4 on 16 tokens: most keys are far
    "rerope+logn": {"rerope_window": 4, "scale": "logn", "train_length": 2},
    "leaky+zero_kv": {"rerope_window": 4, "rerope_leak": 3.0, "zero_kv": True},
    "rerope+sink_learnable": {"rerope_window": 4, "sink_logit": "learnable"},
    "self_extend+logn": {"self_extend_group": 2, "self_extend_window": 4, "scale": "logn", "train_length": 2},
    "dca+sink_learnable": {"dual_chunk_size": 6, "dual_chunk_local": 2, "sink_logit": "learnable"},
}
"""ReRoPE and the other methods of key parts (Self-Extend, Dual Chunk Attention: chunks of 4 on 16 tokens)."""


def rerope_pair(device: torch.device, attn: str, options: dict):
    """(patched, reference) sharp llama models on the device (heads of 16, which flex takes), same weights; the
    reference rotates q and k by the clamped distance in plain eager code (tests/reference.py)."""
    model = sharp_model("llama", attn, **HEADS)
    return tuple(model.to(device) for model in patched_beside_reference(model, options))


@pytest.fixture
def flex_bands(monkeypatch) -> list:
    """Each call of CUDA's flex key bands that served the model (`conftest.count_flex_bands`)."""
    return count_flex_bands(monkeypatch)


@pytest.mark.parametrize("option", list(RE_ROPE))
@pytest.mark.parametrize("attn", ["sdpa", "eager"])  # flex and flash are refused, with the reason
def test_rerope_matches_reference_on_the_device(device, attn, option, flex_bands):
    """Forward and every gradient against the plain reference, fp32 (a learnable sink's own gradient is
    non-zero); and the patch moved the logits. Under sdpa on CUDA the flex key bands did the work, having
    passed their check; elsewhere the public formulation."""
    patched, reference = rerope_pair(device, attn, RE_ROPE[option])
    inputs = on(device, sharp_inputs())
    rows = inputs["attention_mask"].bool()
    outputs = []
    for model in (patched, reference):
        model.zero_grad()
        logits = model(**inputs).logits[rows]
        logits.square().mean().backward()
        outputs.append(logits.detach())
    torch.testing.assert_close(outputs[0], outputs[1], atol=1e-5, rtol=1e-5)
    want = dict(reference.named_parameters())
    for name, p in patched.named_parameters():
        if ".hfa." in name:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
            continue
        theirs = want[name].grad
        scale = theirs.abs().max()
        torch.testing.assert_close(p.grad, theirs, atol=1e-5 * scale, rtol=1e-4, msg=name)
    assert bool(flex_bands) == (device.type == "cuda" and attn == "sdpa"), len(flex_bands)
    assert all(flex_parts.CHECK.verdicts.values()), flex_parts.CHECK.verdicts
    hfa.unpatch(patched)
    with torch.no_grad():
        plain = patched(**inputs).logits[rows]
    assert (plain - outputs[0]).abs().max() > 1e-3, "ReRoPE changed nothing"


@pytest.mark.parametrize("method", ["rerope", "self_extend", "dca"])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("exit_logits", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flex_bands_pass_their_check_on_the_device(device, dtype, exit_logits, masked, method):
    """The check that guards CUDA's flex key bands, compiled, against the plain formula in float64 (forward and
    backward; forward alone without gradients, on 400 queries and on 64), at SmolLM2's heads (9 query, 3
    key-value, 64 wide)."""
    if device.type != "cuda":
        pytest.skip("flex key bands serve on CUDA")
    torch.compiler.reset()  # this process's earlier tests have compiled flex in many combinations
    declared = {"rerope": rerope(2048), "self_extend": self_extend(4, 2048), "dca": dual_chunk(6144, 512)}[
        method
    ]
    combination = flex_parts.Combination(
        dtype, 64, 9, 3, (True,) if masked else (), exit_logits, masked, flex_parts.layout(declared)
    )
    assert flex_parts._check(combination, device) is None


@pytest.mark.parametrize("option", ["leaky+zero_kv", "self_extend+logn", "dca+sink_learnable"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_rerope_generate_through_the_cache_on_the_device(device, attn, option):
    """Each decoding step's logits are the whole sequence's at that step (at generate()'s positions), left
    padding included."""
    model = hfa.patch(sharp_model("llama", attn, **HEADS), **RE_ROPE[option]).to(device)
    inputs = on(device, sharp_inputs(length=6))
    out = model.generate(**inputs, max_new_tokens=12, **GREEDY)
    mask = torch.cat([inputs["attention_mask"], torch.ones(2, 12, dtype=torch.long, device=device)], dim=1)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    with torch.no_grad():
        whole = model(input_ids=out.sequences, attention_mask=mask, position_ids=positions).logits
    torch.testing.assert_close(torch.stack(out.logits, 1), whole[:, 5:-1], atol=1e-4, rtol=1e-4)


def test_rerope_bf16_at_32k_tokens_holds_no_square(device, flex_bands):
    """32k tokens (on CUDA, through the flex key bands; elsewhere in query chunks): finite, and the forward's
    peak stays far below one 32k x 32k score matrix (on CUDA, where the allocator reports it). The first GPU
    session saw 56 GB here: this process's earlier tests had used up torch.compile's recompile limit, and flex
    ran uncompiled. Now the compiled cache starts empty, and past the limit the chunks take over."""
    torch.compiler.reset()
    model = tiny_model("llama", num_hidden_layers=1, **HEADS).to(device, torch.bfloat16)
    hfa.patch(model, rerope_window=1024, scale="logn", train_length=64)
    ids = torch.randint(3, VOCAB, (1, 32768), device=device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with torch.no_grad():
        logits = model(input_ids=ids, logits_to_keep=1).logits
    assert torch.isfinite(logits).all()
    assert bool(flex_bands) == (device.type == "cuda")
    assert all(flex_parts.CHECK.verdicts.values()), flex_parts.CHECK.verdicts
    if device.type == "cuda":
        square = 32768**2 * 2  # one bf16 score matrix of one head
        assert torch.cuda.max_memory_allocated(device) < square / 2


def test_rope_parameters_equal_the_checkpoint_loaded_with_them_on_the_device(device, tmp_path):
    """YaRN on the loaded model (frequencies built by transformers on the model's device) equals the checkpoint
    loaded with those rope_parameters, to fp32's rounding; unpatch restores it bit for bit."""
    yarn = {"rope_type": "yarn", "factor": 4.0}
    model = sharp_model("llama", max_position_embeddings=16)
    model.save_pretrained(tmp_path)
    theta = model.config.rope_parameters["rope_theta"]
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, rope_parameters={**yarn, "rope_theta": theta})
    model, loaded = model.to(device), loaded.eval().to(device)
    ids = torch.randint(3, SHARP_VOCAB, (2, 40), generator=torch.Generator().manual_seed(3)).to(device)
    with torch.no_grad():
        before = model(ids).logits
        hfa.patch(model, rope_parameters=yarn)
        got, want = model(ids).logits, loaded(ids).logits
        assert (got - before).abs().max() > 1e-3, "the rescaling changed nothing"
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        hfa.unpatch(model)
        assert torch.equal(model(ids).logits, before)
