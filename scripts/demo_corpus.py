"""The demo model's corpus: English prose from two Debian packages, made into plain text.

* ``r-cran-janeaustenr`` (Debian main, package MIT): Jane Austen's six novels as published by
  Project Gutenberg; the novels are in the public domain. Stored as an R lazy-load database, read
  here by a small R-serialisation reader (character vectors only; no R needed).
* ``python3.11-doc`` (Debian main, PSF License Version 2): the reStructuredText sources of the Python
  3.11 documentation; only the prose paragraphs are kept (no code, tables or directives).

Both are fetched with ``apt-get download`` (no root, no installation: the .deb files are unpacked
with ``dpkg-deb -x`` into a cache folder), so a fresh Debian 12 machine with the package lists
(``apt-get update``) can rebuild the corpus. Held-out text is split off by document before anything
is trained: the last three chapters of *Persuasion* and the whole Python FAQ (``faq/``).
"""

from __future__ import annotations

import gzip
import hashlib
import random
import re
import struct
import subprocess
import zlib
from dataclasses import dataclass
from pathlib import Path

PACKAGES = ("r-cran-janeaustenr", "python3.11-doc")
AUSTEN_DIR = "usr/lib/R/site-library/janeaustenr/data"
PYDOC_DIR = "usr/share/doc/python3.11/html/_sources"
# sections of the Python documentation used for training (faq/ is held out; the changelog, the C
# API and the packaging guides are left out as lists, API signatures or legacy tooling)
PYDOC_TRAIN = ("tutorial", "howto", "library", "reference", "using", "whatsnew", "glossary.rst.txt")
PYDOC_HELDOUT = ("faq",)
PYDOC_SKIP = ("whatsnew/changelog.rst.txt",)
AUSTEN_HELDOUT_CHAPTERS = 3  # the last chapters of Persuasion
WRAP_SHARE = 0.25  # share of documents kept hard-wrapped at 72 columns (the rest as one line per paragraph)


@dataclass
class Corpus:
    train: list[str]  # documents
    heldout_austen: str
    heldout_pydoc: str

    def digest(self) -> str:
        h = hashlib.sha256()
        for doc in self.train:
            h.update(doc.encode())
            h.update(b"\0")
        return h.hexdigest()


# --- fetching -------------------------------------------------------------------------------------
def fetch(cache: Path) -> Path:
    """Download and unpack the two packages into ``cache``; return the unpacked root."""
    cache.mkdir(parents=True, exist_ok=True)
    root = cache / "root"
    if (root / AUSTEN_DIR / "Rdata.rdb").is_file() and (root / PYDOC_DIR).is_dir():
        return root
    debs = []
    for name in PACKAGES:
        found = sorted(cache.glob(f"{name}_*.deb"))
        if not found:
            subprocess.run(["apt-get", "download", name], cwd=cache, check=True)
            found = sorted(cache.glob(f"{name}_*.deb"))
        debs.append(found[-1])
    root.mkdir(exist_ok=True)
    for deb in debs:
        subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    return root


