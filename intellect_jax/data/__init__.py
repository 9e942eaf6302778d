"""intellect_jax.data: sources, tokenizer, token-shard cache and the grain pipeline.

See docs/data.md. Typical use by the trainer::

    tok = load_tokenizer(cfg.data)
    check_vocab(tok.vocab_size, model_cfg.vocab_size)
    it = make_train_iter(cfg.data, tok, node_rank=r, node_count=n,
                         process_index=jax.process_index(), process_count=jax.process_count())
    batch = next(it)["tokens"]          # int32 [batch_size // process_count, seq_len + 1]
    state = it.get_state()              # JSON-serializable; it.set_state(state) resumes
"""

from .cache import STATS, Shard, TokenStream, token_dtype, tokenize_documents, tokenize_file
from .config import BUNDLED, DataConfig, SourceConfig
from .errors import DataError
from .mixture import MixtureMap, mix, mixture_counts
from .pipeline import (
    DataIterator,
    SourceSplit,
    make_eval_batches,
    make_train_iter,
    make_val_batches,
    prepare_sources,
    train_records,
    val_records,
)
from .sources import iter_documents, iter_file_documents, resolve_files
from .tokenizer import (
    BOS_TOKEN,
    EOS_TOKEN,
    Tok,
    bundled_tokenizer,
    check_vocab,
    load_tokenizer,
    load_tokenizer_file,
    save_hf_tokenizer,
    tok_from_state,
    train_bpe,
)

__all__ = [
    "BOS_TOKEN",
    "BUNDLED",
    "EOS_TOKEN",
    "STATS",
    "DataConfig",
    "DataError",
    "DataIterator",
    "MixtureMap",
    "Shard",
    "SourceConfig",
    "SourceSplit",
    "Tok",
    "tok_from_state",
    "TokenStream",
    "bundled_tokenizer",
    "check_vocab",
    "iter_documents",
    "iter_file_documents",
    "load_tokenizer",
    "load_tokenizer_file",
    "make_eval_batches",
    "make_train_iter",
    "make_val_batches",
    "mix",
    "mixture_counts",
    "prepare_sources",
    "resolve_files",
    "save_hf_tokenizer",
    "token_dtype",
    "tokenize_documents",
    "tokenize_file",
    "train_bpe",
    "train_records",
    "val_records",
]
