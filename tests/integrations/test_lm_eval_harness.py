"""lm-eval integration: the hf-attnscale model type against our own evaluator, the launcher, the task YAMLs."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")

from conftest import stream_logits, tiny_lm_for, tiny_lm_with_tokenizer, tiny_mlm_with_tokenizer  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.api.registry import get_model  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

import hf_attnscale as hfa  # noqa: E402
from hf_attnscale.checkpoints.models import default_model_path  # noqa: E402
from hf_attnscale.evaluation.corpus import builtin_documents, long_documents  # noqa: E402
from hf_attnscale.integrations.lm_eval_model import HFAttnScaleLM, ModelArgsError  # noqa: E402
from hf_attnscale.integrations.lm_eval_tasks_data import TASKS_DIR  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
EVAL_CONFIGS = TASKS_DIR
TASK = "hfa_local_jsonl"
MAX_LENGTH = 48


@pytest.fixture(scope="module")
def tiny():
    model, tokenizer = tiny_lm_with_tokenizer()
    return model, tokenizer


@pytest.fixture(scope="module")
def texts():
    # Lengths around and well past MAX_LENGTH tokens: one window, several, and a partial last one.
    docs = builtin_documents("heldout")
    return [docs[0].text[:90], docs[1].text[:700], docs[2].text[:1500]]


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory, texts):
    """The documented local-jsonl template, pointed at a file of our texts."""
    folder = tmp_path_factory.mktemp("tasks")
    data = folder / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    template = (EVAL_CONFIGS / "templates" / "local_jsonl.yaml").read_text()
    assert "/absolute/path/to/documents.jsonl" in template
    (folder / "local.yaml").write_text(template.replace("/absolute/path/to/documents.jsonl", str(data)))
    return folder


@pytest.fixture(scope="module")
def manager(task_dir):
    # lm-eval's own few thousand task YAMLs take ~15 s to index; these tests need only ours.
    return TaskManager(include_path=str(task_dir), include_defaults=False)


def evaluate(lm, manager) -> dict:
    results = lm_eval.simple_evaluate(
        model=lm, tasks=[TASK], task_manager=manager, bootstrap_iters=0, log_samples=False
    )
    return results["results"][TASK]


@pytest.fixture(scope="module")
def streamed(tiny, manager) -> float:
    """lm-eval's word perplexity with documents streamed through SinkCache(2, 14), 16 tokens per call."""
    model, tokenizer = tiny
    hfa.unpatch(model)
    lm = HFAttnScaleLM(pretrained=model, tokenizer=tokenizer, sink_tokens=2, window=14, chunk_size=16)
    assert lm.streaming and hfa.get_config(lm.model).is_identity
    return evaluate(lm, manager)["word_perplexity,none"]


def rolling_nll(model, tokens: list[int], prefix: int, max_length: int) -> float:
    """Total NLL over lm-eval's rolling windows, scored by hfa.perplexity (dense) one window at a time.

    lm-eval predicts every token: the first window reads ``[prefix] + tokens[:M-1]``; later ones read the
    M tokens before their M (or, last, fewer) targets, so a short last window keeps extra context.
    """
    full = torch.tensor([prefix, *tokens])
    total, done = 0.0, 0
    while done < len(tokens):
        end = min(done + max_length, len(tokens))
        nll = hfa.perplexity(
            model, full[max(0, end - max_length) : end + 1], method="dense", progress=False
        ).nll
        total += nll[-(end - done) :].double().sum().item()
        done = end
    return total


def words(text: str) -> int:
    return len(re.split(r"\s+", text))  # lm-eval's word count for word_perplexity


def test_model_type_is_registered():
    assert get_model("hf-attnscale") is HFAttnScaleLM
    assert hfa.HFAttnScaleLM is HFAttnScaleLM


def test_word_perplexity_matches_our_evaluator_on_the_same_windows(tiny, texts, manager):
    model, tokenizer = tiny
    hfa.unpatch(model)
    lm = HFAttnScaleLM(
        pretrained=model,
        tokenizer=tokenizer,
        scale="logn",
        train_length=8,
        max_length=MAX_LENGTH,
        batch_size=3,
    )
    assert hfa.get_config(lm.model).scale == "logn"
    metrics = evaluate(lm, manager)

    token_lists = [tokenizer(t)["input_ids"] for t in texts]
    assert max(map(len, token_lists)) > 4 * MAX_LENGTH > min(map(len, token_lists))
    nll = sum(rolling_nll(lm.model, ids, tokenizer.bos_token_id, MAX_LENGTH) for ids in token_lists)
    expected = math.exp(nll / sum(map(words, texts)))
    assert metrics["word_perplexity,none"] == pytest.approx(expected, rel=1e-4)

    # The patch really is in lm-eval's forward: without it the same windows score differently.
    hfa.unpatch(lm.model)
    plain = sum(rolling_nll(lm.model, ids, tokenizer.bos_token_id, MAX_LENGTH) for ids in token_lists)
    assert abs(plain / nll - 1) > 1e-3


