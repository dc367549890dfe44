"""Perplexity over one long stream: StreamingLLM (exact and fast), and the baselines it is compared with.

``method="stream"`` feeds the stream through a `SinkCache`. With ``chunk_size=1`` this is the token-by-token
reference of mit-han-lab's ``eval_long_ppl.py``; with larger chunks every token of a chunk still sees exactly
what it would have seen token by token (see `hf_attnscale.streaming.cache`), so the result is the same to
float rounding, many times faster. The baselines: ``"dense"`` (every token sees all earlier ones), window-only
(a `SinkCache` with ``sink_tokens=0``), and ``"recompute"`` (each token re-encodes its last ``window``
tokens from scratch: the sliding window with re-computation that StreamingLLM reports its speed-up against).
"""

from __future__ import annotations

import inspect
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm
from transformers import DynamicCache

from hf_attnscale.core.install.offload import run_device
from hf_attnscale.core.install.routing import cache_argument
from hf_attnscale.core.options.validation import check_int
from hf_attnscale.streaming.cache import SinkCache
from hf_attnscale.streaming.rope import frequencies_of_length
from hf_attnscale.streaming.spec import check_streaming_model

Method = Literal["stream", "dense", "recompute"]
METHODS = ("stream", "dense", "recompute")
LOSS_ROWS = 4096
"""Rows of logits turned into NLL at a time (`_token_scores`)."""
RECOMPUTE_TOKENS_PER_CALL = 8192
"""Windows re-encoded per call by ``"recompute"``, as a token budget (batching keeps it from being slower
than it has to be; the work per token is still a full window)."""


@dataclass(frozen=True)
class PerplexityResult:
    """Per-token negative log-likelihoods of one stream.

    Attributes:
        nll: float32 ``(T-1,)``: ``nll[t]`` is ``-log p(token t+1 | what the method lets it see)``; with
            ``score_last=N``, ``(N,)``: the stream's last N tokens' only.
        method: how it was computed (``"stream"``, ``"dense"`` or ``"recompute"``).
        seconds: wall time of the evaluation.
        details: the settings that produced it (cache size, chunk size, window...).
        greedy: bool ``(T-1,)``: ``greedy[t]`` is whether token t+1 is the model's top choice there (the
            argmax of the logits that predicted it: what greedy decoding would have picked; lm-eval's
            ``is_greedy``); None for a result built without it.
    """

    nll: torch.Tensor
    method: str
    seconds: float
    details: dict = field(default_factory=dict)
    greedy: torch.Tensor | None = None

    @property
    def ppl(self) -> float:
        """Perplexity over the whole stream: ``exp(mean nll)``."""
        return math.exp(self.nll.double().mean().item())

    @property
    def running_ppl(self) -> torch.Tensor:
        """``(T-1,)``: perplexity of the first ``t+1`` predicted tokens, for plots by position."""
        count = torch.arange(1, self.nll.numel() + 1, dtype=torch.float64)
        return (self.nll.double().cumsum(0) / count).exp().float()

    @property
    def tokens_per_second(self) -> float:
        """Predicted tokens per second of wall time."""
        return self.nll.numel() / self.seconds if self.seconds > 0 else math.inf


