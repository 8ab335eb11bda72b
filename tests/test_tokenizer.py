"""Tokenizer tests: SmolLM2's tokenizer.json against transformers' tokenizer built from the same GGUF,
plus tiny SentencePiece (Llama-2 style) and tiktoken (Llama-3 style) files built offline in tmp_path
to exercise get_tokenizer's dispatch and the special-token bookkeeping of each backend."""

import base64
import shutil
import string

import pytest

from tokenizer import (
    HFTokenizer,
    SentencePieceTokenizer,
    TiktokenTokenizer,
    get_tokenizer,
    is_tiktoken_file,
)

TEXTS = {
    "digits": "Call 555-0123 before 10:45, or pay 1000000 euros (3.14159 each) in 2024.",
    "spaces": "two  spaces,   three,    four and trailing   ",
    "tabs_newlines": "col1\tcol2\t\tcol3\nline two\n\n\nafter blank lines\r\n\t indented\n",
    "accents": "Café, naïve résumé, Ærøskøbing, São Paulo, Đà Nẵng, straße, ÉLAN",
    "emoji": "Cold compress 🧊 helps 👍🏽 — or not 🤷‍♀️! 🎉🚀",
    "cjk": "日本語のテキストと中文",
    "chat_special": "<|im_start|>user\nWhat is a cold compress?<|im_end|>\n<|im_start|>assistant\n",
    "special_inside_words": "a<|im_end|>b <|im_start|> c<|endoftext|>",
    "code": "def f(x):\n    return {'a': [x ** 2, x // 3]}  # comment\n",
    "contractions": "I'll say it's what we've done; they'd've LAUGHED",
    "leading_space": " leading space and a final newline\n",
}


@pytest.fixture(scope="module")
def ours(smollm2_checkpoint):
    return get_tokenizer(smollm2_checkpoint)


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_gguf):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)


# ---------------------------------------------------------------- SmolLM2 (tokenizer.json from the GGUF)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TEXTS))
def test_ids_match_transformers(ours, hf_tokenizer, name):
    text = TEXTS[name]
    assert ours.encode(text) == hf_tokenizer.encode(text)  # including the BOS habit (none for SmolLM2)
    assert ours.encode(text, bos=False) == hf_tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.slow
def test_chat_template_matches_transformers(ours, hf_tokenizer):
    prompt = "What is a cold compress?\nAnswer in 2 sentences."
    messages = [{"role": "user", "content": prompt}]
    expected = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(prompt) == expected
    assert ours.encode(ours.apply_chat_template(prompt)) == hf_tokenizer.encode(expected)


def test_smollm2_dispatch_and_flags(ours):
    assert isinstance(ours, HFTokenizer)
    assert ours.is_chat
    assert ours.vocab_size == 49152


@pytest.mark.parametrize("name", list(TEXTS))
def test_decode_inverts_encode(ours, name):
    text = TEXTS[name]
    assert ours.decode(ours.encode(text)) == text


def test_chat_special_tokens_stay_whole(ours):
    start, end = ours.token_id("<|im_start|>"), ours.token_id("<|im_end|>")
    ids = ours.encode(TEXTS["chat_special"])
    assert ids.count(start) == 2 and ids.count(end) == 1
    assert ours.encode("<|im_end|>") == [end]


def test_bos_eos_and_terminators(ours):
    end = ours.token_id("<|im_end|>")
    assert end is not None and end in ours.terminator_ids
    assert ours.eos_id in ours.terminator_ids
    assert ours.encode("hi", bos=True) == [ours.bos_id] + ours.encode("hi", bos=False)
    # the chat template ends where the assistant answers
    assert ours.apply_chat_template("hi").endswith("<|im_start|>assistant\n")


def test_special_ids(ours):
    assert {0, 1, 2} <= set(ours.special_ids)
    assert ours.token_id("<|im_end|>") in ours.special_ids
    assert ours.encode("Hello")[0] not in ours.special_ids


