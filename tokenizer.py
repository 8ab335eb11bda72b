"""One tokenizer interface over tokenizer.json (HF `tokenizers`), tiktoken (Llama-3) and SentencePiece (Llama-2).

A converted checkpoint folder holds the tokenizer file plus `tokenizer_config.json` with the chat
template and the names of BOS/EOS, so generation needs nothing from the network.
"""

import base64
import json
import string
from functools import cached_property
from pathlib import Path

LLAMA2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' %}{{ '<<SYS>>\\n' + message['content'] "
    "+ '\\n<</SYS>>\\n\\n' }}{% elif message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% else %}{{ ' ' + message['content'] + ' ' }}{% endif %}{% endfor %}"
)
LLAMA3_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' "
    "+ message['content'] + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
TERMINATOR_NAMES = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "</s>")
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                  "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>",
                  "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]  # fmt: skip


class TokenizerInterface:
    """What generation, caches and tasks need from a tokenizer, whatever the backend."""

    def __init__(self, config: dict):
        self.config = config
        self.chat_template = config.get("chat_template")
        self.add_bos = config.get("add_bos_token", False)

    def encode(self, text: str, bos: bool | None = None) -> list[int]:
        """Token ids of `text`; special tokens written in the text stay whole. BOS per the model's habit."""
        ids = self._encode(text)
        add = bos if bos is not None else self.add_bos
        if add and self.bos_id is not None and ids[:1] != [self.bos_id]:  # a chat template may write BOS itself
            ids = [self.bos_id] + ids
        return ids

    def encode_split(self, text: str, boundary: int) -> tuple[list[int], int]:
        """Token ids of `text` tokenized as two pieces split at character `boundary`, and the first
        piece's count: the context ends on a token boundary, so it can be compressed on its own."""
        head = self.encode(text[:boundary])
        return head + self.encode(text[boundary:], bos=False), len(head)

    def token_id(self, token: str) -> int | None:
        raise NotImplementedError

    def _encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: list[int]) -> str:
        raise NotImplementedError

    def decode_answer(self, ids) -> str:
        """The text of generated ids (a list or a tensor), without the end-of-turn tokens."""
        ids = ids.tolist() if hasattr(ids, "tolist") else ids
        return self.decode([i for i in ids if i not in self.terminator_ids])

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    @property
    def bos_id(self) -> int | None:
        return self.token_id(self.config.get("bos_token"))

    @property
    def eos_id(self) -> int | None:
        return self.token_id(self.config.get("eos_token"))

    @cached_property
    def terminator_ids(self) -> list[int]:
        ids = {self.eos_id} | {self.token_id(t) for t in TERMINATOR_NAMES}
        return sorted(i for i in ids if i is not None)

    @cached_property
    def special_ids(self) -> list[int]:
        raise NotImplementedError

    @cached_property
    def punctuation_ids(self) -> list[int]:
        """Tokens that are punctuation once stripped of spaces (FastGen's `punc` policy)."""
        punctuation = set(string.punctuation)
        special = set(self.special_ids)
        ids = []
        for i in range(self.vocab_size):
            if i in special:
                continue
            text = self.decode([i]).strip()
            if text and all(c in punctuation for c in text):
                ids.append(i)
        return ids

    @property
    def is_chat(self) -> bool:
        return bool(self.chat_template)

    def apply_chat_template(self, prompt: str) -> str:
        """Wraps a user prompt in the model's own chat template, ending where the assistant answers."""
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        template = ImmutableSandboxedEnvironment().from_string(self.chat_template)
        return template.render(
            messages=[{"role": "user", "content": prompt}],
            add_generation_prompt=True,
            bos_token=self.config.get("bos_token", ""),
            eos_token=self.config.get("eos_token", ""),
        )


