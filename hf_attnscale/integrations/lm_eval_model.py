"""lm-eval's ``hf-attnscale`` model type: `HFAttnScaleLM`, lm-eval's ``HFLM`` with an `hf_attnscale` patch,
per-token rolling scores (for perplexity by position) and StreamingLLM for rolling perplexity and
loglikelihood requests.

The model type is registered with lm-eval when this module is imported. Its tasks and their data are in
`hf_attnscale.integrations.lm_eval_tasks_data`; the command line that runs them, `hf-attnscale lm-eval`, is
`hf_attnscale.integrations.lm_eval_launcher`. From Python, pass an ``HFAttnScaleLM`` (or ``model="hf-attnscale"``
after importing this module) and ``TaskManager(include_path=TASKS_DIR)`` to lm-eval's ``simple_evaluate``.

Importing this module needs lm-eval (``pip install hf_attnscale[eval]``); ``import hf_attnscale`` does not.
"""

from __future__ import annotations

import difflib
import inspect
import re
import sys
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from lm_eval.api.instance import Instance
from lm_eval.api.registry import MODEL_REGISTRY, register_model
from lm_eval.models.huggingface import HFLM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMaskedLM

from hf_attnscale.checkpoints.loading import from_pretrained
from hf_attnscale.checkpoints.models import cannot_load, checked_source, head_kind, model_kind, split_gguf
from hf_attnscale.checkpoints.real import check_gguf_file
from hf_attnscale.core.install.installed import get_config
from hf_attnscale.core.install.patching import patch
from hf_attnscale.core.options.config import (
    OPTION_NAMES,
    AttnScaleConfig,
    default_train_length,
    read_saved_config,
    replaced_patch_note,
)
from hf_attnscale.core.options.validation import check_int
from hf_attnscale.evaluation.mlm import pseudo_log_likelihood
from hf_attnscale.evaluation.perplexity import (
    PerplexityResult,
    chunked_logit_rows,
    logit_rows,
    perplexity,
    takes_logits_to_keep,
)
from hf_attnscale.evaluation.positions import position_buckets as read_buckets
from hf_attnscale.evaluation.processes import join_processes
from hf_attnscale.evaluation.variants import unchanged_within
from hf_attnscale.integrations.peft_adapters import check_adapter_path, load_adapter
from hf_attnscale.streaming.cache import SinkCache, cache_settings
from hf_attnscale.streaming.spec import check_streaming_model

MODEL_TYPE = "hf-attnscale"


class ModelArgsError(ValueError):
    """A ``model_args`` value the ``hf-attnscale`` model type cannot use (an option, a key, the model's name).

    Raised before the model loads, in one line; ``hf-attnscale lm-eval`` prints it as its error, with no
    traceback, and exits with status 2.
    """

    def __init__(self, message: Any) -> None:
        super().__init__(" ".join(str(message).split()))


class _SavedPatchLoader:
    """Stands in for HFLM's ``AUTO_MODEL_CLASS``: loads with `hfa.from_pretrained`, saved patch included.

    ``forwarded``: the model_args keys that neither HFAttnScaleLM nor HFLM takes, which HFLM hands on to
    ``from_pretrained``. Where transformers takes one neither as a loading option nor as a config field, the
    model class's ``__init__`` refuses it (a TypeError, raised before any weight is read): that becomes a
    one-line `ModelArgsError` listing the keys there are. Which keys transformers takes is its own business
    (``attn_implementation``, ``device_map``, a config field such as ``use_cache``...): none is refused here.
    """

    def __init__(self, auto_class: type, forwarded: frozenset[str] = frozenset()) -> None:
        self.auto_class = auto_class
        self.forwarded = forwarded

    def from_pretrained(self, *args: Any, **kwargs: Any):
        try:
            return from_pretrained(self.auto_class, *args, **kwargs)
        except TypeError as err:
            refused = re.search(r"unexpected keyword argument '(\w+)'", str(err))
            if refused is None or refused[1] not in self.forwarded:
                raise
            raise ModelArgsError(_unknown_key(refused[1])) from err