def test_punctuation_ids(ours):
    punctuation = set(ours.punctuation_ids)
    for mark in (".", ",", "?", "!", ";", ":"):
        (token,) = ours.encode(mark)
        assert token in punctuation, mark
    for word in ("a", "the", " Hello", "1"):
        assert not set(ours.encode(word)) & punctuation, word
    for i in ours.punctuation_ids[:: max(1, len(punctuation) // 200)]:  # a sample: punctuation only
        text = ours.decode([i]).strip()
        assert text and all(c in string.punctuation for c in text), (i, text)
    assert not punctuation & set(ours.special_ids)


def test_tokenizer_json_preferred_over_tokenizer_model(smollm2_checkpoint, sentencepiece_dir, tmp_path):
    """HF Llama-2 folders hold both files; tokenizer.json wins."""
    shutil.copy(smollm2_checkpoint / "tokenizer.json", tmp_path)
    shutil.copy(sentencepiece_dir / "tokenizer.model", tmp_path)
    assert isinstance(get_tokenizer(tmp_path), HFTokenizer)


def test_missing_tokenizer_names_the_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        get_tokenizer(tmp_path)


# ---------------------------------------------------------------- SentencePiece (Llama-2 style)

SP_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A cold compress reduces swelling and eases pain.",
    "Keys and values are stored in the cache after rotary embeddings.",
    "Evicting a token never changes the positions of the others.",
    "Numbers like 12, 345 and 6789 appear in text too!",
    "Café crème, naïve résumé.",
] * 20


@pytest.fixture(scope="module")
def sentencepiece_dir(tmp_path_factory):
    import sentencepiece as spm

    out = tmp_path_factory.mktemp("sentencepiece")
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(SP_CORPUS),
        model_prefix=str(out / "tokenizer"),
        vocab_size=400,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        minloglevel=2,
    )  # Llama-2's layout: <unk>=0, <s>=1, </s>=2
    (out / "tokenizer.vocab").unlink(missing_ok=True)
    return out


def test_sentencepiece_backend(sentencepiece_dir):
    assert not is_tiktoken_file(sentencepiece_dir / "tokenizer.model")
    tok = get_tokenizer(sentencepiece_dir)
    assert isinstance(tok, SentencePieceTokenizer)
    text = "The cold fox stores 42 keys. Évidemment 🧊"  # unseen characters go through byte fallback
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id == 1  # Llama-2 adds BOS by default
    assert tok.encode(text, bos=False) == ids[1:]
    assert tok.decode(ids[1:]) == text
    assert tok.eos_id == 2 and 2 in tok.terminator_ids
    assert {0, 1, 2} <= set(tok.special_ids)
    assert tok.token_id("<unk>") == 0 and tok.token_id("<|no such piece|>") is None
    assert tok.encode(".", bos=False)[-1] in tok.punctuation_ids
    assert tok.is_chat and tok.apply_chat_template("Hi there") == "[INST] Hi there [/INST]"


def test_sentencepiece_tokenizer_config_overrides_defaults(sentencepiece_dir, tmp_path):
    shutil.copy(sentencepiece_dir / "tokenizer.model", tmp_path)
    (tmp_path / "tokenizer_config.json").write_text('{"add_bos_token": false, "bos_token": {"content": "<s>"}}')
    tok = get_tokenizer(tmp_path)
    assert tok.encode("fox")[0] != tok.bos_id
    assert tok.bos_id == 1


# ---------------------------------------------------------------- tiktoken (Llama-3 style)

MERGES = [b"he", b"ll", b"llo", b"hello"]


@pytest.fixture(scope="module")
def tiktoken_dir(tmp_path_factory):
    """A Llama-3 style tokenizer.model: base64 token and rank per line, 256 bytes then a few merges."""
    out = tmp_path_factory.mktemp("tiktoken")
    tokens = [bytes([i]) for i in range(256)] + MERGES
    lines = [f"{base64.b64encode(t).decode()} {rank}" for rank, t in enumerate(tokens)]
    (out / "tokenizer.model").write_text("\n".join(lines) + "\n")
    return out


def test_tiktoken_backend(tiktoken_dir):
    assert is_tiktoken_file(tiktoken_dir / "tokenizer.model")
    tok = get_tokenizer(tiktoken_dir)
    assert isinstance(tok, TiktokenTokenizer)
    n = 256 + len(MERGES)  # special tokens follow the ranks, as in Llama-3 (128000 ...)
    bos, eot, end_of_text = n, n + 9, n + 1
    assert (tok.bos_id, tok.eos_id) == (bos, eot)
    assert tok.token_id("<|begin_of_text|>") == bos and tok.token_id("<|eot_id|>") == eot
    assert tok.encode("hello") == [bos, n - 1]  # BOS by default, then the merged token
    assert tok.encode(" hello", bos=False) == [ord(" "), n - 1]
    assert {eot, end_of_text} <= set(tok.terminator_ids)
    assert len(tok.special_ids) == 256 and bos in tok.special_ids
    assert tok.vocab_size == n + 256
    text = "Ça va? 🧊 ok\t\n<|eot_id|>"
    ids = tok.encode(text, bos=False)
    assert ids[-1] == eot
    assert tok.decode(ids) == text
    assert {ord("."), ord(","), ord("?")} <= set(tok.punctuation_ids)
    assert not {ord("a"), ord("Z"), ord("7")} & set(tok.punctuation_ids)
    rendered = tok.apply_chat_template("Hi")
    assert (
        rendered
        == "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    )