# --- R serialisation (XDR), enough for character vectors --------------------------------------------
class _RReader:
    _SPECIAL = {254, 242, 241, 253, 252, 251, 247}  # NULL, environments, unbound, missing

    def __init__(self, data: bytes):
        self.b, self.p, self.refs = data, 0, []
        if data[:2] != b"X\n":
            raise ValueError("not an XDR R serialisation")
        self.p = 2
        version = self.int()
        self.int(), self.int()
        if version == 3:
            n = self.int()  # native encoding name
            self.p += n

    def int(self) -> int:
        (v,) = struct.unpack_from(">i", self.b, self.p)
        self.p += 4
        return v

    def item(self):
        flags = self.int()
        kind, has_attr, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
        if kind in self._SPECIAL:
            return None
        if kind == 255:  # reference
            ref = flags >> 8 or self.int()
            return self.refs[ref - 1]
        if kind == 1:  # symbol
            sym = ("sym", self.item())
            self.refs.append(sym)
            return sym
        if kind in (2, 3, 5, 6, 17):  # pairlists, closures, promises, calls, dots
            attr = self.item() if has_attr else None
            tag = self.item() if has_tag else None
            return ("list", tag, self.item(), self.item(), attr)
        if kind == 4:  # environment
            self.int()
            env: dict = {}
            self.refs.append(env)
            for _ in range(4):
                self.item()
            return env
        if kind == 9:  # CHARSXP
            n = self.int()
            if n < 0:
                return None
            s = self.b[self.p : self.p + n].decode("utf-8", "replace")
            self.p += n
            return s
        if kind in (10, 13):
            n = self.int()
            value = list(struct.unpack_from(f">{n}i", self.b, self.p))
            self.p += 4 * n
        elif kind == 14:
            n = self.int()
            value = list(struct.unpack_from(f">{n}d", self.b, self.p))
            self.p += 8 * n
        elif kind in (16, 19, 20):
            value = [self.item() for _ in range(self.int())]
        elif kind == 24:
            n = self.int()
            value = self.b[self.p : self.p + n]
            self.p += n
        elif kind == 238:  # ALTREP: class info, state, attributes
            return ("altrep", self.item(), self.item(), self.item())
        else:
            raise ValueError(f"R serialisation: unsupported type {kind}")
        if has_attr:
            self.item()  # attributes (names, class): not needed here
        return value


def read_austen(root: Path) -> dict[str, list[str]]:
    """The six novels (title -> lines) from janeaustenr's lazy-load database."""
    data = root / AUSTEN_DIR
    index = _RReader(gzip.decompress((data / "Rdata.rdx").read_bytes())).item()
    db = (data / "Rdata.rdb").read_bytes()
    novels = {}
    for offset, length in index[0]:
        chunk = db[offset : offset + length]
        lines = _RReader(zlib.decompress(chunk[4:])).item()
        lines = [line or "" for line in lines]
        title = next(line for line in lines if line.strip()).strip().title()
        novels[title] = lines
    return novels


# --- text clean-up -----------------------------------------------------------------------------------
def paragraphs(lines: list[str]) -> list[list[str]]:
    out, cur = [], []
    for line in lines:
        if line.strip():
            cur.append(line.rstrip())
        elif cur:
            out.append(cur)
            cur = []
    if cur:
        out.append(cur)
    return out


def render(paras: list[list[str]], wrapped: bool) -> str:
    """Paragraphs separated by a blank line; inside one, either its lines or one line."""
    joined = [re.sub(r"\s+", " ", " ".join(p)).strip() for p in paras]
    if wrapped:
        return "\n\n".join("\n".join(_rewrap(p)) for p in joined)
    return "\n\n".join(joined)


def _rewrap(text: str, width: int = 72) -> list[str]:
    lines, cur = [], ""
    for word in text.split():
        if cur and len(cur) + 1 + len(word) > width:
            lines.append(cur)
            cur = word
        else:
            cur = f"{cur} {word}" if cur else word
    if cur:
        lines.append(cur)
    return lines


_CHAPTER = re.compile(r"^\s*(CHAPTER|Chapter)\s+[0-9IVXLC]+\.?\s*$")


def split_chapters(lines: list[str]) -> list[list[str]]:
    chapters, cur = [], []
    for line in lines:
        if _CHAPTER.match(line) and cur:
            chapters.append(cur)
            cur = []
        cur.append(line)
    chapters.append(cur)
    return chapters


_ROLE = re.compile(r":[a-z:]+:`~?!?([^`<]*?)(?:\s*<[^>]*>)?`")
_LINK = re.compile(r"`([^`<]+?)\s*<[^>]*>`_+")
_REF = re.compile(r"`([^`]+)`_+")
_LITERAL = re.compile(r"``([^`]+)``")
_EMPH = re.compile(r"\*\*?([^*\s][^*]*?)\*\*?")
_FOOT = re.compile(r"\s*\[#?[\w-]*\]_")


