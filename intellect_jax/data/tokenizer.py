"""Tokenizers: a Hugging Face ``tokenizer.json`` from disk, or a byte-level BPE trained
deterministically on the bundled corpus (cached); export for ``AutoTokenizer``."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import tokenizers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from ..files import atomic_write
from .config import BUNDLED, DataConfig
from .errors import DataError

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
BPE_RECIPE = 1
"""Bump when :func:`train_bpe` changes, so cached tokenizers are not reused."""
_BOS_CANDIDATES = (BOS_TOKEN, "<s>", "<bos>", "<|startoftext|>", "<|endoftext|>")
_EOS_CANDIDATES = (EOS_TOKEN, "</s>", "<eos>", "<|endoftext|>", "<|eot_id|>")


@dataclass(frozen=True, eq=False)
class Tok:
    """A ``tokenizers.Tokenizer`` plus what the pipeline needs to know about it."""

    tokenizer: Tokenizer
    bos_token: str
    eos_token: str
    bos_id: int
    eos_id: int
    vocab_size: int
    """max token id + 1 (the model's embedding table must be at least this large)."""
    name: str = field(default="")
    """Where it came from (path, or ``bundled-bpe-<V>``), for messages."""

    @cached_property
    def json(self) -> str:
        """The serialized ``tokenizer.json``."""
        return self.tokenizer.to_str()

    @cached_property
    def fingerprint(self) -> str:
        """sha256 of ``tokenizer.json``: part of every token-cache key."""
        return hashlib.sha256(self.json.encode("utf-8")).hexdigest()

    @cached_property
    def data_tokenizer(self) -> Tokenizer:
        """Copy used on training text: special-token strings in the text stay plain text."""
        t = Tokenizer.from_str(self.json)
        t.encode_special_tokens = True
        return t

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without BOS/EOS (as the data pipeline does)."""
        return self.data_tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(list(map(int, ids)), skip_special_tokens=skip_special_tokens)

    def state(self) -> dict:
        """JSON-serializable form (checkpoints, grain workers); inverse of :func:`tok_from_state`."""
        return {
            "json": self.json,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "name": self.name,
        }

    def __getstate__(self) -> dict:  # picklable for grain worker processes
        return self.state()

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(tok_from_state(state).__dict__)


def tok_from_state(state: dict) -> Tok:
    """Rebuild a :class:`Tok` from :meth:`Tok.state` (e.g. the copy stored in a checkpoint)."""
    try:
        tok = Tokenizer.from_str(state["json"])
    except Exception as e:  # missing key, wrong type, or the tokenizers parser's own error
        raise DataError(f"stored tokenizer is unreadable: {e}") from None
    return _make_tok(tok, state["bos_token"], state["eos_token"], state.get("name", ""))


def _vocab_size(tok: Tokenizer) -> int:
    vocab = tok.get_vocab(with_added_tokens=True)
    return max(vocab.values()) + 1 if vocab else 0


def _make_tok(tok: Tokenizer, bos: str, eos: str, name: str) -> Tok:
    ids = {t: tok.token_to_id(t) for t in (bos, eos)}
    for t, i in ids.items():
        if i is None:
            raise DataError(f"tokenizer {name!r} has no token {t!r}")
    return Tok(tok, bos, eos, ids[bos], ids[eos], _vocab_size(tok), name)


def check_vocab(tokenizer_vocab: int | Tok, model_vocab: int) -> None:
    """Raise :class:`DataError` if token ids could index past the model's embedding table."""
    n = tokenizer_vocab.vocab_size if isinstance(tokenizer_vocab, Tok) else int(tokenizer_vocab)
    if n > model_vocab:
        raise DataError(
            f"tokenizer vocab size {n} exceeds the model's vocab_size {model_vocab}: "
            f"raise model vocab_size to >= {n} or use a smaller tokenizer"
        )


# ----------------------------------------------------------------------------- training


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE (GPT-2/Llama-3 style pre-tokenization) with BOS/EOS at ids 0/1.

    Deterministic: the same texts (in the same order) and vocab size give a byte-identical
    ``tokenizer.json`` (the trainer breaks count ties by pair id). ``encode`` with
    ``add_special_tokens=True`` prepends BOS, like Llama-3's tokenizer.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=[BOS_TOKEN, EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    bos_id = tok.token_to_id(BOS_TOKEN)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B:1",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return tok


def bundled_tokenizer(vocab_size: int, cache_dir: str | Path) -> Tok:
    """BPE trained on the bundled corpus, cached under ``cache_dir/tokenizers``."""
    from .sources import BUNDLED_FILES, CORPUS_DIR, iter_documents

    corpus = hashlib.sha256()
    for name in BUNDLED_FILES:
        corpus.update((CORPUS_DIR / name).read_bytes())
    tag = f"bpe{vocab_size}-{corpus.hexdigest()[:12]}-r{BPE_RECIPE}-tk{tokenizers.__version__}"
    path = Path(cache_dir).expanduser() / "tokenizers" / f"{tag}.json"
    name = f"bundled-bpe-{vocab_size}"
    if path.is_file():
        try:
            return _make_tok(Tokenizer.from_file(str(path)), BOS_TOKEN, EOS_TOKEN, name)
        except Exception:  # noqa: BLE001 - a corrupt cache entry is retrained
            pass
    tok = train_bpe(iter_documents(BUNDLED), vocab_size)
    atomic_write(path, tok.to_str())
    return _make_tok(tok, BOS_TOKEN, EOS_TOKEN, name)


# ----------------------------------------------------------------------------- loading


def _special(cfg: dict, key: str) -> str | None:
    v = cfg.get(key)
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None


def load_tokenizer_file(path: str | Path) -> Tok:
    """A Hugging Face ``tokenizer.json`` (or a directory holding one, e.g. an HF model dir).

    BOS/EOS come from ``tokenizer_config.json`` / ``special_tokens_map.json`` next to it
    if present, else from well-known names (``<|begin_of_text|>``, ``<s>``, ...). A
    tokenizer without a BOS token uses its EOS token as BOS.
    """
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise DataError(
            f"tokenizer not found: {str(path)!r} (expected a tokenizer.json file "
            f"or a directory containing one)"
        )
    try:
        tok = Tokenizer.from_file(str(p))
    except Exception as e:  # noqa: BLE001 - tokenizers raises plain Exception
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(f"cannot load tokenizer {str(p)!r}: {msg}") from None
    meta: dict = {}
    for side in ("special_tokens_map.json", "tokenizer_config.json"):
        f = p.parent / side
        if f.is_file():
            try:
                meta.update(
                    {
                        k: v
                        for k, v in json.loads(f.read_text()).items()
                        if k in ("bos_token", "eos_token") and v
                    }
                )
            except (json.JSONDecodeError, AttributeError):
                pass
    vocab = tok.get_vocab(with_added_tokens=True)
    bos = _special(meta, "bos_token") or next((t for t in _BOS_CANDIDATES if t in vocab), None)
    eos = _special(meta, "eos_token") or next((t for t in _EOS_CANDIDATES if t in vocab), None)
    if eos is None:
        raise DataError(f"tokenizer {str(p)!r} has no EOS token (looked for {_EOS_CANDIDATES})")
    return _make_tok(tok, bos or eos, eos, str(p))


def load_tokenizer(cfg: DataConfig | str | Path) -> Tok:
    """The run's tokenizer: ``cfg.tokenizer`` is ``"bundled"`` or a tokenizer.json path.

    A plain string/path is accepted too (``"bundled"`` then uses the default vocab size
    and cache directory).
    """
    if not isinstance(cfg, DataConfig):
        cfg = DataConfig(tokenizer=str(cfg))
    if cfg.tokenizer == BUNDLED:
        return bundled_tokenizer(cfg.bpe_vocab_size, cfg.cache_path)
    return load_tokenizer_file(cfg.tokenizer)


# ----------------------------------------------------------------------------- export


def save_hf_tokenizer(tok: Tok, out_dir: str | Path, model_max_length: int | None = None) -> Path:
    """Write ``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``.

    The directory then loads with ``transformers.AutoTokenizer.from_pretrained(out_dir)``
    as a ``PreTrainedTokenizerFast`` with the same ids as ``tok.tokenizer``.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(tok.json, encoding="utf-8")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tok.bos_token,
        "eos_token": tok.eos_token,
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
    }
    if model_max_length is not None:
        config["model_max_length"] = int(model_max_length)
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    specials = {"bos_token": tok.bos_token, "eos_token": tok.eos_token}
    (out / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")
    return out
