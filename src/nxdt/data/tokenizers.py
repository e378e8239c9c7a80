"""Build the tokenizer named by `data.tokenizer.*` (offline: nothing is downloaded).

| data.tokenizer.library     | what is loaded                                                        |
|----------------------------|-----------------------------------------------------------------------|
| huggingface (default)      | `AutoTokenizer.from_pretrained(type, local_files_only=True)`; `type`  |
|                            | is a tokenizer directory (null → the bundled KJV BPE tokenizer)       |
| megatron                   | GPT-2 BPE from `vocab_file` (vocab.json) + `merge_file` (merges.txt)  |
| sentencepiece              | a SentencePiece `model` file (needs the `sentencepiece` package)       |
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from nxdt.config.errors import ConfigError
from nxdt.config.schema import TokenizerConfig
from nxdt.data.assets import bundled_tokenizer_dir
from nxdt.spec.paths import hub_id_hint


def _require_file(path: str | None, key: str, what: str) -> str:
    if not path:
        raise ConfigError(f"data.tokenizer.{key}: required for {what}")
    path = os.path.expanduser(str(path))
    if not os.path.isfile(path):
        raise ConfigError(f"data.tokenizer.{key}: file not found: {path}")
    return path


def build_tokenizer(tok_cfg: TokenizerConfig | None = None, flag: str = "data.tokenizer.type"):
    """Return a `transformers.PreTrainedTokenizerBase` for `cfg.data.tokenizer` (a TokenizerConfig;
    None = the schema default, the bundled tokenizer).

    A missing directory or file raises `ConfigError` naming the key (a command's `flag` for the
    huggingface directory, e.g. `--tokenizer`) and the path.
    """
    tok_cfg = TokenizerConfig() if tok_cfg is None else tok_cfg
    library = tok_cfg.library.lower()
    if library in ("huggingface", "hf"):
        return _huggingface(tok_cfg, flag)
    if library == "megatron":
        return _megatron_gpt2(tok_cfg)
    if library == "sentencepiece":
        return _sentencepiece(tok_cfg)
    raise ConfigError(
        f"data.tokenizer.library: unknown value '{library}' (expected huggingface, megatron or sentencepiece)"
    )


def _huggingface(tok_cfg: Any, flag: str = "data.tokenizer.type"):
    path = tok_cfg.type
    path = str(bundled_tokenizer_dir()) if path is None else os.path.expanduser(str(path))
    if not os.path.isdir(path):
        hint = hub_id_hint(path) or ("nxdt loads tokenizers offline; point it at a directory made by save_pretrained: "
                                     "tokenizer.json or tokenizer.model, with tokenizer_config.json")
        raise ConfigError(f"{flag}: tokenizer directory not found: {os.path.abspath(path)} ({hint})")
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True, use_fast=tok_cfg.use_fast)
    except (OSError, ValueError) as err:
        raise ConfigError(f"{flag}: cannot load a tokenizer from {path}: {err}") from err


def _megatron_gpt2(tok_cfg: Any):
    tok_type = tok_cfg.type or "GPT2BPETokenizer"  # null: Megatron's GPT-2 BPE
    if tok_type not in ("GPT2BPETokenizer", "GPT2BPE", "gpt2"):
        raise ConfigError(f"data.tokenizer.type: megatron library supports GPT2BPETokenizer, got '{tok_type}'")
    vocab = _require_file(tok_cfg.vocab_file, "vocab_file", "the megatron GPT2BPE tokenizer")
    merges = _require_file(tok_cfg.merge_file, "merge_file", "the megatron GPT2BPE tokenizer")
    # Built from `tokenizers` directly: the transformers GPT-2 class changed its arguments in v5.
    try:
        bpe = models.BPE.from_file(vocab, merges)
    except Exception as err:  # noqa: BLE001 - tokenizers raises plain Exception
        raise ConfigError(f"data.tokenizer.vocab_file: cannot read GPT-2 BPE files {vocab}, {merges}: {err}") from err
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    eod = "<|endoftext|>"
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=eod, eos_token=eod, unk_token=eod, pad_token=eod)


def _sentencepiece(tok_cfg: Any):
    model = _require_file(tok_cfg.model, "model", "the sentencepiece tokenizer")
    try:  # optional extra: sentencepiece (transformers' LlamaTokenizer needs it)
        import sentencepiece  # noqa: F401
    except ImportError as err:
        raise ConfigError(
            "data.tokenizer.library: 'sentencepiece' needs the sentencepiece package (pip install sentencepiece)"
        ) from err
    from transformers import LlamaTokenizer  # needs the optional sentencepiece, checked above

    # from_pretrained on a directory holding `tokenizer.model` works the same in transformers 4 and 5.
    with tempfile.TemporaryDirectory(prefix="nxdt-spm-") as tmp:
        os.symlink(os.path.abspath(model), os.path.join(tmp, "tokenizer.model"))
        try:
            tok = LlamaTokenizer.from_pretrained(
                tmp, local_files_only=True, legacy=tok_cfg.sentencepiece_legacy
            )
        except Exception as err:  # noqa: BLE001 - the converters raise many kinds
            raise ConfigError(f"data.tokenizer.model: cannot load sentencepiece model {model}: {err}") from err
    if tok.pad_token is None:
        tok.pad_token = tok.unk_token or tok.eos_token
    return tok


def eod_id(tokenizer, flag: str = "data.tokenizer.type") -> int:
    """The end-of-document id appended after every document: the tokenizer's eos id. Without one, a
    ConfigError that says how to name it (or, for `nxdt preprocess`, to go without)."""
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        where = getattr(tokenizer, "name_or_path", "") or "its folder"
        special = [str(t) for t in getattr(tokenizer, "all_special_tokens", [])]
        added = [str(t) for t in getattr(tokenizer, "added_tokens_decoder", {}).values()]
        known = list(dict.fromkeys(special + added))
        example = next((t for t in known if "end" in t.lower() or "eos" in t.lower() or t == "</s>"),
                       known[0] if known else "</s>")
        without = ", or tokenize without end-of-document ids: --no-append-eod" if flag == "--tokenizer" else ""
        raise ConfigError(
            f"{flag}: the tokenizer {where} has no eos token, which nxdt appends as end-of-document: add "
            f'"eos_token": "{example}" to its tokenizer_config.json'
            + (f" (its special tokens: {', '.join(known[:6])})" if known else "")
            + without)
    return int(eos)