def perplexity(
    model: nn.Module,
    input_ids: torch.Tensor,
    cache: SinkCache | None = None,
    *,
    chunk_size: int = 512,
    method: Method | None = None,
    window: int | None = None,
    max_length: int | None = None,
    score_last: int | None = None,
    progress: bool | None = None,
) -> PerplexityResult:
    """Per-token NLL of one token stream under a causal LM.

    Args:
        model: a causal LM in eval mode. With a `SinkCache` it must be patched (``hfa.patch(model)``).
        input_ids: one stream, ``(T,)`` or ``(1, T)``.
        cache: a fresh `SinkCache` for ``method="stream"`` (the default when given). ``SinkCache(0, W)`` is
            the window-only baseline.
        chunk_size: tokens per model call for "stream" and "dense" (1: the token-by-token reference; the
            results agree within a few 1e-6 nats a token in float32 whatever the chunk size). A model whose RoPE rescales with
            the length read (``rope_type`` dynamic NTK or LongRoPE) is read densely in chunks at the
            frequencies of the T - 1 tokens read (the last is only a target), as ``model(ids[:, :-1])`` and
            lm-eval read it (`frequencies_of_length`), not at those of each chunk's end.
        method: "stream" (needs ``cache``), "dense" (default without a cache), or "recompute" (needs
            ``window``).
        window: tokens each re-encoded window holds for "recompute", the predicted token's context included.
        max_length: score only the first ``max_length`` tokens (the dense baseline's memory grows with T).
        score_last: score only the stream's last N tokens (a continuation after its context, as a passkey or a
            loglikelihood request): the output layer then runs on the positions that predict them and no
            other (transformers' ``logits_to_keep``), so a long context costs no T × V logits. None: every
            token.
        progress: show a tqdm bar (None: only on a terminal).

    Example:
        >>> res = hfa.perplexity(model, ids, cache=hfa.SinkCache(4, 1020), chunk_size=512)
        >>> res.ppl, res.nll.shape, res.running_ppl[-1]
    """
    method = method or ("stream" if cache is not None else "dense")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}.")
    chunk_size = check_int("chunk_size", chunk_size, 1)
    ids = _one_stream(input_ids, model)
    if max_length is not None:
        ids = ids[:, : check_int("max_length", max_length, 2)]
    if ids.shape[1] < 2:
        raise ValueError("Perplexity needs a stream of at least 2 tokens.")
    total = ids.shape[1] - 1
    first = total - min(check_int("score_last", score_last, 1), total) if score_last is not None else 0

    if method == "stream":
        if not isinstance(cache, SinkCache):
            raise ValueError("method='stream' needs cache=hfa.SinkCache(sink_tokens, window).")
        if cache.get_seq_length() > 0:
            raise ValueError(
                "The SinkCache already holds a stream; pass a fresh one (or call cache.reset())."
            )
        check_streaming_model(model)
        details = {"sink_tokens": cache.sink_tokens, "window": cache.window, "chunk_size": chunk_size}
        run = lambda bar: _chunked(model, ids, cache, chunk_size, first, bar)  # noqa: E731
    elif cache is not None:
        raise ValueError(f"method={method!r} takes no cache.")
    elif method == "dense":
        details = {"chunk_size": chunk_size}

        def run(bar) -> Scores:
            with frequencies_of_length(model, ids.shape[1] - 1):  # as one call over the tokens read would
                return _chunked(model, ids, DynamicCache(config=model.config), chunk_size, first, bar)

    else:
        if window is None:
            raise ValueError(
                "method='recompute' needs window, an int >= 1 (the tokens each re-encoded window holds)."
            )
        window = check_int("window", window, 1)
        details = {"window": window}
        run = lambda bar: _recompute(model, ids, window, bar, first)  # noqa: E731

    start = time.perf_counter()
    with (
        torch.no_grad(),
        tqdm(
            total=total,
            desc=f"ppl ({method})",
            unit="tok",
            disable=None if progress is None else not progress,
        ) as bar,
    ):
        nll, greedy = run(bar)
    return PerplexityResult(
        nll=nll.float().cpu(),
        method=method,
        seconds=time.perf_counter() - start,
        details=details,
        greedy=greedy.cpu(),
    )


def _one_stream(input_ids: torch.Tensor, model: nn.Module) -> torch.Tensor:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() not in (1, 2):
        raise ValueError("input_ids must be a tensor of shape (T,) or (1, T).")
    ids = input_ids.view(1, -1) if input_ids.dim() == 1 else input_ids
    if ids.shape[0] != 1:
        raise ValueError(f"perplexity() scores one stream; got a batch of {ids.shape[0]}.")
    return ids.to(device=run_device(model), dtype=torch.long)


