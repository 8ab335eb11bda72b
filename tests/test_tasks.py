"""Tests of the tasks/ package (no model needed). Fake tokenizers keep them fast; the `slow`
test repeats the length checks with the real SmolLM2 tokenizer when its file is present."""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import sys
import types
from collections import Counter
from pathlib import Path

import pytest

import tasks
from tasks import metrics as M
from tasks import pick_option
from tasks.ruler import RULER_TASKS

RULER_NAMES = [cls.name for cls in RULER_TASKS]
REAL_TOKENIZER = Path(os.environ.get("TASKS_TOKENIZER_JSON", "checkpoints/SmolLM2-135M-Instruct/tokenizer.json"))


class WordTokenizer:
    """Lossless fake BPE: words with their leading space, single digits, single symbols."""

    PATTERN = re.compile(r" ?[A-Za-z]+| ?\d| ?[^\sA-Za-z\d]|\s+")

    def __init__(self):
        self.vocab: dict[str, int] = {}
        self.inverse: list[str] = []

    def encode(self, text: str) -> list[int]:
        ids = []
        for piece in self.PATTERN.findall(text):
            if piece not in self.vocab:
                self.vocab[piece] = len(self.inverse)
                self.inverse.append(piece)
            ids.append(self.vocab[piece])
        return ids

    def decode(self, ids) -> str:
        return "".join(self.inverse[i] for i in ids)


class CharTokenizer:
    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids) -> str:
        return "".join(map(chr, ids))


@pytest.fixture(scope="module")
def tok():
    return WordTokenizer()


# ---- registry and arguments ----------------------------------------------------------------


def test_registry_lists_every_task():
    expected = {
        *RULER_NAMES,
        "rulerqa",
        "musique",
        "triviaqa",
        "quality",
        "squality",
        "qmsum",
        "dolomites",
        "repobench",
        "truthfulqa",
        "pg19",
    }
    assert set(tasks.list_tasks()) == expected
    for name in expected:
        task = tasks.get_task(name)
        assert task.name == name
        assert task.kind in ("generate", "multiple_choice", "perplexity")
        assert task.metrics


def test_unknown_task_and_option():
    with pytest.raises(ValueError, match=r"unknown task 'nope'; choose from: .*rulerniah"):
        tasks.get_task("nope")
    with pytest.raises(ValueError, match="has no option colour"):
        tasks.get_task("rulerniah", colour="red")
    with pytest.raises(ValueError, match="seq_length must be a positive integer"):
        tasks.get_task("rulerniah", seq_length=0)


@pytest.mark.parametrize("bad", [0, -3, 2.5, "5", True])
def test_num_samples_must_be_positive(tok, bad):
    with pytest.raises(ValueError, match="num_samples must be a positive integer"):
        tasks.get_task("rulerniah", seq_length=500).samples(tok, num_samples=bad)


# ---- RULER generators ----------------------------------------------------------------------


@pytest.mark.parametrize("name", RULER_NAMES)
def test_ruler_is_deterministic(tok, name):
    task = tasks.get_task(name, seq_length=1000)
    a = task.samples(tok, num_samples=3, seed=0)
    b = tasks.get_task(name, seq_length=1000).samples(tok, num_samples=3, seed=0)
    c = task.samples(tok, num_samples=3, seed=1)
    assert [s.to_dict() for s in a] == [s.to_dict() for s in b]
    assert [s.id for s in a] != [s.id for s in c]
    assert all(x.prompt != y.prompt for x, y in zip(a, c, strict=True))
    assert len({s.prompt for s in a}) == 3  # samples differ from each other
    longer = task.samples(tok, num_samples=5, seed=0)  # a longer run starts with the same samples
    assert [s.to_dict() for s in longer[:3]] == [s.to_dict() for s in a]


