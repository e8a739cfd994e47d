"""One way to open a store: a URL whose scheme picks the backend, and no store made
anywhere else in ``farm/``, ``worker/`` or ``loader/``.

The rules every backend keeps are ``test_store_contract.py``'s; here, which store the
settings name, what a bad URL says, and the AST walk (as ``test_limits.py`` walks the
code) that finds a backend built outside the opener.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from farm.core.errors import SettingsError
from farm.core.settings import Settings
from farm.store import MemoryStore, SQLiteStore, TieredStore
from farm.store.open import BACKENDS, open_store, shared_url, sqlite_url, store_url
from farm.store.url import Opening, StoreURL

ROOT = Path(__file__).resolve().parents[1]
#: the opener itself: the one place a backend is named to be made
OPENER = ROOT / "farm" / "store" / "open.py"
BACKEND_CLASSES = frozenset(target.partition(":")[2] for target in BACKENDS.values())


def stores_made(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what) of every backend made by name in ``tree``: a call of a backend class
    (``SQLiteStore(...)``, ``minio.MinioStore(...)``) or of its ``from_url``."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.id if isinstance(func, ast.Name) else \
            func.attr if isinstance(func, ast.Attribute) else ""
        if name in BACKEND_CLASSES:
            found.append((node.lineno, name))
        elif name == "from_url" and isinstance(func, ast.Attribute):
            owner = func.value
            owner_name = owner.id if isinstance(owner, ast.Name) else \
                owner.attr if isinstance(owner, ast.Attribute) else ""
            if owner_name in BACKEND_CLASSES:
                found.append((node.lineno, f"{owner_name}.from_url"))
    return found


def test_no_store_is_made_outside_the_opener() -> None:
    made = []
    for package in ("farm", "worker", "loader"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path == OPENER:
                continue
            tree = ast.parse(path.read_text(), filename=str(path))
            made += [f"{path.relative_to(ROOT)}:{line}: {what}"
                     for line, what in stores_made(tree)]
    assert made == [], "open stores with farm.store.open.open_store"


def test_the_walk_finds_a_store_made_by_hand() -> None:
    tree = ast.parse("from farm.store import sqlite, minio\n"
                     "a = SQLiteStore(path)\n"
                     "b = minio.MinioStore('h:9000', None, None, 'b')\n"
                     "c = MinioStore.from_url(url, opening)\n"
                     "d = open_store(settings)\n"
                     "e = InstrumentedStore(d)\n")
    assert stores_made(tree) == [(2, "SQLiteStore"), (3, "MinioStore"),
                                 (4, "MinioStore.from_url")]


def test_without_a_url_the_store_is_the_environment_file(tmp_path: Path) -> None:
    plain = Settings(home=tmp_path, environment="other")
    assert store_url(plain) == sqlite_url(plain.store_path)
    store = open_store(plain)
    assert isinstance(store, SQLiteStore) and store.path == plain.store_path
    store.close()


def test_farm_store_url_picks_the_backend(tmp_path: Path) -> None:
    memory = open_store(Settings(home=tmp_path, store_url="memory://?max_bytes=64"))
    assert isinstance(memory, MemoryStore) and memory.max_bytes == 64
    odd = tmp_path / "a folder|with odd#chars" / "s.sqlite"
    url = sqlite_url(odd)
    assert "|" not in url and "#" not in url
    local = open_store(Settings(home=tmp_path, store_url=url))
    assert isinstance(local, SQLiteStore) and local.path == odd
    local.close()
    both = Settings(home=tmp_path, store_url=f"tiered:memory://|{url}")
    tiered = open_store(both)
    assert isinstance(tiered, TieredStore)
    assert [type(t) for t in tiered.tiers] == [MemoryStore, SQLiteStore]
    tiered.close()
    assert shared_url(both) == url  # a worker's store: the last tier


def test_the_default_is_the_environment_file_in_front_of_minio(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path, minio_endpoint="https://minio.example:9000",
                        minio_bucket="kernels")
    assert store_url(settings) == (f"tiered:{sqlite_url(settings.store_path)}"
                                   "|minio://minio.example:9000/kernels?secure=true")
    assert shared_url(settings) == "minio://minio.example:9000/kernels?secure=true"
    with pytest.raises(SettingsError, match="FARM_MINIO_ENDPOINT: not set"):
        shared_url(Settings(home=tmp_path))


@pytest.mark.parametrize(("url", "why"), [
    ("nope://x", "no store backend for scheme 'nope'"),
    ("/just/a/path", "no scheme"),
    ("sqlite://relative/path", "not sqlite:///<absolute path>"),
    ("sqlite:///x.sqlite?mode=ro", "not sqlite:///<absolute path>"),
    ("memory://somewhere/else", "not memory://"),
    ("memory://?max_bytes=-1", "not memory://"),
    ("minio://host:9000", "not minio://host:port/bucket"),
    ("minio://host:9000/a/b", "not minio://host:port/bucket"),
    ("minio://host:9000/b?secure=maybe", "secure must be true or false"),
    ("tiered:", "a tier is empty"),
    ("tiered:memory://||memory://", "a tier is empty"),
    ("tiered:memory://|tiered:memory://", "tiers do not nest"),
])
def test_a_bad_store_url_is_one_line_naming_it(tmp_path: Path, url: str, why: str) -> None:
    with pytest.raises(SettingsError) as info:
        open_store(Settings(home=tmp_path, store_url=url, minio_access_key="a",
                            minio_secret_key="b"))
    text = str(info.value)
    assert why in text and "\n" not in text
    assert url in text or why == "no scheme"


@pytest.mark.parametrize("url", ["minio://admin:s3cret@host:9000/b",
                                 "tiered:memory://||minio://admin:s3cret@host:9000/b"])
def test_credentials_in_a_store_url_are_refused_and_never_echoed(tmp_path: Path,
                                                                 url: str) -> None:
    with pytest.raises(SettingsError) as info:
        open_store(Settings(home=tmp_path, store_url=url))
    assert "must not carry credentials" in str(info.value)
    assert "s3cret" not in str(info.value) and "admin" not in str(info.value)


class Spy(MemoryStore):
    """A backend of a test's own, registered under ``spy://``: what a plugin's would be."""

    opened: list[Spy] = []

    def __init__(self) -> None:
        super().__init__()
        self.closed = False

    @classmethod
    def from_url(cls, url: StoreURL, opening: Opening) -> Spy:
        made = cls()
        cls.opened.append(made)
        return made

    def close(self) -> None:
        self.closed = True


def test_a_registered_scheme_opens_its_backend_and_a_failed_tier_closes_the_others(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(BACKENDS, "spy", f"{__name__}:Spy")
    monkeypatch.setattr(Spy, "opened", [])
    assert isinstance(open_store(Settings(home=tmp_path, store_url="spy://")), Spy)
    with pytest.raises(SettingsError, match="no store backend for scheme 'nope'"):
        open_store(Settings(home=tmp_path, store_url="tiered:spy://|nope://x"))
    assert [s.closed for s in Spy.opened] == [False, True]
