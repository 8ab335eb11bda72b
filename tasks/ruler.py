"""RULER synthetic tasks, generated locally and deterministically (no downloads).

Each sample is generated from (task, seq_length, seed, index), so the same arguments always give
the same samples and a longer run starts with the samples of a shorter one. The amount of filler
(haystack sentences, list words) is searched with the supplied tokenizer so that the whole prompt,
question included, has between 95% and 100% of `seq_length` tokens.

Options (get_task(name, **options)): seq_length (prompt tokens, default 2000), size (samples
generated when num_samples is not given, default 100), haystack_file (niah/vt: a local text file
whose sentences replace the filler), and per-task knobs listed in each class's option_defaults.
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import ClassVar

from tasks.base import Task

FILLER = ["The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again."]

ADJECTIVES = (
    "ancient bold brave bright calm clever cosmic curious daring eager elated fancy fierce "
    "gentle giant glossy golden grumpy happy hidden humble icy jolly keen lively lucky lunar "
    "mellow misty noble odd proud quiet rapid rustic silent silver sleepy smooth sunny swift "
    "tidy vivid wild"
).split()
NOUNS = (
    "anchor apple badger barrel beacon canyon castle cedar comet copper desert dragon falcon "
    "forest garden glacier harbor helmet island jacket kettle lantern lemon marble meadow "
    "mirror needle orchid otter pepper planet pocket puzzle river rocket saddle tiger tunnel "
    "violin walrus"
).split()
CONSONANTS, VOWELS = "bdfgklmnprstvz", "aeiou"


def made_up_words(rng: random.Random, count: int, syllables: int = 3) -> list[str]:
    """`count` distinct pronounceable words of equal length (so none is a substring of another)."""
    per = len(CONSONANTS) * len(VOWELS)
    if count > per**syllables:
        raise ValueError(f"cannot make {count} distinct {syllables}-syllable words")
    words = []
    for code in rng.sample(range(per**syllables), count):
        letters = []
        for _ in range(syllables):
            code, s = divmod(code, per)
            letters.append(CONSONANTS[s // len(VOWELS)] + VOWELS[s % len(VOWELS)])
        words.append("".join(letters))
    return words


def join_and(items: list[str]) -> str:
    if len(items) <= 2:
        return " and ".join(items)
    return ", ".join(items[:-1]) + ", and " + items[-1]


class WordCounter:
    """Stand-in tokenizer (one token per whitespace word) for `load()` without a tokenizer."""

    def encode(self, text: str) -> list[int]:
        return [len(w) for w in text.split()]


def fit_units(build, count, target: int, max_units: int | None = None) -> tuple[int, int]:
    """Largest n <= max_units with count(build(n)) <= target, in a handful of `count` calls.

    Proportional guesses from the observed tokens per unit, bisection once the bracket is known
    to be stubborn; stops as soon as the prompt reaches 98% of the target.
    """
    base = count(build(0))
    if base > target:
        raise ValueError(f"the prompt needs {base} tokens before any filler, more than seq_length={target}")
    lo, lo_tokens = 0, base
    hi = (max_units if max_units is not None else target) + 1  # smallest n known (or assumed) too long
    n = 16
    for step in range(64):
        if lo_tokens >= 0.98 * target or hi - lo <= 1:
            break
        n = min(max(n, lo + 1), hi - 1)
        tokens = count(build(n))
        if tokens <= target:
            lo, lo_tokens = n, tokens
        else:
            hi = n
        rate = max((tokens - base) / n, 1e-3)  # tokens per unit
        n = lo + int((0.99 * target - lo_tokens) / rate)
        if step >= 6 or not lo < n < hi:
            n = (lo + hi) // 2
    return lo, lo_tokens


class RulerTask(Task):
    """Base of the synthetic tasks: rows are just indices; `generate` makes each one."""

    metrics = ("string_match_all",)
    columns = ()
    option_defaults: ClassVar[dict] = {"seq_length": 2000, "size": 100}

    def __init__(self, **options):
        super().__init__(**options)
        for key in ("seq_length", "size"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"task '{self.name}': {key} must be a positive integer, got {value!r}")

    def rows(self, tokenizer, data_dir=None, seed=0, num_samples=None):
        return [{"index": i} for i in range(num_samples or self.size)]

    def load(self, data_dir=None, tokenizer=None, seed: int = 0) -> list[dict]:
        """Generated rows (lengths counted in whitespace words unless a tokenizer is given)."""
        tokenizer = tokenizer or WordCounter()
        return [self.expand(row, row["index"], tokenizer, seed) for row in self.rows(tokenizer, seed=seed)]

    def expand(self, row, index, tokenizer, seed):
        rng = random.Random(f"{self.name}|{self.seq_length}|{seed}|{index}")
        return self.generate(rng, tokenizer)

    def sample_id(self, row, index, seed):
        return f"{self.name}-{self.seq_length}-s{seed}-{index}"

    def generate(self, rng: random.Random, tokenizer) -> dict:
        raise NotImplementedError

    def fill(self, tokenizer, fields: dict, build_context, max_units=None) -> tuple[str, dict]:
        """Context with as many filler units as fit in seq_length; returns it and length info."""

        def count(text):
            return len(tokenizer.encode(text))

        n, tokens = fit_units(
            lambda k: self.prompt({**fields, "context": build_context(k)}),
            count,
            self.seq_length,
            max_units,
        )
        if tokens < 0.95 * self.seq_length:
            raise ValueError(
                f"task '{self.name}': could only reach {tokens} of seq_length={self.seq_length} prompt tokens"
            )
        return build_context(n), {
            "units": n,
            "prompt_tokens": tokens,
            "seq_length": self.seq_length,
        }


class HaystackTask(RulerTask):
    """Needles inserted at seeded depths into filler sentences (or a local text file's)."""

    option_defaults: ClassVar[dict] = {
        **RulerTask.option_defaults,
        "haystack_file": None,
    }
    _sentences: list[str] | None = None

    def haystack(self) -> list[str]:
        if self.haystack_file is None:
            return FILLER
        if self._sentences is None:
            path = Path(self.haystack_file)
            if not path.is_file():
                raise ValueError(f"task '{self.name}': haystack_file {path} does not exist")
            text = " ".join(path.read_text(encoding="utf-8", errors="replace").split())
            self._sentences = [s for s in re.split(r"(?<=[.!?])\s+", text) if s]
            if not self._sentences:
                raise ValueError(f"task '{self.name}': haystack_file {path} holds no text")
        return self._sentences

    def insert(self, n: int, needles: list[str], depths: list[float]) -> str:
        """n haystack sentences with needle j before sentence round(depths[j] * n); needles at the
        same place keep their order (variable chains must read in order)."""
        hay = self.haystack()
        at = sorted((round(d * n), j) for j, d in enumerate(depths))
        out, k = [], 0
        for i in range(n + 1):
            while k < len(at) and at[k][0] == i:
                out.append(needles[at[k][1]])
                k += 1
            if i < n:
                out.append(hay[i % len(hay)])
        return " ".join(out)


class RulerNiah(HaystackTask):
    """Needle in a haystack: find the 7-digit number(s) stated for a key."""

    name = "rulerniah"
    max_new_tokens = 128
    num_keys, num_values, num_queries = (
        1,
        1,
        1,
    )  # needles with different keys / values per key / keys asked
    template = (
        "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
        "I will quiz you about the numbers afterwards.\n{context}\n"
        "What are all the special magic numbers for {query} mentioned in the provided text?\n"
        "Answer: The special magic numbers for {query} mentioned in the provided text are"
    )

    def generate(self, rng, tokenizer):
        pairs = rng.sample([f"{a}-{b}" for a in ADJECTIVES for b in NOUNS], self.num_keys)
        values = [str(v) for v in rng.sample(range(1_000_000, 10_000_000), self.num_keys * self.num_values)]
        by_key = {key: values[i * self.num_values : (i + 1) * self.num_values] for i, key in enumerate(pairs)}
        needles = [f"One of the special magic numbers for {k} is: {v}." for k, vs in by_key.items() for v in vs]
        rng.shuffle(needles)
        depths = sorted(rng.random() for _ in needles)
        queried = pairs[: self.num_queries]
        fields = {
            "query": join_and(queried),
            "answers": [v for k in queried for v in by_key[k]],
        }
        context, info = self.fill(tokenizer, fields, lambda n: self.insert(n, needles, depths))
        return {
            **fields,
            "context": context,
            "meta": {**info, "depths": [round(d, 4) for d in depths]},
        }


class RulerNiahMultiKey(RulerNiah):
    """One queried needle among needles for other keys (distractors)."""

    name = "rulerniah_multikey"
    num_keys = 4


class RulerNiahMultiValue(RulerNiah):
    """Several numbers stated for the same key; all must be found."""

    name = "rulerniah_multivalue"
    num_values = 4


class RulerNiahMultiQuery(RulerNiah):
    """Several keys asked at once; every number must be found."""

    name = "rulerniah_multiquery"
    num_keys, num_queries = 4, 4


class RulerNiahShared(RulerNiah):
    """Several needles in one haystack, one question per needle: samples that share a context,
    which eval.py in context-only mode compresses once and asks every question of."""

    name = "rulerniah_shared"
    option_defaults: ClassVar[dict] = {**RulerNiah.option_defaults, "questions": 4}

    def __init__(self, **options):
        super().__init__(**options)
        if isinstance(self.questions, bool) or not isinstance(self.questions, int) or self.questions < 1:
            raise ValueError(f"task '{self.name}': questions must be a positive integer, got {self.questions!r}")
        self._contexts: dict = {}  # (index, seed) -> generated haystack, for self._tokenizer
        self._tokenizer = None

    def rows(self, tokenizer, data_dir=None, seed=0, num_samples=None):
        count = num_samples or self.size
        return [{"index": i // self.questions, "question": i % self.questions} for i in range(count)]

    def expand(self, row, index, tokenizer, seed):
        if tokenizer is not self._tokenizer:
            self._contexts, self._tokenizer = {}, tokenizer
        key = (row["index"], seed)
        if key not in self._contexts:
            rng = random.Random(f"{self.name}|{self.seq_length}|{seed}|{row['index']}")
            self._contexts[key] = self.generate(rng, tokenizer)
        shared = self._contexts[key]
        key_asked, value, depth = shared["needles"][row["question"]]
        group = f"{self.name}-{self.seq_length}-s{seed}-{row['index']}"
        meta = {**shared["meta"], "group": group, "question": row["question"], "depth": depth}
        return {"query": key_asked, "answers": [value], "context": shared["context"], "meta": meta}

    def sample_id(self, row, index, seed):
        return f"{row['meta']['group']}-q{row['meta']['question']}"

    def generate(self, rng, tokenizer):
        keys = rng.sample([f"{a}-{b}" for a in ADJECTIVES for b in NOUNS], self.questions)
        values = [str(v) for v in rng.sample(range(1_000_000, 10_000_000), self.questions)]
        needles = [f"One of the special magic numbers for {k} is: {v}." for k, v in zip(keys, values)]
        order = rng.sample(range(self.questions), self.questions)
        depths = sorted(rng.random() for _ in needles)
        longest = max(keys, key=lambda k: len(tokenizer.encode(k)))  # every question's prompt must fit
        fields = {"query": longest, "answers": []}
        context, info = self.fill(tokenizer, fields, lambda n: self.insert(n, [needles[j] for j in order], depths))
        placed = [round(depths[order.index(j)], 4) for j in range(self.questions)]
        return {"context": context, "needles": list(zip(keys, values, placed)), "meta": info}


class RulerVT(HaystackTask):
    """Variable tracking: name every variable a chain of assignments gives a value."""

    name = "rulervt"
    max_new_tokens = 30
    option_defaults: ClassVar[dict] = {
        **HaystackTask.option_defaults,
        "num_chains": 1,
        "num_hops": 4,
    }
    template = (
        "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
        "Question: Find all variables that are assigned the value {query} in the text above.\n"
        "Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables "
        "are assigned the value {query}, they are:"
    )

    def generate(self, rng, tokenizer):
        length = self.num_hops + 1
        names = set()
        while len(names) < self.num_chains * length:
            names.add("".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5)))
        names = sorted(names)
        rng.shuffle(names)
        values = rng.sample(range(10_000, 100_000), self.num_chains)
        chains = []
        for c in range(self.num_chains):
            v = names[c * length : (c + 1) * length]
            chains.append(
                [f"VAR {v[0]} = {values[c]}."] + [f"VAR {v[j + 1]} = VAR {v[j]}." for j in range(self.num_hops)]
            )
        turns = [c for c in range(self.num_chains) for _ in range(length)]  # interleave, each chain in order
        rng.shuffle(turns)
        position = [0] * self.num_chains
        statements = []
        for c in turns:
            statements.append(chains[c][position[c]])
            position[c] += 1
        depths = sorted(rng.random() for _ in statements)
        fields = {"query": str(values[0]), "num_v": length, "answers": names[:length]}
        context, info = self.fill(tokenizer, fields, lambda n: self.insert(n, statements, depths))
        return {**fields, "context": context, "meta": info}


class RulerCWE(RulerTask):
    """Common words extraction: the num_cw words repeated most often in a numbered list."""

    name = "rulercwe"
    max_new_tokens = 120
    option_defaults: ClassVar[dict] = {
        **RulerTask.option_defaults,
        "num_cw": 10,
        "freq_cw": 30,
        "freq_ucw": 3,
    }
    template = (
        "Below is a numbered list of words. In these words, some appear more often than others. "
        "Memorize the ones that appear most often.\n{context}\n"
        "Question: What are the {num_cw} most common words in the above list?\n"
        "Answer: The top {num_cw} words that appear most often in the list are:"
    )

    def generate(self, rng, tokenizer):
        words = made_up_words(rng, self.num_cw + self.seq_length // self.freq_ucw + 1)
        common, uncommon = words[: self.num_cw], words[self.num_cw :]
        order_seed = rng.random()
        # Short contexts cannot hold 30 copies of 10 words: let common words take about half.
        probe = " ".join(f"{i + 1}. {w}" for i, w in enumerate(uncommon[:50]))
        per_item = len(tokenizer.encode(probe)) / 50
        freq = min(self.freq_cw, int(0.5 * self.seq_length / per_item / self.num_cw))
        if freq <= self.freq_ucw:
            raise ValueError(
                f"task '{self.name}': seq_length={self.seq_length} is too short for {self.num_cw} common words"
            )

        def build(n):
            items = common * freq + uncommon[:n] * self.freq_ucw
            random.Random(order_seed).shuffle(items)
            return " ".join(f"{i + 1}. {w}" for i, w in enumerate(items))

        fields = {"num_cw": self.num_cw, "answers": common}
        context, info = self.fill(tokenizer, fields, build, max_units=len(uncommon))
        return {
            **fields,
            "context": context,
            "meta": {**info, "freq_cw": freq, "freq_ucw": self.freq_ucw},
        }


class RulerFWE(RulerTask):
    """Frequent words extraction: the 3 most frequent coded words of a Zipf-distributed text
    (the most frequent of all is the noise word '....', which the question says to ignore)."""

    name = "rulerfwe"
    max_new_tokens = 50
    option_defaults: ClassVar[dict] = {**RulerTask.option_defaults, "alpha": 2.0}
    template = (
        "Read the following coded text and track the frequency of each coded word. Find the three most "
        "frequently appeared coded words. {context}\n"
        "Question: Do not provide any explanation. Please ignore the dots '....'. What are the three most "
        "frequently appeared words in the above coded text?\n"
        "Answer: According to the coded text above, the three most frequently appeared words are:"
    )

    def counts(self, n: int) -> list[int]:
        """Occurrences of each rank in an n-word text: Zipf counts, the rest filled with singletons."""
        weights = [k**-self.alpha for k in range(1, n + 1)]
        total = sum(weights)
        counts = [c for c in (int(n * w / total) for w in weights) if c > 0]
        return counts + [1] * (n - sum(counts))

    def generate(self, rng, tokenizer):
        words = ["...."] + made_up_words(rng, self.seq_length)
        order_seed = rng.random()

        def build(n):
            items = [words[rank] for rank, c in enumerate(self.counts(n)) for _ in range(c)]
            random.Random(order_seed).shuffle(items)
            return " ".join(items)

        fields = {"answers": words[1:4]}
        context, info = self.fill(tokenizer, fields, build, max_units=self.seq_length)
        counts = self.counts(info["units"])
        if len(counts) < 5 or min(counts[1:4]) <= max(counts[4:]):
            raise ValueError(f"task '{self.name}': seq_length={self.seq_length} is too short for a clear top 3")
        return {**fields, "context": context, "meta": info}


RULER_TASKS = [
    RulerNiah,
    RulerNiahMultiKey,
    RulerNiahMultiValue,
    RulerNiahMultiQuery,
    RulerNiahShared,
    RulerVT,
    RulerCWE,
    RulerFWE,
]