@pytest.mark.parametrize("name", RULER_NAMES)
@pytest.mark.parametrize("seq_length", [1000, 2000, 4000])
def test_ruler_prompt_length_within_5_percent(tok, name, seq_length):
    for sample in tasks.get_task(name, seq_length=seq_length).samples(tok, num_samples=2, seed=7):
        n = len(tok.encode(sample.prompt))
        assert n == sample.prompt_tokens
        assert 0.95 * seq_length <= n <= seq_length, (name, seq_length, n)


@pytest.mark.parametrize("name", ["rulerniah", "rulervt", "rulercwe", "rulerfwe"])
def test_ruler_length_with_char_tokenizer(name):
    for sample in tasks.get_task(name, seq_length=3000).samples(CharTokenizer(), num_samples=2):
        assert 0.95 * 3000 <= len(sample.prompt) <= 3000


def context_of(sample) -> str:
    """The generated context: the prompt minus the question (which repeats the query)."""
    return sample.prompt.split("\nQuestion:")[0].split("\nWhat are all")[0]


@pytest.mark.parametrize(
    "name",
    ["rulerniah", "rulerniah_multikey", "rulerniah_multivalue", "rulerniah_multiquery"],
)
def test_niah_needles_are_in_context(tok, name):
    expected_answers = {
        "rulerniah": 1,
        "rulerniah_multikey": 1,
        "rulerniah_multivalue": 4,
        "rulerniah_multiquery": 4,
    }
    for sample in tasks.get_task(name, seq_length=1000).samples(tok, num_samples=10, seed=3):
        context = context_of(sample)
        assert len(sample.labels) == expected_answers[name]
        needles = re.findall(r"One of the special magic numbers for (\S+) is: (\d{7})\.", context)
        assert len(needles) == (4 if name != "rulerniah" else 1)
        for value in sample.labels:
            assert re.fullmatch(r"\d{7}", value)
            assert any(v == value for _, v in needles)
            # the needle's key is the one asked about
            key = next(k for k, v in needles if v == value)
            assert key in sample.prompt.split("\nWhat are all")[1]


def test_vt_chain_is_in_context_in_order(tok):
    for sample in tasks.get_task("rulervt", seq_length=1000).samples(tok, num_samples=10, seed=5):
        context = context_of(sample)
        value = re.search(r"assigned the value (\d+) in the text", sample.prompt).group(1)
        names = sample.labels
        assert len(names) == 5
        positions = [context.index(f"VAR {names[0]} = {value}.")]
        positions += [context.index(f"VAR {b} = VAR {a}.") for a, b in itertools.pairwise(names)]
        assert positions == sorted(positions)


def test_vt_multiple_chains(tok):
    task = tasks.get_task("rulervt", seq_length=1500, num_chains=3, num_hops=2)
    for sample in task.samples(tok, num_samples=3):
        context = context_of(sample)
        assert len(re.findall(r"VAR [A-Z]{5} = \d{5}\.", context)) == 3
        assert len(sample.labels) == 3 and all(f"VAR {n} " in context for n in sample.labels)


def test_cwe_answers_are_the_most_common_words(tok):
    for seq_length in (1000, 4000):
        for sample in tasks.get_task("rulercwe", seq_length=seq_length).samples(tok, num_samples=3, seed=2):
            words = re.findall(r"\d+\. ([a-z]+)", context_of(sample))
            counts = Counter(words)
            top = counts.most_common()
            assert len(sample.labels) == 10
            assert {w for w, _ in top[:10]} == set(sample.labels)
            assert top[9][1] > top[10][1]  # strictly more common than every other word


def test_fwe_answers_are_the_most_frequent_words(tok):
    for seq_length in (1000, 4000):
        for sample in tasks.get_task("rulerfwe", seq_length=seq_length).samples(tok, num_samples=3, seed=2):
            words = context_of(sample).split("coded words. ", 1)[1].split()
            counts = Counter(w for w in words if w != "....")
            top = counts.most_common()
            assert {w for w, _ in top[:3]} == set(sample.labels)
            assert top[2][1] > top[3][1]
            assert Counter(words).most_common(1)[0][0] == "...."


