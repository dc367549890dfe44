"""The GPU suite: every feature on a device against the eager reference, in fp32 and bf16, forward and backward;
streaming in chunks against token by token; batched generate with left padding; unpatch; bf16 at 32k tokens.

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
    SHARP_VOCAB,
    VOCAB,
    model_output,
    patched_and_reference,
    sample_inputs,
    sharp_model,
    sharpen,
    stream_logits,
    tiny_model,
)
from reference import reference_attention
from transformers.utils import is_flash_attn_2_available

import hf_attnscale as hfa
from hf_attnscale.core import kernels

pytestmark = pytest.mark.gpu

BACKENDS = ["sdpa", "eager", "flex_attention", "flash_attention_2"]
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
        sharpen(model, torch.Generator().manual_seed(0))


def on(device: torch.device, inputs: dict) -> dict:
    return {name: tensor.to(device) for name, tensor in inputs.items()}


@pytest.mark.parametrize("feature", DEVICE_FEATURES)
@pytest.mark.parametrize("attn", BACKENDS)
def test_fp32_matches_reference(device, attn, feature):
    options = FEATURES[feature]
    skip_unless_runs(attn, device, torch.float32, options)
    patched, reference, _, _ = patched_and_reference("llama", attn, options)  # GQA: 4 query heads, 2 KV heads
    plain = tiny_model("llama", "sdpa")
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
    patched, reference, _, _ = patched_and_reference("llama", attn, options)
    plain = tiny_model("llama", "sdpa")
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
    patched, reference, states, refs = patched_and_reference("llama", attn, options)
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
    for state, ref in zip(states, refs, strict=True):  # the reference's parameters live on the CPU
        assert state.sink.grad.abs().max() > 0 and state.ssmax.grad.abs().max() > 0
        torch.testing.assert_close(state.sink.grad.cpu(), ref.sink.grad, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(state.ssmax.grad.cpu(), ref.slope.grad, atol=1e-5, rtol=1e-4)


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("masked", [False, True])
def test_fused_exit_kernel_matches_reference(device, dtype, masked, monkeypatch):
    """The exit through the fused kernel sdpa would pick, forward and backward, with GQA as it comes and a
    length that is not a multiple of 32 (the memory-efficient kernel pads its log-sum-exp).

    On CUDA that kernel is flash in bf16 without a mask and memory-efficient otherwise; on the CPU, sdpa's flash
    kernel. A padded row's first queries see no key: the exit takes all of their attention. bf16 keeps 8
    significant bits: the kernel rounds the probabilities and the output, each to 2^-9 of their size, so the
    bound is 2^-7 of the largest output (and 2^-6 of the largest gradient), against fp32 on the same inputs.
    """
    ran = []
    apply = kernels._ExitAttention.apply
    monkeypatch.setattr(
        kernels._ExitAttention, "apply", lambda kernel, *args: ran.append(kernel.name) or apply(kernel, *args)
    )
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 37, 64, generator=generator) * 2
    k, v = (torch.randn(2, 2, 37, 64, generator=generator) for _ in range(2))
    sinks = torch.tensor([0.0, 1.5, -1.0, 3.0])
    visible = torch.ones(37, 37, dtype=torch.bool).tril().expand(2, 1, 37, 37).clone()
    if masked:
        visible[1, :, :, :5] = False  # row 1 left-padded by 5
    mask = visible if masked else None
    inputs = [t.to(device, dtype).requires_grad_() for t in (q, k, v)]
    exit_logits = sinks.to(device).requires_grad_()
    got = kernels.fused_exit_attention(
        *inputs, None if mask is None else mask.to(device), exit_logits, True, 0.125
    )
    leaves = [t.detach().float().cpu().requires_grad_() for t in (*inputs, exit_logits)]
    want = reference_attention(*leaves[:3], visible, 0.125, sink=leaves[3])
    expected = "cpu flash"
    if device.type == "cuda":
        expected = "cuda flash" if dtype == torch.bfloat16 and not masked else "cuda memory-efficient"
    assert ran == [expected]
    grad = torch.randn(want.shape, generator=generator)
    got.backward(grad.to(device, dtype))
    want.backward(grad)
    exact = dtype == torch.float32
    torch.testing.assert_close(
        got.float().cpu(), want, rtol=0, atol=1e-5 if exact else 2**-7 * want.abs().max().item()
    )
    assert masked <= bool((got[1, :, :5] == 0).all()), "a query that sees no key must give zero"
    for mine, theirs in zip((*inputs, exit_logits), leaves, strict=True):
        size = theirs.grad.abs().max().item()
        atol = 1e-5 * size if exact else 2**-6 * size
        torch.testing.assert_close(
            mine.grad.float().cpu(), theirs.grad, rtol=0 if not exact else 1e-4, atol=atol
        )