Scores = tuple[torch.Tensor, torch.Tensor]
"""Per-token NLL (float32) and whether each target is the argmax (bool), both ``(T-1,)``."""


def _chunked(model: nn.Module, ids: torch.Tensor, cache, chunk_size: int, first: int, bar) -> Scores:
    """Feed ``ids[:-1]`` in chunks through ``cache``; the last token is only a target. Only the predictions of
    tokens ``first + 1`` onwards are scored."""
    total = ids.shape[1] - 1
    nll = torch.empty(total - first, dtype=torch.float32, device=ids.device)
    greedy = torch.empty(total - first, dtype=torch.bool, device=ids.device)
    for start, stop, logits in _chunk_logits(model, ids[:, :-1], cache, chunk_size, first):
        if logits is not None:
            scored = max(start, first)
            rows = slice(scored - first, stop - first)
            nll[rows], greedy[rows] = _token_scores(logits[0], ids[0, scored + 1 : stop + 1])
        bar.update(stop - start)
    return nll, greedy


def _chunk_logits(model: nn.Module, ids: torch.Tensor, cache, chunk_size: int, first: int):
    """Feed ``ids`` ``(B, T)`` in chunks of ``chunk_size`` through ``cache``: each chunk's ``(start, stop, logits)``,
    the logits of its positions from ``first`` on, None where it has none (such a chunk computes one row)."""
    with_cache = {cache_argument(model): cache}
    for start in range(0, ids.shape[1], chunk_size):
        stop = min(start + chunk_size, ids.shape[1])
        scored = max(start, first)  # the chunk's first kept row
        logits = logit_rows(model, ids[:, start:stop], stop - scored, use_cache=True, **with_cache)
        yield start, stop, logits[:, scored - stop :] if scored < stop else None


def logit_rows(model: nn.Module, input_ids: torch.Tensor, rows: int, **kwargs) -> torch.Tensor:
    """``model``'s logits at the last ``rows`` positions of ``input_ids`` (at least one; all where it has fewer),
    ``(B, rows, V)``: through transformers' ``logits_to_keep`` where the model takes it, so the output layer (and
    the family's own ending: soft-capping, logit scaling) runs on those positions only; else the whole call's
    logits, cut."""
    rows = min(max(rows, 1), input_ids.shape[1])
    if takes_logits_to_keep(model):
        return model(input_ids=input_ids, logits_to_keep=rows, **kwargs).logits[:, -rows:]
    return model(input_ids=input_ids, **kwargs).logits[:, -rows:]


def chunked_logit_rows(model: nn.Module, input_ids: torch.Tensor, rows: int, chunk_size: int) -> torch.Tensor:
    """`logit_rows` over ``input_ids`` ``(B, T)`` read ``chunk_size`` tokens a call through a `DynamicCache` (each
    layer keeps what the model's own cache keeps: a sliding-window layer, its window), at the RoPE frequencies of
    one call over the T tokens (`frequencies_of_length`): the same logits, with one chunk's activations and
    scores at a time, not the whole call's (Gemma-3's local layers then score a chunk against their window alone,
    not against a T × T mask). Rows stay apart: right padding after a row's tokens changes none of its logits."""
    total = input_ids.shape[1]
    first = total - min(max(rows, 1), total)
    cache = DynamicCache(config=model.config)
    with frequencies_of_length(model, total):
        kept = [
            logits
            for _, _, logits in _chunk_logits(model, input_ids, cache, chunk_size, first)
            if logits is not None
        ]
    return torch.cat(kept, dim=1) if len(kept) > 1 else kept[0]