def test_haystack_file(tok, tmp_path):
    essay = tmp_path / "essay.txt"
    essay.write_text("Paul wrote essays about startups. Some were long!\nOthers were short? Yes.\n")
    task = tasks.get_task("rulerniah", seq_length=800, haystack_file=str(essay))
    sample = task.samples(tok, num_samples=1)[0]
    assert "Paul wrote essays about startups." in sample.prompt
    assert "The grass is green" not in sample.prompt
    assert sample.labels[0] in sample.prompt
    assert 0.95 * 800 <= sample.prompt_tokens <= 800
    with pytest.raises(ValueError, match="does not exist"):
        tasks.get_task("rulervt", haystack_file=str(tmp_path / "missing.txt")).samples(tok, num_samples=1)


def test_too_short_seq_length_is_explained(tok):
    with pytest.raises(ValueError, match="seq_length"):
        tasks.get_task("rulerniah", seq_length=20).samples(tok, num_samples=1)
    with pytest.raises(ValueError, match="too short"):
        tasks.get_task("rulercwe", seq_length=100).samples(tok, num_samples=1)


def test_filtering_prints_count(tok, capsys):
    task = tasks.get_task("rulerniah", seq_length=1000)
    assert task.samples(tok, max_prompt_tokens=500, num_samples=4) == []
    assert "rulerniah: filtered 4 of 4 samples (longer than 500 tokens)" in capsys.readouterr().out
    assert len(task.samples(tok, max_prompt_tokens=1000, num_samples=4)) == 4
    assert "filtered 0 of 4" in capsys.readouterr().out


def test_load_without_tokenizer_counts_words():
    rows = tasks.get_task("rulerniah", seq_length=300, size=2).load()
    assert len(rows) == 2 and all(r["answers"][0] in r["context"] for r in rows)


# ---- data files ----------------------------------------------------------------------------


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def qa_rows(n):
    return [
        {
            "context": f"Passage {i}: the capital of land {i} is city {i}.",
            "question": f"Capital of land {i}?",
            "answers": [f"city {i}", f"c{i}"],
        }
        for i in range(n)
    ]


def test_jsonl_loading_and_seeded_subset(tok, tmp_path):
    write_jsonl(tmp_path / "musique.jsonl", qa_rows(20))
    task = tasks.get_task("musique")
    everything = task.samples(tok, data_dir=tmp_path)
    assert [s.id for s in everything] == [f"musique-{i}" for i in range(20)]
    assert "Capital of land 3?" in everything[3].prompt and "city 3" in everything[3].prompt
    assert everything[3].labels == ["city 3", "c3"]
    a = task.samples(tok, num_samples=5, seed=0, data_dir=tmp_path)
    b = task.samples(tok, num_samples=5, seed=0, data_dir=tmp_path)
    c = task.samples(tok, num_samples=5, seed=1, data_dir=tmp_path)
    assert [s.id for s in a] == [s.id for s in b] and len(a) == 5
    assert [s.id for s in a] != [s.id for s in c]
    assert [s.id for s in a] == sorted((s.id for s in a), key=lambda x: int(x.split("-")[1]))
    assert len(task.samples(tok, num_samples=50, data_dir=tmp_path)) == 20


def test_csv_loading_multiple_choice(tok, tmp_path):
    (tmp_path / "quality.csv").write_text(
        "context,question,options,label\n"
        '"A long story, with commas.",Who won?,"[""Ann"", ""Bob"", ""Cy""]",1\n'
        '"Another story\nover two lines.",Where?,"[""here"", ""there""]",0\n'
    )
    samples = tasks.get_task("quality").samples(tok, data_dir=tmp_path)
    assert len(samples) == 2
    first = samples[0]
    assert first.options == [" Ann", " Bob", " Cy"] and first.answer_index == 1 and first.labels == ["Bob"]
    assert first.prompt.endswith("Question: Who won?\nAnswer:")
    assert first.total_tokens == first.prompt_tokens + max(len(tok.encode(o)) for o in first.options)
    assert "over two lines" in samples[1].prompt
    task = tasks.get_task("quality")
    assert task.score(["Bob", "there"], [s.labels for s in samples]) == {"accuracy": 0.5}


