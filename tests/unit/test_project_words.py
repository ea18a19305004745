"""The project speaks of the software alone: no tracked text file names how its work was organised
(numbered work periods, tracker numbers, the tools, loans and machine kinds a measurement was taken
through). Measurements are cited by benchmark and date instead (BENCHMARKS.md, docs/benchmark-notes/).

Each pattern below is written with a character class (`[s]`, `[d]`, ...) so that this file's own
source does not match it. The words the patterns look for also have legitimate software senses (a
process session, an HTTP session, a lock's term, "threads issue 2 loads"), so every pattern asks for the
form the work-organisation sense takes: a number after the word, or a fixed phrase."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

TEXT_SUFFIXES = {".py", ".md", ".toml", ".json", ".txt", ".cfg", ".ini", ".sh", ".yml", ".yaml", ".hjson",
                 ".rst", ".in"}
TEXT_NAMES = {"Makefile"}

# (what it catches, pattern); matched case-insensitively
PATTERNS = [
    ("a numbered work period", r"\b[s]essions?[\s_-]*\d"),
    ("a tracker number", r"\b[i]ssues?\s*#\d+|\b[i]ssues?\s+\d+(?=[)\],:;.']|\s*$)"),
    ("the tool a machine was reached through", r"\b[d]evice[\s-](?:tool|time|kind)s?\b"),
    ("a machine on loan", r"\b[l]eases?\b"),
    ("a scratch path of the measuring machine", r"(?<![\w)\]])\.[d]evice/"),
    ("a lent machine kind", r"\b[n]vidia-h200-x\d+\b"),
]
_COMBINED = re.compile("|".join(f"(?:{p})" for _, p in PATTERNS), re.IGNORECASE | re.MULTILINE)


def _scanned(path: str) -> bool:
    """Text files of the project. Dotfiles at any level (.gitignore: tooling, not prose) and corpora
    under a `data/` directory (the demo's Shakespeare uses some of these words in their plain senses) are
    left out."""
    p = Path(path)
    if p.name.startswith(".") or "data" in p.parts[:-1]:
        return False
    return p.suffix in TEXT_SUFFIXES or p.name in TEXT_NAMES or (p.suffix == "" and p.parent.name == ".ci")


def _tracked_files() -> list[str]:
    if shutil.which("git") is None:
        pytest.skip("git is not installed: the tracked files cannot be listed")
    done = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, timeout=30)
    if done.returncode != 0:
        pytest.skip(f"{ROOT} is not a git checkout: the tracked files cannot be listed")
    return [f for f in done.stdout.decode("utf-8", "surrogateescape").split("\0") if f]


# every pattern needs one of these (lower case); lines without any are not searched, which keeps the
# scan of the whole repository well under a second
_KEYWORDS = ("s" + "ession", "i" + "ssue", "d" + "evice", "l" + "ease", "n" + "vidia-h200-x")


def offences(text: str) -> list[tuple[int, str]]:
    """(1-based line, matched text) of every work-organisation word in `text`."""
    lower = text.lower()
    if not any(k in lower for k in _KEYWORDS):
        return []
    found = []
    for number, (line, line_lower) in enumerate(zip(text.split("\n"), lower.split("\n")), 1):
        if any(k in line_lower for k in _KEYWORDS):
            found += [(number, m.group(0)) for m in _COMBINED.finditer(line)]
    return found


def test_no_work_organisation_words_in_tracked_text_files():
    found = []
    for rel in _tracked_files():
        if not _scanned(rel):
            continue
        path = ROOT / rel
        if not path.is_file():  # deleted in the working tree, not yet in the index
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        found += [f"{rel}:{line}: {word!r}" for line, word in offences(text)]
    assert not found, ("cite measurements by benchmark and date, name hardware as hardware:\n"
                       + "\n".join(found))


# The phrases are assembled at run time so that this file holds none of them.
_S, _I, _D = "sess" + "ion", "iss" + "ue", "dev" + "ice"


@pytest.mark.parametrize("text", [
    f"measured in {_S} 19", f"{_S.title()} 20 (2026-11-30)", f"{_S}s 4-5", f"the {_S}-18 results",
    f"Claim ({_I} 6): faster", f"the fused step ({_I} 4), 2026", f"fixes {_I} #12", f"see {_I}#3",
    f"one H200 ({_D} tool)", f"no {_D} time left", f"({_D} kind " + "nvidia-h200-x" + "2)", "same le" + "ase",
    f"run from `.{_D}/s20/ab.py`", "the nvidia-h200-x" + "4 kind",
])
def test_patterns_catch_the_work_organisation_forms(text):
    assert offences(text), text


@pytest.mark.parametrize("text", [
    f"a new {_S} is started with setsid", f"requests.{_S.title()}() keeps the connection", "Test-" + _S,
    f"every rank must {_I} 2 collectives in order", f"the {_I} of a king", "release the group", "x.device",
    f"torch.{_D}('cuda:0')", f"{_D} = torch.{_D}(\"cuda\")", "one NVIDIA H200, torch 2.11", "2 x NVIDIA H200",
])
def test_patterns_spare_the_software_senses(text):
    assert not offences(text), text