class HFAttnScaleLM(HFLM):
    """lm-eval's ``HFLM`` with an `hf_attnscale` patch, and StreamingLLM for rolling perplexity.

    A saved model is loaded with the patch it was saved with (learned values included). Every request type
    runs through the patched model. With ``window`` set, ``loglikelihood_rolling`` (perplexity tasks) streams
    each whole document through a fresh ``SinkCache(sink_tokens, window)`` instead of scoring disjoint
    ``max_length`` windows: every token is predicted from the document's first ``sink_tokens`` tokens plus its
    last ``window`` tokens, as in StreamingLLM, however long the document. ``loglikelihood`` (multiple choice,
    a question after a long context) streams each context + continuation whole the same way, instead of
    cutting it to ``max_length`` from the left. ``generate_until`` stays HFLM's, dense: its context is cut
    from the left to ``max_length`` minus the tokens to generate.

    A masked LM (an encoder such as BERT) has no causal likelihood: its perplexity tasks are scored with the
    pseudo-log-likelihood (every token masked alone, in windows of ``max_length``), so ``word_perplexity``
    is a pseudo-perplexity; its other request types are refused.

    Args:
        pretrained: a model path, Hub id, ``builtin:tiny-llama-stdlib`` (the shipped model), the name of a real
            checkpoint (``smollm2-135m``, ``gemma3-270m``: fetched on first use), a path to a ``.gguf`` file, or
            a model object (then also pass ``tokenizer``).
        scale, train_length, ...: the `hf_attnscale.patch` options (`AttnScaleConfig`'s fields; their text as on
            the command line, but ``clipped_softmax`` as ``"GAMMA;ZETA"``, model_args being comma-separated).
            With none of them, a checkpoint saved from a patched model (``hf_attnscale`` in its config) is
            patched as saved, and any other model runs as loaded. A scale without ``train_length`` takes the
            saved config's ``max_position_embeddings``, as ``--scale`` without ``--train-length`` does on the
            command line (`hf_attnscale.core.options.config.default_train_length`).
        sink_tokens: sink tokens of the streaming cache (default with ``window``: SinkCache's; 0: window-only).
        window: recent tokens each query sees while streaming; None (default) keeps lm-eval's windows.
        chunk_size: tokens per model call, streamed or dense, a loglikelihood request's and a generated prompt's
            too (memory and time only; results do not depend on it).
        gguf_file: a GGUF file in the ``pretrained`` folder or Hub repo (or a path to one), loaded de-quantised
            to a plain model (`hf_attnscale.from_pretrained`).
        position_buckets: the edges of the perplexity tasks' position buckets, ``"2048;4096;8192"``
            (`PositionPerplexityTask`; lm-eval hands model_args to the tasks as metadata). Checked here only.
        peft: a PEFT adapter (a folder or a Hub id), as lm-eval's ``hf`` takes it, loaded with the patch it was
            trained under (`hf_attnscale.load_adapter`: the base is patched as the adapter saved it, and patch
            options given here that differ from it are refused), then merged into the model (``merge_and_unload``:
            every request reads a plain patched model). Needs ``pip install "hf_attnscale[peft]"``.
        **kwargs: everything ``HFLM`` takes (``max_length``, ``dtype``, ``device``, ``batch_size``...), and,
            through it, what transformers' ``from_pretrained`` takes (``attn_implementation``, a config field).

    Raises:
        ModelArgsError: (a ValueError) a bad option, a key nothing takes, or a model name that is nothing (no
            such folder; an uncached Hub id while the Hub is off or unreachable; a near miss of a real
            checkpoint's name), in one line, before any weight is read.
        FetchError: a real checkpoint could not be fetched.
    """

    def __init__(
        self,
        pretrained: Any,
        sink_tokens: int | None = None,
        window: int | None = None,
        chunk_size: int = 512,
        gguf_file: str | None = None,
        position_buckets: Any = None,
        peft: str | None = None,
        **kwargs: Any,
    ) -> None:
        # Validate everything before the model loads, which can take minutes: each error is one line.
        try:
            read_buckets(as_written(position_buckets))  # read by the tasks, from their metadata
            check_adapter_path(peft)
            config, pretrained, gguf_file = self._check_model_args(
                pretrained, sink_tokens, window, chunk_size, gguf_file, kwargs
            )
        except ModelArgsError:
            raise
        except (ValueError, FileNotFoundError) as err:
            raise ModelArgsError(err) from err
        forwarded = frozenset(kwargs) - set(_HFLM_KEYS)
        self.AUTO_MODEL_CLASS = _SavedPatchLoader(
            AutoModelForMaskedLM if self.masked else AutoModelForCausalLM, forwarded
        )

        cpu_processes = _start_cpu_processes() if isinstance(pretrained, str) else None
        super().__init__(pretrained=pretrained, gguf_file=gguf_file, **kwargs)
        if cpu_processes is not None:
            # HFLM shares the documents across processes only when it counts more than one GPU; on CPU every
            # process would score every document as rank 0. Each takes its share, and rank 0 gathers, as on GPUs.
            self.accelerator = cpu_processes
            self._rank, self._world_size = cpu_processes.process_index, cpu_processes.num_processes

        model = self.model
        if config is not None:
            note = replaced_patch_note(get_config(model), config)
            if note is not None and self.rank == 0:
                print(note, file=sys.stderr, flush=True)
            patch(model, config=config)
        elif (
            get_config(model) is None
            and peft is None
            and (window is not None or read_saved_config(model.config))
        ):
            patch(model)  # the saved patch (with its learned parameters), or the identity one for streaming
        if peft is not None:
            try:
                adapted = load_adapter(model, peft)  # patches an unpatched base as the adapter saved it
            except ValueError as err:
                raise ModelArgsError(err) from err
            self._model = model = adapted.merge_and_unload().eval()  # the merged model stays patched
        if window is not None:
            check_streaming_model(model)

    def _check_model_args(
        self,
        pretrained: Any,
        sink_tokens: Any,
        window: Any,
        chunk_size: Any,
        gguf_file: str | None,
        kwargs: dict[str, Any],
    ) -> tuple[AttnScaleConfig | None, Any, str | None]:
        """Read and check hf-attnscale's own model_args (popping the patch options from ``kwargs``) and the
        model's name, and read its config (not its weights): ``(patch config, pretrained, gguf_file)``.

        A scale without ``train_length`` takes the config's ``max_position_embeddings``, as on the command line
        (`hf_attnscale.core.options.config.default_train_length`); the other options are checked before the model is
        looked for, which may mean a download.
        """
        options = {name: as_written(kwargs.pop(name)) for name in OPTION_NAMES if name in kwargs}
        scale = options.get("scale")
        length_from_config = scale not in (None, "none") and options.get("train_length") is None
        self._train_length_from_config = length_from_config
        # Every other option is checked now, with a stand-in length where the config is to give it.
        config = AttnScaleConfig.from_text(**options, **({"train_length": 2} if length_from_config else {}))
        settings = cache_settings(as_written(sink_tokens), as_written(window))
        self.sink_tokens, self.window = settings if settings is not None else (None, None)
        self.chunk_size = check_int("chunk_size", as_written(chunk_size), 1)
        if isinstance(pretrained, str):
            pretrained, gguf_file = split_gguf(pretrained, gguf_file)
            name = pretrained
            try:
                pretrained = checked_source(pretrained, gguf_file)
            except FileNotFoundError as err:
                if length_from_config:
                    raise ModelArgsError(
                        f"{err} (And scale={scale!r} needs train_length=N, or a model config that gives "
                        "max_position_embeddings.)"
                    ) from err
                raise
            if gguf_file:  # checked before transformers reads it (local files only)
                check_gguf_file(Path(pretrained) / gguf_file)
            gguf = {"gguf_file": gguf_file} if gguf_file else {}
            try:
                model_config = AutoConfig.from_pretrained(pretrained, **gguf)
            except OSError as err:
                raise cannot_load(name, err) from err
            self.masked = model_kind(model_config) == "masked"
        else:
            model_config = getattr(pretrained, "config", None)
            self.masked = head_kind(type(pretrained).__name__) == "masked"
        if self.masked and self.window is not None:
            raise ValueError("window= streams a causal LM through a SinkCache; this model is a masked LM.")
        if length_from_config:
            length = default_train_length(None, model_config)
            if length is None:
                raise ValueError(
                    f"scale={scale!r} needs train_length=N, the model's trained length (its config "
                    "gives no max_position_embeddings)."
                )
            config = AttnScaleConfig.from_text(**options, train_length=length)
        return config, pretrained, gguf_file

    @property
    def streaming(self) -> bool:
        """Whether rolling perplexity and loglikelihood requests stream through a `SinkCache`."""
        return self.window is not None

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of each whole document, as a `DocumentLogLikelihood` (a float that also carries each
        token's NLL, for perplexity by position).

        With a ``window``, each document streams whole through a fresh `SinkCache`; without one, it is read in
        lm-eval's own rolling windows of ``max_length`` (one window, the whole document, when it fits), each
        read densely. For a masked LM: the pseudo-log-likelihood, in windows of ``max_length``.
        """
        self._longest_read = 0
        if self.masked:
            results = self._pseudo_log_likelihoods(requests, disable_tqdm)
        else:
            results, windowed = [], 0
            desc = "streaming documents" if self.streaming else "scoring documents"
            for request in tqdm(requests, desc=desc, disable=disable_tqdm or self.rank != 0):
                (text,) = request.args
                tokens = self.tok_encode(text)
                windowed += not self.streaming and len(tokens) > self.max_length  # more than one window
                score = DocumentLogLikelihood(self._document_nll(tokens))
                self.cache_hook.add_partial("loglikelihood_rolling", (text,), score)
                results.append(score)
            if windowed:  # perplexity by position past max_length would read fresh windows, not a long read
                share = f" (process {self.rank}'s share)" if self.world_size > 1 else ""
                print(
                    f"note: {windowed} of {len(requests)} documents{share} are longer than "
                    f"max_length={self.max_length} "
                    "tokens and were read in lm-eval's windows of that length: a token past it is predicted "
                    "from its own window, not the whole document (set max_length above the longest document, "
                    "or stream it with window=).",
                    file=sys.stderr,
                    flush=True,
                )
        self._note_if_unchanged("loglikelihood_rolling", len(requests))
        return results

    def _document_nll(self, tokens: list[int]) -> torch.Tensor:
        """Each of ``tokens``' NLL, the first predicted from the prefix token, as lm-eval's rolling
        perplexity scores them: streamed with a ``window``, else in lm-eval's disjoint windows of
        ``max_length`` (`lm_eval.utils.get_rolling_token_windows`, as HFLM reads them)."""
        if not tokens:
            return torch.zeros(0)
        if self.streaming:
            return self._score([self.prefix_token_id, *tokens]).nll
        windows = get_rolling_token_windows(
            token_list=tokens, prefix_token=self.prefix_token_id, max_seq_len=self.max_length, context_len=1
        )
        pieces = []
        for context, predicted in map(make_disjoint_window, windows):
            pieces.append(self._score([*context, *predicted]).nll[-len(predicted) :])
        return torch.cat(pieces)

    def _score(self, ids: list[int], score_last: int | None = None) -> PerplexityResult:
        """Per-token scores of one token sequence (at least 2), of its last ``score_last`` tokens only where
        given: streamed through a fresh `SinkCache` with a ``window``, else read densely
        (`hf_attnscale.perplexity`, ``chunk_size`` tokens per call)."""
        self._read(len(ids))
        return perplexity(
            self.model,
            torch.tensor(ids, dtype=torch.long),
            cache=SinkCache(self.sink_tokens, self.window) if self.streaming else None,
            chunk_size=self.chunk_size,
            score_last=score_last,
            progress=False,
        )

    def _pseudo_log_likelihoods(self, requests: list[Instance], disable_tqdm: bool) -> list[float]:
        if self.tokenizer.mask_token_id is None:
            raise ValueError("This masked LM's tokenizer has no mask token; pseudo-likelihood needs one.")
        results = []
        for request in tqdm(requests, desc="pseudo-likelihood", disable=disable_tqdm or self.rank != 0):
            (text,) = request.args
            # The text's own tokens: special ones are neither context the encoder was given nor scored.
            ids = torch.tensor(self.tok_encode(text, add_special_tokens=False), dtype=torch.long)
            self._read(min(ids.numel(), self.max_length))
            total = pseudo_log_likelihood(self.model, ids, self.tokenizer.mask_token_id, self.max_length)
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
            results.append(total)
        return results

    def loglikelihood(self, requests: list[Instance], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """HFLM's, through the patched model, or with ``window`` each context + continuation streamed whole
        (`_loglikelihood_tokens`); an encoder refuses (it has no continuation to score). Then the note where the
        patch changed nothing at the lengths read."""
        if self.masked:
            raise NotImplementedError(
                "hf-attnscale scores masked LMs (encoders) on perplexity tasks only (loglikelihood_rolling, as "
                "pseudo-likelihood); multiple-choice loglikelihood needs a causal LM."
            )
        self._longest_read = 0
        results = super().loglikelihood(requests, disable_tqdm=disable_tqdm)
        self._note_if_unchanged("loglikelihood", len(requests))
        return results

    def _loglikelihood_tokens(
        self,
        requests: list[tuple[tuple[str, str], list[int], list[int]]],
        disable_tqdm: bool = False,
        override_bs: int | None = None,
    ) -> list[tuple[float, bool]]:
        """``(log-likelihood of the continuation, whether each of its tokens is the argmax)`` per request.

        ``requests`` are HFLM's ``((context, continuation), context tokens, continuation tokens)``, encoded by
        HFLM's ``loglikelihood``. Without a ``window``, HFLM scores them (cut to ``max_length`` from the left,
        in its batches), its model calls computing logits only where continuations are (`_model_call`); with
        one, each context + continuation is streamed whole through a fresh `SinkCache`, uncut, and only the
        continuation's positions reach the output layer.
        """
        if not self.streaming:
            self._longest_continuation = max((len(cont) for _, _, cont in requests), default=0)
            try:
                return super()._loglikelihood_tokens(
                    requests, disable_tqdm=disable_tqdm, override_bs=override_bs
                )
            finally:
                self._longest_continuation = None
        results = []
        bar = tqdm(requests, desc="streaming loglikelihood requests", disable=disable_tqdm or self.rank != 0)
        for request_str, context_enc, continuation_enc in bar:
            if not context_enc or not continuation_enc:
                raise ValueError(
                    "A loglikelihood request needs context and continuation tokens; got "
                    f"{len(context_enc)} and {len(continuation_enc)}."
                )
            scored = self._score([*context_enc, *continuation_enc], score_last=len(continuation_enc))
            answer = (-scored.nll.double().sum().item(), bool(scored.greedy.all()))
            if request_str is not None:
                self.cache_hook.add_partial("loglikelihood", request_str, answer)
            results.append(answer)
        return results

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        """HFLM's, through the patched model (an encoder refuses); then the note where the patch changed nothing
        at the lengths read."""
        if self.masked:
            raise NotImplementedError("A masked LM (an encoder) does not generate text.")
        self._longest_read = 0
        results = super().generate_until(requests, disable_tqdm=disable_tqdm)
        self._note_if_unchanged("generate_until", len(requests))
        return results

    def _model_call(self, inps: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """HFLM's model call on a right-padded batch of loglikelihood requests: the logits of the batch's last
        positions only, from the first that predicts a continuation token of any row (`_rows_to_keep`), not
        ``(B, T, V)``, and no cache is kept (HFLM's own call keeps the keys and values of every layer); a batch
        longer than ``chunk_size`` is read that many tokens a call (`chunked_logit_rows`). HFLM
        reads a shorter logits tensor as ending where the batch ends (its slicing allows for prefix tokens),
        so its answers stay its own."""
        self._read(inps.shape[-1])  # HFLM's dense loglikelihood batches (right-padded to the longest)
        rows = self._rows_to_keep(inps)
        if args or kwargs or rows is None or not takes_logits_to_keep(self.model):
            return super()._model_call(inps, *args, **kwargs)
        mixed = getattr(self, "mixed_precision_dtype", None)  # HFLM's autocast, as its own call takes it
        with torch.no_grad(), torch.autocast(self.device.type, dtype=mixed, enabled=mixed is not None):
            if inps.shape[-1] > self.chunk_size:  # one chunk's activations at a time
                return chunked_logit_rows(self.model, inps, rows, self.chunk_size)
            return logit_rows(self.model, inps, rows, use_cache=False)  # a score needs no cache after it

    def _rows_to_keep(self, inps: torch.Tensor) -> int | None:
        """How many last positions of ``inps`` (HFLM's batch, right-padded with zeros) hold every row's
        continuation, at most `_longest_continuation` tokens before each row's end; None outside
        ``_loglikelihood_tokens`` (HFLM's batch size probe). A row's end is taken after its last nonzero token:
        a real token 0 at its end only keeps more rows than needed, never fewer."""
        longest = getattr(self, "_longest_continuation", None)
        if not longest:
            return None
        positions = torch.arange(1, inps.shape[-1] + 1, device=inps.device)
        ends = (positions * (inps != 0)).amax(dim=-1)  # each row's last nonzero token, counted from 1
        return int(inps.shape[-1] - (ends - longest).clamp(min=0).min())

    def _model_generate(
        self, context: torch.Tensor, max_length: int, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        """HFLM's ``generate`` call, its prompt read ``chunk_size`` tokens at a time into the cache (transformers'
        ``prefill_chunk_size``): one chunk's activations at a time, not the whole prompt's."""
        self._read(max_length)  # the context and every token it may generate
        if context.shape[-1] > self.chunk_size:
            kwargs.setdefault("prefill_chunk_size", self.chunk_size)
        return super()._model_generate(context, max_length, *args, **kwargs)

    def _read(self, tokens: int) -> None:
        """Count a model call over ``tokens`` tokens in the most keys a query has seen since the request type
        began: ``tokens`` read densely, at most the cache's ``sink_tokens + window`` streamed."""
        seen = min(tokens, self.sink_tokens + self.window) if self.streaming else tokens
        self._longest_read = max(getattr(self, "_longest_read", 0), seen)

    def _note_if_unchanged(self, request_type: str, count: int) -> None:
        """Say, in one line on stderr, that the patch changed nothing on the ``count`` requests just scored,
        where no query saw more keys than its scale leaves as they are (`unchanged_within`, the rule by which
        ``hf-attnscale compare`` leaves logn out): e.g. ``scale=logn`` on a 4k task, whose train_length came
        from a config's 8,192. Not said with several processes: each has read only its share."""
        config = get_config(self.model)
        reason = unchanged_within(config, self._longest_read) if self._longest_read else None
        if reason is None or self.world_size > 1:
            return
        source = (
            f"; train_length={config.train_length} is the model config's max_position_embeddings (pass "
            "train_length=N to scale from another length)"
            if self._train_length_from_config
            else ""
        )
        print(
            f"note: scale={config.scale!r} changed nothing on {count} {request_type} request{'s' * (count != 1)} "
            f"(no query saw more than {self._longest_read} tokens): {reason}{source}.",
            file=sys.stderr,
            flush=True,
        )

    def get_model_info(self) -> dict:
        info = super().get_model_info()
        config = get_config(self.model)
        info["hf_attnscale"] = {
            "patch": None if config is None else config.to_dict(),
            "sink_tokens": self.sink_tokens,
            "window": self.window,
        }
        return info


class DocumentLogLikelihood(float):
    """A document's log-likelihood (the float lm-eval sums into its perplexities) that also carries ``nll``,
    each of its tokens' negative log-likelihood (float32, the document's first token first), from which
    `PositionPerplexityTask` reports perplexity by position."""

    nll: torch.Tensor

    def __new__(cls, nll: torch.Tensor) -> DocumentLogLikelihood:
        score = super().__new__(cls, -nll.double().sum().item())
        score.nll = nll.detach().float().cpu()
        return score

    def __reduce__(self) -> tuple:
        return DocumentLogLikelihood, (self.nll,)


_OWN_KEYS = tuple(
    name for name in inspect.signature(HFAttnScaleLM.__init__).parameters if name not in ("self", "kwargs")
)
"""The model_args keys of the ``hf-attnscale`` model type itself (the patch options apart)."""
_HFLM_KEYS = tuple(
    name for name in inspect.signature(HFLM.__init__).parameters if name not in ("self", "kwargs")
)
"""The keys lm-eval's HFLM takes by name; the others it hands on to ``from_pretrained``."""


def _unknown_key(key: str) -> str:
    """The one line for a model_args key that nothing takes: the closest known key, and the known keys."""
    hflm = [name for name in _HFLM_KEYS if name not in _OWN_KEYS]
    close = difflib.get_close_matches(key, [*_OWN_KEYS, *OPTION_NAMES, *hflm], n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return (
        f"Unknown model_args key {key!r}{hint}: hf-attnscale takes {', '.join(_OWN_KEYS)} and the patch options "
        f"{', '.join(OPTION_NAMES)}; lm-eval's HFLM takes {', '.join(hflm)}; any other key goes to "
        f"transformers' from_pretrained, which takes neither {key!r} as a loading option nor as a field of the "
        "model's config."
    )


def as_written(value: Any) -> Any:
    """A number as written in ``--model_args``: lm-eval's command line reads a negative whole number such as
    ``-4`` as the float -4.0 (only unsigned digit strings become ints), which every count here refuses
    either way; read back as the int it was written as, the error says ``-4``."""
    return int(value) if isinstance(value, float) and value < 0 and value.is_integer() else value


def _start_cpu_processes() -> Accelerator | None:
    """Under ``accelerate launch`` (or torchrun) with several processes on a machine without a GPU: accelerate's
    CPU process group (gloo, `join_processes`), as an Accelerator started before HFLM makes its own, which
    would otherwise run each process alone. None elsewhere."""
    if join_processes() is None or torch.accelerator.current_accelerator() is not None:
        return None
    accelerator = Accelerator(cpu=True)
    return accelerator if accelerator.num_processes > 1 else None


def register() -> None:
    """Register `HFAttnScaleLM` as lm-eval's ``hf-attnscale`` model type (once)."""
    if MODEL_TYPE not in MODEL_REGISTRY:
        register_model(MODEL_TYPE)(HFAttnScaleLM)


register()