def test_csv_plain_string_answers(tok, tmp_path):
    (tmp_path / "repobench.csv").write_text('context,answers\n"def f():\n    return 1",x = f()\n')
    sample = tasks.get_task("repobench").samples(tok, data_dir=tmp_path)[0]
    assert sample.labels == ["x = f()"] and "def f():" in sample.prompt


def test_missing_column_names_file_and_line(tmp_path):
    rows = qa_rows(3)
    del rows[1]["question"]
    path = write_jsonl(tmp_path / "triviaqa.jsonl", rows)
    with pytest.raises(
        ValueError,
        match=rf"{re.escape(str(path))} line 2: missing column\(s\) question",
    ):
        tasks.get_task("triviaqa").load(tmp_path)
    (tmp_path / "qmsum.csv").write_text("context,answers\ntext,summary\n")
    with pytest.raises(ValueError, match=r"qmsum\.csv line 1 \(header\): missing column\(s\) question"):
        tasks.get_task("qmsum").load(tmp_path)


def test_malformed_lines_name_file_and_line(tmp_path):
    good = json.dumps(qa_rows(1)[0])
    write_jsonl(tmp_path / "musique.jsonl", [good, "", good, '{"context": "x", "question": '])
    with pytest.raises(ValueError, match=r"musique\.jsonl line 4: malformed JSON"):
        tasks.get_task("musique").load(tmp_path)
    write_jsonl(tmp_path / "squality.jsonl", [good, "[1, 2]"])
    with pytest.raises(ValueError, match=r"squality\.jsonl line 2: expected a JSON object"):
        tasks.get_task("squality").load(tmp_path)
    (tmp_path / "qmsum.csv").write_text("context,question,answers\na,b,c\na,b,c,d\n")
    with pytest.raises(ValueError, match=r"qmsum\.csv line 3: 4 fields, but the header has 3"):
        tasks.get_task("qmsum").load(tmp_path)
    (tmp_path / "truthfulqa.csv").write_text('question,options,label\nWhy?,"[""a"", ""b""]",2\n')
    with pytest.raises(
        ValueError,
        match=r"truthfulqa\.csv line 2: column 'label' must be an option index 0\.\.1",
    ):
        tasks.get_task("truthfulqa").load(tmp_path)
    write_jsonl(tmp_path / "triviaqa.jsonl", [{"context": "c", "question": "q", "answers": []}])
    with pytest.raises(
        ValueError,
        match=r"triviaqa\.jsonl line 1: column 'answers' must be a non-empty",
    ):
        tasks.get_task("triviaqa").load(tmp_path)


def test_missing_data_file_or_hub(tmp_path):
    with pytest.raises(
        ValueError,
        match=r"no data file for task 'qmsum' in .*qmsum\.jsonl.*columns: context, question, answers",
    ):
        tasks.get_task("qmsum").load(tmp_path)
    try:
        import datasets  # noqa: F401
    except ImportError:
        with pytest.raises(
            ValueError,
            match=r"'datasets' package is not installed; pass --data_dir DIR holding pg19\.jsonl",
        ):
            tasks.get_task("pg19").load()


def test_parquet_without_engine_is_one_line_error(tmp_path):
    (tmp_path / "musique.parquet").write_bytes(b"not really parquet")
    with pytest.raises(ValueError, match=r"musique\.parquet: (reading parquet needs|unreadable)"):
        tasks.get_task("musique").load(tmp_path)


def fake_datasets(monkeypatch, rows=None, error=None):
    """Stand-in for the `datasets` package: load_dataset returns `rows` or raises `error`."""

    def load_dataset(path, config=None, split=None):
        if error:
            raise error
        return rows

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))


