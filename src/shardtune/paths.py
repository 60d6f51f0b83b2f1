"""Paths as users write them, and what a command may write into or delete (a leaf module: the standard library only).

Three jobs, shared by the config loader, the launching host's checks and the commands that write files:
- ``expand_user_path``: ``~`` and ``$VAR`` / ``${VAR}`` expanded as a shell (and the Trainer, for ``~``) would, an
  unset variable an error instead of a folder literally named ``$VAR``;
- ``shown``: a path or name with its invisible and look-alike characters named by code point, so a message about
  ``'models/tiny-llama\u200b'`` says why the folder that looks right is not found;
- ownership: which folders and files shardtune wrote (a run folder, its checkpoints, a generated file), so that
  nothing it did not create is ever deleted or overwritten.
"""

from __future__ import annotations

import errno
import os
import re
import unicodedata
from pathlib import Path

RUN_FOLDER_MARKS = (".shardtune", "shardtune_config.json")  # a folder holding either is a shardtune run folder
# In the first lines of every file shardtune generates ("# Written by `shardtune slurm` ..."): its own, to replace.
GENERATED_MARK = re.compile(r"written by `?shardtune", re.IGNORECASE)
# A model hub's "org/name": a relative path of two parts that does not say it is local (./, ../, /, ~).
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# A URL's scheme ("https://", "s3://", "hf://"): no file operation reads one, and pathlib would fold "//" into "/".
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_HUB_URL = re.compile(r"^(?:hf://|https?://huggingface\.co/)(?:models/)?([\w.-]+/[\w.-]+)/?$")
_VARIABLE = re.compile(r"\$(\w+)|\$\{([^}]*)\}")
# Entries a fresh volume or a file manager leaves in an empty folder: not the user's work.
_NOISE = frozenset({"lost+found", ".DS_Store", "Thumbs.db"})


def expand_user_path(value: str, hub_id_too: bool = False) -> str:
    """``~`` and environment variables expanded; ValueError names a URL, a variable that is not set, or a character
    no file name can hold (NUL, a lone UTF-16 surrogate)."""
    problem = url_problem(value, hub_id_too)
    if problem:
        raise ValueError(problem)
    if "\x00" in value:
        raise ValueError(f"{shown(value)} contains a NUL character, which no file name can hold")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{value!r} contains a lone UTF-16 surrogate (an escaped character cut in half?), which "
                         "no file name can hold") from None
    missing = [m.group(1) or m.group(2) for m in _VARIABLE.finditer(value)
               if (m.group(1) or m.group(2)) not in os.environ]
    if missing:
        names = ", ".join(f"${name}" for name in dict.fromkeys(missing))
        raise ValueError(f"{shown(value)} uses {names}, which is not set in the environment; set it or write the "
                         "path out")
    expanded = os.path.expanduser(os.path.expandvars(value))
    problem = unusable_path_problem(expanded)
    if problem:
        raise ValueError(problem)
    return expanded


def url_problem(value: str, hub_id_too: bool = False) -> str | None:
    """What to do with a URL given where a local path is read (None when ``value`` is no URL); ``hub_id_too``: the
    key also takes a hub id, which a model page's URL holds. Said before any lookup, so the user reads "is a URL"
    rather than "not found" about a folder named ``https:``."""
    if not _URL.match(value.strip()):
        return None
    hub = _HUB_URL.match(value.strip())
    or_id = f", or give its hub id '{hub.group(1)}'" if hub_id_too and hub else ""
    return (f"{shown(value)} is a URL; shardtune reads local paths: download it first (huggingface-cli download, "
            f"aws s3 cp, curl -O, ...) and give the local path{or_id}")


def folder_problem(key: str, given: str, wanted: str = "a folder") -> str | None:
    """Why ``given``, which ``key`` reads as a folder, is not one: a URL, missing, or a file (``wanted`` names the
    folder to give instead); None when it is a folder. ``given`` as the user wrote it: a Path would fold a URL's
    "//" into "/" and hide it."""
    url = url_problem(given)
    if url:
        return f"{key}: {url}"
    path = Path(given)
    if path.is_dir():
        return None
    if path.exists():
        return f"{key}: {shown(str(path), quote=False)} is a file; give {wanted}"
    return f"{key}: folder not found: {shown(str(path), quote=False)}"


NAME_MAX, PATH_MAX = 255, 4095  # bytes in one part of a path, and in the whole, on Linux filesystems


