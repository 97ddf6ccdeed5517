"""Which tokenizer a run was trained with, and the Hugging Face files that describe it.

A run records its tokenizer only through its config (`data.source`, `data.path`,
`data.tokenizer`, in `config.json` and in every checkpoint's metadata) and the corpus
manifest (`<data.path>/manifest.json`: kind, file name, sha256, vocab size, EOS id). The
stdlib corpus is always byte level. `run_tokenizer` puts these together:

- byte level: ids 0..255 are the bytes, 256 is EOS. Export writes an equivalent
  `tokenizer.json` built with the `tokenizers` library (a BPE model with the 256 byte
  symbols of the ByteLevel alphabet as ids 0..255 and no merges, a ByteLevel
  pre-tokenizer and decoder, `<|endoftext|>` as id 256) and `split_special_tokens` so that
  a literal "<|endoftext|>" in a text stays bytes, as it does for `ByteTokenizer`;
- a `tokenizer.json`: the file named by `data.tokenizer` (or given explicitly), which must
  still exist and hash to the manifest's sha256; it is copied byte for byte, with the EOS
  id from the manifest and a BOS token from a `tokenizer_config.json` beside it, if any.

`write_tokenizer_files` writes `tokenizer.json`, `tokenizer_config.json`
(`PreTrainedTokenizerFast`), `special_tokens_map.json`; `generation_config` is the
matching `generation_config.json`. `AutoTokenizer.from_pretrained` then encodes a text to
the ids europa-jax trained on (no BOS is added: `prepare` adds none).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import shutil
from pathlib import Path

from europa_jax.config import Config
from europa_jax.data.corpus import DataError, Manifest
from europa_jax.data.tokenizer import (BYTE_EOS_ID, BYTE_VOCAB_SIZE, ByteTokenizer,
                                       HuggingFaceTokenizer, Tokenizer)

log = logging.getLogger(__name__)

BYTE_EOS_TOKEN = "<|endoftext|>"
INSTALL_TOKENIZERS = "a dependency of europa-jax: pip install 'tokenizers>=0.20'"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@dataclasses.dataclass(frozen=True)
class RunTokenizer:
    """The tokenizer a run's corpus was made with."""

    kind: str                 # "bytes" | "huggingface"
    path: Path | None         # the tokenizer.json (huggingface)
    vocab_size: int           # max id + 1
    eos_id: int
    eos_token: str
    bos_token: str | None = None
    bos_id: int | None = None
    verified: bool = True     # False: no manifest to check the file's sha256 against

    def load(self) -> Tokenizer:
        """europa-jax's own tokenizer object (encode/decode; HF needs `tokenizers`)."""
        if self.kind == "bytes":
            return ByteTokenizer()
        return HuggingFaceTokenizer(self.path, self.eos_token)


BYTES = RunTokenizer(kind="bytes", path=None, vocab_size=BYTE_VOCAB_SIZE, eos_id=BYTE_EOS_ID,
                     eos_token=BYTE_EOS_TOKEN)


def run_tokenizer(cfg: Config, path: str | Path | None = None
                  ) -> tuple[RunTokenizer | None, str]:
    """(the run's tokenizer, "") or (None, why it is unknown).

    `path` overrides `data.tokenizer` (e.g. after the file moved). A tokenizer file that is
    named but gone, or whose sha256 differs from the corpus manifest's, is a DataError.
    """
    data = cfg.data
    if data.source == "stdlib":
        return BYTES, ""
    spec = str(path) if path is not None else data.tokenizer
    key = "--tokenizer" if path is not None else "data.tokenizer"
    recorded, corpus, missing = _recorded_tokenizer(cfg)
    if recorded is not None and recorded.get("kind") == "bytes":
        if spec not in (None, "bytes"):
            raise DataError(f"{key}: {spec}: the run's corpus {corpus} was prepared byte "
                            "level, not with this tokenizer")
        return BYTES, ""
    if spec == "bytes":
        if recorded is not None:  # training would have refused this corpus
            raise DataError(f"{key}: 'bytes' but the run's corpus {corpus} was prepared with "
                            f"{recorded.get('kind')} '{recorded.get('name')}'")
        return BYTES, ""
    if spec is None:
        if recorded is None:
            return None, (f"the corpus manifest is unreadable ({missing}) and the config has no "
                          "data.tokenizer")
        return None, (f"the corpus was prepared with {recorded.get('kind')} "
                      f"'{recorded.get('name')}' (sha256 {str(recorded.get('sha256'))[:12]}) "
                      "but the config has no data.tokenizer naming the file (pass --tokenizer)")
    file = Path(spec)
    if not file.is_file():
        raise DataError(f"{file}: the run's tokenizer ({key}) is gone; restore it or pass "
                        "--tokenizer with a copy")
    raw = file.read_bytes()
    digest = hashlib.sha256(raw).hexdigest()
    try:
        parsed = json.loads(raw)
        vocab = _token_ids(parsed)
    except (ValueError, TypeError, AttributeError) as e:
        raise DataError(f"{file}: not a Hugging Face tokenizer.json ({e})") from None
    if recorded is None:  # the corpus is gone: the file as it is now, unverified
        log.warning(f"{missing}; the tokenizer {file} is not checked against the one the run "
                    "was trained with")
        if not _has_tokenizers():
            return None, (f"the corpus manifest is unreadable and finding {file}'s EOS needs "
                          f"the 'tokenizers' package ({INSTALL_TOKENIZERS})")
        try:
            info = HuggingFaceTokenizer(file).info
        except DataError as e:
            return None, f"the corpus manifest is unreadable and {e}"
        eos_id, vocab_size, verified = info.eos_id, info.vocab_size, False
    else:
        if digest != recorded.get("sha256"):
            raise DataError(f"{file}: sha256 {digest[:12]} differs from the corpus manifest's "
                            f"{str(recorded.get('sha256'))[:12]} ({corpus / 'manifest.json'}): not "
                            "the tokenizer the run was trained with")
        eos_id, vocab_size, verified = int(recorded["eos_id"]), int(recorded["vocab_size"]), True
    by_id = {i: t for t, i in vocab.items()}
    if eos_id not in by_id:
        raise DataError(f"{file}: has no token with the EOS id {eos_id}")
    bos = _configured_token(file, "bos_token")
    bos_id = vocab.get(bos) if bos else None
    return RunTokenizer(kind="huggingface", path=file, vocab_size=vocab_size, eos_id=eos_id,
                        eos_token=by_id[eos_id], bos_token=bos if bos_id is not None else None,
                        bos_id=bos_id, verified=verified), ""