def test_streaming_scores_whole_documents_through_a_sink_cache(tiny, texts, manager, streamed):
    model, tokenizer = tiny
    hfa.patch(model)
    nll = 0.0
    for text in texts:
        ids = torch.tensor([tokenizer.bos_token_id, *tokenizer(text)["input_ids"]])
        result = hfa.perplexity(model, ids, cache=hfa.SinkCache(2, 14), chunk_size=16, progress=False)
        nll += result.nll.double().sum().item()
    assert streamed == pytest.approx(math.exp(nll / sum(map(words, texts))), rel=1e-4)

    # A cache and a window that both hold every document see everything: stream == lm-eval's dense windows.
    hfa.unpatch(model)
    longest = max(len(tokenizer(t)["input_ids"]) for t in texts) + 1
    whole = evaluate(HFAttnScaleLM(pretrained=model, tokenizer=tokenizer, window=longest), manager)
    hfa.unpatch(model)
    dense = evaluate(HFAttnScaleLM(pretrained=model, tokenizer=tokenizer, max_length=longest), manager)
    assert whole["word_perplexity,none"] == pytest.approx(dense["word_perplexity,none"], rel=1e-4)
    assert whole["word_perplexity,none"] != pytest.approx(streamed, rel=1e-3)


def loglikelihood_requests(pairs: list[tuple[str, str]]) -> list[Instance]:
    return [Instance("loglikelihood", {}, pair, idx) for idx, pair in enumerate(pairs)]