def unusable_path_problem(path: str) -> str | None:
    """Why no file operation can use ``path`` (too long, a symbolic-link loop); None when it can be tried."""
    longest = max((len(part.encode()) for part in path.split(os.sep)), default=0)
    if longest > NAME_MAX or len(path.encode()) > PATH_MAX:
        return (f"{shown(path[:60] + '...')} is longer than a path can be ({longest} bytes in one part, at most "
                f"{NAME_MAX}; {len(path.encode())} in all, at most {PATH_MAX}); give the real path")
    try:
        os.stat(path)
    except OSError as err:
        if err.errno == errno.ELOOP:
            return f"{shown(path)} is a loop of symbolic links; point it at a real file or folder"
    return None


def reads_as_hub_id(name: str) -> bool:
    """Whether ``name`` has a hub id's shape (``org/name``); a local folder of that shape is read first."""
    return bool(_HUB_ID.match(name)) and not name.startswith((".", "/", "~"))


def unusual_characters(text: str) -> list[str]:
    """The characters of ``text`` a reader cannot tell apart from ordinary ASCII ones, named by code point."""
    found = []
    for index, char in enumerate(text):
        name = unicodedata.name(char, "a control character")
        if char.isspace() and index in (0, len(text) - 1):
            found.append(f"U+{ord(char):04X} {name} at the {'start' if index == 0 else 'end'}")
        elif not (char.isascii() and char.isprintable()):
            found.append(f"U+{ord(char):04X} {name} at position {index + 1}")
    return found


def shown(text: str, quote: bool = True) -> str:
    """``text`` for a one-line message (in single quotes, or bare with ``quote`` False); a text with invisible or
    look-alike characters is written as a Python literal with those characters named after it."""
    odd = unusual_characters(text)
    if odd:
        return f"{text!r} (contains {'; '.join(odd)})"
    return f"'{text}'" if quote else text


def is_inside(path: Path, folder: Path) -> bool:
    """``path`` is ``folder`` or lies inside it (both resolved; neither has to exist)."""
    path, folder = home_expanded(path).resolve(), home_expanded(folder).resolve()
    return path == folder or folder in path.parents


def overlaps(a: Path, b: Path) -> bool:
    """One of the two folders is the other or contains it."""
    return is_inside(a, b) or is_inside(b, a)


def is_run_folder(folder: Path) -> bool:
    """A folder a shardtune run wrote (its ``.shardtune/`` or its resolved config is there)."""
    return any((folder / mark).exists() for mark in RUN_FOLDER_MARKS)


def user_entries(folder: Path) -> list[str]:
    """The names in ``folder`` that count as someone's work (empty when the folder is missing or empty)."""
    if not folder.is_dir():
        return []
    return sorted(entry.name for entry in folder.iterdir() if entry.name not in _NOISE)


def listed(names: list[str], limit: int = 4) -> str:
    """``a, b, c`` or ``a, b, c and 7 more``."""
    head = ", ".join(names[:limit])
    return head if len(names) <= limit else f"{head} and {len(names) - limit} more"


def is_generated_file(path: Path) -> bool:
    """A file shardtune wrote earlier (one of its first lines carries the mark; a script's first line is its
    interpreter), which a new run of the same command may replace."""
    try:
        with path.open(encoding="utf-8", errors="replace") as handle:
            return any(GENERATED_MARK.search(handle.readline()) for _ in range(3))
    except OSError:
        return False


def output_file_problem(path: Path, what: str) -> str | None:
    """Why a command must not write its ``what`` to ``path`` (None when it may: new, or its own earlier file)."""
    if path.is_dir():
        return f"{what}: {path} is a folder; give a file name"
    if path.exists() and not is_generated_file(path):
        return (f"{what}: {path} exists and was not written by shardtune; choose another file name (or delete it "
                "yourself)")
    return None


def ascii_lookalike(text: str) -> str:
    """``text`` with accents stripped and invisible characters dropped, for the closest-key search."""
    decomposed = unicodedata.normalize("NFKD", text.strip())
    return "".join(_CONFUSABLE.get(c, c) for c in decomposed if not unicodedata.combining(c) and c.isprintable())


# Cyrillic and Greek letters that render like Latin ones (the usual copy-paste culprits).
_CONFUSABLE = dict(zip("аеорсухіјѕԁԛԝАВЕКМНОРСТХІЈЅαοϲνΑΒΕΖΗΙΚΜΝΟΡΤΥΧ",
                      "aeopcyxijsdqwABEKMHOPCTXIJSaocvABEZHIKMNOPTYX", strict=True))


def home_expanded(value: str | Path) -> Path:
    """``value`` with a leading ``~`` or ``~user`` expanded as the shell does: a ``~name`` of no known user stays
    as written (``Path.expanduser`` raises RuntimeError there, a traceback for a mistyped path)."""
    return Path(os.path.expanduser(value))