def takes_logits_to_keep(model: nn.Module) -> bool:
    """Whether ``model``'s forward (a PEFT model's: its base model's) takes transformers' ``logits_to_keep``."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "logits_to_keep" in inspect.signature(base.forward).parameters


def _token_scores(logits: torch.Tensor, targets: torch.Tensor) -> Scores:
    """Per-token NLL of ``targets`` under ``logits`` (T, V), and whether each target is the argmax, a slice of
    `LOSS_ROWS` rows at a time: a long call's log-softmax never holds more than that."""
    nll, greedy = [], []
    for first in range(0, logits.shape[0], LOSS_ROWS):
        rows = logits[first : first + LOSS_ROWS].float()
        wanted = targets[first : first + LOSS_ROWS]
        nll.append(F.cross_entropy(rows, wanted, reduction="none"))
        greedy.append(rows.argmax(dim=-1) == wanted)
    return torch.cat(nll), torch.cat(greedy)


def _recompute(model: nn.Module, ids: torch.Tensor, window: int, bar, first: int = 0) -> Scores:
    """Each token predicted from its last ``window`` tokens, re-encoded from scratch at positions 0..window-1
    (every one: its logits are one window's last row at a time), and those from ``first`` on returned."""
    total = ids.shape[1] - 1
    nll = torch.empty(total, dtype=torch.float32, device=ids.device)
    greedy = torch.empty(total, dtype=torch.bool, device=ids.device)
    # Tokens 0..window-1 see their whole prefix: one causal call scores them all exactly.
    head = min(window, total)
    logits = logit_rows(model, ids[:, :head], head, use_cache=False)
    nll[:head], greedy[:head] = _token_scores(logits[0], ids[0, 1 : head + 1])
    bar.update(head)
    windows = ids[0].unfold(0, window, 1)  # windows[s] = ids[s : s + window]; it predicts ids[s + window]
    per_call = max(1, RECOMPUTE_TOKENS_PER_CALL // window)
    for begin in range(1, total - window + 1, per_call):
        end = min(begin + per_call, total - window + 1)
        logits = logit_rows(model, windows[begin:end], 1, use_cache=False)[:, -1]
        scored = slice(begin + window - 1, end + window - 1)
        nll[scored], greedy[scored] = _token_scores(logits, ids[0, begin + window : end + window])
        bar.update(end - begin)
    return nll[first:], greedy[first:]


def segment_nll(
    model: nn.Module,
    ids: torch.Tensor,
    bos_id: int | None = None,
    *,
    cache: SinkCache | None = None,
    chunk_size: int = 512,
) -> torch.Tensor:
    """Per-token NLL of a segment ``ids`` read on its own, from scratch (held-out perplexity's unit).

    With ``bos_id`` the segment is read behind a BOS token and every one of its tokens is predicted; without,
    its first token has no context and only the others are. ``cache``: a fresh `SinkCache` to stream it.
    """
    if bos_id is not None:
        ids = torch.cat([ids.new_tensor([bos_id]), ids])
    return perplexity(model, ids, cache, chunk_size=chunk_size, progress=False).nll


@torch.inference_mode()
def windowed_perplexity(
    model: nn.Module, token_docs: Sequence[torch.Tensor], window: int, bos_id: int | None = None
) -> float:
    """Token-weighted perplexity, each document scored alone in non-overlapping windows of ``window`` tokens.

    Each window is a `segment_nll` segment: its first token has no context and is not scored, unless
    ``bos_id`` is given: then every window after a document's first is read behind a BOS token (as the
    model was trained; the first opens with the document's own), and all of its tokens are scored. A final
    partial window is scored if it has at least two tokens.

    This is perplexity at one window over every token of every document. The length sweep
    (`hf_attnscale.evaluation.sweep.sweep`) answers another question, how perplexity changes with the context
    alone: it keeps only documents of at least the longest length, cut to it, so that every length scores the
    same tokens.
    """
    nll_sum, count = 0.0, 0
    for doc in token_docs:
        for start in range(0, len(doc), window):
            behind = bos_id if start > 0 else None
            ids = doc[start : start + window]
            if len(ids) + (behind is not None) >= 2:
                nll = segment_nll(model, ids, behind, chunk_size=window + 1)
                nll_sum += nll.double().sum().item()
                count += nll.numel()
    return math.exp(nll_sum / count)
