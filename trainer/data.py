"""Tokenizers, documents and a stateful, reshardable data loader; nothing is downloaded.

- ``ByteTokenizer`` (default): UTF-8 bytes are ids 0..255, then BOS=256 and EOS=257.
- ``HFTokenizer``: a local ``tokenizer.json`` (``tokenizer_file``: the file, or a folder holding it)
  through the ``tokenizers`` package, if installed.
- ``load_documents``: the corpus shipped in ``trainer/corpus/`` or local .txt / .jsonl files.
- ``TokenStream``: every document tokenized once into one int32 array, ``BOS doc EOS BOS doc EOS ...``.
- ``load_training_tokens``: the trainer's tokenizer and token array, refusing (ConfigError) what cannot work.
- ``DataLoader``: fixed windows of the stream in a seeded per-epoch order. Its state is the number of
  *global* samples consumed, so a run resumed with another data-parallel (or context-parallel) degree
  continues with exactly the samples the union of all ranks would have seen. Under context
  parallelism every rank of a CP group gets the same samples, cut to its positions
  (:func:`trainer.context_parallel.shard_positions`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator, Protocol

import numpy as np
import torch

from .config.schema import ConfigError, is_byte_tokenizer
from .context_parallel import shard_positions

SHIPPED_CORPUS = Path(__file__).with_name("corpus")


# ---------------------------------------------------------------------------------------------------
# Tokenizers


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str, bos: bool = True, eos: bool = True) -> list[int]: ...

    def decode(self, ids) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255; 256 is BOS and 257 is EOS."""

    bos_id = 256
    eos_id = 257
    vocab_size = 258

    def encode(self, text: str, bos: bool = True, eos: bool = True) -> list[int]:
        head = [self.bos_id] if bos else []
        tail = [self.eos_id] if eos else []
        return head + list(text.encode("utf-8")) + tail

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


def tokenizer_file(path: str | Path) -> Path:
    """The tokenizer.json ``path`` names (the file, or a folder holding it); FileNotFoundError when
    there is none."""
    path = Path(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"no tokenizer file at {path}")
    return path


class HFTokenizer:
    """A local Hugging Face ``tokenizer.json`` (a file, or a folder holding one); needs ``tokenizers``.

    BOS/EOS are the first of the usual special tokens the vocabulary has (``<s>``/``</s>``,
    ``<|begin_of_text|>``/``<|end_of_text|>``, ``<bos>``/``<eos>``, ``<|endoftext|>``); one it lacks
    is simply not added.
    """

    BOS_NAMES = ("<s>", "<|begin_of_text|>", "<bos>", "<|endoftext|>")
    EOS_NAMES = ("</s>", "<|end_of_text|>", "<eos>", "<|endoftext|>")

    def __init__(self, path: str | Path):
        try:
            from tokenizers import Tokenizer as _Tokenizer
        except ImportError as e:
            raise ImportError(
                "a tokenizer.json needs the 'tokenizers' package (pip install tokenizers); "
                "leave the tokenizer unset to use the built-in byte-level tokenizer"
            ) from e
        self._tok = _Tokenizer.from_file(str(tokenizer_file(path)))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_id = self._first_id(self.BOS_NAMES)
        self.eos_id = self._first_id(self.EOS_NAMES)

    def _first_id(self, names: tuple[str, ...]) -> int | None:
        ids = (self._tok.token_to_id(name) for name in names)
        return next((i for i in ids if i is not None), None)

    def encode(self, text: str, bos: bool = True, eos: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        head = [self.bos_id] if bos and self.bos_id is not None else []
        tail = [self.eos_id] if eos and self.eos_id is not None else []
        return head + ids + tail

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)


def load_tokenizer(path: str | None) -> ByteTokenizer | HFTokenizer:
    """The byte-level tokenizer (see :func:`is_byte_tokenizer`); otherwise a local tokenizer.json."""
    if is_byte_tokenizer(path):
        return ByteTokenizer()
    return HFTokenizer(path)


# ---------------------------------------------------------------------------------------------------
# Documents


def _txt_documents(path: Path) -> list[str]:
    """Documents of a text file are separated by blank lines."""
    text = path.read_text(encoding="utf-8")
    return [doc.strip() for doc in text.replace("\r\n", "\n").split("\n\n") if doc.strip()]


def _jsonl_documents(path: Path) -> list[str]:
    docs = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise ValueError(f"{path}:{lineno}: expected an object with a string 'text' field")
            if record["text"]:
                docs.append(record["text"])
    return docs


def load_documents(source: str) -> list[str]:
    """``"shipped"``: the corpus in ``trainer/corpus/``; a ``.txt`` file (documents separated by
    blank lines); a ``.jsonl`` file (the ``"text"`` field of each line); or a folder of such files,
    read in sorted order."""
    path = SHIPPED_CORPUS if source == "shipped" else Path(source)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in (".txt", ".jsonl") and p.is_file())
        if not files:
            raise ValueError(f"no .txt or .jsonl files in {path}")
    elif path.is_file():
        files = [path]
    else:
        raise FileNotFoundError(f"data source {source!r}: no such file or folder (or use 'shipped')")
    docs = []
    for file in files:
        if file.suffix == ".jsonl":
            docs += _jsonl_documents(file)
        elif file.suffix == ".txt":
            docs += _txt_documents(file)
        else:
            raise ValueError(f"{file}: expected a .txt or .jsonl file")
    if not docs:
        raise ValueError(f"data source {source!r} holds no documents")
    return docs