def encoded(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """A request's tokens as lm-eval's HFLM encodes them (for a context that ends in no space): the context
    alone, and what encoding context + continuation adds after as many tokens."""
    assert context == context.rstrip()
    context_enc = tokenizer(context)["input_ids"]
    return context_enc, tokenizer(context + continuation)["input_ids"][len(context_enc) :]


@pytest.fixture(scope="module")
def long_pairs(texts) -> list[tuple[str, str]]:
    """(context, continuation) pairs from the held-out texts: two contexts several times MAX_LENGTH tokens
    long, and one short enough for any window."""
    text = texts[2]
    return [
        (text[:1100].rstrip(), text[1100:1150]),
        (text[:700].rstrip(), " x"),
        (texts[0][:8], texts[0][8:16]),
    ]


def test_a_long_loglikelihood_request_streams_whole_through_a_sink_cache(tiny, long_pairs):
    model, tokenizer = tiny
    hfa.unpatch(model)
    lm = HFAttnScaleLM(
        pretrained=model, tokenizer=tokenizer, sink_tokens=2, window=14, chunk_size=16, max_length=MAX_LENGTH
    )
    results = lm.loglikelihood(loglikelihood_requests(long_pairs))
    hfa.unpatch(model)
    dense = HFLM(pretrained=model, tokenizer=tokenizer, max_length=MAX_LENGTH).loglikelihood(
        loglikelihood_requests(long_pairs)
    )
    hfa.patch(model)  # the identity patch, as streaming needs
    for (context, continuation), (logprob, _), (dense_logprob, _) in zip(long_pairs, results, dense):
        context_enc, continuation_enc = encoded(tokenizer, context, continuation)
        ids = torch.tensor([*context_enc, *continuation_enc])
        nll = hfa.perplexity(model, ids, cache=hfa.SinkCache(2, 14), chunk_size=5, progress=False).nll
        assert logprob == pytest.approx(-nll[-len(continuation_enc) :].double().sum().item(), abs=1e-4)
        if len(ids) > MAX_LENGTH + 1:  # lm-eval's dense scoring cuts the context to MAX_LENGTH: not ours
            assert abs(logprob - dense_logprob) > 1e-2
        elif len(ids) <= 2 + 14:  # the cache holds it all: the stream sees what the dense model sees
            assert logprob == pytest.approx(dense_logprob, abs=1e-4)
    lengths = [sum(map(len, encoded(tokenizer, *pair))) for pair in long_pairs]
    assert min(lengths[:2]) > 3 * MAX_LENGTH and lengths[2] <= 16


def test_a_streamed_request_is_greedy_where_each_continuation_token_is_the_streams_argmax():
    """The shipped model, a held-out file's first ~800 tokens as context (max_length 64, SinkCache(4, 28)):
    the stream's own greedy continuation is greedy; the file's real continuation is not. (Cut to the last 64
    tokens, the dense model would pick another first token: lm-eval's scoring would call the first not greedy.)"""
    lm = HFAttnScaleLM(
        pretrained=str(default_model_path()),
        sink_tokens=4,
        window=28,
        max_length=64,
        dtype="float32",
        device="cpu",
    )
    model, tokenizer = lm.model, lm.tokenizer
    text = builtin_documents("heldout")[1].text
    context = text[:2500].rstrip()
    greedy = []
    with torch.no_grad():  # decoded greedily, token by token through the cache
        cache = hfa.SinkCache(4, 28)
        logits = stream_logits(model, torch.tensor([tokenizer(context)["input_ids"]]), cache, [64])
        for _ in range(6):
            greedy.append(logits[0, -1].argmax().item())
            logits = stream_logits(model, torch.tensor([greedy[-1:]]), cache, [1])
    pairs = [(context, tokenizer.decode(greedy)), (context, text[len(context) : len(context) + 30])]
    assert encoded(tokenizer, *pairs[0])[1] == greedy  # the text encodes back to the same tokens

    results = lm.loglikelihood(loglikelihood_requests(pairs))
    expected = []
    for pair, (logprob, _) in zip(pairs, results):
        context_enc, continuation_enc = encoded(tokenizer, *pair)
        assert len(context_enc) > 10 * 64
        ids = torch.tensor([[*context_enc, *continuation_enc]])
        with torch.no_grad():  # the reference: every token fed alone through the cache
            logits = stream_logits(model, ids[:, :-1], hfa.SinkCache(4, 28), [1])[0]
        scored = logits[-len(continuation_enc) :]
        targets = ids[0, -len(continuation_enc) :]
        expected.append(bool((scored.argmax(-1) == targets).all()))
        reference = -torch.nn.functional.cross_entropy(scored, targets, reduction="sum").item()
        assert logprob == pytest.approx(reference, abs=1e-4)
    assert [is_greedy for _, is_greedy in results] == expected == [True, False]


def output_rows(model) -> list[int]:
    """The positions each call of ``model``'s output layer computes logits at, appended as it runs."""
    rows: list[int] = []
    model.get_output_embeddings().register_forward_hook(lambda m, args, out: rows.append(out.shape[-2]))
    return rows


def assert_same_answers(ours: list, theirs: list, continuations: list[int]) -> None:
    """lm-eval's answers, as stock HFLM gives them: log-likelihood within 1e-4 nats per token, the same
    is_greedy."""
    assert [greedy for _, greedy in ours] == [greedy for _, greedy in theirs]
    for (mine, _), (stock, _), count in zip(ours, theirs, continuations):
        assert abs(mine - stock) <= 1e-4 * count, (mine, stock)


# Families whose causal LM ends its own way after the output layer: tied embeddings, Gemma-2's final
# soft-capping, Cohere's logit scale, Granite's logits scaling. Weights 10x wider than the default, so that the
# scores differ from token to token.
ENDINGS = {
    "llama": {"tie_word_embeddings": True},
    "gemma2": {"final_logit_softcapping": 5.0, "head_dim": 8},
    "cohere": {"logit_scale": 0.5},
    "granite": {"logits_scaling": 4.0},
}


@pytest.mark.parametrize("model_type", ENDINGS)
def test_without_a_window_loglikelihood_is_lm_evals_own_without_logits_over_the_context(
    model_type, tiny, long_pairs
):
    """HFLM's dense loglikelihood, its right-padded batches and its cut to max_length included, with the output
    layer run only where continuations are: the answers stock HFLM gives, and no call computes logits at every
    position (it used to, (B, T, V), and log-softmax them whole)."""
    _, tokenizer = tiny
    attention = "eager" if model_type == "gemma2" else "sdpa"  # Gemma-2 refuses sdpa
    model = tiny_lm_for(tokenizer, model_type, attention, max_position_embeddings=512, **ENDINGS[model_type])
    pairs = [*long_pairs, (long_pairs[1][0][:300].rstrip(), " import os")]
    continuations = [len(encoded(tokenizer, *pair)[1]) for pair in pairs]
    lengths = [sum(map(len, encoded(tokenizer, *pair))) - 1 for pair in pairs]
    max_length = 128  # three requests are longer, cut from the left as HFLM cuts them; one is shorter
    assert sorted(lengths)[0] < max_length < sorted(lengths)[1]
    rows = output_rows(model)
    theirs = HFLM(pretrained=model, tokenizer=tokenizer, max_length=max_length, batch_size=4)
    stock = theirs.loglikelihood(loglikelihood_requests(pairs))
    assert rows == [max_length]  # stock: logits at every position of one right-padded batch
    rows.clear()
    ours = HFAttnScaleLM(pretrained=model, tokenizer=tokenizer, max_length=max_length, batch_size=3)
    assert not ours.streaming and hfa.get_config(model) is None
    assert_same_answers(ours.loglikelihood(loglikelihood_requests(pairs)), stock, continuations)
    # The three cut requests in one batch: the rows of the longest continuation. Then the short one alone.
    assert rows == [max(continuations), min(lengths)]
    rows.clear()
    padded = HFAttnScaleLM(pretrained=model, tokenizer=tokenizer, max_length=max_length, batch_size=4)
    assert_same_answers(padded.loglikelihood(loglikelihood_requests(pairs)), stock, continuations)
    assert rows == [max_length]  # the short request right-padded: its continuation is far from the end
    rows.clear()
    alone = HFAttnScaleLM(pretrained=model, tokenizer=tokenizer, max_length=max_length, batch_size=1)
    assert_same_answers(alone.loglikelihood(loglikelihood_requests(pairs)), stock, continuations)
    assert max(rows) == max(continuations)  # one request a call: its longest continuation's rows at most


@pytest.mark.parametrize("model_type", ["llama", "gemma2", "gemma3_text"])
def test_a_request_longer_than_chunk_size_is_read_in_chunks_with_stock_hflms_answers(
    model_type, tiny, long_pairs
):
    """A loglikelihood request longer than ``chunk_size`` is read that many tokens a call through the model's own
    cache (`chunked_logit_rows`): lm-eval's answers as stock HFLM gives them from one whole call, batched and
    alone, with Gemma-2's soft-cap and Gemma-3's sliding-window layers (a window of 24, shorter than the requests),
    and no call reads more than ``chunk_size`` tokens."""
    _, tokenizer = tiny
    attention = "eager" if model_type == "gemma2" else "sdpa"  # Gemma-2 refuses sdpa
    overrides = {}
    if model_type == "gemma3_text":
        overrides = {"sliding_window": 24, "layer_types": ["sliding_attention", "full_attention"]}
    model = tiny_lm_for(
        tokenizer,
        model_type,
        attention,
        max_position_embeddings=512,
        **ENDINGS.get(model_type, {}),
        **overrides,
    )
    pairs = long_pairs
    continuations = [len(encoded(tokenizer, *pair)[1]) for pair in pairs]
    stock = HFLM(pretrained=model, tokenizer=tokenizer, max_length=128, batch_size=4)
    answers = stock.loglikelihood(loglikelihood_requests(pairs))
    read: list[int] = []
    model.register_forward_pre_hook(
        lambda m, args, kwargs: read.append(kwargs["input_ids"].shape[-1]), with_kwargs=True
    )
    for batch_size in (3, 1):
        ours = HFAttnScaleLM(
            pretrained=model, tokenizer=tokenizer, max_length=128, batch_size=batch_size, chunk_size=32
        )
        assert_same_answers(ours.loglikelihood(loglikelihood_requests(pairs)), answers, continuations)
    assert max(read) == 32 and len(read) > 2 * len(pairs)


def test_documents_read_in_windows_say_so(tiny, texts, capsys):
    """A document longer than max_length is read in lm-eval's windows, so a token past max_length is not read
    with the whole document before it: one note line says how many; none when every document fits, one of
    exactly max_length tokens included (lm-eval reads it as one window)."""
    model, tokenizer = tiny
    hfa.unpatch(model)
    requests = [Instance("loglikelihood_rolling", {}, (text,), i) for i, text in enumerate(texts)]
    lm = HFAttnScaleLM(pretrained=model, tokenizer=tokenizer)
    lengths = sorted(len(lm.tok_encode(text)) for text in texts)
    assert lengths[0] < lengths[1]
    for max_length, longer in ((lengths[0] - 1, 3), (lengths[0], 2), (lengths[-1], 0)):
        lm = HFAttnScaleLM(pretrained=model, tokenizer=tokenizer, max_length=max_length)
        capsys.readouterr()
        lm.loglikelihood_rolling(requests)
        notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")]
        if longer:
            (note,) = notes
            assert note.startswith(f"note: {longer} of 3 documents are longer than max_length={max_length}")
        else:
            assert not notes


def test_rolling_perplexity_reads_chunks_of_logits_as_stock_hflm_reads_whole_windows(tiny, texts):
    """Rolling loglikelihood (perplexity tasks) on a model whose RoPE rescales with the length read (dynamic
    NTK): lm-eval's windows, each read in chunks of 16 at the whole window's frequencies, score as stock HFLM's
    one call per window does, while no call computes logits at more than one chunk's positions."""
    _, tokenizer = tiny
    dynamic = {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 100.0}
    model = tiny_lm_for(tokenizer, max_position_embeddings=32, rope_parameters=dynamic)
    requests = [Instance("loglikelihood_rolling", {}, (text,), i) for i, text in enumerate(texts[1:])]
    rows = output_rows(model)
    stock = HFLM(pretrained=model, tokenizer=tokenizer, max_length=160).loglikelihood_rolling(requests)
    assert max(rows) == 160
    rows.clear()
    ours = HFAttnScaleLM(pretrained=model, tokenizer=tokenizer, max_length=160, chunk_size=16)
    scores = ours.loglikelihood_rolling(requests)
    assert max(rows) == 16
    for mine, theirs in zip(scores, stock):
        assert abs(mine - theirs) <= 1e-4 * len(mine.nll), (mine, theirs)


def test_a_patch_that_changes_nothing_at_the_lengths_read_says_so(capsys):
    """``scale=logn`` without train_length takes the shipped model's max_position_embeddings, 128. Where no query
    sees more than 128 tokens, logn's factor is 1 and the scores are the unpatched model's: one note line says
    so, by the rule by which ``hf-attnscale compare`` leaves logn out (issue 54). Past 128, nothing is said."""
    from hf_attnscale.evaluation.variants import unchanged_within

    path = str(default_model_path())
    text = builtin_documents("heldout")[1].text
    short, long = [(text[:150].rstrip(), text[150:170])], [(text[:1500].rstrip(), text[1500:1520])]
    lm = HFAttnScaleLM(pretrained=path, scale="logn", max_length=512, dtype="float32", device="cpu")
    plain = HFLM(pretrained=path, max_length=512, dtype="float32", device="cpu")
    capsys.readouterr()

    def notes() -> list[str]:
        return [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")]

    assert lm.loglikelihood(loglikelihood_requests(short)) == plain.loglikelihood(
        loglikelihood_requests(short)
    )
    read = sum(map(len, encoded(lm.tokenizer, *short[0]))) - 1  # HFLM reads all but the last token
    within = "every length is within the trained length (128), where its factor max(1, log_L n) is 1"
    assert within == unchanged_within(hfa.AttnScaleConfig(scale="logn", train_length=128), read)
    assert notes() == [
        f"note: scale='logn' changed nothing on 1 loglikelihood request (no query saw more than {read} tokens): "
        f"{within}; train_length=128 is the model config's max_position_embeddings (pass train_length=N to scale "
        "from another length)."
    ]
    assert read < 128 and lm.loglikelihood(loglikelihood_requests(long)) and notes() == []
    # Streamed, a query sees at most the cache's sink_tokens + window tokens, however long the request.
    document = [Instance("loglikelihood_rolling", {}, (text[:1500],), 0)]
    for window, said in [(124, [f"(no query saw more than 128 tokens): {within}."]), (125, [])]:
        streamed = HFAttnScaleLM(
            pretrained=path, scale="logn", train_length=128, sink_tokens=4, window=window, device="cpu"
        )
        streamed.loglikelihood_rolling(document)
        assert [
            line.removeprefix("note: scale='logn' changed nothing on 1 loglikelihood_rolling request ")
            for line in notes()
        ] == said
    # Anything but the scale changes attention at every length; so do laws that are not 1 within L.
    for changes in ({"sink_logit": 0.0}, {"clamp": False}, {"scale": "ssmax"}, {"scale": "llama4"}):
        assert (
            unchanged_within(hfa.AttnScaleConfig(**{"scale": "logn", "train_length": 128, **changes}), 128)
            is None
        )
    assert unchanged_within(hfa.AttnScaleConfig(scale="llama4", train_length=128), 127) is not None


def test_bad_options_fail_before_loading():
    with pytest.raises(ValueError, match="sink_tokens=4 needs a window"):
        HFAttnScaleLM(pretrained="/nonexistent/model", sink_tokens=4)
    with pytest.raises(ValueError, match="needs train_length"):
        HFAttnScaleLM(pretrained="/nonexistent/model", scale="logn")
    with pytest.raises(ValueError, match="window must be an int >= 1"):
        HFAttnScaleLM(pretrained="/nonexistent/model", window=0)


def test_launcher_runs_lm_eval_cli_end_to_end(tiny, task_dir, streamed, tmp_path):
    model, tokenizer = tiny
    hfa.unpatch(model)
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    out = tmp_path / "out"
    args = [
        *("--model", "hf-attnscale"),
        *("--model_args", f"pretrained={model_dir},sink_tokens=2,window=14,chunk_size=16,dtype=float32"),
        *("--tasks", TASK, "--include_path", str(task_dir), "--device", "cpu", "--output_path", str(out)),
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "hf_attnscale.integrations.lm_eval_launcher", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (result_file,) = out.rglob("results_*.json")
    saved = json.loads(result_file.read_text())
    assert saved["config"]["hf_attnscale"] == {
        "patch": hfa.AttnScaleConfig().to_dict(),
        "sink_tokens": 2,
        "window": 14,
    }

    assert saved["results"][TASK]["word_perplexity,none"] == pytest.approx(streamed, rel=1e-5)


def test_eval_configs_index_and_build_the_builtin_tasks():
    manager = TaskManager(include_path=str(EVAL_CONFIGS), include_defaults=False)
    names = set(manager.all_tasks)
    expected = {
        "hfa_stdlib_heldout",
        "hfa_stdlib_heldout_1k",
        "hfa_stdlib_heldout_2k",
        "hfa_stdlib_heldout_4k",
        "hfa_local_jsonl",
        "hfa_local_text",
        "hfa_pg19",
        "hfa_wikitext103",
    }
    assert expected <= names
    if not (default_model_path() / "tokenizer.json").is_file():
        pytest.skip("shipped tokenizer missing")
    task = manager.load(["hfa_stdlib_heldout_4k"])["tasks"]["hfa_stdlib_heldout_4k"]
    docs = list(task.test_docs())
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    long = long_documents("heldout", 4096, tokenizer)
    assert [d["name"] for d in docs] == [d.name for d in long]
    for doc, source in zip(docs, long):
        assert source.text.startswith(doc["text"])
        assert abs(len(tokenizer(doc["text"])["input_ids"]) - 4096) <= 2  # cut at a token boundary


def _builtin_task(name: str, **metadata):
    manager = TaskManager(include_path=str(EVAL_CONFIGS), include_defaults=False, metadata=metadata or None)
    return manager.load([name])["tasks"][name]


def test_a_metadata_key_the_task_sets_too_takes_the_users_value():
    """``--metadata '{"first_tokens": 512}'`` on ``hfa_stdlib_heldout_1k``, whose YAML sets ``first_tokens: 1024``,
    as the README's lm-eval command passes it: the user's value, not lm-eval's TypeError (issue 54)."""
    if not (default_model_path() / "tokenizer.json").is_file():
        pytest.skip("shipped tokenizer missing")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    whole = list(_builtin_task("hfa_stdlib_heldout_1k").test_docs())
    task = _builtin_task("hfa_stdlib_heldout_1k", first_tokens=512)
    cut = list(task.test_docs())
    assert [d["name"] for d in cut] == [d["name"] for d in whole]  # min_tokens still the YAML's 1024
    for doc, source in zip(cut, whole):
        assert source["text"].startswith(doc["text"])
        assert abs(len(tokenizer(doc["text"])["input_ids"]) - 512) <= 2
    # The saved task config says which value was used: the metadata's, no longer the YAML's dataset_kwargs.
    assert task.config.metadata["first_tokens"] == 512 and "first_tokens" not in task.config.dataset_kwargs
    prompts = list(_builtin_task("hfa_passkey_4k", lengths=[256], per_cell=1).test_docs())
    assert {d["length"] for d in prompts} == {256} and len(prompts) == 5


def test_the_passkey_table_has_rows_only_for_the_depths_run():
    """Depths that no prompt of the run has are left out, not printed as NaN; each depth row is the mean over
    its own prompts (issue 54)."""
    lm = HFAttnScaleLM(pretrained=str(default_model_path()), dtype="float32", device="cpu")
    manager = TaskManager(include_path=str(EVAL_CONFIGS), include_defaults=False)

    def run(limit: int) -> tuple[dict, list]:
        out = lm_eval.simple_evaluate(
            model=lm,
            tasks=["hfa_passkey_4k"],
            task_manager=manager,
            limit=limit,
            bootstrap_iters=0,
            log_samples=True,
        )
        return out["results"]["hfa_passkey_4k"], out["samples"]["hfa_passkey_4k"]

    def rows(metrics: dict) -> list[str]:
        return sorted(k for k in metrics if k.startswith("acc") and "_stderr" not in k)

    metrics, samples = run(1)  # one prompt, at depth 0
    assert rows(metrics) == ["acc,none", "acc_depth_0,none"]
    assert not any(isinstance(v, float) and math.isnan(v) for v in metrics.values())
    metrics, samples = run(3)  # two prompts at depth 0, one at 25%
    assert rows(metrics) == ["acc,none", "acc_depth_0,none", "acc_depth_25,none"]
    found = {s["doc_id"]: s["acc"] for s in samples}
    assert metrics["acc_depth_0,none"] == pytest.approx((found[0] + found[1]) / 2)
    assert metrics["acc_depth_25,none"] == found[2]


def test_an_encoder_is_scored_by_pseudo_likelihood(texts, manager, tmp_path):
    """A saved masked LM through the lm-eval route: word perplexity from the pseudo-log-likelihood."""
    from hf_attnscale.evaluation.mlm import masked_one_at_a_time

    bert, tokenizer = tiny_mlm_with_tokenizer(max_position_embeddings=64, initializer_range=0.2)
    hfa.patch(bert, scale="logn", train_length=8)
    bert.save_pretrained(tmp_path / "bert")
    tokenizer.save_pretrained(tmp_path / "bert")
    lm = HFAttnScaleLM(pretrained=str(tmp_path / "bert"), max_length=MAX_LENGTH, device="cpu")
    assert lm.masked and hfa.get_config(lm.model).scale == "logn"  # loaded with its saved patch
    metrics = evaluate(lm, manager)
    total, word_count = 0.0, 0
    for text in texts:
        ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"])
        for start in range(0, ids.numel(), MAX_LENGTH):  # written out: every token masked alone
            piece = ids[start : start + MAX_LENGTH]
            for position in range(piece.numel()):
                nll, _ = masked_one_at_a_time(lm.model, [piece], [position], tokenizer.mask_token_id)
                total += nll.item()
        word_count += words(text)
    assert metrics["word_perplexity,none"] == pytest.approx(math.exp(total / word_count), rel=1e-4)
    with pytest.raises(ValueError, match="this model is a masked LM"):
        HFAttnScaleLM(pretrained=str(tmp_path / "bert"), window=16)


def test_options_given_replace_a_saved_patch_and_say_so(tmp_path, capsys):
    """Patch options in model_args replace the patch a model was saved with, in one note line (as `eval`
    says it); a model saved unpatched is patched without one."""
    bert, tokenizer = tiny_mlm_with_tokenizer(max_position_embeddings=64)
    tokenizer.save_pretrained(tmp_path / "plain")
    bert.save_pretrained(tmp_path / "plain")
    hfa.patch(bert, scale="logn", train_length=8)
    bert.save_pretrained(tmp_path / "bert")
    tokenizer.save_pretrained(tmp_path / "bert")
    capsys.readouterr()
    lm = HFAttnScaleLM(pretrained=str(tmp_path / "bert"), scale="ssmax", train_length=16, device="cpu")
    assert hfa.get_config(lm.model).scale == "ssmax"
    (note,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")]
    assert "replace the patch saved with the model" in note and "logn" in note
    HFAttnScaleLM(pretrained=str(tmp_path / "plain"), scale="ssmax", train_length=16, device="cpu")
    assert not [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")]


def _lm_eval_samples(launcher: list[str], model_args: str, out: Path) -> tuple[dict[int, float], str]:
    """Run the hf-attnscale model type through lm-eval's CLI under ``launcher``: each document's
    log-likelihood, and the run's log."""
    args = [
        *("--model", "hf-attnscale", "--model_args", model_args, "--tasks", "hfa_stdlib_heldout_1k"),
        *("--limit", "6", "--device", "cpu", "--output_path", str(out), "--log_samples"),
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [*launcher, "-m", "hf_attnscale.integrations.lm_eval_launcher", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    (samples,) = out.rglob("samples_hfa_stdlib_heldout_1k_*.jsonl")
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    return {row["doc_id"]: float(row["resps"][0][0]) for row in rows}, proc.stdout + proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("streamed", [False, True], ids=["dense", "streamed"])
def test_two_processes_score_each_document_as_one_does(streamed, tmp_path):
    # lm-eval's data parallelism: `accelerate launch` starts 2 CPU processes (gloo), each scores its share of
    # the documents, and rank 0 gathers them. Every document's log-likelihood equals the one-process run. (lm-eval
    # alone shares documents only over GPUs: on CPU both processes would score all of them, as rank 0.)
    model_args = f"pretrained={default_model_path()},max_length=128,dtype=float32"
    if streamed:
        model_args += ",sink_tokens=4,window=60,chunk_size=32"
    single, _ = _lm_eval_samples([sys.executable], model_args, tmp_path / "one")
    accelerate = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes=2"]
    accelerate += ["--num_machines=1", "--mixed_precision=no", "--dynamo_backend=no"]
    double, log = _lm_eval_samples(accelerate, model_args, tmp_path / "two")
    assert "hfa_stdlib_heldout_1k on rank 1" in log  # the second process took its own share
    assert sorted(double) == sorted(single) == list(range(6))
    for doc_id, value in single.items():
        assert double[doc_id] == pytest.approx(value, abs=1e-4), doc_id


@pytest.mark.slow
def test_parallelize_offloads_to_disk_and_scores_each_document_as_loaded_whole(tmp_path):
    # parallelize=True is lm-eval's device_map="auto". Without GPUs it can only spread the model over the CPU
    # and the disk: a CPU budget below the model's 16 MB sends layers to disk (accelerate's hooks).
    model_args = f"pretrained={default_model_path()},max_length=128,dtype=float32,sink_tokens=4,window=60"
    whole, _ = _lm_eval_samples([sys.executable], model_args, tmp_path / "whole")
    offload = f"{model_args},parallelize=True,max_cpu_memory=6MB,offload_folder={tmp_path / 'offload'}"
    split, log = _lm_eval_samples([sys.executable], offload, tmp_path / "split")
    assert "offloaded to the disk" in log  # (read from the safetensors file in place: the folder stays empty)
    assert sorted(split) == sorted(whole)
    for doc_id, value in whole.items():
        assert split[doc_id] == pytest.approx(value, abs=1e-4), doc_id


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    """A LoRA adapter trained a few steps on the tiny LM under a learnable sink (learned values to carry), saved
    with its patch, and the adapted model's logits on a probe."""
    peft = pytest.importorskip("peft")
    folder = tmp_path_factory.mktemp("adapter")
    model, tokenizer = tiny_lm_with_tokenizer()
    model.save_pretrained(folder / "base")
    tokenizer.save_pretrained(folder / "base")
    hfa.patch(model, scale="logn", train_length=16, sink_logit="learnable")
    adapted = peft.get_peft_model(model, hfa.lora_config(model, r=4, init_lora_weights=False))
    ids = torch.randint(3, 300, (1, 40), generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.SGD([p for p in adapted.parameters() if p.requires_grad], lr=0.1)
    for _ in range(3):
        adapted(ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    adapted.eval()
    adapted.save_pretrained(folder / "lora")
    with torch.no_grad():
        return folder, ids, adapted(ids).logits


def test_peft_loads_the_adapter_with_the_patch_it_was_trained_under(adapter):
    folder, ids, expected = adapter
    lm = HFAttnScaleLM(pretrained=str(folder / "base"), peft=str(folder / "lora"), device="cpu")
    config = hfa.get_config(lm.model)
    assert config.scale == "logn" and config.sink_logit == "learnable"
    with torch.no_grad():
        torch.testing.assert_close(lm.model(ids).logits, expected, rtol=0, atol=1e-5)
    plain = HFAttnScaleLM(pretrained=str(folder / "base"), device="cpu")
    with torch.no_grad():
        assert (plain.model(ids).logits - expected).abs().max() > 1e-2  # the adapter and its sink moved them


@pytest.mark.parametrize(
    "args, message",
    [
        ({"peft": "./missing-adapter"}, "peft='./missing-adapter' does not exist"),
        ({"peft": "base"}, "has no adapter_config.json"),
        ({"peft": "lora", "scale": "ssmax", "train_length": 16}, "was trained with the attention patch"),
    ],
)
def test_a_bad_adapter_is_one_line(adapter, args, message, monkeypatch):
    folder, _, _ = adapter
    monkeypatch.chdir(folder)
    with pytest.raises(ModelArgsError, match=re.escape(message)) as err:
        HFAttnScaleLM(pretrained=str(folder / "base"), device="cpu", **args)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("command", ["eval", "compare", "diagnose"])
def test_the_commands_load_the_adapter_as_the_model_type_does(adapter, command):
    from hf_attnscale.cli import build_parser
    from hf_attnscale.cli.options import load_model

    folder, ids, expected = adapter
    extra = ["--lengths", "32"] if command == "eval" else []
    args = build_parser().parse_args(
        [command, "--model", str(folder / "base"), "--peft", str(folder / "lora"), *extra]
    )
    model, _, kind = load_model(args, torch.device("cpu"))
    assert kind == "causal" and hfa.get_config(model).sink_logit == "learnable"
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected, rtol=0, atol=1e-5)