def test_hub_rows_are_mapped(tok, monkeypatch):
    choices = ["true answer", "false one", "false two", "false three"]
    hub_row = {
        "question": "Is it?",
        "mc1_targets": {"choices": choices, "labels": [1, 0, 0, 0]},
    }
    fake_datasets(monkeypatch, [hub_row])
    (sample,) = tasks.get_task("truthfulqa").samples(tok)
    assert sorted(o.strip() for o in sample.options) == sorted(choices)
    assert sample.options[sample.answer_index] == " true answer" and sample.labels == ["true answer"]
    fake_datasets(monkeypatch, [{"document": "A story.", "query": "What?", "summary": "It."}])
    (sample,) = tasks.get_task("squality").samples(tok)  # generic column aliases
    assert "A story." in sample.prompt and "What?" in sample.prompt and sample.labels == ["It."]
    fake_datasets(monkeypatch, [{"unrelated": 1}])
    with pytest.raises(ValueError, match=r"row 0: missing column\(s\) context, question, answers"):
        tasks.get_task("qmsum").load()
    fake_datasets(monkeypatch, error=ConnectionError("no network\nsecond line"))
    with pytest.raises(
        ValueError,
        match=r"could not load .* \(ConnectionError: no network\); pass --data_dir",
    ):
        tasks.get_task("musique").load()


def test_rulerqa_adds_distractors(tok, tmp_path):
    write_jsonl(tmp_path / "rulerqa.jsonl", qa_rows(200))
    task = tasks.get_task("rulerqa", seq_length=600)
    samples = task.samples(tok, num_samples=3, data_dir=tmp_path)
    for sample in samples:
        i = int(re.search(r"Capital of land (\d+)\?", sample.prompt).group(1))
        assert f"Passage {i}: the capital of land {i} is city {i}." in sample.prompt
        assert sample.meta["distractors"] > 10
        assert 0.95 * 600 <= sample.prompt_tokens <= 600
    assert task.score(["City 0", "nothing"], [["city 0"], ["x"]]) == {"string_match_part": 0.5}


def test_pg19_splits_book_by_tokens(tmp_path):
    book = "It was a dark and stormy night. " * 40
    write_jsonl(tmp_path / "pg19.jsonl", [{"text": book}, {"text": "Short book."}])
    task = tasks.get_task("pg19", prompt_tokens=100, continuation_tokens=50)
    long, short = task.samples(CharTokenizer(), data_dir=tmp_path)
    assert (long.prompt_tokens, len(long.continuation)) == (100, 50)
    assert book.startswith(long.prompt + long.continuation) and long.labels == [long.continuation]
    assert short.prompt + short.continuation == "Short book." and short.total_tokens == 11
    ppl = task.score([[math.log(0.5)] * 4, [math.log(0.25)] * 4], [long.labels, short.labels])
    assert ppl["perplexity"] == pytest.approx(math.sqrt(8))


# ---- metrics -------------------------------------------------------------------------------


def test_string_match():
    assert M.string_match_all("The numbers are 123 and 456.", ["123", "456", "789"]) == pytest.approx(2 / 3)
    assert M.string_match_all("ABC", ["abc"]) == 1.0
    assert M.string_match_part("The numbers are 123.", ["999", "123"]) == 1.0
    assert M.string_match_part("nothing", ["999", "123"]) == 0.0
    assert M.compute("string_match_all", ["a b", "a"], [["a", "b"], ["b"]]) == {"string_match_all": 0.5}


def test_exact_match_levenshtein_accuracy():
    assert M.exact_match("The  Eiffel tower.", ["eiffel Tower"]) == 1.0
    assert M.exact_match("Paris, France", ["Paris"]) == 0.0
    assert M.levenshtein_similarity("abcd", ["abcd"]) == 1.0
    assert M.levenshtein_similarity("abcd", ["abce", "zzzz"]) == pytest.approx(0.75)
    assert M.accuracy(" Bob", ["Bob"]) == 1.0 and M.accuracy(2, ["2"]) == 1.0 and M.accuracy("Ann", ["Bob"]) == 0.0