def rst_prose(text: str) -> list[str]:
    """Plain prose paragraphs of one reStructuredText file: no code, tables, titles or directive lines
    (prose inside directive bodies, such as a function's description, is kept)."""
    out = []
    skip_indented = False  # the block after "::" or a code directive is code
    for block in re.split(r"\n\s*\n", text):
        lines = [line for line in block.split("\n") if line.strip()]
        if not lines:
            continue
        first = lines[0]
        indented = first[0].isspace()
        code_next = lines[-1].rstrip().endswith("::") or bool(
            re.match(r"\s*\.\. (code-block|doctest|testcode|productionlist)", first)
        )
        if indented and skip_indented:
            skip_indented = code_next or skip_indented
            continue
        skip_indented = code_next
        first = first.strip()
        if first.startswith(("..", "::", ">>>", "...", "+", "|", "=", "-", "*", "#", "~", "^", ":", "`", "%", "$")):
            continue
        if len(lines) > 1 and re.fullmatch(r"([=\-~^*#\"'+`])\1{2,}", lines[1].strip()):
            continue  # a section title
        width = len(lines[0]) - len(lines[0].lstrip())
        if any(len(line) - len(line.lstrip()) != width for line in lines[1:]):
            continue  # definition lists, option descriptions, nested code
        para = " ".join(line.strip() for line in lines)
        para = _ROLE.sub(lambda m: m.group(1).lstrip("~!").strip(), para)
        para = _LINK.sub(r"\1", para)
        para = _REF.sub(r"\1", para)
        para = _LITERAL.sub(r"\1", para)
        para = _EMPH.sub(r"\1", para)
        para = _FOOT.sub("", para)
        para = re.sub(r"::$", ":", para)
        para = re.sub(r"\s+", " ", para).strip()
        letters = sum(c.isalpha() or c == " " for c in para)
        if len(para) < 80 or len(para.split()) < 10 or letters < 0.85 * len(para):
            continue
        if para.count("(") > len(para) / 40 or para[-1] not in ".:!?)\"'":
            continue
        out.append(para)
    return out


def read_pydoc(root: Path, sections: tuple[str, ...]) -> dict[str, list[str]]:
    base = root / PYDOC_DIR
    docs = {}
    for section in sections:
        path = base / section
        files = [path] if path.is_file() else sorted(path.rglob("*.rst.txt"))
        for f in files:
            rel = f.relative_to(base).as_posix()
            if rel in PYDOC_SKIP:
                continue
            paras = rst_prose(f.read_text(encoding="utf-8", errors="replace"))
            if paras:
                docs[rel] = paras
    return docs


def build(root: Path, seed: int = 0) -> Corpus:
    """Training documents (chapters and doc pages, some kept hard-wrapped) and the held-out text."""
    rng = random.Random(seed)
    train: list[str] = []
    heldout_austen = ""
    for title, lines in read_austen(root).items():
        chapters = split_chapters(lines)
        if title.lower() == "persuasion":
            held = chapters[-AUSTEN_HELDOUT_CHAPTERS:]
            chapters = chapters[:-AUSTEN_HELDOUT_CHAPTERS]
            heldout_austen = "\n\n".join(render(paragraphs(c), wrapped=False) for c in held)
        for chapter in chapters:
            train.append(render(paragraphs(chapter), wrapped=rng.random() < WRAP_SHARE))
    for paras in read_pydoc(root, PYDOC_TRAIN).values():
        train.append(render([[p] for p in paras], wrapped=rng.random() < WRAP_SHARE))
    held = read_pydoc(root, PYDOC_HELDOUT)
    heldout_pydoc = "\n\n".join("\n\n".join(paras) for paras in held.values())
    return Corpus(train=train, heldout_austen=heldout_austen, heldout_pydoc=heldout_pydoc)


if __name__ == "__main__":
    import sys

    corpus = build(fetch(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/demo-corpus")))
    print(
        f"{len(corpus.train)} training documents, {sum(map(len, corpus.train)) / 1e6:.2f} M characters; "
        f"held out: Austen {len(corpus.heldout_austen)} chars, Python FAQ {len(corpus.heldout_pydoc)} chars; "
        f"sha256 {corpus.digest()}"
    )