class TokenStream:
    """All documents tokenized once, BOS/EOS around each, as one int32 array (``.tokens``)."""

    def __init__(self, documents: list[str], tokenizer: Tokenizer):
        ids: list[int] = []
        for doc in documents:
            ids += tokenizer.encode(doc, bos=True, eos=True)
        self.tokens = np.asarray(ids, dtype=np.int32)

    def __len__(self) -> int:
        return len(self.tokens)


def load_training_tokens(tokenizer_path: str | None, dataset: str, seq_len: int) -> tuple[Tokenizer, np.ndarray]:
    """The trainer's tokenizer (``model.tokenizer``) and text (``training.dataset``) as one token
    array; ConfigError naming the key when either cannot be used or the text is shorter than one
    sequence of ``seq_len + 1`` tokens (``training.seq_len``)."""
    try:
        tokenizer = load_tokenizer(tokenizer_path)
    except Exception as exc:  # a missing file, no `tokenizers` package, or its own parse errors
        raise ConfigError(f"model.tokenizer={tokenizer_path!r} cannot be loaded: {exc}") from exc
    try:
        tokens = TokenStream(load_documents(dataset), tokenizer).tokens
    except (OSError, ValueError) as exc:
        raise ConfigError(f"training.dataset={dataset!r} cannot be used: {exc}") from exc
    if len(tokens) < seq_len + 1:
        raise ConfigError(f"training.seq_len={seq_len} is invalid: training.dataset={dataset!r} holds "
                          f"{len(tokens)} tokens, fewer than one sequence (seq_len + 1)")
    return tokenizer, tokens


# ---------------------------------------------------------------------------------------------------
# Loader


class DataLoader:
    """Batches of ``seq_len + 1``-token windows, identical for any data-parallel layout.

    The stream is cut into non-overlapping windows of ``seq_len + 1`` tokens (the tail is dropped).
    Global sample ``g`` is window ``perm(seed, epoch)[g % n]`` with ``epoch = g // n``, so epochs
    wrap forever, each in its own seeded order. Every ``next_batch`` call consumes the next
    ``global_batch`` global samples; rank ``r`` of ``D`` takes the contiguous slice
    ``[r * global_batch / D, (r + 1) * global_batch / D)`` of them. The state is the global position,
    so resuming with another ``dp_degree`` continues with the same global samples. CP rank ``c`` of
    ``cp_degree`` keeps its positions of each (inputs and labels alike); the state does not change.
    """

    def __init__(
        self, stream_tokens: np.ndarray, seq_len: int, global_batch: int,
        dp_rank: int = 0, dp_degree: int = 1, seed: int = 0, cp_rank: int = 0, cp_degree: int = 1,
    ):
        if global_batch % dp_degree:
            raise ValueError(f"global_batch {global_batch} is not divisible by dp_degree {dp_degree}")
        if not 0 <= dp_rank < dp_degree:
            raise ValueError(f"dp_rank {dp_rank} is outside 0..{dp_degree - 1}")
        self.tokens = np.asarray(stream_tokens)
        self.seq_len = int(seq_len)
        self.num_windows = len(self.tokens) // (self.seq_len + 1)
        if self.num_windows == 0:
            raise ValueError(f"{len(self.tokens)} tokens do not fill one window of {seq_len + 1}")
        self.global_batch = global_batch
        self.local_batch = global_batch // dp_degree
        self.dp_rank = dp_rank
        self.columns = np.asarray(shard_positions(self.seq_len, cp_degree, cp_rank))
        self.seed = int(seed)
        self.position = 0  # global samples consumed
        self._perm_epoch: int | None = None
        self._perm: np.ndarray | None = None

    def _window(self, g: int) -> int:
        epoch, i = divmod(g, self.num_windows)
        if epoch != self._perm_epoch:
            rng = np.random.default_rng([self.seed % 2**63, epoch])
            self._perm, self._perm_epoch = rng.permutation(self.num_windows), epoch
        return int(self._perm[i])

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, labels)``, each ``LongTensor[local_batch, seq_len / cp_degree]``; labels are inputs
        shifted by one (before the CP cut)."""
        first = self.position + self.dp_rank * self.local_batch
        windows = [self._window(g) for g in range(first, first + self.local_batch)]
        width = self.seq_len + 1
        rows = [self.tokens[w * width:(w + 1) * width] for w in windows]
        self.position += self.global_batch
        batch = np.stack(rows).astype(np.int64)
        return torch.from_numpy(batch[:, self.columns]), torch.from_numpy(batch[:, self.columns + 1])

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, int]:
        return {
            "position": self.position, "seed": self.seed,
            "seq_len": self.seq_len, "num_tokens": len(self.tokens),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state``; its ``seq_len`` and ``num_tokens`` must match this loader's data."""
        for key, mine in (("seq_len", self.seq_len), ("num_tokens", len(self.tokens))):
            if int(state[key]) != mine:
                raise ValueError(f"loader state has {key}={int(state[key])}, but this loader has {mine}")
        self.position = int(state["position"])
        self.seed = int(state["seed"])
        self._perm_epoch = self._perm = None