def test_rouge():
    scores = M.rouge("the cat sat on the mat", ["the cat sat on the mat"])
    assert scores == {"rouge1": 1.0, "rouge2": 1.0, "rougeL": 1.0}
    partial = M.compute(
        "rouge",
        ["the cat sat", "dogs bark"],
        [["the cat sat on the mat"], ["cats meow"]],
    )
    assert set(partial) == {"rouge1", "rouge2", "rougeL"}
    assert partial["rouge1"] == pytest.approx((2 * 3 / 9) / 2)  # P=1, R=0.5 -> F=2/3; second 0


def test_perplexity():
    assert M.perplexity([math.log(0.5)] * 3) == pytest.approx(2.0)
    with pytest.raises(ValueError):
        M.perplexity([])


def test_optional_metrics_skip_with_a_note(monkeypatch, capsys):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    M._NOTES.clear()
    assert M.compute("llm_rouge", ["a"], [["a"]]) is None
    assert M.compute("llm_rouge", ["a"], [["a"]]) is None
    out = capsys.readouterr().out
    assert out.count("LLM-judged ROUGE skipped") == 1
    try:
        import bert_score  # noqa: F401
    except ImportError:
        assert M.compute("bertscore", ["a"], [["a"]]) is None
        assert "BERTScore skipped" in capsys.readouterr().out
    scores = tasks.get_task("squality").score(["the cat"], [["the cat"]])
    assert scores["rouge1"] == 1.0 and "llm_rouge" not in scores
    with pytest.raises(ValueError, match="unknown metric"):
        M.compute("bleu", ["a"], [["a"]])


def test_llm_rouge_never_prints_the_key(monkeypatch, capsys):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret-123")
    monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:9")  # nothing listens: the call fails
    M._NOTES.clear()
    assert M.compute("llm_rouge", ["a"], [["a"]]) is None
    out = capsys.readouterr().out
    assert "LLM-judged ROUGE skipped" in out and "sk-secret" not in out


def test_task_score_and_postprocess():
    niah = tasks.get_task("rulerniah")
    assert niah.score([" 1234567.", "no"], [["1234567"], ["7654321"]]) == {"string_match_all": 0.5}
    repo = tasks.get_task("repobench")
    scores = repo.score(["\n  x = f()\ny = 2", "z"], [["x = f()"], ["q"]])
    assert scores["exact_match"] == 0.5 and scores["levenshtein"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="2 predictions for 1 labels"):
        niah.score(["a", "b"], [["a"]])


def test_pick_option():
    assert pick_option([-5.0, -1.5, -3.0]) == 1
    assert pick_option([-2.0, -2.0]) == 0
    assert pick_option([-0.1]) == 0
    with pytest.raises(ValueError):
        pick_option([])


# ---- the real tokenizer ------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(not REAL_TOKENIZER.is_file(), reason=f"{REAL_TOKENIZER} not found")
def test_ruler_with_real_tokenizer():
    from tokenizers import Tokenizer

    inner = Tokenizer.from_file(str(REAL_TOKENIZER))

    class Real:
        def encode(self, text):
            return inner.encode(text, add_special_tokens=False).ids

        def decode(self, ids):
            return inner.decode(ids)

    real = Real()
    for name in RULER_NAMES:
        for seq_length in (1000, 2000, 4000):
            samples = tasks.get_task(name, seq_length=seq_length).samples(real, num_samples=3, seed=11)
            for sample in samples:
                n = len(real.encode(sample.prompt))
                assert 0.95 * seq_length <= n <= seq_length, (name, seq_length, n)
                assert all(label in context_of(sample) for label in sample.labels), (
                    name,
                    sample.id,
                )
