"""The length sweep (hf_attnscale.evaluation.sweep): its definition, its variants, its data loading and its outputs."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import random_documents, tiny_lm_with_tokenizer, tiny_model

import hf_attnscale as hfa
from hf_attnscale.cli.options import parse_lengths
from hf_attnscale.evaluation.corpus import Document, builtin_documents
from hf_attnscale.evaluation.documents import load_documents
from hf_attnscale.evaluation.perplexity import perplexity
from hf_attnscale.evaluation.recompute import recompute_rows
from hf_attnscale.evaluation.sweep import sweep
from hf_attnscale.evaluation.variants import Variant, demo_variants


def segment_ppl(model, documents: list[torch.Tensor], longest: int, length: int) -> float:
    """The definition, written out: first `longest` tokens, L-token segments, one plain forward each."""
    total, count = 0.0, 0
    with torch.no_grad():
        for doc in documents:
            for segment in doc[:longest].view(-1, length):
                logits = model(input_ids=segment[None]).logits[0, :-1]
                total += F.cross_entropy(logits.double(), segment[1:], reduction="sum").item()
                count += length - 1
    return math.exp(total / count)


def test_parse_lengths():
    assert parse_lengths("256, 512,1k,2K") == [256, 512, 1024, 2048]
    for bad in ("1.5k", "abc", "", "1m"):
        with pytest.raises(ValueError, match="512,1k,2k,4k"):
            parse_lengths(bad)


def test_sweep_follows_its_definition_and_variants_agree_where_they_must():
    # Larger weights than the default make attention matter, so variants that differ measurably do.
    model = tiny_model("llama", initializer_range=0.2)
    docs = random_documents([64, 70, 40, 96])  # the 40-token document is too short for 64 and is skipped
    variants = [
        Variant("unpatched"),
        Variant("logn", patch={"scale": "logn", "train_length": 16}),
        Variant("window-only", window=16),
        Variant("sink+window", sink_tokens=2, window=14),
        Variant("big cache", sink_tokens=2, window=62),
    ]
    result = sweep(model, docs, [16, 64, 32], variants, max_documents=2, train_length=16, progress=False)

    assert result.lengths == [16, 32, 64]
    assert result.documents == ["doc0", "doc1"]
    assert hfa.get_config(model) is None  # left unpatched
    for length in (16, 32, 64):
        expected = segment_ppl(model, docs[:2], 64, length)
        assert result.ppl("unpatched", length) == pytest.approx(expected, rel=1e-5)
        row = next(r for r in result.rows if r.variant == "unpatched" and r.length == length)
        assert row.tokens == 2 * (64 - 64 // length) and row.documents == 2
        # A cache that holds a whole segment streams it exactly as dense attention reads it; so does the
        # clamped logn scale within its trained length, and every variant at L=16.
        assert result.ppl("big cache", length) == pytest.approx(expected, rel=1e-5)
    for name in ("logn", "window-only", "sink+window"):
        assert result.ppl(name, 16) == pytest.approx(result.ppl("unpatched", 16), rel=1e-5)
        # Past 16 tokens each of them changes what a token sees: the result must move.
        assert abs(result.ppl(name, 64) / result.ppl("unpatched", 64) - 1) > 1e-3
    assert abs(result.ppl("sink+window", 64) / result.ppl("window-only", 64) - 1) > 1e-4


def test_sweep_rejects_bad_input_before_any_work():
    model = tiny_model("llama")
    docs = random_documents([50, 30])
    with pytest.raises(
        ValueError, match=r"No document has at least 64 tokens.*longest of the 2 documents has 50"
    ):
        sweep(model, docs, [32, 64], [Variant("unpatched")])
    with pytest.raises(ValueError, match=r"divide the longest \(48\).*\[32\]"):
        sweep(model, docs, [32, 48], [Variant("unpatched")])
    with pytest.raises(ValueError, match="unique"):
        sweep(model, docs, [16], [Variant("a"), Variant("a", window=8)])

    encoder = tiny_model("bert")  # an encoder: it cannot stream
    with pytest.raises(ValueError, match=r"Variant 'stream'.*SinkCache needs a RoPE decoder"):
        sweep(encoder, docs, [16], [Variant("dense"), Variant("stream", window=8)])
    assert hfa.get_config(encoder) is None


def test_variant_validation():
    assert Variant("s", window=8).patch == {}  # streaming needs the (identity) patch
    assert Variant("d").patch is None and not Variant("d").streaming
    with pytest.raises(ValueError, match="sink_tokens=4 needs a window"):
        Variant("x", sink_tokens=4)
    with pytest.raises(ValueError, match="train_length"):
        Variant("x", patch={"scale": "logn"})
    with pytest.raises(ValueError, match="window must be an int >= 1"):
        Variant("x", window=0)
    names = [v.name for v in demo_variants(256)]
    assert names == [
        "unpatched",
        "logn",
        "ReRoPE + logn (w=64)",
        "window-only (256)",
        "sink+window (4+252)",
        "sink+window (4+508)",
        "streaming+logn (4+508)",
    ]


def test_load_documents(tmp_path):
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text('{"text": "first doc"}\n\n{"text": "second", "id": 2}\n')
    docs = load_documents(str(jsonl))
    assert [(d.name, d.text) for d in docs] == [("docs.jsonl:1", "first doc"), ("docs.jsonl:3", "second")]
    text = tmp_path / "book.txt"
    text.write_text("one long book\n")
    assert load_documents(str(text)) == [Document("book.txt", "one long book\n")]
    assert len(load_documents("builtin:stdlib-heldout")) == len(builtin_documents("heldout"))

    with pytest.raises(FileNotFoundError, match=r"does not exist.*builtin:stdlib-heldout"):
        load_documents(str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": \n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2 is not valid JSON"):
        load_documents(str(bad))
    with pytest.raises(ValueError, match=r"docs.jsonl:1 has no string field 'body' \(found \['text'\]\)"):
        load_documents(str(jsonl), text_field="body")
    binary = tmp_path / "data.bin"
    binary.write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(ValueError, match="not UTF-8"):
        load_documents(str(binary))
    with pytest.raises(ValueError, match="not a file"):
        load_documents(str(tmp_path))
    with pytest.raises(ValueError, match="Unknown built-in corpus"):
        load_documents("builtin:nope")


def test_table_json_and_plot(tmp_path):
    model = tiny_model("llama")
    variants = [Variant("unpatched"), Variant("sink+window", sink_tokens=2, window=6)]
    result = sweep(model, random_documents([32, 32]), [8, 16, 32], variants, train_length=8, progress=False)

    table = result.table().splitlines()
    assert table[0] == "| variant | 8 (1x) | 16 (2x) | 32 (4x) | tok/s |"
    assert table[2].startswith(f"| unpatched | {result.ppl('unpatched', 8):.2f} | ")
    assert len(table) == 4

    saved = json.loads(result.write_json(tmp_path / "out" / "results.json").read_text())
    assert saved["lengths"] == [8, 16, 32] and saved["train_length"] == 8
    assert [v["name"] for v in saved["variants"]] == ["unpatched", "sink+window"]
    assert saved["variants"][1] == {"name": "sink+window", "patch": {}, "sink_tokens": 2, "window": 6}
    row = saved["rows"][-1]
    assert (row["variant"], row["length"]) == ("sink+window", 32)
    assert row["ppl"] == pytest.approx(math.exp(row["nll"]))

    png = result.plot(tmp_path / "out" / "ppl.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000


def test_a_long_legend_goes_beside_the_plot(tmp_path):
    from matplotlib.image import imread

    from hf_attnscale.evaluation.figure import LEGEND_INSIDE
    from hf_attnscale.evaluation.report import SweepResult, SweepRow

    def result(count: int) -> SweepResult:
        variants = [Variant(f"variant {i}") for i in range(count)]
        rows = [
            SweepRow(v.name, n, 10.0 + i, math.log(10.0 + i), 8, 1)
            for i, v in enumerate(variants)
            for n in (8, 16)
        ]
        return SweepResult(rows, variants, [8, 16], ["doc0"])

    inside = imread(result(LEGEND_INSIDE).plot(tmp_path / "inside.png"))
    beside = imread(result(LEGEND_INSIDE + 1).plot(tmp_path / "beside.png"))
    assert beside.shape[0] == inside.shape[0] and beside.shape[1] > 1.3 * inside.shape[1]


def test_re_computation_equals_the_perplexity_method():
    model, _ = tiny_lm_with_tokenizer()
    doc = torch.randint(0, model.config.vocab_size, (64,), generator=torch.Generator().manual_seed(0))
    full = perplexity(model, doc, method="recompute", window=12).nll.double()
    (row,) = recompute_rows(model, "r", 12, [doc], [64])
    assert row.tokens == 63 and row.nll == pytest.approx(full.mean().item(), rel=1e-5)
    (row,) = recompute_rows(model, "r", 12, [doc], [64], every=4)  # tokens 3, 7, ...: nll[2], nll[6], ...
    assert row.tokens == 16 and row.nll == pytest.approx(full[2::4].mean().item(), rel=1e-5)
    # Two 32-token segments: the second starts from scratch (its first token is not predicted).
    second = perplexity(model, doc[32:], method="recompute", window=12).nll.double()
    rows = recompute_rows(model, "r", 12, [doc], [32, 64])
    assert rows[0].nll == pytest.approx(torch.cat([full[:31], second]).mean().item(), rel=1e-5)


def test_re_computation_behind_bos_holds_bos_and_the_last_tokens():
    model, tokenizer = tiny_lm_with_tokenizer()
    bos = tokenizer.bos_token_id
    doc = torch.randint(3, model.config.vocab_size, (48,), generator=torch.Generator().manual_seed(1))
    # Written out: token j of a 24-token segment is predicted from BOS and the segment's last 11 tokens before it.
    nll = []
    with torch.no_grad():
        for start in (0, 24):
            for j in range(start, start + 24):
                context = torch.cat([torch.tensor([bos]), doc[max(start, j - 11) : j]])
                nll.append(F.cross_entropy(model(context[None]).logits[0, -1], doc[j]).item())
    (row,) = recompute_rows(model, "r", 12, [doc], [24], bos_id=bos)
    assert row.tokens == 48 and row.nll == pytest.approx(sum(nll) / 48, rel=1e-5)
    (row,) = recompute_rows(model, "r", 12, [doc], [24], bos_id=bos, every=5)  # tokens 4, 9, ..., 44
    assert row.tokens == 9 and row.nll == pytest.approx(sum(nll[4::5]) / 9, rel=1e-5)


def test_perplexity_by_position_is_the_longest_segments_nll_over_the_same_positions(tmp_path):
    model = tiny_model("llama", initializer_range=0.2)
    docs = random_documents([64, 70])
    variants = [Variant("unpatched"), Variant("sink+window", sink_tokens=2, window=14)]
    result = sweep(model, docs, [16, 32, 64], variants, train_length=16, progress=False, positions=[16, 32])
    assert result.positions.buckets == ["0-16", "16-32", "32-64"] and result.positions.starts == [0, 16, 32]
    for variant in variants:
        per_segment = []
        with variant.applied(model):
            for doc in docs:
                # Without BOS the segment's first token (position 0) is not predicted: nll[i] is position i + 1.
                nll = perplexity(model, doc[:64], cache=variant.new_cache(), progress=False).nll
                per_segment.append(torch.cat([torch.tensor([math.nan]), nll]))
        for label, start, end, ppl in zip(
            ["0-16", "16-32", "32-64"], [0, 16, 32], [16, 32, 64], result.positions.ppl[variant.name]
        ):
            values = torch.cat([s[start:end] for s in per_segment]).double()
            expected = values[~values.isnan()].mean().item()
            assert math.log(ppl) == pytest.approx(expected, abs=1e-5), (variant.name, label)
    # The window changes what tokens past 16 see, not the first 16.
    by = result.positions.ppl
    assert by["sink+window"][0] == pytest.approx(by["unpatched"][0], rel=1e-5)
    assert abs(by["sink+window"][2] / by["unpatched"][2] - 1) > 1e-3

    saved = json.loads(result.write_json(tmp_path / "results.json").read_text())
    assert saved["positions"]["buckets"] == ["0-16", "16-32", "32-64"]
    png = result.plot(tmp_path / "ppl.png")
    assert png.stat().st_size > 20_000
    with pytest.raises(ValueError, match=r"within the longest length \(64 tokens\)"):
        sweep(model, docs, [32, 64], variants, positions=[64])
    assert sweep(model, docs, [32, 64], variants[:1], progress=False).positions is None