def _recorded_tokenizer(cfg: Config) -> tuple[dict | None, Path | None, str]:
    """(manifest tokenizer identity, its corpus, "") of the run's corpus — the first
    readable one of a mixture (data.sources share one tokenizer) — or (None, None, why)."""
    data = cfg.data
    paths = [data.path] if data.path else [s.path for s in getattr(data, "sources", ())]
    errors = []
    for path in paths:
        try:
            return Manifest.read(Path(path)).tokenizer, Path(path), ""
        except DataError as e:
            errors.append(str(e))
    return None, None, (errors[0] if errors else "the config names no corpus")


def _has_tokenizers() -> bool:
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        return False
    return True


def _token_ids(tokenizer_json: dict) -> dict[str, int]:
    """Token → id of a tokenizer.json (model vocabulary and added tokens), without the
    `tokenizers` package."""
    vocab = tokenizer_json.get("model", {}).get("vocab") or {}
    ids = ({piece[0]: i for i, piece in enumerate(vocab)} if isinstance(vocab, list)
           else {str(t): int(i) for t, i in vocab.items()})
    for added in tokenizer_json.get("added_tokens") or ():
        ids[added["content"]] = int(added["id"])
    return ids


def _configured_token(path: Path, name: str) -> str | None:
    """`name` (e.g. bos_token) from a tokenizer_config.json beside the tokenizer."""
    try:
        value = json.loads(path.with_name("tokenizer_config.json").read_text()).get(name)
    except (OSError, ValueError, AttributeError):
        return None
    return value.get("content") if isinstance(value, dict) else value


def byte_level_tokenizer_json() -> str:
    """A tokenizer.json equal to `ByteTokenizer`: byte b ↦ id b, EOS `<|endoftext|>` = 256.

    Raises ImportError without the `tokenizers` package.
    """
    from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    vocab = {symbol: byte for byte, symbol in enumerate(_byte_symbols())}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(BYTE_EOS_TOKEN, special=True, normalized=False)])
    assert tok.token_to_id(BYTE_EOS_TOKEN) == BYTE_EOS_ID
    return tok.to_str(pretty=True)


def _byte_symbols() -> list[str]:
    """The ByteLevel (GPT-2) alphabet in byte order: the printable character for byte b."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    symbols, extra = {}, 0
    for b in range(256):
        if b in printable:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]


def write_tokenizer_files(out_dir: Path, tok: RunTokenizer, model_max_length: int) -> list[str]:
    """tokenizer.json, tokenizer_config.json, special_tokens_map.json into `out_dir`; the
    names written (none, with a warning, for a byte-level run without `tokenizers`)."""
    out_dir = Path(out_dir)
    if tok.kind == "bytes":
        try:
            text = byte_level_tokenizer_json()
        except ImportError:
            log.warning("tokenizer files not written: the byte-level tokenizer.json is built "
                        f"with the 'tokenizers' package ({INSTALL_TOKENIZERS}); export again "
                        "with --overwrite to add them")
            return []
        (out_dir / "tokenizer.json").write_text(text)
    else:
        shutil.copyfile(tok.path, out_dir / "tokenizer.json")
    special = {"eos_token": tok.eos_token}
    if tok.bos_token is not None:
        special["bos_token"] = tok.bos_token
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **special,
              "model_max_length": int(model_max_length),
              "clean_up_tokenization_spaces": False,
              "add_bos_token": False, "add_eos_token": False}
    if tok.kind == "bytes":
        config["split_special_tokens"] = True  # "<|endoftext|>" in a text is 13 bytes
    else:
        template = _configured_token(tok.path, "chat_template")
        if isinstance(template, str):
            config["chat_template"] = template
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2,
                                                              ensure_ascii=False))
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2,
                                                                ensure_ascii=False))
    return list(TOKENIZER_FILES)


def generation_config(eos_id: int | None, bos_id: int | None) -> dict:
    """generation_config.json: greedy by default, stop at EOS.

    No `max_length`: transformers warns on every `generate(max_new_tokens=...)` when one is
    set, and caps the length at `max_position_embeddings` itself.
    """
    out = {"_from_model_config": False, "do_sample": False}
    if bos_id is not None:
        out["bos_token_id"] = bos_id
    if eos_id is not None:
        out["eos_token_id"] = eos_id
        out["pad_token_id"] = eos_id  # batched generate pads with it (no pad token exists)
    return out
