"""The corpus: the Python standard library's own source files, read as bytes (tokens 0..255).

Nothing is downloaded: every machine with Python has this text. The file list is the sorted list
of ``*.py`` files under ``sysconfig.get_paths()['stdlib']`` (``site-packages`` left out), and a file
is held out for evaluation when the CRC-32 of its relative path is 0 mod 10, so the split is the
same on every run of the same Python version (the text itself differs between Python versions; the
bench records the version and the byte counts).
"""

from __future__ import annotations

import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

VOCAB_SIZE = 256  # byte-level tokenizer: token id = byte value


def encode(text: str | bytes) -> torch.Tensor:
    """Bytes (UTF-8 for a str) -> token ids ``[T]`` int64."""
    data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    if not data:
        return torch.zeros(0, dtype=torch.long)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def decode(ids: torch.Tensor | list[int]) -> str:
    """Token ids -> text (invalid UTF-8 shown with replacement characters)."""
    values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
    return bytes(int(v) & 0xFF for v in values).decode("utf-8", errors="replace")


def stdlib_files(root: str | Path | None = None) -> list[Path]:
    """Every ``*.py`` file of the standard library, sorted by relative path (site-packages excluded)."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    files = [
        p for p in base.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts
    ]
    return sorted(files, key=lambda p: p.relative_to(base).as_posix())


def is_heldout(relative_path: str) -> bool:
    """The deterministic split: about one file in ten is held out."""
    return zlib.crc32(relative_path.encode("utf-8")) % 10 == 0


@dataclass
class Corpus:
    """Training and held-out text as flat uint8 tensors (files joined by a blank line)."""

    train: torch.Tensor
    heldout: torch.Tensor
    n_files: int

    def describe(self) -> str:
        return f"{self.n_files} stdlib files: {self.train.numel()} train bytes, {self.heldout.numel()} held-out bytes"


def load_corpus(max_bytes: int | None = None, root: str | Path | None = None) -> Corpus:
    """Read the corpus; ``max_bytes`` caps the training text (held-out capped at a tenth of it).

    Files are taken in the sorted order until the cap is reached, so a cap gives a deterministic
    prefix of the full corpus.
    """
    if max_bytes is not None and max_bytes < 1024:
        raise ValueError(f"load_corpus: max_bytes must be at least 1024 (or None), got {max_bytes}")
    base = Path(root or sysconfig.get_paths()["stdlib"])
    train: list[bytes] = []
    heldout: list[bytes] = []
    n_train = n_held = n_files = 0
    cap_held = None if max_bytes is None else max(max_bytes // 10, 4096)
    for path in stdlib_files(base):
        rel = path.relative_to(base).as_posix()
        held = is_heldout(rel)
        if held and cap_held is not None and n_held >= cap_held:
            continue
        if not held and max_bytes is not None and n_train >= max_bytes:
            if cap_held is None or n_held >= cap_held:
                break
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        if not data:
            continue
        data += b"\n\n"
        n_files += 1
        if held:
            heldout.append(data)
            n_held += len(data)
        else:
            train.append(data)
            n_train += len(data)
    if not train or not heldout:
        raise RuntimeError(f"load_corpus: found no standard-library source under {base}")
    tr = torch.frombuffer(bytearray(b"".join(train)), dtype=torch.uint8)
    he = torch.frombuffer(bytearray(b"".join(heldout)), dtype=torch.uint8)
    if max_bytes is not None:
        tr, he = tr[:max_bytes], he[:cap_held]
    return Corpus(train=tr.clone(), heldout=he.clone(), n_files=n_files)


def random_windows(text: torch.Tensor, batch: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """``batch`` random windows of ``length`` tokens ``[batch, length]`` int64 (on the CPU)."""
    if text.numel() <= length:
        raise ValueError(f"random_windows: text has {text.numel()} tokens, need more than length={length}")
    starts = torch.randint(0, text.numel() - length, (batch,), generator=generator)
    idx = starts[:, None] + torch.arange(length)[None, :]
    return text[idx].long()