class HFTokenizer(TokenizerInterface):
    """tokenizer.json via the `tokenizers` library (SmolLM2, Qwen2, Llama-3 HF)."""

    def __init__(self, path: Path, config: dict):
        from tokenizers import Tokenizer

        super().__init__(config)
        self.tok = Tokenizer.from_file(str(path))

    def _encode(self, text):
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids):
        return self.tok.decode(list(ids), skip_special_tokens=False)

    def token_id(self, token):
        return self.tok.token_to_id(token) if token else None

    @property
    def vocab_size(self):
        return self.tok.get_vocab_size()

    @cached_property
    def special_ids(self):
        return sorted(i for i, t in self.tok.get_added_tokens_decoder().items() if t.special)


class TiktokenTokenizer(TokenizerInterface):
    """Llama-3's tokenizer.model: base64 BPE ranks for tiktoken plus Llama-3's special tokens."""

    def __init__(self, path: Path, config: dict):
        import tiktoken

        ranks = {}
        for line in Path(path).read_text().splitlines():
            if line:
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
        names = LLAMA3_SPECIAL + [f"<|reserved_special_token_{i}|>" for i in range(2, 256 - len(LLAMA3_SPECIAL) + 2)]
        self.special = {name: len(ranks) + i for i, name in enumerate(names)}
        self.enc = tiktoken.Encoding(
            "llama3", pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks, special_tokens=self.special
        )
        config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "add_bos_token": True,
                  "chat_template": LLAMA3_CHAT_TEMPLATE, **config}  # fmt: skip
        super().__init__(config)

    def _encode(self, text):
        return self.enc.encode(text, allowed_special="all")

    def decode(self, ids):
        return self.enc.decode(list(ids))

    def token_id(self, token):
        if token in self.special:
            return self.special[token]
        ids = self.enc.encode(token, allowed_special="all") if token else []
        return ids[0] if len(ids) == 1 else None

    @property
    def vocab_size(self):
        return self.enc.n_vocab

    @cached_property
    def special_ids(self):
        return sorted(self.special.values())


class SentencePieceTokenizer(TokenizerInterface):
    """Llama-2's tokenizer.model."""

    def __init__(self, path: Path, config: dict):
        from sentencepiece import SentencePieceProcessor

        self.sp = SentencePieceProcessor(model_file=str(path))
        config = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True,
                  "chat_template": LLAMA2_CHAT_TEMPLATE, **config}  # fmt: skip
        super().__init__(config)

    def _encode(self, text):
        return self.sp.encode(text)

    def decode(self, ids):
        return self.sp.decode(list(ids))

    def token_id(self, token):
        i = self.sp.piece_to_id(token) if token else 0
        return i if i != self.sp.unk_id() or token == "<unk>" else None

    @property
    def vocab_size(self):
        return self.sp.vocab_size()

    @cached_property
    def special_ids(self):
        return [i for i in range(self.vocab_size) if self.sp.is_control(i) or self.sp.is_unknown(i)]


def is_tiktoken_file(path: Path) -> bool:
    first = Path(path).open("rb").readline().split()
    try:
        return len(first) == 2 and bool(base64.b64decode(first[0], validate=True)) and first[1].isdigit()
    except ValueError:
        return False


def get_tokenizer(checkpoint_dir: Path) -> TokenizerInterface:
    checkpoint_dir = Path(checkpoint_dir)
    config_path = checkpoint_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    # HF configs may spell special tokens as {"content": ...}
    config = {
        k: v["content"] if isinstance(v, dict) and "content" in v else v for k, v in config.items() if v is not None
    }
    if (checkpoint_dir / "tokenizer.json").is_file():
        return HFTokenizer(checkpoint_dir / "tokenizer.json", config)
    model_file = checkpoint_dir / "tokenizer.model"
    if model_file.is_file():
        if is_tiktoken_file(model_file):
            return TiktokenTokenizer(model_file, config)
        return SentencePieceTokenizer(model_file, config)
    raise FileNotFoundError(f"no tokenizer.json or tokenizer.model in {checkpoint_dir}")
